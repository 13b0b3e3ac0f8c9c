"""The attack loops of issue 34, for the soak (``benchmarks/_server_soak.py`` runs them
in its attacker process; ``benchmarks/_server_soak_each.py`` runs each alone beside a
well-behaved tenant). Every loop is bounded: by the window's ``stop`` and by a count.

- ``trickle_puts``: :data:`TRICKLE_WIDTH` PUTs of tenant ``evil``, each announcing
  ``max_inflight_bytes`` and then sending one byte every :data:`TRICKLE_EVERY_S`; one
  closed by the server is reopened (together they announce more than the whole buffer
  budget);
- ``silent_preauth``: connections that never say a word, :data:`SILENT_PER_ADDRESS` from
  each of the flood addresses (together past ``max_connections``), each reopened a
  moment after the server closes it;
- ``resave_same_key``: tenant ``evil`` (a small hot quota) saves the same
  :data:`RESAVE_KEYS` keys from two connections at once, 1 MiB and 4 KiB payloads, then
  deletes them, a few rounds; then fills the hot tier with its own new blocks (kept
  within its quota, they evict only its own);
- ``lookup_bodies``: ``POST /v1/lookup`` on the admin port with one key per token
  (``chunk_tokens: 1``) and :data:`LOOKUP_TOKENS` tokens, from two threads;
- ``healthz_silent``: :data:`ADMIN_SILENT` silent connections to the admin port from one
  address (more than its connection cap), each reopened when closed.
"""

from __future__ import annotations

import json
import selectors
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Callable

EVIL, GOOD = "evil-token", "good-token"
TENANTS = [{"name": "good", "token": GOOD, "salt": "salt-of-the-good-tenant"},
           {"name": "evil", "token": EVIL, "salt": "salt-of-the-evil-tenant", "quota": {"hot": "512KiB"}}]
TRICKLE_WIDTH = 5             # x max_inflight_bytes (8 MiB) announced: past the 32 MiB budget
TRICKLE_EVERY_S = 0.2       # well within read_timeout_s (0.5 s in the soak): each byte in time
SILENT_ADDRESSES = [f"127.0.0.{i}" for i in range(5, 10)]
SILENT_PER_ADDRESS = 64       # = max_connections_per_ip; 5 x 64 > max_connections
RESAVE_KEYS = 50
RESAVE_ROUNDS = 7
FILL_BLOCKS = 320             # x 256 KiB: 80 MiB, past the 64 MiB hot tier
LOOKUP_TOKENS = 1 << 17       # one key each (chunk_tokens 1): a body of about 0.8 MiB
LOOKUP_THREADS = 2
LOOKUP_PER_THREAD = 3
ADMIN_SILENT = 140            # the admin port accepts 128 connections
ADMIN_ADDRESS = "127.0.0.8"

TARGET = {"port": 0, "admin_port": 0}   # set by the attacker process before a window


def _held_open(connect: Callable[[], socket.socket], n: int, stop: threading.Event, counts: dict, name: str,
               *, max_opens: int, reopen_s: float = 0.05, tick: Callable[[list], None] | None = None,
               tick_s: float = 1.0) -> None:
    """Keep ``n`` connections made by ``connect`` open until ``stop`` (or ``max_opens``
    in all), reopening each ``reopen_s`` after the server closes it; counts
    ``name`` (opened), ``name_closed`` (closed by the server). ``tick(socks)`` every
    ``tick_s`` (sends on the open ones)."""
    sel = selectors.DefaultSelector()
    reopen = {i: 0.0 for i in range(n)}
    socks: dict[int, socket.socket] = {}
    next_tick = time.monotonic() + tick_s
    try:
        while not stop.is_set():
            now = time.monotonic()
            for i, at in list(reopen.items()):
                if at > now or counts[name] >= max_opens:
                    continue
                try:
                    sock = connect()
                except OSError:
                    counts["connect_failed"] += 1
                    reopen[i] = now + reopen_s
                    continue
                counts[name] += 1
                del reopen[i]
                sock.setblocking(False)
                socks[i] = sock
                sel.register(sock, selectors.EVENT_READ, i)
            if tick is not None and now >= next_tick:
                tick(list(socks.values()))
                next_tick = now + tick_s
            for key, _ in sel.select(0.02):
                try:
                    data = key.fileobj.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(key.fileobj)
                    key.fileobj.close()
                    socks.pop(key.data, None)
                    counts[f"{name}_closed"] += 1
                    reopen[key.data] = time.monotonic() + reopen_s
    finally:
        for sock in socks.values():
            sock.close()
        sel.close()


def _trickle_puts(port: int, stop: threading.Event, counts: dict) -> None:
    from benchmarks._server_soak import PUT_BYTES, _connect, _frames, _hello
    from kvstore.testing import make_keys
    P = _frames()

    def connect() -> socket.socket:
        s = _connect(port, "127.0.0.4")
        _hello(s, EVIL)
        body = P.encode_records(P.PUT_REC, make_keys(1, salt=f"trickle-{counts['trickle_puts']}"), [PUT_BYTES], [0])
        s.sendall(P.pack_header(P.Op.PUT, 3, len(body), PUT_BYTES) + body + b"\0")
        return s

    def tick(socks: list) -> None:
        for s in socks:
            try:
                s.send(b"\0")
            except OSError:
                pass

    _held_open(connect, TRICKLE_WIDTH, stop, counts, "trickle_puts", max_opens=200, tick=tick,
               tick_s=TRICKLE_EVERY_S)


def _silent_preauth(port: int, stop: threading.Event, counts: dict) -> None:
    from benchmarks._server_soak import _connect
    sources = iter(range(1 << 30))

    def connect() -> socket.socket:
        src = SILENT_ADDRESSES[next(sources) % len(SILENT_ADDRESSES)]
        return _connect(port, src, timeout=1.0)

    _held_open(connect, SILENT_PER_ADDRESS * len(SILENT_ADDRESSES), stop, counts, "silent_preauth",
               max_opens=20_000)


def _resave_same_key(port: int, stop: threading.Event, counts: dict) -> None:
    import numpy as np

    from kvstore.client import Client
    from kvstore.testing import make_keys
    address = f"127.0.0.1:{port}"
    with Client(address, token=EVIL, transport="tcp", pool_size=1, timeout_s=10) as big, \
            Client(address, token=EVIL, transport="tcp", pool_size=1, timeout_s=10) as small:
        keys = make_keys(RESAVE_KEYS, salt=f"resave-{time.monotonic_ns()}")
        payloads = {1 << 20: [np.full(1 << 20, 1, np.uint8)] * RESAVE_KEYS,
                    4096: [np.full(4096, 2, np.uint8)] * RESAVE_KEYS}

        def save(client: Client, nbytes: int) -> None:   # one PUT of all 50 (split by max_inflight_bytes)
            try:
                counts["resave_ok"] += sum(client.save(keys, payloads[nbytes]).result(30))
            except Exception:
                counts["resave_failed"] += 1

        for _ in range(RESAVE_ROUNDS):       # bounded by count, not by the window: the fill must follow
            threads = [threading.Thread(target=save, args=(c, n)) for c, n in ((big, 1 << 20), (small, 4096))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            try:
                big.delete(keys)
            except Exception:
                counts["resave_failed"] += 1
            counts["resave_rounds"] += 1
        fill = make_keys(FILL_BLOCKS, salt=f"fill-{time.monotonic_ns()}")
        block = np.full(256 << 10, 3, np.uint8)
        for i in range(0, FILL_BLOCKS, 16):
            try:
                counts["fill_saved"] += sum(big.save(fill[i:i + 16], [block] * len(fill[i:i + 16])).result(30))
            except Exception:
                counts["resave_failed"] += 1
    stop.wait()                              # the good tenant reads on after the fill, to the window's end


def _lookup_bodies(port: int, stop: threading.Event, counts: dict) -> None:
    body = json.dumps({"namespace": {"model": "soak", "dtype": "uint8", "chunk_tokens": 1},
                       "token_ids": list(range(LOOKUP_TOKENS))}).encode()

    def one_thread() -> None:
        for _ in range(LOOKUP_PER_THREAD):
            if stop.is_set():
                return
            req = urllib.request.Request(f"http://127.0.0.1:{TARGET['admin_port']}/v1/lookup", data=body,
                                         headers={"Authorization": f"Bearer {EVIL}",
                                                  "Content-Type": "application/json"})
            counts["lookups"] += 1
            try:
                with urllib.request.urlopen(req, timeout=20) as resp:
                    resp.read()
                counts["lookups_answered"] += 1
            except urllib.error.HTTPError as exc:
                counts[f"lookups_{exc.code}"] = counts.get(f"lookups_{exc.code}", 0) + 1
            except OSError:
                counts["lookups_timed_out"] += 1

    threads = [threading.Thread(target=one_thread) for _ in range(LOOKUP_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(LOOKUP_PER_THREAD * 25)


def _healthz_silent(port: int, stop: threading.Event, counts: dict) -> None:
    def connect() -> socket.socket:
        return socket.create_connection(("127.0.0.1", TARGET["admin_port"]), timeout=1.0,
                                        source_address=(ADMIN_ADDRESS, 0))

    _held_open(connect, ADMIN_SILENT, stop, counts, "healthz_silent", max_opens=5_000)


ATTACKS = {"trickle_puts": _trickle_puts, "silent_preauth": _silent_preauth, "resave_same_key": _resave_same_key,
           "lookup_bodies": _lookup_bodies, "healthz_silent": _healthz_silent}
COUNTS = ("trickle_puts", "trickle_puts_closed", "silent_preauth", "silent_preauth_closed", "resave_rounds",
          "resave_ok", "resave_failed", "fill_saved", "lookups", "lookups_answered", "lookups_timed_out",
          "healthz_silent", "healthz_silent_closed")
