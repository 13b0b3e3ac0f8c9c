"""A DRAM tier that keeps header frames (the Store's build turns them on when a Mooncake
tier is next below): every slot has a page of its own right before its payload, lent
views carry it, and nothing written there ever reaches another block's bytes."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvstore.buffers.framed import FramedView, frame_of, framed, framed_spans
from kvstore.config import load_config
from kvstore.store.build import header_frames
from kvstore.testing import CAPACITY, TierConformance, make_keys, payload
from kvstore.tiers._arena import SlotIndex
from kvstore.tiers.dram import FRAMED_MIN_BLOCK, SLOT_ALIGN, DramTier


@pytest.fixture
def tier():
    t = DramTier(CAPACITY, name="framed", pin=False, header_frames=True)
    yield t
    t.close()


class TestFramedDramConformance(TierConformance):
    pass


def test_lent_views_carry_their_own_slots_frame_and_derived_arrays_none(tier):
    keys = make_keys(3, salt="lend")
    srcs = [payload(i) for i in range(3)]
    assert tier.write(keys, srcs) == [True] * 3
    with tier.lend(keys) as (views, sums):
        for key, view in zip(keys, views):
            frame = frame_of(view)
            offset, nbytes = tier.offset_of(key)
            assert isinstance(view, FramedView) and not view.flags.writeable
            assert frame.flags.writeable and frame.nbytes == SLOT_ALIGN
            assert frame.ctypes.data + frame.nbytes == view.ctypes.data == tier.arena.ctypes.data + offset
            # a slice (or any array made from the view) never carries the frame
            assert frame_of(view[1:]) is None and frame_of(view[:]) is None
            assert frame_of(view.view(np.uint8)) is None and frame_of(np.asarray(view)) is None
    with tier.views(keys) as plain:   # only lend() hands frames out
        assert all(frame_of(v) is None for v in plain)


def test_writing_every_frame_changes_no_block(tier):
    """Frames filled with garbage while lent: every block still reads byte-exact and
    verified, including slots reused after deletes of other sizes."""
    keys = make_keys(12, salt="garbage")
    sizes = [4096 * (1 + i % 5) for i in range(12)]
    srcs = [payload(40 + i, n) for i, n in enumerate(sizes)]
    assert tier.write(keys[:8], srcs[:8]) == [True] * 8
    assert tier.delete(keys[1:8:2]) == 4
    assert tier.write(keys[8:], srcs[8:]) == [True] * 4
    held = [k for i, k in enumerate(keys) if not (1 <= i < 8 and i % 2)]
    with tier.lend(held) as (views, _):
        for view in views:
            frame_of(view)[:] = 0xA5
    for key, src in zip(keys, srcs):
        if key not in held:
            continue
        dst = np.zeros(src.nbytes, np.uint8)
        assert tier.read_into([key], [dst]) == [True]
        assert np.array_equal(dst, src)
    assert tier.stats()["corrupt_blocks"] == 0


@pytest.mark.parametrize("block", [FRAMED_MIN_BLOCK, 1 << 20])
def test_the_frames_do_not_take_capacity(block):
    """The arena has room for a frame per block down to FRAMED_MIN_BLOCK: a framed tier
    holds as many blocks as its capacity says, as an unframed one does."""
    blocks = 16
    with DramTier(blocks * block, pin=False, header_frames=True) as t:
        keys = make_keys(blocks + 1, salt=f"cap{block}")
        got = t.write(keys, [payload(i, block) for i in range(blocks + 1)])
        assert got == [True] * blocks + [False]
        assert t.used_bytes == blocks * block


def test_slot_index_frames_never_overlap_a_payload():
    """Random reserve/commit/abort/delete of random sizes: every live slot's frame and
    payload are disjoint from every other's, and the payload stays page-aligned."""
    rng = np.random.default_rng(7)
    frame = 4096
    index = SlotIndex(64 * 4096, 96 * 4096, 4096, frame_bytes=frame)
    keys = make_keys(200, salt="index")
    live: set = set()
    for step in range(400):
        key = keys[int(rng.integers(len(keys)))]
        if key in live and rng.random() < 0.5:
            index.delete([key])
            live.discard(key)
            continue
        reserved = index.reserve_many([key], [int(rng.integers(1, 4 * 4096))])
        if isinstance(reserved[0], tuple) and rng.random() < 0.2:
            index.abort_many(reserved)
        elif index.commit_many([key], reserved) == [True]:
            live.add(key)
        extents = sorted((o - frame, o + n) for o, n in (index.offset_of(k) for k in live))
        assert all(start % 4096 == 0 for start, _ in extents)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(extents, extents[1:])), step
        assert all(start >= 0 for start, _ in extents)


def test_framed_refuses_a_frame_that_does_not_end_at_the_payload():
    arena = np.zeros(3 * 4096, np.uint8)
    with pytest.raises(ValueError, match="end where its payload starts"):
        framed(arena[4096:8192], arena[0:2048])
    ro = arena[:4096].view()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        framed(arena[4096:8192], ro)
    with pytest.raises(ValueError, match="flat contiguous uint8"):
        framed(arena[4096:8192], arena[:4096].view(np.uint32))
    with pytest.raises(ValueError, match="flat contiguous uint8"):
        framed(arena[4096:8192], arena[:4096:2])


def test_framed_spans_refuses_an_arena_it_cannot_frame_safely():
    """The bulk form checks the arena once: its read-only view must be the same memory,
    the writable side writable, and every span must leave room for its frame."""
    arena = np.zeros(4 * 4096, np.uint8)
    ro = arena.view()
    ro.flags.writeable = False
    views = framed_spans(arena, ro, [(4096, 4096), None, (12288, 100)], 4096)
    assert views[1] is None
    assert [v.frame.ctypes.data + v.frame.nbytes for v in (views[0], views[2])] == \
        [v.ctypes.data for v in (views[0], views[2])]
    with pytest.raises(ValueError, match="same memory"):
        framed_spans(arena, np.zeros(4 * 4096, np.uint8), [(4096, 4096)], 4096)
    with pytest.raises(ValueError, match="same memory"):
        framed_spans(ro, ro, [(4096, 4096)], 4096)
    with pytest.raises(ValueError, match="no room"):
        framed_spans(arena, ro, [(2048, 4096)], 4096)


def test_the_build_frames_only_a_dram_tier_with_mooncake_next_below(tmp_path):
    mooncake = {"kind": "mooncake", "capacity": "1GiB", "master": "127.0.0.1:1", "metadata_server": "http://x"}
    cfg = load_config({"tiers": [{"name": "hot", "kind": "dram", "capacity": "1MiB"},
                                 {"name": "pool", **mooncake},
                                 {"name": "warm", "kind": "dram", "capacity": "1MiB"},
                                 {"name": "disk", "kind": "nvme", "capacity": "1GiB", "path": str(tmp_path)},
                                 {"name": "pool2", **mooncake, "prefix": "other"}]})
    assert [header_frames(cfg.tiers, i) for i in range(len(cfg.tiers))] == [True, False, False, False, False]


def _resident(addr: int, nbytes: int) -> list[bool]:
    import ctypes
    import mmap

    pages = nbytes // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), vec) == 0
    return [bool(b & 1) for b in vec]


def test_a_shared_framed_arena_is_faulted_in_whole():
    """A shared-memory arena's frame room is faulted in at start-up like the rest (a page
    of a full tmpfs first touched later would kill the process with SIGBUS); an anonymous
    one faults in only its capacity now."""
    capacity = 9 << 20     # the frame room starts past a 2 MiB boundary: its own (huge) pages
    path = f"/dev/shm/kvstore-test-frames-{os.getpid()}"    # tmpfs, as the server's arenas
    with DramTier(capacity, pin=False, header_frames=True, shm_path=path) as shared:
        assert shared.arena.nbytes > capacity
        assert all(_resident(shared.arena.ctypes.data, shared.arena.nbytes))
    with DramTier(capacity, pin=False, header_frames=True) as private:
        assert all(_resident(private.arena.ctypes.data, capacity))


def test_a_frame_lent_past_its_blocks_delete_is_not_reused(tier):
    """Blocks deleted while lent keep their slots, frames included, until the lend ends:
    new blocks written meanwhile land elsewhere, and writing the lent frames then changes
    none of them."""
    keys, others = make_keys(4, salt="lent"), make_keys(8, salt="meanwhile")
    assert tier.write(keys, [payload(i) for i in range(4)]) == [True] * 4
    srcs = [payload(50 + i) for i in range(8)]
    with tier.lend(keys) as (views, _):
        assert tier.delete(keys) == 4
        assert tier.write(others, srcs) == [True] * 8
        lent = {v.ctypes.data - tier.arena.ctypes.data for v in views}
        assert not lent & {tier.offset_of(k)[0] for k in others}
        for view in views:
            frame_of(view)[:] = 0x5A
    for key, src in zip(others, srcs):
        dst = np.zeros(src.nbytes, np.uint8)
        assert tier.read_into([key], [dst]) == [True] and np.array_equal(dst, src)
