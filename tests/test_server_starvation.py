"""One client cannot starve the others (issue 34, items 3 and 4): a tenant's trickling
uploads hold only its own share of the buffer budget and are closed for falling below
the minimum body rate (a byte now and then keeps no deadline alive), and silent
unauthenticated connections, reopened as fast as they are closed, never lock
authenticated clients out. Real servers on 127.0.0.1, raw frames for the attackers,
real Clients for the well-behaved; every wait is a bound, never a timing."""

from __future__ import annotations

import selectors
import socket
import threading
import time

import numpy as np

from kvstore.block import checksum
from kvstore.client import Client
from kvstore.net import protocol as P
from kvstore.testing import make_keys, payload
from tests._hello import paced_put, raw_hello, recv_exact
from tests._servers import ThreadServer, config_dict

WAIT_S = 30          # the longest a test waits for the server to act (a bound, not a timing)
A, B = "token-of-a", "token-of-b"
TENANTS = [{"name": "a", "token": A, "salt": "salt-of-tenant-a-0001"},
           {"name": "b", "token": B, "salt": "salt-of-tenant-b-0001"}]


def _refused(s: ThreadServer, reason: str) -> float:
    return s.server.metrics.registry.get_sample_value("kvstore_refused_connections_total", {"reason": reason}) or 0


def _wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def _closed_by_server(sock: socket.socket) -> bool:
    """Drain until the server closes (True) or WAIT_S passes with the socket open (False)."""
    sock.settimeout(WAIT_S)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except (socket.timeout, OSError):
        return False


def _trickle(sock: socket.socket, stop: threading.Event) -> None:
    """One byte every 0.5 s: each in time for any per-byte deadline (read_timeout_s)."""
    while not stop.wait(0.5):
        try:
            sock.sendall(b"\0")
        except OSError:
            return


def test_a_tenants_trickling_uploads_leave_other_tenants_saves_served_and_are_closed():
    """Three PUTs of tenant a announce max_inflight_bytes each and trickle a byte every
    0.5 s. They held the whole buffer budget (taken at the announced size, one queue for
    all), tenant b's saves waited behind them until they timed out, and a byte now and
    then kept read_timeout_s from ever closing them. Now each tenant has its own share,
    and a frame slower than min_body_rate_bytes_s (defaults) is closed and counted."""
    s = ThreadServer(config_dict("32MiB", tenants=TENANTS, max_inflight_bytes="4MiB",
                                 max_inflight_bytes_total="8MiB"))
    stop = threading.Event()
    tricklers, threads = [], []
    try:
        for i in range(3):
            sock = socket.create_connection(("127.0.0.1", s.server.port), timeout=WAIT_S)
            raw_hello(sock, A)
            body = P.encode_records(P.PUT_REC, make_keys(1, salt=f"trickle-{i}"), [4 << 20], [0])
            sock.sendall(P.pack_header(P.Op.PUT, 3, len(body), 4 << 20) + body + b"\0")
            tricklers.append(sock)
            threads.append(threading.Thread(target=_trickle, args=(sock, stop), daemon=True))
            threads[-1].start()
        _wait_for(lambda: s.server.buffers.used >= 4 << 20 and s.server.buffers.waiting >= 1,
                  "tenant a's uploads holding buffers, one waiting")
        keys = make_keys(4, salt="tenant-b")
        blocks = [payload(i, 256 << 10) for i in range(4)]
        with Client(s.address, token=B, transport="tcp", timeout_s=5) as b:   # its normal timeout
            for k, block in zip(keys, blocks):
                assert b.save([k], [block]).result(WAIT_S) == [True]
            dst = np.zeros(256 << 10, np.uint8)
            assert b.load(keys[:1], [dst]).result(WAIT_S) == [True] and np.array_equal(dst, blocks[0])
        assert all(_closed_by_server(t) for t in tricklers)           # none is kept alive by its trickle
        assert _refused(s, "min_body_rate") >= 3
        assert not any(s.store.contains(make_keys(1, salt=f"trickle-{i}"))[0] for i in range(3))
    finally:
        stop.set()
        for t in tricklers:
            t.close()
        for t in threads:
            t.join(5)
        s.stop()
    assert s.server.buffers.used == 0


def test_one_tenant_holds_at_most_its_share_of_the_buffer_budget():
    s = ThreadServer(config_dict("32MiB", tenants=TENANTS, max_inflight_bytes="4MiB",
                                 max_inflight_bytes_total="8MiB", read_timeout_s=2.0))
    held = []
    try:
        for i in range(2):                                 # a's share is 4 MiB: the second waits
            sock = socket.create_connection(("127.0.0.1", s.server.port), timeout=WAIT_S)
            raw_hello(sock, A)
            body = P.encode_records(P.PUT_REC, make_keys(1, salt=f"held-{i}"), [4 << 20], [0])
            sock.sendall(P.pack_header(P.Op.PUT, 3, len(body), 4 << 20) + body)
            held.append(sock)
        share_a, share_b = s.server.buffers.of("a"), s.server.buffers.of("b")
        _wait_for(lambda: share_a.waiting == 1, "a's second upload waiting for a's share")
        assert share_a.used == 4 << 20 == share_a.limit and share_b.used == 0
        assert s.server.buffers.used <= 8 << 20
        assert all(_closed_by_server(h) for h in held)
    finally:
        for h in held:
            h.close()
        s.stop()


def test_an_upload_above_the_minimum_rate_is_served_however_long_it_takes_and_its_wait_for_the_budget_is_free():
    """The rate counts only time spent waiting for the client's bytes: an upload paced
    above min_body_rate_bytes_s is stored though it lasts past the grace and past
    read_timeout_s in all, and one that waited longer than the grace for the buffer
    budget (reading nothing) is not closed for it once it gets its turn."""
    s = ThreadServer(config_dict("16MiB", max_inflight_bytes="2MiB", max_inflight_bytes_total="2MiB",
                                 min_body_rate_bytes_s="256KiB", min_body_rate_grace_s=0.5, read_timeout_s=1.0))
    try:
        first = socket.create_connection(("127.0.0.1", s.server.port), timeout=WAIT_S)
        second = socket.create_connection(("127.0.0.1", s.server.port), timeout=WAIT_S)
        raw_hello(first)
        raw_hello(second)
        waiting = {}

        def queued_behind() -> None:             # announced while the first holds the whole budget
            data = payload(8, 1 << 20)
            body = P.encode_records(P.PUT_REC, make_keys(1, salt="queued"), [1 << 20], [checksum(data)])
            second.sendall(P.pack_header(P.Op.PUT, 9, len(body), 1 << 20) + body)
            _wait_for(lambda: s.server.buffers.waiting == 1, "the second upload waiting for the budget")
            waiting["since"] = time.monotonic()
            _wait_for(lambda: s.server.buffers.waiting == 0, "the budget given to the second upload")
            waiting["s"] = time.monotonic() - waiting["since"]
            second.sendall(data.tobytes())
            hdr = P.parse_header(recv_exact(second, P.HEADER_BYTES), P.Limits(1 << 40, 1 << 30), reply=True)
            waiting["reply"] = (hdr.status, recv_exact(second, hdr.body_len))

        # the first: 2 MiB in 16 chunks of 128 KiB, one every 0.15 s (about 850 KiB/s; 2.4 s in all)
        t = threading.Thread(target=queued_behind, daemon=True)
        results = {}

        def paced() -> None:
            results["first"] = paced_put(first, "paced", 2 << 20, 128 << 10, 0.15)

        p = threading.Thread(target=paced, daemon=True)
        p.start()
        _wait_for(lambda: s.server.buffers.used == 2 << 20, "the paced upload holding the budget")
        t.start()
        p.join(WAIT_S)
        t.join(WAIT_S)
        assert results["first"] == b"\x01"
        assert waiting["reply"] == (0, b"\x01") and waiting["s"] > 0.5   # it waited past the grace, then was served
        assert _refused(s, "min_body_rate") == 0 and _refused(s, "read_timeout") == 0
        first.close()
        second.close()
    finally:
        s.stop()


class _SilentFlood:
    """Silent connections from 127.0.0.2 and 127.0.0.3 (``per_address`` each), each
    reopened a moment after the server closes it, in one thread, until stopped (and at
    most ``max_opens`` connections in all)."""

    def __init__(self, port: int, per_address: int, *, max_opens: int = 50_000) -> None:
        self.port, self.max_opens = port, max_opens
        self.slots = [src for src in ("127.0.0.2", "127.0.0.3") for _ in range(per_address)]
        self.opened = self.closed = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        reopen = {i: 0.0 for i in range(len(self.slots))}
        try:
            while not self.stop.is_set() and self.opened < self.max_opens:
                now = time.monotonic()
                for i, at in list(reopen.items()):
                    if at <= now:
                        try:
                            sock = socket.create_connection(("127.0.0.1", self.port), timeout=1.0,
                                                            source_address=(self.slots[i], 0))
                        except OSError:
                            reopen[i] = now + 0.05
                            continue
                        self.opened += 1
                        del reopen[i]
                        sock.setblocking(False)
                        sel.register(sock, selectors.EVENT_READ, i)
                for key, _ in sel.select(0.02):
                    try:
                        data = key.fileobj.recv(4096)
                    except OSError:
                        data = b""
                    if not data:                   # closed by the server: reopen it shortly
                        sel.unregister(key.fileobj)
                        key.fileobj.close()
                        self.closed += 1
                        reopen[key.data] = time.monotonic() + 0.05
        finally:
            for key in list(sel.get_map().values()):
                key.fileobj.close()
            sel.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


def test_silent_unauthenticated_connections_never_lock_authenticated_clients_out():
    """Silent connections from two addresses, reopened as they were reaped, held every
    one of max_connections: nearly every new authenticated client was refused. Now the
    unauthenticated ones have a pool of their own and the oldest make room for a new
    connection, so 30 clients all connect and work while the flood goes on."""
    s = ThreadServer(config_dict("16MiB", token=A, max_connections=40, handshake_timeout_s=1.0))
    flood = _SilentFlood(s.server.port, per_address=25)        # 50 > max_connections
    clients = []
    try:
        _wait_for(lambda: len(s.server.conns) >= 40, "the flood filling max_connections")
        refused = 0
        for i in range(30):
            try:
                clients.append(Client(s.address, token=A, transport="tcp", pool_size=1, timeout_s=5))
            except Exception:
                refused += 1
        assert refused == 0, f"{refused} of 30 authenticated clients refused"
        keys = make_keys(30, salt="authed")
        for i, c in enumerate(clients):                        # every one of them works
            assert c.save([keys[i]], [payload(i, 4096)]).result(WAIT_S) == [True]
        dst = np.zeros(4096, np.uint8)
        for i, c in enumerate(clients):
            assert c.load([keys[i]], [dst]).result(WAIT_S) == [True] and np.array_equal(dst, payload(i, 4096))
        assert flood.opened > 50                                # the flood was reopening throughout
    finally:
        flood.close()
        for c in clients:
            c.close()
        s.stop()


def test_past_max_unauthenticated_connections_the_oldest_is_closed_first():
    s = ThreadServer(config_dict("16MiB", token=A, max_connections=20, max_unauthenticated_connections=4,
                                 handshake_timeout_s=WAIT_S * 2))
    socks = []
    try:
        for i in range(7):
            socks.append(socket.create_connection(("127.0.0.1", s.server.port), timeout=WAIT_S))
            _wait_for(lambda: len(s.server.conns) == min(i + 1, 4), f"connection {i + 1} accepted")
        assert all(_closed_by_server(x) for x in socks[:3])     # the three oldest made room
        assert len(s.server.unauthed) == 4 and _refused(s, "max_unauthenticated_connections") == 3
        raw_hello(socks[3], A)                                  # the others are served
        raw_hello(socks[6], A)
        assert len(s.server.unauthed) == 2 and len(s.server.conns) == 4
    finally:
        for x in socks:
            x.close()
        s.stop()
