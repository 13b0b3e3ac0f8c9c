"""The redis tier against a real standalone ``redis-server`` on loopback: conformance, key
layout, verification of every read (a flipped value is never served), ACL credentials,
Redis's own eviction and expiry as clean misses, restart recovery through SCAN, a server
stopped and restarted under a Store, and config through the Store."""

import time
import uuid

import numpy as np
import pytest

from kvstore.block import EXT_HEADER_BYTES, HEADER_BYTES, parse_any_header, parse_extension
from kvstore.errors import BufferSizeError, ConfigError, TierUnavailableError
from kvstore.store import Store
from kvstore.testing import CAPACITY, TierConformance, make_keys, payload
from tests._redis import RedisServer, need_redis, running_redis
from tests._stray_dram import check_a_spill_keeps_drams_checksum

pytest.importorskip("redis", reason="redis-py is installed by scripts/deps/00-python.sh")
pytestmark = pytest.mark.redis


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from running_redis(tmp_path_factory, "redis-tier")


@pytest.fixture(scope="module")
def raw(server):
    client = server.client()
    yield client
    client.close()


def make_tier(server, capacity=CAPACITY, prefix=None, **kwargs):
    from kvstore.tiers.redis import RedisTier

    return RedisTier(capacity, name="redis-test", url=server.url, prefix=prefix or f"t{uuid.uuid4().hex[:12]}",
                     concurrency=4, **kwargs)


@pytest.fixture
def tier(server):
    t = make_tier(server)
    yield t
    t.close()


class TestRedisConformance(TierConformance):
    CONCURRENCY_ROUNDS = 10


def test_key_layout_and_value_format(tier, raw):
    keys = make_keys(2)
    srcs = [payload(i) for i in range(2)]
    assert tier.write(keys, srcs) == [True, True]
    ns = keys[0].namespace.hex()
    names = sorted(raw.scan_iter(match=f"{tier.prefix}:*"))
    assert names == sorted(f"{tier.prefix}:{ns}:{k.hex()}".encode() for k in keys)
    body = raw.get(f"{tier.prefix}:{ns}:{keys[1].hex()}")
    assert len(body) == EXT_HEADER_BYTES + len(srcs[1])
    assert parse_any_header(body, digest=keys[1].digest)[:2] == (2, len(srcs[1]))
    assert parse_extension(body[:EXT_HEADER_BYTES]) == keys[0].digest
    assert body[EXT_HEADER_BYTES:] == srcs[1].tobytes()
    assert raw.ttl(f"{tier.prefix}:{ns}:{keys[1].hex()}") == -1   # no ttl_s: no expiry


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate", "extend", "other_key", "garbage",
                                    "flip_parent", "empty"])
def test_damaged_value_is_a_miss_deleted_and_counted(tier, raw, damage):
    keys = make_keys(2, salt=damage)
    srcs = [payload(i) for i in range(2)]
    assert tier.write(keys, srcs) == [True, True]
    name, other = tier.key_name(keys[0]), tier.key_name(keys[1])
    body = bytearray(raw.get(name))
    if damage == "flip_payload":
        body[EXT_HEADER_BYTES + 1000] ^= 0x01
    elif damage == "flip_header":
        body[20] ^= 0x01
    elif damage == "truncate":
        body = body[:-10]
    elif damage == "extend":
        body += b"\0" * 10
    elif damage == "other_key":
        body = bytearray(raw.get(other))
    elif damage == "flip_parent":  # keys[0] has no parent: claim one, header checksum intact
        body[HEADER_BYTES + 4] = 1
    elif damage == "empty":
        body = bytearray()
    else:
        body = bytearray(b"not a block at all")
    raw.set(name, bytes(body))
    dsts = [np.full(len(s), 7, np.uint8) for s in srcs]
    # Both in one pipeline: the damaged reply must not put the stream out of step.
    assert tier.read_into(keys, dsts) == [False, True]
    assert np.array_equal(dsts[1], srcs[1])
    stats = tier.stats()
    assert stats["corrupt_blocks"] == 1 and stats["faults"] == 0
    assert tier.contains(keys) == [False, True]
    assert tier.used_bytes == len(srcs[1])
    assert raw.exists(name) == 0   # deleted, so no reader anywhere gets it again


def test_flipped_value_never_served_through_the_store(server, raw):
    prefix = f"s{uuid.uuid4().hex[:8]}"
    keys = make_keys(3, salt="store-flip")
    srcs = [payload(i) for i in range(3)]
    with _store(server, prefix) as store:
        assert store.save(keys, srcs).result() == [True] * 3
        name = f"{prefix}:{keys[1].namespace.hex()}:{keys[1].hex()}"
        body = bytearray(raw.get(name))
        body[-1] ^= 0x80
        raw.set(name, bytes(body))
        dsts = [np.zeros(len(s), np.uint8) for s in srcs]
        assert store.load(keys, dsts).result() == [True, False, True]
        assert store.lookup(keys) == 1
        assert store.stats()["tiers"][0]["corrupt_blocks"] == 1


def test_a_spill_keeps_drams_checksum_so_a_stray_write_after_its_check_is_a_miss(server):
    prefix = f"stray{uuid.uuid4().hex[:8]}"
    check_a_spill_keeps_drams_checksum({"name": "redis-test", "kind": "redis", "url": server.url, "prefix": prefix,
                                        "capacity": "1MiB"}, make_tier(server, 1 << 20, prefix=prefix))


def test_buffer_size_differs_from_unindexed_block(tier, server):
    keys = make_keys(2, salt="size")
    tier.write(keys, [payload(0), payload(1)])
    other = make_tier(server, prefix=tier.prefix)   # does not index them
    try:
        with pytest.raises(BufferSizeError):
            other.read_into(keys[:1], [np.zeros(100, np.uint8)])
        dsts = [np.zeros(len(payload(0)), np.uint8) for _ in keys]
        assert other.read_into(keys, dsts) == [True, True]   # the connection is still in step
        assert other.contains(keys) == [True, True]          # now known to this tier too
    finally:
        other.close()


def test_recover_after_restart_via_scan(server, raw):
    prefix = f"r{uuid.uuid4().hex[:8]}"
    keys = make_keys(6, salt="recover")
    srcs = [payload(i) for i in range(6)]
    first = make_tier(server, prefix=prefix)
    assert all(first.write(keys, srcs))
    first.close()
    raw.set(f"{prefix}:not-a-block", b"x")                      # foreign key under the prefix: ignored
    bad = tier_name(prefix, keys[5])
    raw.setrange(bad, 10, b"\xff")                               # damaged header: dropped at recovery
    second = make_tier(server, prefix=prefix)
    try:
        found = second.recover()
        assert {b.key for b in found} == set(keys[:5])
        assert {b.key: b.key.parent for b in found} == {k: k.parent for k in keys[:5]}
        assert all(b.nbytes == len(srcs[0]) for b in found)
        assert second.used_bytes == 5 * len(srcs[0]) and second.stats()["corrupt_blocks"] == 1
        assert raw.exists(bad) == 0 and raw.exists(f"{prefix}:not-a-block") == 1
        dsts = [np.zeros_like(s) for s in srcs[:5]]
        assert second.read_into(keys[:5], dsts) == [True] * 5
        assert all(np.array_equal(s, d) for s, d in zip(srcs, dsts))
        assert set(second.keys()) == set(keys[:5])
    finally:
        second.close()


def tier_name(prefix, key):
    return f"{prefix}:{key.namespace.hex()}:{key.hex()}"


def test_ttl_expiry_is_a_clean_miss(server, raw):
    t = make_tier(server, ttl_s=0.3)
    try:
        keys = make_keys(2, salt="ttl")
        assert t.write(keys, [payload(0), payload(1)]) == [True, True]
        assert 0 < raw.pttl(t.key_name(keys[0])) <= 300
        deadline = time.monotonic() + 10
        while raw.exists(t.key_name(keys[0])) and time.monotonic() < deadline:
            time.sleep(0.05)
        dsts = [np.zeros(len(payload(0)), np.uint8) for _ in keys]
        assert t.read_into(keys, dsts) == [False, False]
        stats = t.stats()
        assert stats["vanished"] == 2 and stats["corrupt_blocks"] == 0 and stats["faults"] == 0
        assert t.used_bytes == 0
    finally:
        t.close()


def test_redis_maxmemory_eviction_is_a_clean_miss(tmp_path):
    need_redis()
    server = RedisServer(tmp_path / "lru", extra=("--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru"))
    try:
        from kvstore.tiers.redis import RedisTier

        t = RedisTier(64 << 20, url=server.url, prefix="lru")
        keys = make_keys(40, salt="lru")
        srcs = [payload(i) for i in range(40)]   # 40 x 64 KiB: more than maxmemory holds
        for k, s in zip(keys, srcs):
            assert t.write([k], [s]) == [True]
        dsts = [np.zeros_like(s) for s in srcs]
        ok = t.read_into(keys, dsts)
        assert 0 < sum(ok) < len(keys)              # Redis evicted some on its own
        assert all(np.array_equal(s, d) for s, d, good in zip(srcs, dsts, ok) if good)
        stats = t.stats()
        assert stats["vanished"] == len(keys) - sum(ok) and stats["corrupt_blocks"] == 0
        assert t.used_bytes == sum(ok) * len(srcs[0])
        t.close()
    finally:
        server.stop()


def test_acl_wrong_credentials_name_the_setting(server, raw):
    from kvstore.tiers.redis import RedisTier

    user = f"u{uuid.uuid4().hex[:6]}"
    raw.acl_setuser(user, enabled=True, passwords=["+right-pw"], keys=["acl:*"], commands=["+@all"])
    t = RedisTier(CAPACITY, url=server.url, username=user, password="right-pw", prefix="acl")
    assert t.write(make_keys(1, salt="acl"), [payload(0)]) == [True]
    t.close()
    with pytest.raises(ConfigError, match=r"tiers\.acl-tier\.password: .*refused the credentials"):
        RedisTier(CAPACITY, name="acl-tier", url=server.url, username=user, password="wrong", prefix="acl")
    with pytest.raises(ConfigError, match=r"tiers\.acl-tier\.password"):
        RedisTier(CAPACITY, name="acl-tier", url=server.url, username="nobody", password="x", prefix="acl")
    # Right password, but the user may not touch keys under this prefix.
    with pytest.raises(ConfigError, match=r"tiers\.acl-tier\.username: .*lacks a permission"):
        RedisTier(CAPACITY, name="acl-tier", url=server.url, username=user, password="right-pw", prefix="other")


def test_password_from_env_through_config(server, raw, monkeypatch):
    user = f"e{uuid.uuid4().hex[:6]}"
    raw.acl_setuser(user, enabled=True, passwords=["+env-pw"], keys=["envp:*"], commands=["+@all"])
    cfg = {"tiers": [{"name": "shared", "kind": "redis", "url": server.url, "capacity": "4MiB", "prefix": "envp",
                      "username": user, "password_env": "KVTEST_REDIS_PW"}]}
    monkeypatch.delenv("KVTEST_REDIS_PW", raising=False)
    with pytest.raises(ConfigError, match=r"tiers\.shared\.password_env: .*KVTEST_REDIS_PW"):
        Store.from_config(cfg)
    monkeypatch.setenv("KVTEST_REDIS_PW", "wrong")
    with pytest.raises(ConfigError, match=r"tiers\.shared\.password"):
        Store.from_config(cfg)
    monkeypatch.setenv("KVTEST_REDIS_PW", "env-pw")
    with Store.from_config(cfg) as store:
        keys = make_keys(2, salt="env")
        assert store.save(keys, [payload(0), payload(1)]).result() == [True, True]


def test_bad_config_is_named(server):
    from kvstore.tiers.redis import RedisTier

    with pytest.raises(ConfigError, match=r"tiers\.r\.url: cannot use"):
        RedisTier(CAPACITY, name="r", url="redis://127.0.0.1:1", timeout_s=0.5)
    with pytest.raises(ConfigError, match=r"tiers\.r\.url: put credentials"):
        RedisTier(CAPACITY, name="r", url=f"redis://u:p@127.0.0.1:{server.port}")
    with pytest.raises(ConfigError, match=r"tiers\.r\.cluster: .*not a Cluster node"):
        RedisTier(CAPACITY, name="r", url=server.url, cluster=True)
    with pytest.raises(ConfigError, match=r"tiers\.r: give exactly one of url or nodes"):
        RedisTier(CAPACITY, name="r")
    with pytest.raises(ConfigError, match=r"tiers\.r\.prefix"):
        RedisTier(CAPACITY, name="r", url=server.url, prefix="a:b")


def _store(server, prefix, **extra):
    return Store.from_config({"tiers": [{
        "name": "shared", "kind": "redis", "url": server.url, "capacity": "64MiB", "prefix": prefix,
        "timeout_s": 0.5, "max_attempts": 2, **extra}]})


def test_server_killed_during_loads_then_restarted(tmp_path):
    """Misses while the server is down, no exception to the caller, the fault counted;
    the tier comes back by itself once the server does (AOF: the blocks too)."""
    need_redis()
    server = RedisServer(tmp_path / "outage", appendonly=True)
    keys = make_keys(8, salt="outage")
    srcs = [payload(i) for i in range(8)]
    try:
        with _store(server, "outage") as store:
            assert all(store.save(keys, srcs).result())
            server.kill()
            dsts = [np.zeros_like(s) for s in srcs]
            assert store.load(keys, dsts).result() == [False] * 8     # misses, no exception
            stats = store.stats()["tiers"][0]
            assert stats["healthy"] is False and stats["faults"] >= 1
            with pytest.raises(TierUnavailableError):                 # the tier itself fails fast
                store._levels[0].tier.read_into(keys, dsts)
            server.start()
            deadline = time.monotonic() + 30
            while not store.stats()["tiers"][0]["healthy"]:
                assert time.monotonic() < deadline, "tier did not come back"
                time.sleep(0.1)
            assert store.load(keys, dsts).result() == [True] * 8      # still indexed, byte-exact
            assert all(np.array_equal(s, d) for s, d in zip(srcs, dsts))
    finally:
        server.stop()


def test_find_asks_redis_for_blocks_another_node_wrote(tier, server, raw):
    keys = make_keys(4, salt="find-other")
    srcs = [payload(i) for i in range(3)]
    assert tier.write(keys[:3], srcs) == [True] * 3
    name = f"{tier.prefix}:{keys[2].namespace.hex()}:{keys[2].hex()}"
    body = bytearray(raw.get(name))
    body[10] ^= 0x01                      # inside the header: not this key's block
    raw.set(name, bytes(body))
    other = make_tier(server, prefix=tier.prefix, capacity=len(srcs[0]) * 4)
    try:
        assert other.used_bytes == 0 and other.contains(keys) == [False] * 4
        assert other.find(keys) == [len(srcs[0]), len(srcs[1]), None, None]
        assert other.contains(keys) == [True, True, False, False]       # indexed ...
        assert other.used_bytes == len(srcs[0]) + len(srcs[1])          # ... and budgeted here
        stats = other.stats()
        assert stats["found"] == 2 and stats["corrupt_blocks"] == 1
        assert raw.exists(name) == 0                                    # the bad value is gone
        assert other.find(keys[:2]) == [len(srcs[0]), len(srcs[1])]     # from the index now
        assert other.stats()["found"] == 2
    finally:
        other.close()
    full = make_tier(server, prefix=tier.prefix, capacity=len(srcs[0]))
    try:
        assert full.find(keys[:2]) == [len(srcs[0]), None]              # past this node's budget
    finally:
        full.close()


def test_store_finds_what_another_store_saved_after_it_started(server):
    prefix = f"f{uuid.uuid4().hex[:8]}"
    keys = make_keys(5, salt="store-find")
    srcs = [payload(i) for i in range(5)]
    with _store(server, prefix) as reader, _store(server, prefix) as writer:
        assert reader.lookup(keys) == 0
        assert writer.save(keys[:4], srcs[:4]).result() == [True] * 4
        assert reader.lookup(keys) == 4                       # asked Redis; the fifth was never saved
        assert reader.stats()["shared_found"] == 4
        dsts = [np.zeros(len(s), np.uint8) for s in srcs]
        assert reader.load(keys, dsts).result() == [True] * 4 + [False]
        assert all(np.array_equal(d, s) for d, s in zip(dsts, srcs[:4]))
        more = make_keys(2, salt="store-find-load")
        assert writer.save(more, srcs[:2]).result() == [True, True]
        dsts = [np.zeros(len(s), np.uint8) for s in srcs[:2]]
        assert reader.load(more, dsts).result() == [True, True]   # a load without a lookup finds them too
        assert np.array_equal(dsts[1], srcs[1])
        wrong = [np.zeros(len(srcs[0]) - 1, np.uint8)]
        assert writer.save(make_keys(1, salt="store-find-size"), srcs[:1]).result() == [True]
        assert reader.load(make_keys(1, salt="store-find-size"), wrong).result() == [False]   # another size: a miss


def test_blocks_found_in_a_shared_tier_are_counted_for_their_tenant(server):
    # a block another node wrote and this node found is a tenant's block like one it
    # saved: counted in the tenant's bytes (so evicting it later cannot go negative) and,
    # with no quota in that tier, listed as one whose hints protect nothing there
    from kvstore.store.tenants import TAG_BYTES, TenantLedger

    prefix = f"t{uuid.uuid4().hex[:8]}"
    keys = make_keys(3, salt="tenant-found")
    srcs = [payload(i) for i in range(3)]
    with _store(server, prefix) as reader, _store(server, prefix) as writer:
        ledger = TenantLedger({k.digest[:TAG_BYTES]: "n" for k in keys}, {"n": {}}, ["shared"])
        reader.set_tenants(ledger)
        assert writer.save(keys, srcs).result() == [True] * 3
        assert reader.lookup(keys) == 3 and reader.stats()["shared_found"] == 3
        held = reader.stats()["tenants"]["n"]["tiers"]["shared"]
        assert held["blocks"] == 3 and held["used_bytes"] == sum(len(s) for s in srcs)
        with reader._lock:
            unprotected = ledger.hint_bound(0)()
            assert unprotected is not None and set(keys) <= set(unprotected)
        reader.delete(keys)
        held = reader.stats()["tenants"]["n"]["tiers"]["shared"]
        assert held["blocks"] == 0 and held["used_bytes"] == 0
