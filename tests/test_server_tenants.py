"""Tenants (``server.tenants``): a real server on 127.0.0.1 with two tenants that use the
very same client keys. Tenant B can never read, see, lease, hint, reserve over or delete
tenant A's block on any path (TCP, the admin port; the shared arena and NIXL are not
offered with tenants); a tenant over its quota in a tier evicts its own blocks first;
wrong tokens are refused; stats and metrics per tenant; config errors name the field."""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import urllib.error
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.net.client.wire import Address, Conn
from kvstore.client import Client
from kvstore.config import load_config
from kvstore.errors import AuthError, ConfigError, KVStoreError
from kvstore.hint import Hint
from kvstore.keys import BlockKey, Namespace
from kvstore.net import protocol as P
from kvstore.net.server._tenants import KEYLESS, SCOPED, Tenant
from kvstore.testing import make_keys, payload
from tests._hello import call, raw_hello
from tests._servers import ThreadServer, config_dict

BLOCK = 256 * 1024
A, B, OPERATOR = "token-of-a", "token-of-b", "operator-token"
TENANTS = [{"name": "a", "token": A, "salt": "salt-of-tenant-a-0001"}, {"name": "b", "token": B, "salt": "salt-of-tenant-b-0001"}]
SALT1, SALT2 = "salt-one-0123456789", "salt-two-0123456789"
TWO_TIERS = [{"name": "hot", "kind": "dram", "capacity": "16MiB", "pin": False},
             {"name": "warm", "kind": "dram", "capacity": "64MiB", "pin": False}]


def _keys(n: int, salt: str = "") -> list[BlockKey]:
    return Namespace(model="tenants", dtype="uint8", chunk_tokens=1, salt=salt).chunk_keys(np.arange(n))


@pytest.fixture(scope="module")
def server():
    s = ThreadServer(config_dict(tiers=TWO_TIERS, token=OPERATOR, tenants=TENANTS))
    yield s
    s.stop()


def _saved_by_a(server, transport: str, salt: str, n: int = 3) -> tuple[list[BlockKey], list[np.ndarray]]:
    keys, srcs = _keys(n, salt), [payload(i, BLOCK) for i in range(n)]
    with Client(server.address, token=A, transport=transport) as a:
        assert a.save(keys, srcs).result(10) == [True] * n
    return keys, srcs


def _a_reads_back(server, keys, srcs, transport: str = "tcp") -> None:
    with Client(server.address, token=A, transport=transport) as a:
        dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
        assert a.load(keys, dsts).result(10) == [True] * len(keys)
        assert all(np.array_equal(s, d) for s, d in zip(srcs, dsts))


# -- isolation, path by path -----------------------------------------------------------------

@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_b_cannot_read_see_or_delete_a_block_under_the_same_key(server, transport):
    keys, srcs = _saved_by_a(server, transport, f"same-{transport}")
    with Client(server.address, token=B, transport=transport) as b:
        assert b.transport == "tcp"                                  # never the shared arena (nor NIXL)
        assert b.contains(keys) == [False] * 3                      # CONTAINS
        assert b.lookup(keys) == 0 and b.lookup(keys, lease_s=30) == 0   # LOOKUP (and no lease)
        dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
        assert b.load(keys, dsts).result(10) == [False] * 3          # GET / SHM_GET
        assert not any(d.any() for d in dsts)
        assert b.hint(keys, Hint(retain_s=60)) == 0                  # HINT
        assert b.delete(keys) == 0                                   # DELETE
        assert b.clear(namespaces=[keys[0].namespace]) == 0          # CLEAR of the namespace
    _a_reads_back(server, keys, srcs, transport)
    stored = Tenant("a", A, "salt-of-tenant-a-0001").keys(keys)
    assert server.store.contains(stored) == [True] * 3 and not any(k in server.store._hints for k in stored)


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_the_same_key_holds_each_tenants_own_bytes(server, transport):
    """B saving A's key is not "already present" (no PRESENT from a reservation, no
    dedup): B stores its own block, and each tenant reads back its own bytes."""
    keys, srcs = _saved_by_a(server, transport, f"own-{transport}")
    theirs = [payload(100 + i, BLOCK) for i in range(3)]
    with Client(server.address, token=B, transport=transport) as b:
        assert b.save(keys, theirs).result(10) == [True] * 3         # PUT / SHM_RESERVE + SHM_COMMIT
        dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
        assert b.load(keys, dsts).result(10) == [True] * 3
        assert all(np.array_equal(t, d) for t, d in zip(theirs, dsts))
    _a_reads_back(server, keys, srcs, transport)
    assert server.store.contains(keys) == [False] * 3               # the Store never saw the client keys


def test_a_tenant_client_gets_no_arena_and_still_works(server):
    """Review F1: with tenants the shared arena is never offered (a process that maps it
    reads and writes every tenant's hot-tier bytes): HELLO names none, a same-host client
    takes the copy path, SHM_* ops are refused, and the arena is not under /dev/shm."""
    assert server.server.arena is None and server.server.store.tiers[0].shm_path is None
    for token in (A, B, OPERATOR):
        with Client(server.address, token=token) as c:               # transport auto, same host
            assert c.info["shm"] is None and c.transport == "tcp"
    keys, srcs = _saved_by_a(server, "auto", "no-arena")
    _a_reads_back(server, keys, srcs, "auto")
    with pytest.raises(KVStoreError, match="no shared memory"):
        Client(server.address, token=A, transport="shm")
    sock = socket.create_connection(("127.0.0.1", server.server.port))
    try:
        raw_hello(sock, B)
        hdr, _ = call(sock, P.Op.SHM_RESERVE, P.encode_records(P.SIZED, keys, [BLOCK] * 3), rid=3)
        assert hdr.status == P.Status.UNAVAILABLE
    finally:
        sock.close()


def test_transport_shm_with_tenants_is_a_config_error():
    with pytest.raises(ConfigError, match="server.transport"):
        ThreadServer(config_dict(tiers=TWO_TIERS, transport="shm", tenants=TENANTS))


def test_release_by_b_does_not_drop_a_lease(server):
    keys, _ = _saved_by_a(server, "tcp", "lease")
    before = server.store.stats()["leases"]
    with Client(server.address, token=A, transport="tcp") as a, Client(server.address, token=B, transport="tcp") as b:
        assert a.lookup(keys, lease_s=60) == 3
        assert server.store.stats()["leases"] == before + 3
        b.release(keys)                                              # RELEASE
        assert server.store.stats()["leases"] == before + 3
        a.release(keys)
        assert server.store.stats()["leases"] == before


def test_clear_removes_only_the_callers_blocks(server):
    keys, srcs = _saved_by_a(server, "tcp", "clear")
    with Client(server.address, token=B, transport="tcp") as b:
        b.save(keys[:1], [payload(9, BLOCK)]).result(10)
        assert b.clear(namespaces=[_keys(1, "clear")[0].namespace]) == 1   # CLEAR of a namespace: B's one
        b.save(keys[:1], [payload(9, BLOCK)]).result(10)
        held_by_b = server.server.stats()["tenants"]["b"]["tiers"]["hot"]["blocks"]
        assert b.clear() == held_by_b >= 1                           # CLEAR of everything: B's only
        assert server.server.stats()["tenants"]["b"]["tiers"]["hot"]["blocks"] == 0
    _a_reads_back(server, keys, srcs)


def test_every_op_is_scoped_or_carries_no_key():
    assert SCOPED | KEYLESS == set(P.Op) and not SCOPED & KEYLESS
    tenant = Tenant("t", "x", "salt")
    with pytest.raises(Exception, match="no tenant scope"):
        tenant.scope(99, None)   # an op without a rule is refused, never passed through


# -- NIXL ----------------------------------------------------------------------------------

def test_nixl_is_refused_with_tenants(server):
    """Review F4: the server's NIXL metadata names its registered arena (any NIXL peer
    could READ and WRITE it), so with tenants NIXL is not offered: HELLO says so, a
    NIXL_HELLO is refused before any peer metadata is loaded (no endpoint is even
    started), an auto client takes TCP, and server.transport nixl is a config error."""
    with Client(server.address, token=A) as a:                       # transport auto
        assert a.info["nixl"] is False and a.transport == "tcp"
        keys, srcs = _keys(2, "nixl-refused"), [payload(i, BLOCK) for i in range(2)]
        assert a.save(keys, srcs).result(10) == [True, True]
    _a_reads_back(server, keys, srcs)
    conn = Conn(Address.parse(server.address), B, 30)
    try:
        with pytest.raises(KVStoreError, match="not offered with server.tenants"):
            conn.call(P.Op.NIXL_HELLO, b"metadata of some agent")
    finally:
        conn.close()
    nixl = server.server.nixl

    class _Conn:
        tenant = Tenant("b", B, "salt-of-tenant-b-0001")
        nixl_peer = None

    with pytest.raises(KVStoreError, match="not offered with server.tenants"):
        nixl.hello(_Conn(), b"metadata of some agent")              # the service's own check
    assert nixl._endpoint is None and not nixl._peers and not nixl.offered()
    with pytest.raises(KVStoreError):
        Client(server.address, token=A, transport="nixl")
    with pytest.raises(ConfigError, match="server.transport"):
        ThreadServer(config_dict(tiers=TWO_TIERS, transport="nixl", tenants=TENANTS))


# -- authentication ------------------------------------------------------------------------

@pytest.mark.parametrize("token", [None, "wrong", A[:-1], A + "x"])
def test_a_wrong_or_missing_token_is_refused(server, token):
    with pytest.raises(AuthError):
        Client(server.address, token=token, transport="tcp")


def test_each_token_names_its_tenant_and_never_crosses_the_wire(server):
    sock = socket.create_connection(("127.0.0.1", server.server.port), timeout=5)
    try:
        assert raw_hello(sock, B)["tenant"] == "b"
    finally:
        sock.close()
    with Client(server.address, token=OPERATOR, transport="tcp") as c:
        assert c.info["tenant"] == "default"


def test_a_connection_cannot_change_tenants(server):
    sock = socket.create_connection(("127.0.0.1", server.server.port), timeout=5)
    try:
        raw_hello(sock, A)
        _, body = call(sock, P.Op.HELLO, P.encode_json({"client": "test", "protocol": P.VERSION}), rid=3)
        nonce = bytes.fromhex(P.decode_json(body)["challenge"])
        from kvstore.net.auth import hello_proof

        hello = {"client": "test", "protocol": P.VERSION, "proof": hello_proof(B, nonce, "test")}
        hdr, body = call(sock, P.Op.HELLO, P.encode_json(hello), rid=4)
        assert hdr.status == P.Status.AUTH and b"cannot change tenants" in body
    finally:
        sock.close()


def test_server_token_is_the_default_tenant_isolated_from_the_others(server):
    keys, srcs = _saved_by_a(server, "tcp", "default")
    with Client(server.address, token=OPERATOR, transport="tcp") as c:
        assert c.contains(keys) == [False] * 3
        assert c.delete(keys) == 0
        assert c.clear() == 0            # the default tenant's own blocks: none
    _a_reads_back(server, keys, srcs)


# -- the admin port ------------------------------------------------------------------------

def _http(port: int, path: str, token: str | None, method: str = "GET",
          body: dict | None = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_admin_port_is_scoped_by_the_bearer_tenant(server):
    port = server.server.admin_port
    keys, srcs = _saved_by_a(server, "tcp", "admin")
    query = {"keys": [k.hex() for k in keys]}
    for token, held in ((A, 3), (B, 0), (OPERATOR, 0)):
        status, answer = _http(port, "/v1/lookup", token, "POST", query)
        assert status == 200 and json.loads(answer)["prefix_blocks"] == held
    assert _http(port, "/v1/lookup", "nobody", "POST", query)[0] == 401
    assert _http(port, "/stats", None)[0] == 401
    status, body = _http(port, "/stats", B)
    assert status == 200 and set(json.loads(body)["tenants"]) == {"b"}         # B sees only its own entry
    assert set(json.loads(_http(port, "/stats", OPERATOR)[1])["tenants"]) == {"default", "a", "b"}
    status, body = _http(port, "/clear", B, "POST")
    assert status == 200
    _a_reads_back(server, keys, srcs)                                          # B's /clear: B's blocks only


def test_operator_clear_removes_everything():
    s = ThreadServer(config_dict(token=OPERATOR, tenants=TENANTS))
    try:
        for token in (A, B):
            with Client(s.address, token=token, transport="tcp") as c:
                assert c.save(_keys(2, "op"), [payload(i, BLOCK) for i in range(2)]).result(10) == [True] * 2
        status, body = _http(s.server.admin_port, "/clear", OPERATOR, "POST")
        assert status == 200 and json.loads(body) == {"removed": 4}
    finally:
        s.stop()


# -- quotas ----------------------------------------------------------------------------------

QUOTA_TENANTS = [{"name": "a", "token": A, "salt": "salt-of-tenant-a-0001", "quota": {"hot": "1MiB"}},
                 {"name": "b", "token": B, "salt": "salt-of-tenant-b-0001"},
                 {"name": "c", "token": "token-of-c", "salt": "salt-of-tenant-c-0001", "quota": {"hot": 0}}]


@pytest.fixture
def quota_server():
    tiers = [{"name": "hot", "kind": "dram", "capacity": "4MiB", "pin": False},
             {"name": "warm", "kind": "dram", "capacity": "64MiB", "pin": False}]
    s = ThreadServer(config_dict(tiers=tiers, tenants=QUOTA_TENANTS))
    yield s
    s.stop()


def _tier(server, tenant: str, tier: str) -> dict:
    return server.server.stats()["tenants"][tenant]["tiers"][tier]


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_a_tenant_over_quota_evicts_its_own_blocks_first(quota_server, transport):
    s = quota_server
    mine, theirs = _keys(8, "a"), _keys(4, "b")
    srcs = [payload(i, BLOCK) for i in range(8)]
    with Client(s.address, token=B, transport=transport) as b:
        assert b.save(theirs, [payload(50 + i, BLOCK) for i in range(4)]).result(10) == [True] * 4
    with Client(s.address, token=A, transport=transport) as a:
        assert a.save(mine[:4], srcs[:4]).result(10) == [True] * 4      # exactly A's quota in hot
        assert _tier(s, "a", "hot")["used_bytes"] == 1 << 20
        assert a.save(mine[4:], srcs[4:]).result(10) == [True] * 4      # over it: A's first four go down
        hot = _tier(s, "a", "hot")
        assert hot["used_bytes"] == 1 << 20 and hot["evictions"] == 4 and hot["quota_bytes"] == 1 << 20
        assert _tier(s, "a", "warm")["blocks"] == 4                     # spilled, as eviction does
        assert _tier(s, "b", "hot") == {"used_bytes": 1 << 20, "blocks": 4, "quota_bytes": None,
                                        "evictions": 0, "quota_full": 0, "walk_capped": 0}   # B's stayed
        with Client(s.address, token=B, transport=transport) as b:        # lower-tier paths are scoped too
            assert b.load(mine[:4], [np.zeros(BLOCK, np.uint8) for _ in range(4)]).result(10) == [False] * 4
        dsts = [np.zeros(BLOCK, np.uint8) for _ in mine]
        assert a.load(mine, dsts).result(10) == [True] * 8               # all of A's, from either tier
        assert all(np.array_equal(x, d) for x, d in zip(srcs, dsts))
        assert _tier(s, "a", "hot")["used_bytes"] <= 1 << 20            # promotions stay in quota too
    assert _tier(s, "b", "hot")["blocks"] == 4 and _tier(s, "b", "hot")["evictions"] == 0


def test_an_insert_that_cannot_fit_the_quota_behaves_like_a_full_tier(quota_server):
    s = quota_server
    with Client(s.address, token=A, transport="tcp") as a:
        big = np.full(2 << 20, 7, np.uint8)                              # larger than A's 1 MiB quota
        assert a.save(_keys(1, "big"), [big]).result(10) == [True]      # refused by hot, stored in warm
        assert _tier(s, "a", "hot")["quota_full"] == 1 and _tier(s, "a", "hot")["used_bytes"] == 0
        assert _tier(s, "a", "warm")["used_bytes"] == 2 << 20
    with Client(s.address, token="token-of-c", transport="tcp") as c:   # quota 0: never in hot
        assert c.save(_keys(2, "c"), [payload(i, BLOCK) for i in range(2)]).result(10) == [True] * 2
        assert _tier(s, "c", "hot") == {"used_bytes": 0, "blocks": 0, "quota_bytes": 0, "evictions": 0,
                                        "quota_full": 2, "walk_capped": 0}
        assert _tier(s, "c", "warm")["blocks"] == 2
        dst = np.zeros(BLOCK, np.uint8)
        assert c.load(_keys(2, "c")[:1], [dst]).result(10) == [True]    # and no promotion into hot
        assert np.array_equal(dst, payload(0, BLOCK)) and _tier(s, "c", "hot")["blocks"] == 0


# -- stats and metrics ----------------------------------------------------------------------

def test_stats_and_metrics_per_tenant(quota_server):
    s = quota_server
    keys = _keys(4, "stats")
    with Client(s.address, token=A, transport="tcp") as a:
        a.save(keys[:2], [payload(i, BLOCK) for i in range(2)]).result(10)
        dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
        assert a.load(keys, dsts).result(10) == [True, True, False, False]
        mine = a.stats()["tenants"]
        assert set(mine) == {"a"}                                        # a tenant sees its own entry only
        assert mine["a"]["hits"] == 2 and mine["a"]["misses"] == 2
        assert mine["a"]["tiers"]["hot"]["used_bytes"] == 2 * BLOCK
    with Client(s.address, token=B, transport="tcp") as b:
        assert b.load(keys[:1], dsts[:1]).result(10) == [False]
        assert b.stats()["tenants"]["b"]["misses"] == 1
    status, text = _http(s.server.admin_port, "/metrics", None)
    assert status == 200
    got = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
           for family in text_string_to_metric_families(text.decode()) for sample in family.samples}

    def metric(name: str, tenant: str, tier: str | None = None) -> float | None:
        labels = {"tenant": tenant, **({"tier": tier} if tier else {})}
        return got.get((name, tuple(sorted(labels.items()))))

    assert metric("kvstore_tenant_used_bytes", "a", "hot") == 2 * BLOCK
    assert metric("kvstore_tenant_blocks", "a", "hot") == 2 and metric("kvstore_tenant_blocks", "b", "hot") == 0
    assert metric("kvstore_tenant_hits_total", "a") == 2 and metric("kvstore_tenant_misses_total", "a") == 2
    assert metric("kvstore_tenant_misses_total", "b") == 1 and metric("kvstore_tenant_hits_total", "b") == 0
    assert metric("kvstore_tenant_quota_bytes", "a", "hot") == 1 << 20
    assert metric("kvstore_tenant_quota_bytes", "b", "hot") is None          # no quota: no gauge
    assert metric("kvstore_tenant_evictions_total", "a", "hot") == 0
    assert metric("kvstore_tenant_quota_full_total", "c", "hot") == 0


def test_without_tenants_keys_are_stored_as_sent():
    s = ThreadServer(config_dict(token=A))
    try:
        keys = _keys(2, "plain")
        with Client(s.address, token=A, transport="tcp") as c:
            assert c.save(keys, [payload(i, BLOCK) for i in range(2)]).result(10) == [True] * 2
            assert c.info["tenant"] is None and "tenants" not in c.stats()
        assert s.store.contains(keys) == [True] * 2 and "tenants" not in s.store.stats()
    finally:
        s.stop()


# -- the mapping ------------------------------------------------------------------------------

def test_the_key_mapping_is_the_documented_hkdf_and_hmac():
    """docs/server.md (Tenants) states the derivation; this recomputes it from there."""
    salt, key = "salt-of-tenant-a-0001", make_keys(2, salt="kat")[1]
    prk = hmac.new(b"kvstore/tenant/v1", salt.encode(), hashlib.sha256).digest()
    k_map = hmac.new(prk, b"key-map\x01", hashlib.sha256).digest()
    tag = hmac.new(prk, b"tag\x01", hashlib.sha256).digest()[:8]

    def mapped(d: bytes) -> bytes:
        return tag + hmac.new(k_map, d, hashlib.sha256).digest()[:24]

    got = Tenant("a", A, salt).keys([key])[0]
    assert got.digest == mapped(key.digest) and got.parent == mapped(key.parent)
    assert got.namespace == mapped(key.namespace)
    other = Tenant("b", B, "salt-of-tenant-b-0001").keys([key])[0]
    assert other.digest != got.digest and other.digest[:8] != got.digest[:8]
    assert Tenant("d", None, None).keys([key])[0] is key                  # no tenants: as sent


# -- configuration --------------------------------------------------------------------------

@pytest.mark.parametrize("tenants, where", [
    ([{"name": "a", "token": A, "salt": SALT1}, {"name": "a", "token": B, "salt": SALT2}], "tenants.1.name"),
    ([{"name": "a", "token": A, "salt": SALT1}, {"name": "b", "token": A, "salt": SALT2}], "tenants.1.token"),
    ([{"name": "a", "token": A, "salt": SALT1}, {"name": "b", "token": B, "salt": SALT1}], "tenants.1.salt"),
    ([{"name": "a", "token": "", "salt": SALT1}], "server.tenants.0: token is set but empty"),
    ([{"name": "a", "token": None, "salt": SALT1}], "server.tenants.0: token is set but empty"),
    ([{"name": "a", "salt": SALT1}], "server.tenants.0.token"),
    ([{"name": "a", "token": A, "salt": ""}], "server.tenants.0.salt"),
    ([{"name": "a", "token": A}], "server.tenants.0.salt"),
    ([{"name": "a", "token": A, "salt": "a" * 15}], "server.tenants.0.salt: salt has 15 characters, needs at least 16"),
    ([{"name": "a", "token": A, "salt": SALT1, "quota": {"cold": "1GiB"}}], "server.tenants.0.quota.cold"),
    ([{"name": "a", "token": A, "salt": SALT1, "quota": {"hot": "lots"}}], "server.tenants.0.quota.hot"),
    ([{"name": "a b", "token": A, "salt": SALT1}], "server.tenants.0.name"),
    ([{"name": "default", "token": A, "salt": SALT1}], "tenants.0.name: 'default' is already"),
    ([{"name": "a", "token": OPERATOR, "salt": SALT1}], "tenants.0.token: this token is already server.token"),
])
def test_config_errors_name_the_field(tenants, where):
    with pytest.raises(ConfigError, match=where.replace(".", r"\.")) as err:
        load_config(config_dict(token=OPERATOR, tenants=tenants), env={})
    for t in tenants:   # review F6: a salt is a secret, like a token: never echoed
        for secret in (t.get("salt"), t.get("token")):
            assert not secret or repr(secret) not in str(err.value)


def test_tenant_tokens_come_from_the_environment_too():
    cfg = load_config(config_dict(tenants=[{"name": "a", "token": "placeholder", "salt": SALT1}]),
                      env={"KVSTORE_SERVER__TENANTS__a__TOKEN": "from-env",
                           "KVSTORE_SERVER__TENANTS__0__QUOTA": "{hot: 2MiB}"})
    assert cfg.server.tenants[0].token == "from-env" and cfg.server.tenants[0].quota == {"hot": 2 << 20}
    with pytest.raises(ConfigError, match="token is set but empty"):
        load_config(config_dict(tenants=[{"name": "a", "token": "t", "salt": SALT1}]),
                    env={"KVSTORE_SERVER__TENANTS__0__TOKEN": ""})


def test_tenants_alone_authenticate_a_server_beyond_loopback():
    from kvstore.server import Server

    with pytest.raises(ConfigError, match="no server.token is set"):
        Server(load_config(config_dict(host="0.0.0.0"), env={}))
    s = ThreadServer(config_dict(host="0.0.0.0", tenants=TENANTS))   # tenants are authentication
    try:
        with pytest.raises(AuthError):
            Client(f"127.0.0.1:{s.server.port}", transport="tcp")
    finally:
        s.stop()


# -- the Store's accounting (kvstore.store.tenants), under every eviction policy ----------------

def _store_with_tenants(tiers: list, tenants: list = QUOTA_TENANTS):
    from kvstore.net.server._tenants import Tenants
    from kvstore.store import Store

    config = load_config({"tiers": tiers, "server": {"tenants": tenants}}, env={})
    named = Tenants(config.server)
    store = Store(config)
    store.set_tenants(named.ledger([t.name for t in config.tiers]))
    return store, {t.name: t for t in named.all}


def _nothing_in_flight(store) -> bool:
    return all(n == 0 for per_tier in store._tenants._pending.values() for n in per_tier)


@pytest.mark.parametrize("eviction", ["lru", "fifo", "lfu", "s3fifo", "sieve", "arc", "lineage"])
def test_the_store_keeps_each_quota_and_evicts_the_tenants_own_blocks_first(eviction):
    tiers = [{"name": "hot", "kind": "dram", "capacity": "4MiB", "eviction": eviction, "pin": False},
             {"name": "warm", "kind": "dram", "capacity": "64MiB", "pin": False}]
    store, t = _store_with_tenants(tiers)
    try:
        theirs = t["b"].keys(_keys(8, "store-b"))
        assert store.save(theirs, [payload(i, BLOCK) for i in range(8)]).result() == [True] * 8
        mine = t["a"].keys(_keys(12, "store-a"))
        srcs = [payload(100 + i, BLOCK) for i in range(12)]
        for lo in range(0, 12, 4):
            assert store.save(mine[lo:lo + 4], srcs[lo:lo + 4]).result() == [True] * 4
            hot = store.stats()["tenants"]["a"]["tiers"]["hot"]
            assert hot["used_bytes"] <= 1 << 20
        with store.reserve(mine[:1] + t["a"].keys(_keys(13, "store-a"))[12:], [BLOCK, BLOCK]) as res:
            for view in res.views:
                if view is not None:
                    view[:] = 1
        assert store.stats()["tenants"]["a"]["tiers"]["hot"]["used_bytes"] <= 1 << 20
        b_hot = store.stats()["tenants"]["b"]["tiers"]["hot"]
        assert b_hot["blocks"] == 8 and b_hot["evictions"] == 0                # B's blocks all stayed
        dsts = [np.zeros(BLOCK, np.uint8) for _ in mine]
        assert store.load(mine, dsts).result() == [True] * 12                  # A's went down, not away
        assert all(np.array_equal(x, d) for x, d in zip(srcs, dsts))
        assert store.stats()["tenants"]["a"]["tiers"]["hot"]["used_bytes"] <= 1 << 20
        assert _nothing_in_flight(store)
        stats = store.stats()
        for tier, lvl in zip(("hot", "warm"), stats["tiers"]):                 # the ledger sums to the tiers
            assert sum(v["tiers"][tier]["used_bytes"] for v in stats["tenants"].values()) == lvl["used_bytes"]
    finally:
        store.close()


def test_concurrent_saves_of_one_tenant_never_pass_its_quota():
    from concurrent.futures import ThreadPoolExecutor

    tiers = [{"name": "hot", "kind": "dram", "capacity": "8MiB", "pin": False},
             {"name": "warm", "kind": "dram", "capacity": "128MiB", "pin": False}]
    store, t = _store_with_tenants(tiers)
    peak = []
    try:
        def batch(n: int) -> list[bool]:
            keys = t["a"].keys(_keys(4, f"conc-{n}"), cached=False)
            ok = store.save(keys, [payload(n, BLOCK)] * 4).result()
            peak.append(store.stats()["tenants"]["a"]["tiers"]["hot"]["used_bytes"])
            return ok
        with ThreadPoolExecutor(8) as pool:
            assert all(all(ok) for ok in pool.map(batch, range(64)))
        assert max(peak) <= 1 << 20 and _nothing_in_flight(store)
    finally:
        store.close()


def test_blocks_recovered_from_a_persistent_tier_count_for_their_tenants(tmp_path):
    tiers = [{"name": "hot", "kind": "dram", "capacity": "1MiB", "pin": False},
             {"name": "disk", "kind": "nvme", "path": str(tmp_path / "nvme"), "capacity": "16MiB",
              "file_bytes": "4MiB", "direct_io": False}]
    store, t = _store_with_tenants(tiers)
    keys = t["b"].keys(_keys(3, "persist"))
    assert store.save(keys, [payload(i, BLOCK) for i in range(3)]).result() == [True] * 3
    assert store.flush() == 3
    store.close()
    store, t = _store_with_tenants(tiers)      # a restart: the owner is read off each key
    try:
        disk = store.stats()["tenants"]["b"]["tiers"]["disk"]
        assert disk["blocks"] == 3 and disk["used_bytes"] == 3 * BLOCK
        assert store.stats()["tenants"]["a"]["tiers"]["disk"]["blocks"] == 0
    finally:
        store.close()


def test_a_store_without_tenants_reports_none():
    from kvstore.store import Store

    with Store.from_config({"tiers": [{"name": "hot", "kind": "dram", "capacity": "1MiB", "pin": False}]}) as store:
        assert store.save(make_keys(1), [payload(0, 4096)]).result() == [True]
        assert "tenants" not in store.stats() and store._tenants is None


def test_the_ledger_uncharges_what_it_charged_and_never_goes_negative():
    """Issue 34 item 1: a tier's ledger is charged a block's bytes as it enters that tier
    and uncharged exactly those as it leaves (whatever size a caller believes), once; an
    unbalanced change fails loudly."""
    from kvstore.store.tenants import TenantLedger

    a = Tenant("a", A, SALT1)
    ledger = TenantLedger({a.tag: "a"}, {"a": {0: 1 << 20}}, ["hot", "warm"])
    key, other = a.keys(make_keys(2, salt="ledger"), cached=False)
    ledger.add(key, 0, 4096)
    ledger.add(key, 1, 4096)
    with pytest.raises(AssertionError, match="charged twice"):
        ledger.add(key, 0, 1 << 20)
    ledger.remove(key, 0)
    ledger.remove(key, 0)                      # no longer charged there: nothing to uncharge
    ledger.remove(other, 0)                    # never charged
    hot, warm = (ledger.stats()["a"]["tiers"][t] for t in ("hot", "warm"))
    assert hot["used_bytes"] == 0 and hot["blocks"] == 0
    assert warm["used_bytes"] == 4096 and warm["blocks"] == 1 and dict(ledger.charged("a", 1)) == {key: 4096}
    with pytest.raises(AssertionError, match="in flight went negative"):
        ledger.settle(0, {key: ("a", 4096)})   # settled without being planned
