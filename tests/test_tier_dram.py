import numpy as np
import pytest

from kvstore.testing import CAPACITY, TierConformance, make_keys, payload
from tiers.dram import DramTier


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
