"""The tier conformance suite. Every tier's tests subclass :class:`TierConformance` and
provide a ``tier`` fixture (a fresh, empty tier of ``CAPACITY`` bytes) — see
``tests/test_tier_dram.py``. Shipped in the package so third-party tiers can run it too.
:func:`make_keys` and :func:`payload` are its keys and block contents.

The ``test_declares_*`` tests hold a tier to its ``capabilities``: what it declares it
really does, and what it does not declare raises
:class:`~kvstore.errors.NotSupportedError` (callers read the record, never probe).
"""

from __future__ import annotations

import os
import re
import threading

import numpy as np
import pytest

from kvstore.block import checksum
from kvstore.buffers import copy_bytes, host_view
from kvstore.errors import BufferSizeError, InvalidArgumentError, NotSupportedError
from kvstore.keys import BlockKey, Namespace
from kvstore.tiers.base import HostArena

BLOCK = 64 * 1024
CAPACITY = 16 * BLOCK


def make_keys(n: int, *, salt: str = "") -> list[BlockKey]:
    ns = Namespace(model="conformance", dtype="uint8", chunk_tokens=1, salt=salt)
    return ns.chunk_keys(np.arange(n, dtype=np.int64))


def payload(i: int, nbytes: int = BLOCK) -> np.ndarray:
    rng = np.random.default_rng(i)
    return rng.integers(0, 256, nbytes, dtype=np.uint8)


class TierConformance:
    """Behaviour every tier must have. Subclasses set ``CAPACITY``/``BLOCK`` if their
    fixture differs, and may set ``CONCURRENCY_ROUNDS`` lower for slow media."""

    CAPACITY = CAPACITY
    BLOCK = BLOCK
    CONCURRENCY_ROUNDS = 50

    def test_round_trip(self, tier):
        keys = make_keys(4)
        srcs = [payload(i, self.BLOCK) for i in range(4)]
        assert tier.write(keys, srcs) == [True] * 4
        dsts = [np.zeros(self.BLOCK, np.uint8) for _ in keys]
        assert tier.read_into(keys, dsts) == [True] * 4
        for s, d in zip(srcs, dsts):
            assert np.array_equal(s, d)

    def test_buffer_types(self, tier):
        torch = pytest.importorskip("torch")
        key = make_keys(1)
        src = payload(7, self.BLOCK)
        assert tier.write(key, [bytearray(src.tobytes())]) == [True]
        for dst in (bytearray(self.BLOCK), np.zeros(self.BLOCK, np.uint8),
                    torch.zeros(self.BLOCK // 2, dtype=torch.float16), memoryview(bytearray(self.BLOCK))):
            assert tier.read_into(key, [dst]) == [True]
            got = dst.view(torch.uint8).numpy() if isinstance(dst, torch.Tensor) else np.frombuffer(dst, np.uint8)
            assert np.array_equal(got, src)

    def test_miss_is_false(self, tier):
        keys = make_keys(2)
        assert tier.write(keys[:1], [payload(0, self.BLOCK)]) == [True]
        dst = np.zeros(self.BLOCK, np.uint8)
        assert tier.read_into(keys[1:], [dst]) == [False]
        assert tier.contains(keys) == [True, False]

    def test_find_answers_sizes(self, tier):
        keys = make_keys(3, salt="find")
        assert tier.write(keys[:2], [payload(0, self.BLOCK), payload(1, self.BLOCK)]) == [True, True]
        assert tier.find(keys) == [self.BLOCK, self.BLOCK, None]
        assert tier.find([]) == []

    def test_wrong_buffer_size_raises_and_keeps_data(self, tier):
        key = make_keys(1)
        src = payload(1, self.BLOCK)
        tier.write(key, [src])
        with pytest.raises(BufferSizeError):
            tier.read_into(key, [np.zeros(self.BLOCK - 1, np.uint8)])
        dst = np.zeros(self.BLOCK, np.uint8)
        assert tier.read_into(key, [dst]) == [True] and np.array_equal(dst, src)

    def test_bad_batches_fail_the_same_way_on_every_tier(self, tier):
        keys = make_keys(2, salt="bad-batch")
        one = [payload(0, self.BLOCK)]
        with pytest.raises(InvalidArgumentError, match="^2 keys but 1 buffers$"):
            tier.write(keys, one)
        with pytest.raises(InvalidArgumentError, match="^2 keys but 1 buffers$"):
            tier.read_into(keys, [np.zeros(self.BLOCK, np.uint8)])
        assert tier.contains(keys) == [False, False] and tier.used_bytes == 0
        assert tier.write(keys[:1], one) == [True]
        with pytest.raises(BufferSizeError, match=rf"^\[{re.escape(tier.name)}\] buffer has {self.BLOCK - 1} bytes, "
                                                  rf"block has {self.BLOCK}$"):
            tier.read_into(keys[:1], [np.zeros(self.BLOCK - 1, np.uint8)])

    def test_capacity_never_exceeded(self, tier):
        keys = make_keys(self.CAPACITY // self.BLOCK + 4)
        results = tier.write(keys, [payload(i, self.BLOCK) for i in range(len(keys))])
        assert tier.used_bytes <= tier.capacity_bytes
        assert sum(results) * self.BLOCK == tier.used_bytes
        assert not all(results)

    def test_delete(self, tier):
        keys = make_keys(3)
        tier.write(keys, [payload(i, self.BLOCK) for i in range(3)])
        assert tier.delete(keys[:2] + keys[:1]) == 2
        assert tier.contains(keys) == [False, False, True]
        assert tier.used_bytes == self.BLOCK
        assert tier.delete(keys[:1]) == 0

    def test_delete_frees_room(self, tier):
        n = self.CAPACITY // self.BLOCK
        first, second = make_keys(n, salt="a"), make_keys(n, salt="b")
        assert all(tier.write(first, [payload(i, self.BLOCK) for i in range(n)]))
        tier.delete(first)
        assert all(tier.write(second, [payload(i, self.BLOCK) for i in range(n)]))
        assert tier.used_bytes == n * self.BLOCK

    def test_keys(self, tier):
        keys = make_keys(5)
        tier.write(keys, [payload(i, self.BLOCK) for i in range(5)])
        tier.delete(keys[1:2])
        assert set(tier.keys()) == set(keys) - {keys[1]}

    def test_write_existing_key_is_kept(self, tier):
        key = make_keys(1)
        src = payload(3, self.BLOCK)
        assert tier.write(key, [src]) == [True]
        assert tier.write(key, [payload(4, self.BLOCK)]) == [True]
        dst = np.zeros(self.BLOCK, np.uint8)
        tier.read_into(key, [dst])
        assert np.array_equal(dst, src)  # same key means same content: the first copy stays
        assert tier.used_bytes == self.BLOCK

    def test_buffer_ownership(self, tier):
        key = make_keys(1)
        src = payload(5, self.BLOCK)
        expected = src.copy()
        tier.write(key, [src])
        src[:] = 0
        dst = np.zeros(self.BLOCK, np.uint8)
        assert tier.read_into(key, [dst]) == [True]
        assert np.array_equal(dst, expected)

    def test_concurrent_use(self, tier):
        n_threads, per_thread = 4, 3
        errors: list[BaseException] = []

        def worker(t: int) -> None:
            try:
                keys = make_keys(per_thread, salt=f"t{t}")
                srcs = [payload(100 * t + i, self.BLOCK) for i in range(per_thread)]
                dst = np.zeros(self.BLOCK, np.uint8)
                for r in range(self.CONCURRENCY_ROUNDS):
                    tier.write(keys, srcs)
                    for k, s in zip(keys, srcs):
                        if tier.read_into([k], [dst])[0]:
                            assert np.array_equal(dst, s), "wrong bytes under concurrency"
                    if r % 3 == 2:
                        tier.delete(keys[:1])
                    assert tier.used_bytes <= tier.capacity_bytes
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors[0]

    # -- declared capabilities -------------------------------------------------------------

    def _read_back(self, tier, keys):
        dsts = [np.zeros(self.BLOCK, np.uint8) for _ in keys]
        return tier.read_into(keys, dsts), dsts

    def test_declares_reserve(self, tier):
        keys = make_keys(3, salt="reserve-cap")
        srcs = [payload(40 + i, self.BLOCK) for i in range(3)]
        if not tier.capabilities.reserve:
            with pytest.raises(NotSupportedError, match=r"\.reserve is not supported.*capabilities\.reserve"):
                tier.reserve(keys, [self.BLOCK] * 3)
            return
        res = tier.reserve(keys[:2], [self.BLOCK] * 2)
        for view, src in zip(res.views, srcs):
            copy_bytes(view, src)
        assert tier.contains(keys[:2]) == [False, False], "reserved blocks are visible before commit"
        assert res.commit([checksum(srcs[0]), None]) == [True, True]
        ok, dsts = self._read_back(tier, keys[:2])
        assert ok == [True, True]
        assert all(np.array_equal(d, s) for d, s in zip(dsts, srcs)), "committed bytes differ from those filled in"
        used = tier.used_bytes
        res = tier.reserve(keys[2:], [self.BLOCK])        # a writer's checksum that does not match
        copy_bytes(res.views[0], srcs[2])
        assert res.commit([checksum(srcs[2]) ^ 1]) == [False]
        assert tier.contains(keys[2:]) == [False] and tier.used_bytes == used
        res = tier.reserve(keys[2:], [self.BLOCK])        # abort stores nothing and frees the room
        res.abort()
        assert tier.contains(keys[2:]) == [False] and tier.used_bytes == used

    def test_declares_write_checksums(self, tier):
        """A tier that takes the writer's checksums (a spill hands DRAM's down) never
        re-hashes the bytes: a block under a wrong one is refused at the write (DRAM checks
        as it copies) or stored as given and a miss on its first read, never served."""
        if not tier.capabilities.write_checksums:
            return
        keys = make_keys(3, salt="given-sums")
        srcs = [payload(50 + i, self.BLOCK) for i in range(3)]
        given = [checksum(srcs[0]), checksum(srcs[1]) ^ 1, None]   # right, wrong, hash it here
        with pytest.raises(InvalidArgumentError, match="^3 keys but 2 checksums$"):
            tier.write(keys, srcs, given[:2])
        assert tier.contains(keys) == [False] * 3
        stored = tier.write(keys, srcs, given)
        assert stored[0] and stored[2]
        ok, dsts = self._read_back(tier, keys)
        assert ok == [True, False, True], "a block stored under a wrong given checksum was served"
        assert np.array_equal(dsts[0], srcs[0]) and np.array_equal(dsts[2], srcs[2])

    def test_declares_slots(self, tier):
        keys = make_keys(2, salt="slots-cap")
        src = payload(50, self.BLOCK)
        assert tier.write(keys[:1], [src]) == [True]
        if not tier.capabilities.slots:
            with pytest.raises(NotSupportedError, match=r"\.slots is not supported.*capabilities\.slots"):
                tier.slots(keys)
            return
        assert tier.capabilities.host_arena, "slots are offsets into the tier's host arena"
        with tier.slots(keys) as got:
            assert got[1] is None
            offset, nbytes = got[0]
            assert nbytes == self.BLOCK
            assert np.array_equal(host_view(tier.arena)[offset:offset + nbytes], src)

    def test_declares_host_arena(self, tier):
        if not tier.capabilities.host_arena:
            return   # nothing to lend: callers do not look for an arena on this tier
        assert isinstance(tier, HostArena)
        arena = tier.arena
        assert isinstance(arena, np.ndarray) and arena.dtype == np.uint8 and arena.ndim == 1
        assert arena.nbytes >= tier.capacity_bytes
        assert tier.shm_path is None or os.path.getsize(tier.shm_path) == arena.nbytes
        key = make_keys(1, salt="arena-cap")
        assert tier.write(key, [payload(51, self.BLOCK)]) == [True]
        with tier.views(key) as views:
            assert np.shares_memory(host_view(views[0]), arena), "a stored block is outside the arena"
