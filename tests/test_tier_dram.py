import ctypes
import mmap
from pathlib import Path

import numpy as np
import pytest

from kvstore.testing import CAPACITY, TierConformance, make_keys, payload
from kvstore.tiers.dram import DramTier


@pytest.fixture
def tier():
    t = DramTier(CAPACITY, name="dram-test")
    yield t
    t.close()


class TestDramConformance(TierConformance):
    pass


def test_view_survives_delete(tier):
    key = make_keys(1)
    src = payload(9)
    tier.write(key, [src])
    with tier.view(key[0]) as view:
        tier.delete(key)
        # the slot is not reused while the view is held
        tier.write(make_keys(1, salt="x"), [np.zeros(len(src), np.uint8)])
        assert np.array_equal(view, src)
    assert tier.used_bytes == len(src)


def test_shared_memory_arena(tmp_path):
    path = f"/dev/shm/kvstore-test-{tmp_path.name}"
    t = DramTier(CAPACITY, shm_path=path)
    key = make_keys(1)
    t.write(key, [payload(2)])
    off, n = t.offset_of(key[0])
    import mmap, os
    fd = os.open(path, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        assert np.array_equal(np.frombuffer(mm, np.uint8, n, off), payload(2))
        del mm
    finally:
        os.close(fd)
    t.close()
    assert not __import__("os").path.exists(path)


def test_fragmentation_is_reused(tier):
    small = make_keys(32, salt="s")
    srcs = [payload(i, 4096) for i in range(32)]
    assert all(tier.write(small, srcs))
    tier.delete(small[::2])
    # freed 4 KiB slots get reused exactly
    again = make_keys(16, salt="t")
    assert all(tier.write(again, [payload(i, 4096) for i in range(16)]))


def test_reserve_commit_abort_abandon(tier):
    keys = make_keys(4, salt="reserve")
    tier.write(keys[:1], [payload(0)])
    n = len(payload(0))
    res = tier.reserve(keys, [n] * 4)
    assert res.views[0] is None and all(v is not None for v in res.views[1:])
    assert tier.contains(keys) == [True, False, False, False]  # invisible until commit
    for i, v in enumerate(res.views[1:], 1):
        v[:] = payload(i)
    assert res.commit() == [True] * 4
    dst = np.zeros(n, np.uint8)
    for i, k in enumerate(keys):
        assert tier.read_into([k], [dst]) == [True] and np.array_equal(dst, payload(i))
    with pytest.raises(Exception, match="already ended"):
        res.abort()
    more = make_keys(2, salt="more")
    before = tier.used_bytes
    r2 = tier.reserve(more, [n, n])
    assert tier.used_bytes == before + 2 * n
    r2.abort()
    assert tier.used_bytes == before and tier.contains(more) == [False, False]
    r3 = tier.reserve(more[:1], [n])
    r3.abandon()
    assert tier.stats()["abandoned_bytes"] == n and tier.used_bytes == before + n
    assert tier.contains(more[:1]) == [False]


def test_reserve_respects_capacity(tier):
    n = len(payload(0))
    keys = make_keys(CAPACITY // n + 2, salt="cap")
    res = tier.reserve(keys, [n] * len(keys))
    assert sum(v is not None for v in res.views) == CAPACITY // n
    assert tier.used_bytes <= tier.capacity_bytes
    stored = res.commit()
    assert sum(stored) == CAPACITY // n


def _vm_flags(address: int) -> list[str]:
    """The kernel's VmFlags of the mapping holding ``address`` (from /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_arena_asks_for_huge_pages_and_is_faulted_in():
    """The arena is advised MADV_HUGEPAGE before its first touch (O_DIRECT reads into
    small pages are split by the disk driver), and every page is resident at start-up."""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("transparent huge pages are disabled on this kernel")
    t = DramTier(8 << 20, name="dram-thp")
    try:
        assert "hg" in _vm_flags(t.arena.ctypes.data)
        pages = t.arena.nbytes // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.mincore(ctypes.c_void_p(t.arena.ctypes.data), ctypes.c_size_t(t.arena.nbytes), vec) == 0
        assert all(b & 1 for b in vec)  # resident: no first-touch fault on the data path
    finally:
        t.close()
