"""Test harness for the NIXL data plane: a server process holding a DramTier whose arena
is registered with NIXL, driven over a multiprocessing control connection, and a client
that dies mid-transfer.

    python -m tests._nixl_server serve --capacity BYTES      # prints "PORT <n>"
    python -m tests._nixl_server die --port N --op get|put --blocks K --block-bytes B

The authkey comes from $NIXL_TEST_AUTHKEY (not KVSTORE_…: that prefix is for config
overrides). Each connection is served by its own
thread; a client that vanishes ends only its own thread.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import traceback
import zlib
from multiprocessing.connection import Client, Listener

import numpy as np

from kvstore.errors import KVStoreError
from kvstore.keys import BlockKey
from kvstore.testing import make_keys, payload
from kvstore.net.nixl.endpoint import Descs, NixlEndpoint, descs_of, receive_blocks, send_blocks
from kvstore.tiers.dram import DramTier


def block_payload(salt: str, i: int, nbytes: int) -> np.ndarray:
    return payload(zlib.crc32(f"{salt}/{i}".encode()), nbytes)  # same in every process


class _ChurnEndpoint(NixlEndpoint):
    """Runs a per-thread ``before_write`` hook after send_blocks took its leases and
    before the bytes move, so a test can delete and overwrite the leased blocks then."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hook = threading.local()

    def write(self, local, peer, remote, **kwargs):
        fn = getattr(self.hook, "before_write", None)
        if fn is not None:
            self.hook.before_write = None
            fn()
        super().write(local, peer, remote, **kwargs)


class Harness:
    def __init__(self, capacity: int) -> None:
        self.tier = DramTier(capacity, name="nixl-test")
        # with a copy-thread pool, as the cache server runs it: transfers of SPLIT_DESCS
        # blocks or more (the 8-block round trip, the 128-block dying client) are split
        self.endpoint = _ChurnEndpoint("server", threads=2, timeout_s=20.0)
        self.endpoint.register(self.tier.arena)
        self.events: list[tuple] = []
        self._churns = 0

    def churn(self, keys: list[BlockKey]) -> None:
        """Delete the requested blocks and fill every free byte with 0xFF blocks."""
        self.tier.delete(keys)
        self._churns += 1
        junk = np.full(64 * 1024, 0xFF, np.uint8)
        for i, k in enumerate(make_keys(self.tier.capacity_bytes // junk.nbytes + 1, salt=f"churn{self._churns}")):
            if not self.tier.write([k], [junk])[0]:
                break

    def stats(self) -> dict:
        st = self.tier.stats()
        return {"used": self.tier.used_bytes, "largest_free": st["largest_free_bytes"],
                "abandoned": st["abandoned_bytes"], "arena": self.tier.arena.nbytes,
                "keys": sum(1 for _ in self.tier.keys()), "stuck": self.endpoint.stuck_transfers}

    def handle(self, conn) -> None:
        peer = None
        try:
            while True:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    return
                op, args = msg[0], msg[1:]
                try:
                    if op == "hello":
                        peer = self.endpoint.add_peer(args[0])
                        reply = ("ok", self.endpoint.metadata())
                    else:
                        reply = ("ok", self.dispatch(op, args, peer))
                except KVStoreError as exc:
                    self.events.append((op, peer, "error", type(exc).__name__, str(exc)))
                    reply = ("error", type(exc).__name__, str(exc), getattr(exc, "in_flight", False))
                try:
                    conn.send(reply)
                except (OSError, EOFError):
                    return
        finally:
            if peer is not None:
                self.endpoint.remove_peer(peer)

    def dispatch(self, op: str, args: tuple, peer: str | None):
        if op == "seed":
            salt, n, nbytes = args
            keys = make_keys(n, salt=salt)
            return self.tier.write(keys, [block_payload(salt, i, nbytes) for i in range(n)])
        if op == "get":
            keys = [BlockKey.from_bytes(b) for b in args[0]]
            remote = Descs.from_bytes(args[1])
            if args[2]:
                self.endpoint.hook.before_write = lambda: self.churn(keys)
            hits = send_blocks(self.endpoint, self.tier, keys, peer, remote)
            self.events.append(("get", peer, "done", sum(hits)))
            return hits
        if op == "put":
            keys = [BlockKey.from_bytes(b) for b in args[0]]
            stored = receive_blocks(self.endpoint, self.tier, keys, peer, Descs.from_bytes(args[1]))
            self.events.append(("put", peer, "done", sum(stored)))
            return stored
        if op == "clear":
            self.tier.delete(list(self.tier.keys()))
            return self.stats()
        if op == "stats":
            return self.stats()
        if op == "events":
            return list(self.events)
        raise ValueError(f"unknown op {op}")


def serve(capacity: int) -> None:
    harness = Harness(capacity)
    listener = Listener(("127.0.0.1", 0), authkey=os.environb[b"NIXL_TEST_AUTHKEY"])
    print(f"PORT {listener.address[1]}", flush=True)
    while True:
        try:
            conn = listener.accept()
        except Exception:  # a client that fails the handshake must not stop the server
            traceback.print_exc()
            continue
        threading.Thread(target=harness.handle, args=(conn,), daemon=True).start()


class HarnessClient:
    """A client of :class:`Harness`: one NIXL endpoint, one control connection."""

    def __init__(self, port: int, authkey: bytes, role: str = "client") -> None:
        self.endpoint = NixlEndpoint(role, timeout_s=20.0)
        self.conn = Client(("127.0.0.1", port), authkey=authkey)
        self._hello_done = False

    def call(self, op: str, *args):
        if op in ("get", "put"):
            self._sync_metadata()
        self.conn.send((op, *args))
        reply = self.conn.recv()
        if reply[0] == "error":
            raise RuntimeError(f"server {op} failed: {reply[1]}: {reply[2]} (in_flight={reply[3]})")
        return reply[1]

    def register(self, buf) -> None:
        self.endpoint.register(buf)
        self._hello_done = False  # the server needs our refreshed metadata

    def _sync_metadata(self) -> None:
        if not self._hello_done:
            self.conn.send(("hello", self.endpoint.metadata()))
            reply = self.conn.recv()
            self.endpoint.add_peer(reply[1])
            self._hello_done = True

    def get(self, keys, bufs, *, churn: bool = False, send_only: bool = False):
        self._sync_metadata()
        msg = ("get", [k.to_bytes() for k in keys], descs_of(bufs).to_bytes(), churn)
        if send_only:
            self.conn.send(msg)
            return None
        return self.call(*msg)

    def put(self, keys, bufs, *, send_only: bool = False):
        self._sync_metadata()
        msg = ("put", [k.to_bytes() for k in keys], descs_of(bufs).to_bytes())
        if send_only:
            self.conn.send(msg)
            return None
        return self.call(*msg)

    def close(self) -> None:
        self.conn.close()
        self.endpoint.close()


def die(port: int, op: str, blocks: int, block_bytes: int) -> None:
    """Register a fresh (unfaulted, so slow to fill) buffer, ask for a big transfer and
    SIGKILL this process while the server is moving the bytes."""
    client = HarnessClient(port, os.environb[b"NIXL_TEST_AUTHKEY"], role="dying")
    buf = np.empty(blocks * block_bytes, np.uint8)
    client.register(buf)
    bufs = [buf[i * block_bytes:(i + 1) * block_bytes] for i in range(blocks)]
    keys = make_keys(blocks, salt="big" if op == "get" else "dying-put")
    (client.get if op == "get" else client.put)(keys, bufs, send_only=True)
    print("SENT", flush=True)
    threading.Event().wait(0.1)  # the server is now moving bytes into/out of `buf`
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("serve", "die"))
    ap.add_argument("--capacity", type=int, default=64 << 20)
    ap.add_argument("--port", type=int)
    ap.add_argument("--op", choices=("get", "put"), default="get")
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--block-bytes", type=int, default=1 << 20)
    args = ap.parse_args()
    if args.mode == "serve":
        serve(args.capacity)
    else:
        die(args.port, args.op, args.blocks, args.block_bytes)


if __name__ == "__main__":
    sys.exit(main())
