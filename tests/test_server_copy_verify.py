"""Issue 20 (review F2): a block is vouched for by the hash of the bytes as they landed
in their destination, never by a hash of a shared source taken next to the copy. A
writer that changes a shared source while it is copied (and puts it back before the
hash) must not get its bytes loaded as ``True``: on a same-host GET (the arena slot),
on a spill between two DRAM tiers (the hot slot), and on a save (the bytes a client
uploaded, or put in its staging region).

The concurrent writer is played deterministically: the copy primitive is wrapped so that
one copy out of the chosen region reads changed bytes, and the region is put back right
after that copy (what a racing writer does at the worst moment)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kvstore.buffers import host
from kvstore.client import Client
from kvstore.testing import make_keys, payload
from tests._servers import ThreadServer, config_dict

BLOCK = 256 * 1024


def _inside(addr: int, base: int, nbytes: int) -> bool:
    return base <= addr < base + nbytes


class _RacingWriter:
    """Wraps ``host._memmove``: the first copy whose source lies in [src_base, +src_n)
    (and, with ``dst_base``, whose destination lies in that range) reads 64 changed
    bytes; the source is restored before anything hashes it."""

    def __init__(self, monkeypatch, src_base: int, src_n: int, dst_base: int | None = None, dst_n: int = 0):
        self.real = host._memmove
        self.src, self.dst = (src_base, src_n), (dst_base, dst_n)
        self.fired = 0
        monkeypatch.setattr(host, "_memmove", self)

    def __call__(self, dst, src, n):
        dst_a, src_a = int(dst), int(src)
        hit = not self.fired and _inside(src_a, *self.src) and (
            self.dst[0] is None or _inside(dst_a, *self.dst))
        if not hit:
            return self.real(dst, src, n)
        k = min(64, n)
        orig = ctypes.string_at(src_a, k)
        ctypes.memset(src_a, 0x42, k)
        try:
            return self.real(dst, src, n)
        finally:
            ctypes.memmove(src_a, orig, k)   # the writer puts the bytes back
            self.fired += 1


def test_a_same_host_get_hashes_the_copy_not_the_arena(monkeypatch):
    s = ThreadServer(config_dict("16MiB"))
    try:
        keys = make_keys(2, salt="f2a-get")
        srcs = [payload(60 + i, BLOCK) for i in range(2)]
        with Client(s.address, transport="shm", timeout_s=30) as c:
            assert c.transport == "shm" and c.integrity.verify
            assert c.save(keys, srcs).result(10) == [True, True]
            arena = c._transport.arena
            racer = _RacingWriter(monkeypatch, arena.address, arena.nbytes)
            dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
            got = c.load(keys, dsts).result(10)
            assert racer.fired == 1
            # never True with wrong bytes; the block whose copy caught the writer is a miss
            for ok, d, src in zip(got, dsts, srcs):
                assert not ok or np.array_equal(d, src)
            assert got.count(False) == 1
            monkeypatch.undo()
            dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]   # the slot itself is intact
            assert c.load(keys, dsts).result(10) == [True, True]
            assert all(np.array_equal(d, src) for d, src in zip(dsts, srcs))
    finally:
        s.stop()


def test_a_spill_between_dram_tiers_is_verified_as_copied(monkeypatch):
    tiers = [{"name": "hot", "kind": "dram", "capacity": str(2 * BLOCK), "pin": False},
             {"name": "warm", "kind": "dram", "capacity": "16MiB", "pin": False}]
    s = ThreadServer(config_dict(tiers=tiers))
    try:
        keys = make_keys(4, salt="f2b-spill")
        srcs = [payload(70 + i, BLOCK) for i in range(4)]
        hot, warm = s.server.store.tiers
        with Client(s.address, transport="tcp", timeout_s=30) as c:
            assert c.save(keys[:2], srcs[:2]).result(10) == [True, True]
            racer = _RacingWriter(monkeypatch, hot.arena.ctypes.data, hot.arena.nbytes,
                                  warm.arena.ctypes.data, warm.arena.nbytes)
            assert c.save(keys[2:], srcs[2:]).result(10) == [True, True]   # the first two spill
            assert racer.fired == 1
            monkeypatch.undo()
            assert warm.stats()["refused_writes"] == 1
            dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
            got = c.load(keys, dsts).result(10)
            for ok, d, src in zip(got, dsts, srcs):
                assert not ok or np.array_equal(d, src)
            assert got.count(False) == 1 and got[2:] == [True, True]
    finally:
        s.stop()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_save_is_verified_as_copied_into_the_slot(monkeypatch, transport):
    # quota-free: the client's bytes reach the DRAM tier through the server's receive
    # buffer (TCP) or the client's staging region (read-only arena: staged SHM_PUT)
    s = ThreadServer(config_dict("16MiB"))
    try:
        keys = make_keys(2, salt=f"f2c-save-{transport}")
        srcs = [payload(80 + i, BLOCK) for i in range(2)]
        hot = s.server.store.tiers[0]
        with Client(s.address, transport=transport, timeout_s=30) as c:
            if transport == "shm":
                c._transport.arena.writable = False   # as a client that may only read the arena
            # the first copy into the hot arena from anywhere else reads changed bytes
            base, n = hot.arena.ctypes.data, hot.arena.nbytes

            class _IntoArena(_RacingWriter):
                def __call__(self, dst, src, k):
                    if not self.fired and _inside(int(dst), base, n) and not _inside(int(src), base, n):
                        self.src = (int(src), k)
                    return super().__call__(dst, src, k)

            racer = _IntoArena(monkeypatch, 0, 0, base, n)
            got = c.save(keys, srcs).result(10)
            assert racer.fired == 1
            monkeypatch.undo()
            assert got.count(False) == 1
            assert hot.stats()["refused_writes"] == 1
            dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
            back = c.load(keys, dsts).result(10)
            assert back == got
            for ok, d, src in zip(back, dsts, srcs):
                assert not ok or np.array_equal(d, src)
    finally:
        s.stop()


def test_a_same_host_get_into_device_buffers_hashes_a_private_copy(monkeypatch):
    """A device buffer cannot be hashed on the host: its block is copied out of the
    arena into a private host buffer, hashed there, and only then sent to the device
    (never straight from the shared slot). torch's "meta" device and a recording copier
    stand in for a GPU."""
    torch = pytest.importorskip("torch")
    s = ThreadServer(config_dict("16MiB"))
    try:
        keys = make_keys(2, salt="f2a-device")
        srcs = [payload(65 + i, BLOCK) for i in range(2)]
        with Client(s.address, transport="shm", timeout_s=30) as c:
            assert c.save(keys, srcs).result(10) == [True, True]
            arena = c._transport.arena
            sent = []
            monkeypatch.setattr(host, "copy_device_pairs",
                                lambda pairs, pinned=False: sent.extend(np.array(src) for _, src in pairs))
            racer = _RacingWriter(monkeypatch, arena.address, arena.nbytes)
            dsts = [torch.empty(BLOCK, dtype=torch.uint8, device="meta") for _ in keys]
            got = c.load(keys, dsts).result(10)
            assert racer.fired == 1 and len(sent) == 2
            # what went to the device is what was hashed: the block that caught the
            # writer is a miss, the other True with exactly its bytes
            assert got.count(False) == 1
            for ok, dev_bytes, src in zip(got, sent, srcs):
                assert ok == np.array_equal(dev_bytes, src)
    finally:
        s.stop()
