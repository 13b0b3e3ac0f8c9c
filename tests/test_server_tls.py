"""TLS on the cache server's TCP path (issue 20): ``server.tls``, ``Client(tls=...)``
and the remote tier's ``tls:``. A throwaway CA, server and client certificates are
made for the module (``tests/_pki.py``); servers listen on 127.0.0.1, random ports."""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

pytest.importorskip("cryptography")

from kvstore.client import Client  # noqa: E402
from kvstore.config import ClientTlsConfig, load_config  # noqa: E402
from kvstore.errors import ConfigError, ProtocolError, TierUnavailableError  # noqa: E402
from kvstore.net import protocol as P  # noqa: E402
from kvstore.store import Store  # noqa: E402
from kvstore.testing import make_keys, payload  # noqa: E402
from tests._flip_proxy import ByteFlipProxy  # noqa: E402
from tests._hello import paced_put, raw_hello  # noqa: E402
from tests._pki import encrypted_key, make_pki  # noqa: E402
from tests._servers import ThreadServer, config_dict  # noqa: E402

WAIT_S = 20


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory):
    """Another CA, with its own server and client certificates."""
    return make_pki(tmp_path_factory.mktemp("other-pki"), name="other")


@pytest.fixture(scope="module", params=[4, 0], ids=["sender-threads", "event-loop"])
def tls_server(request, pki):
    """TLS, client certificates checked when presented (ca set, not required)."""
    s = ThreadServer(config_dict("64MiB", transport="tcp", send_threads=request.param,
                                 tls=pki.server_tls(ca=pki.ca)))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def mtls_server(pki):
    s = ThreadServer(config_dict("16MiB", transport="tcp", handshake_timeout_s=1.0,
                                 tls=pki.server_tls(ca=pki.ca, require_client_cert=True)))
    yield s
    s.stop()


def _refused(server, reason: str) -> float:
    value = server.server.metrics.registry.get_sample_value("kvstore_refused_connections_total",
                                                            {"reason": reason})
    return value or 0.0


def _roundtrip(client: Client, sizes: list[int], salt: str) -> None:
    keys = make_keys(len(sizes), salt=salt)
    srcs = [payload(i + 7 * len(salt), n) for i, n in enumerate(sizes)]
    assert client.save(keys, srcs).result(WAIT_S) == [True] * len(sizes)
    dsts = [np.zeros(n, np.uint8) for n in sizes]
    assert client.load(keys, dsts).result(WAIT_S) == [True] * len(sizes)
    for src, dst in zip(srcs, dsts):
        assert np.array_equal(src, dst)
    assert client.stats()["client"]["checksum_mismatches"] == 0


# -- the data path -------------------------------------------------------------------------


@pytest.mark.parametrize("sizes", [[1], [4096] * 3, [3000] * 200, [5 << 20, 1, 777_777]],
                         ids=["one-byte", "small", "many-small", "large"])
def test_save_and_load_are_byte_exact_over_tls(tls_server, pki, sizes):
    # many-small: replies coalesced into larger TLS writes; large: past the sender-thread threshold
    with Client(tls_server.address, transport="tcp", tls=pki.client_tls()) as c:
        assert c.tls and c.transport == "tcp"
        _roundtrip(c, sizes, salt=f"exact-{len(sizes)}-{sizes[0]}")
        assert c.stats()["server"]["tls"] is True


def test_tls_accepts_an_ssl_context_a_config_and_a_client_certificate(tls_server, pki):
    ctx = ssl.create_default_context(cafile=pki.ca)
    with Client(tls_server.address, transport="tcp", tls=ctx) as c:
        _roundtrip(c, [10_000], salt="ctx")
    with Client(tls_server.address, transport="tcp", tls=ClientTlsConfig(ca=pki.ca, cert=pki.client_cert,
                                                                         key=pki.client_key)) as c:
        _roundtrip(c, [10_000], salt="cfg")


def test_a_pool_of_tls_connections_serves_concurrent_calls(tls_server, pki):
    with Client(tls_server.address, transport="tcp", pool_size=4, tls=pki.client_tls()) as c:
        errors: list[BaseException] = []

        def work(i: int) -> None:
            try:
                _roundtrip(c, [300_000] * 4, salt=f"pool-{i}")
            except BaseException as exc:   # reported below
                errors.append(exc)
        threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors


def test_a_same_host_client_keeps_shared_memory_which_tls_does_not_cover(pki):
    """The Unix socket + shared memory path stays plaintext: bytes never leave the host."""
    s = ThreadServer(config_dict("16MiB", tls=pki.server_tls()))
    try:
        with Client(s.address, tls=pki.client_tls()) as c:
            assert c.transport == "shm" and not c.tls
            _roundtrip(c, [50_000], salt="shm")
        with Client(s.address, transport="tcp", tls=pki.client_tls()) as c:
            assert c.transport == "tcp" and c.tls
    finally:
        s.stop()


# -- who may connect -------------------------------------------------------------------------


def test_mutual_tls_refuses_a_client_without_a_certificate(mtls_server, pki):
    before = _refused(mtls_server, "tls_handshake")
    with pytest.raises(TierUnavailableError, match="TLS|certificate"):
        Client(mtls_server.address, transport="tcp", tls=pki.client_tls())
    with Client(mtls_server.address, transport="tcp", tls=pki.client_tls(cert=True)) as c:
        _roundtrip(c, [4096, 2 << 20], salt="mtls")
    assert _refused(mtls_server, "tls_handshake") > before


def test_mutual_tls_refuses_a_certificate_from_another_ca(mtls_server, pki, other_pki):
    wrong = {"ca": pki.ca, "cert": other_pki.client_cert, "key": other_pki.client_key}
    with pytest.raises(TierUnavailableError, match="TLS|certificate"):
        Client(mtls_server.address, transport="tcp", tls=wrong)


def test_a_server_certificate_from_another_ca_is_refused(tls_server, other_pki):
    before = _refused(tls_server, "tls_handshake")
    with pytest.raises(TierUnavailableError, match="certificate failed verification"):
        Client(tls_server.address, transport="tcp", tls=other_pki.client_tls())
    _wait_for(lambda: _refused(tls_server, "tls_handshake") > before)


def test_the_server_name_is_checked_unless_turned_off(tls_server, pki):
    with pytest.raises(TierUnavailableError, match="certificate failed verification"):
        Client(tls_server.address, transport="tcp", tls=pki.client_tls(server_hostname="cache.example"))
    with Client(tls_server.address, transport="tcp",
                tls=pki.client_tls(server_hostname="cache.example", check_hostname=False)) as c:
        _roundtrip(c, [1000], salt="nocheck")   # the chain is still verified (see the test above)
    with Client(f"localhost:{tls_server.server.port}", transport="tcp", tls=pki.client_tls()) as c:
        assert c.tls


def test_a_plaintext_client_is_refused_cleanly_and_counted(tls_server, pki, caplog):
    before, junk_before = _refused(tls_server, "tls_required"), _refused(tls_server, "tls_handshake")
    with caplog.at_level(logging.INFO, logger="kvstore.server"):
        for _ in range(5):
            with pytest.raises(ProtocolError, match="requires TLS"):
                Client(tls_server.address, transport="tcp")
        # not a kvstore client at all: the handshake fails, one line each
        for junk in (b"GET / HTTP/1.1\r\n\r\n", b"\x16\x03\x01\x00\x05hello"):
            with socket.create_connection(("127.0.0.1", tls_server.server.port), timeout=WAIT_S) as sock:
                sock.sendall(junk)
                assert _closed(sock)
    assert _refused(tls_server, "tls_required") == before + 5
    _wait_for(lambda: _refused(tls_server, "tls_handshake") >= junk_before + 2)
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]
    with Client(tls_server.address, transport="tcp", tls=pki.client_tls()) as c:   # still serving
        _roundtrip(c, [2048], salt="after-plaintext")


def test_a_tls_client_on_a_plaintext_server_gets_an_error_naming_tls(pki):
    s = ThreadServer(config_dict("8MiB", transport="tcp"))
    try:
        with pytest.raises(TierUnavailableError, match="TLS") as info:
            Client(s.address, transport="tcp", tls=pki.client_tls())
        assert "server.tls" in str(info.value)
    finally:
        s.stop()


def test_a_silent_or_stalled_tls_peer_is_closed(pki):
    s = ThreadServer(config_dict("8MiB", transport="tcp", handshake_timeout_s=0.5, read_timeout_s=0.5,
                                 tls=pki.server_tls()))
    try:
        silent = socket.create_connection(("127.0.0.1", s.server.port), timeout=WAIT_S)
        half = socket.create_connection(("127.0.0.1", s.server.port), timeout=WAIT_S)
        half.sendall(b"\x16\x03\x01\x02\x00\x01")          # a ClientHello that stops
        assert _closed(silent) and _closed(half)
        # authenticated over TLS, then a PUT whose payload stops arriving
        ctx = ssl.create_default_context(cafile=pki.ca)
        sock = ctx.wrap_socket(socket.create_connection(("127.0.0.1", s.server.port), timeout=WAIT_S),
                               server_hostname="127.0.0.1")
        raw_hello(sock)
        keys = make_keys(1, salt="stalled-tls")
        body = P.encode_records(P.PUT_REC, keys, [4 << 20], [0])
        sock.sendall(P.pack_header(P.Op.PUT, 2, len(body), 4 << 20) + body + bytes(1 << 20))
        assert _closed(sock)
        assert s.store.contains(keys) == [False]
        assert _refused(s, "handshake_timeout") >= 2 and _refused(s, "read_timeout") >= 1
    finally:
        s.stop()


def test_over_tls_a_trickling_upload_is_closed_for_its_rate_and_a_paced_one_is_stored(pki):
    """min_body_rate_bytes_s over TLS: the bytes a TLS read has taken so far count
    while it waits, so an upload paced above the rate is stored however long it lasts,
    and one that trickles a record at a time (each in time for read_timeout_s) is
    closed and counted."""
    s = ThreadServer(config_dict("8MiB", transport="tcp", tls=pki.server_tls(), read_timeout_s=1.0,
                                 min_body_rate_bytes_s="256KiB", min_body_rate_grace_s=0.5))
    ctx = ssl.create_default_context(cafile=pki.ca)
    try:
        paced = ctx.wrap_socket(socket.create_connection(("127.0.0.1", s.server.port), timeout=WAIT_S),
                                server_hostname="127.0.0.1")
        raw_hello(paced)
        assert paced_put(paced, "paced-tls", 2 << 20, 128 << 10, 0.15) == b"\x01"   # 2.4 s, ~850 KiB/s
        paced.close()
        trickle = ctx.wrap_socket(socket.create_connection(("127.0.0.1", s.server.port), timeout=WAIT_S),
                                  server_hostname="127.0.0.1")
        raw_hello(trickle)
        keys = make_keys(1, salt="trickle-tls")
        body = P.encode_records(P.PUT_REC, keys, [1 << 20], [0])
        trickle.sendall(P.pack_header(P.Op.PUT, 2, len(body), 1 << 20) + body)
        closed = False
        for _ in range(int(WAIT_S / 0.2)):                  # a byte every 0.2 s until the server closes it
            try:
                trickle.sendall(b"\0")
                trickle.settimeout(0.2)
                if trickle.recv(4096) == b"":
                    closed = True
                    break
            except socket.timeout:
                continue
            except OSError:
                closed = True
                break
        trickle.close()
        assert closed and _refused(s, "min_body_rate") >= 1 and _refused(s, "read_timeout") == 0
        assert s.store.contains(keys) == [False]
    finally:
        s.stop()


def test_a_byte_changed_on_the_wire_is_a_tls_error_never_stored(tls_server, pki):
    """TLS authenticates every record: a byte flipped in a PUT's payload ends that
    connection (counted); the client's retry stores the block as it was sent."""
    keys = make_keys(1, salt="tamper")
    src = payload(11, 2 << 20)
    before = _refused(tls_server, "tls_error")
    with ByteFlipProxy(("127.0.0.1", tls_server.server.port), after=1 << 20) as proxy:
        with Client(proxy.address, transport="tcp", pool_size=1, tls=pki.client_tls()) as c:
            try:
                ok = c.save(keys, [src]).result(WAIT_S)
            except TierUnavailableError:
                ok = [False]
        assert proxy.flipped
    _wait_for(lambda: _refused(tls_server, "tls_error") > before)
    with Client(tls_server.address, transport="tcp", tls=pki.client_tls()) as c:
        dst = np.zeros_like(src)
        assert c.load(keys, [dst]).result(WAIT_S) == ok
        assert not ok[0] or np.array_equal(dst, src)


def test_the_admin_port_serves_https_with_the_same_certificate(tls_server, pki):
    url = f"https://127.0.0.1:{tls_server.server.admin_port}/healthz"
    ctx = ssl.create_default_context(cafile=pki.ca)
    with urllib.request.urlopen(url, context=ctx, timeout=WAIT_S) as resp:
        assert resp.status == 200
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(f"http://127.0.0.1:{tls_server.server.admin_port}/healthz", timeout=5)
    with urllib.request.urlopen(url, context=ctx, timeout=WAIT_S) as resp:   # and it still serves
        assert resp.status == 200


def test_kvstore_stats_connects_over_tls(tls_server, pki, capsys):
    from kvstore.cli import main

    assert main(["stats", "--server", tls_server.address, "--tls-ca", pki.ca, "--json"]) == 0
    assert '"tls": true' in capsys.readouterr().out
    assert main(["stats", "--server", tls_server.address]) == 2    # plaintext: refused, one error line
    assert "requires TLS" in capsys.readouterr().err


def test_kvstore_serve_with_tls(pki, tmp_path):
    """The real ``kvstore serve`` (uvloop where installed): TLS data path and HTTPS admin."""
    from tests._servers import ProcessServer

    s = ProcessServer(config_dict("16MiB", tls=pki.server_tls(ca=pki.ca, require_client_cert=True)), tmp_path)
    try:
        with Client(s.address, transport="tcp", tls=pki.client_tls(cert=True)) as c:
            _roundtrip(c, [3 << 20, 5000], salt="process")
        with pytest.raises(ProtocolError, match="requires TLS"):
            Client(s.address, transport="tcp")
        ctx = ssl.create_default_context(cafile=pki.ca)
        ctx.load_cert_chain(pki.client_cert, pki.client_key)
        with urllib.request.urlopen(f"https://127.0.0.1:{s.admin_port}/metrics", context=ctx, timeout=WAIT_S) as r:
            assert 'reason="tls_required"' in r.read().decode()
        assert s.terminate() == 0
    finally:
        s.kill()


# -- the remote tier ---------------------------------------------------------------------------


def test_a_remote_tier_over_mutual_tls_through_a_store(mtls_server, pki):
    tls = pki.client_tls(cert=True)
    cfg = load_config({"tiers": [{"name": "hot", "kind": "dram", "capacity": "1MiB", "pin": False},
                                 {"name": "shared", "kind": "remote", "capacity": "8MiB",
                                  "address": mtls_server.address, "tls": tls}]}, env={})
    assert cfg.tiers[1].tls.cert == pki.client_cert
    keys = make_keys(6, salt="remote-tls")
    srcs = [payload(40 + i, 300_000) for i in range(6)]   # 1.8 MB: most spill through the 1 MiB DRAM tier
    with Store(cfg) as store:
        assert all(store.save(keys, srcs).result(WAIT_S))
        remote = store.tiers[1]
        assert remote.stats()["tls"] is True and remote.stats()["transport"] == "tcp"
        assert any(remote.contains(keys))
        for k in keys:   # read each back through the Store, wherever it lives now
            dst = np.zeros(300_000, np.uint8)
            assert store.load([k], [dst]).result(WAIT_S) == [True]
            assert np.array_equal(dst, srcs[keys.index(k)])
    assert mtls_server.store.stats()["blocks"] > 0


def test_a_remote_tier_without_its_client_certificate_is_unavailable(mtls_server, pki):
    cfg = load_config({"tiers": [{"name": "shared", "kind": "remote", "capacity": "8MiB",
                                  "address": mtls_server.address, "tls": {"ca": pki.ca}}]}, env={})
    with pytest.raises(TierUnavailableError, match="shared"):
        Store(cfg)


# -- config ---------------------------------------------------------------------------------


def _server_cfg(tls: dict, env: dict | None = None):
    return load_config(config_dict("8MiB", tls=tls), env=env or {})


def test_server_tls_config_loads_and_dumps(pki):
    cfg = _server_cfg(pki.server_tls(ca=pki.ca, require_client_cert=True, min_version="1.3"))
    assert cfg.server.tls.require_client_cert and cfg.server.tls.min_version == "1.3"
    ctx = cfg.server.tls.context()
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.minimum_version == ssl.TLSVersion.TLSv1_3
    assert _server_cfg(pki.server_tls(ca=pki.ca)).server.tls.context().verify_mode == ssl.CERT_OPTIONAL
    assert _server_cfg(pki.server_tls()).server.tls.context().minimum_version == ssl.TLSVersion.TLSv1_2
    env = {"KVSTORE_SERVER__TLS__CERT": pki.server_cert, "KVSTORE_SERVER__TLS__KEY": pki.server_key}
    assert load_config(config_dict("8MiB"), env=env).server.tls.cert == pki.server_cert


def test_client_tls_defaults_verify_the_server(pki):
    ctx = ClientTlsConfig(ca=pki.ca).context()
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert ctx.minimum_version >= ssl.TLSVersion.TLSv1_2
    loose = ssl.create_default_context()
    loose.check_hostname = False
    loose.verify_mode = ssl.CERT_NONE
    with pytest.raises(ConfigError, match="does not verify"):
        Client("127.0.0.1:1", tls=loose)


@pytest.mark.parametrize("field,value,needle", [
    ("cert", "missing.pem", "server.tls.cert: no such file"),
    ("cert", "garbage", "server.tls.cert: not a PEM certificate"),
    ("cert", "dir", "server.tls.cert: is a directory"),
    ("key", "missing.pem", "server.tls.key: no such file"),
    ("key", "client-key", "server.tls.key: the key does not match the certificate"),
    ("key", "garbage", "server.tls.key: not a PEM private key"),
    ("key", "encrypted", "server.tls.key: the key is passphrase-protected"),
    ("ca", "missing.pem", "server.tls.ca: no such file"),
    ("ca", "garbage", "server.tls.ca: not a PEM CA certificate bundle"),
    ("ca", "key-file", "server.tls.ca: not a PEM CA certificate bundle"),
    ("min_version", "1.1", "server.tls.min_version"),
    ("require_client_cert", True, "require_client_cert: true needs ca"),
    ("ciphers", "NULL", "server.tls.ciphers: unknown field"),
])
def test_server_tls_config_errors_name_the_field(pki, tmp_path, field, value, needle):
    files = {"missing.pem": str(tmp_path / "missing.pem"), "garbage": str(tmp_path / "garbage.pem"),
             "dir": str(tmp_path), "client-key": pki.client_key, "encrypted": encrypted_key(tmp_path),
             "key-file": pki.server_key}
    (tmp_path / "garbage.pem").write_text("not a certificate\n")
    tls = {**pki.server_tls(), field: files.get(value, value) if isinstance(value, str) else value}
    with pytest.raises(ConfigError) as info:
        _server_cfg(tls)
    assert needle in str(info.value)


def test_a_missing_server_tls_field_is_named(pki):
    with pytest.raises(ConfigError, match=r"server\.tls\.key: Field required"):
        _server_cfg({"cert": pki.server_cert})


@pytest.mark.parametrize("tls,needle", [
    ({"ca": "/nonexistent/ca.pem"}, "tiers.0.tls.ca: no such file"),
    ({"cert": "CLIENT"}, "give both cert and key"),
    ({"cert": "CLIENT", "key": "SERVERKEY"}, "tiers.0.tls.key: the key does not match"),
    ({"server_hostname": ""}, "tiers.0.tls.server_hostname"),
    ({"verify": False}, "tiers.0.tls.verify: unknown field"),
])
def test_remote_tier_tls_config_errors_name_the_field(pki, tls, needle):
    subst = {"CLIENT": pki.client_cert, "SERVERKEY": pki.server_key}
    tls = {k: subst.get(v, v) if isinstance(v, str) else v for k, v in tls.items()}
    with pytest.raises(ConfigError) as info:
        load_config({"tiers": [{"name": "r", "kind": "remote", "capacity": "1MiB", "address": "h:1", "tls": tls}]},
                    env={})
    assert needle in str(info.value)


def test_remote_tier_tls_true_is_verified_against_the_system_store():
    cfg = load_config({"tiers": [{"name": "r", "kind": "remote", "capacity": "1MiB", "address": "h:1",
                                  "tls": True}]}, env={})
    assert cfg.tiers[0].tls == ClientTlsConfig()
    assert load_config({"tiers": [{"name": "r", "kind": "remote", "capacity": "1MiB", "address": "h:1",
                                   "tls": False}]}, env={}).tiers[0].tls is None


def test_client_tls_settings_errors_name_the_field(pki):
    with pytest.raises(ConfigError, match=r"tls\.ca: no such file"):
        Client("127.0.0.1:1", tls={"ca": "/nonexistent/ca.pem"})
    with pytest.raises(ConfigError, match="tls must be"):
        Client("127.0.0.1:1", tls="yes")


# -- helpers ----------------------------------------------------------------------------------


def _closed(sock: socket.socket) -> bool:
    """Drain until the server closes (True) or WAIT_S passes with the socket open."""
    sock.settimeout(WAIT_S)
    try:
        while sock.recv(4096):
            pass
        return True
    except (ConnectionResetError, ssl.SSLError):
        return True
    except socket.timeout:
        return False
    finally:
        sock.close()


def _wait_for(cond, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_a_connector_reaches_a_tls_server_through_open_store(mtls_server, pki):
    from kvstore.connectors._store_handle import open_store, release_store

    store = open_store({"server": mtls_server.address, "tls": pki.client_tls(cert=True)}, owner="vllm")
    try:
        keys, srcs = make_keys(2, salt="connector-tls"), [payload(90 + i, 4096) for i in range(2)]
        assert store.save(keys, srcs).result(WAIT_S) == [True, True]
        dst = [np.zeros(4096, np.uint8) for _ in keys]
        assert store.load(keys, dst).result(WAIT_S) == [True, True]
        assert all(np.array_equal(d, s) for d, s in zip(dst, srcs))
        assert store.client.tls
    finally:
        release_store(store)
    with pytest.raises(ConfigError, match="vllm: 'tls' must be true or a mapping"):
        open_store({"server": mtls_server.address, "tls": "yes"}, owner="vllm")
    with pytest.raises(ConfigError, match="vllm: .*tls"):
        open_store({"server": mtls_server.address, "tls": {"ca": "/nonexistent/ca.pem"}}, owner="vllm")


# -- a certificate out of its validity window (issue 34 item 9) -------------------------------

@pytest.mark.parametrize("days, says", [((-30, -1), "expired on "), ((2, 30), "is not valid until ")],
                         ids=["expired", "not-yet-valid"])
def test_serve_and_validate_refuse_a_server_certificate_out_of_its_dates(tmp_path, capsys, days, says):
    import datetime as dt
    import os
    import subprocess
    import sys

    import yaml

    from kvstore.cli import main

    now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    window = tuple(now + dt.timedelta(days=d) for d in days)
    pki = make_pki(tmp_path / "pki", name="dated", server_valid=window)
    path = tmp_path / "kvstore.yaml"
    path.write_text(yaml.safe_dump(config_dict("1MiB", tls=pki.server_tls())))
    shown = (window[1] if "expired" in says else window[0]).strftime("%Y-%m-%d %H:%M:%S UTC")
    expected = f"server.tls.cert: {pki.server_cert} {says}{shown}"
    assert main(["config", "validate", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvstore: error: ") and expected in err[0], err
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-m", "kvstore", "--log-level", "WARNING", "serve", "--config", str(path)],
                          cwd=root, env={**os.environ, "PYTHONPATH": root}, capture_output=True, text=True,
                          timeout=60)                     # a server that starts anyway never returns: a failure
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1 and err[0].startswith("kvstore: error: "), err
    assert expected in err[0]
