"""NvmeTier on a real directory: the conformance suite, restart recovery, layout."""

import contextlib
import os
import subprocess

import numpy as np
import pytest

from kvstore.errors import InvalidArgumentError, TierIOError, TierUnavailableError
from kvstore.testing import CAPACITY, TierConformance, make_keys, payload
from kvstore.tiers.nvme.io import READ_RUN_BYTES, aligned_empty, extent_bytes, plan_runs
from kvstore.tiers.nvme import NvmeTier

FILE_BYTES = 512 * 1024


def open_tier(path, capacity=CAPACITY, **kw):
    kw.setdefault("file_bytes", FILE_BYTES)
    kw.setdefault("io_threads", 4)
    return NvmeTier(path, capacity, name="nvme-test", **kw)


@pytest.fixture
def tier(tmp_path):
    t = open_tier(str(tmp_path / "nvme"))
    yield t
    t.close()


class TestNvmeConformance(TierConformance):
    CONCURRENCY_ROUNDS = 15


class TestNvmeStripedConformance(TierConformance):
    CONCURRENCY_ROUNDS = 10

    @pytest.fixture
    def tier(self, tmp_path):
        t = open_tier([str(tmp_path / "a"), str(tmp_path / "b")])
        yield t
        t.close()


def test_direct_io_on_a_real_directory(tier):
    # /tmp here is a disk file system; O_DIRECT must be in use, not silently buffered
    if tier.io_mode != "direct":
        pytest.skip(f"file system under the test directory refuses O_DIRECT ({tier.io_mode})")
    assert tier.stats()["io_mode"] == "direct"


@contextlib.contextmanager
def mounted(where, fstype, options=None):
    """A real file system mounted for one test; mounting needs root, elsewhere the
    test is skipped with the reason."""
    where.mkdir()
    cmd = ["mount", "-t", fstype] + (["-o", options] if options else []) + [fstype, str(where)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount {fstype} (needs root): {res.stderr.strip()}")
    try:
        yield str(where / "nvme")
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture
def no_direct_dir(tmp_path):
    """A directory on ramfs, which refuses O_DIRECT (tmpfs accepts it since Linux 6.6)."""
    with mounted(tmp_path / "ramfs", "ramfs") as path:
        yield path


def test_disk_full_is_a_counted_refusal(tmp_path, caplog):
    with mounted(tmp_path / "small", "tmpfs", "size=1m") as path:
        t = open_tier(path, capacity=8 << 20, file_bytes=256 * 1024)
        try:
            keys = make_keys(24)
            with caplog.at_level("WARNING"):
                ok = t.write(keys, [payload(i) for i in range(24)])
            assert 0 < sum(ok) < 24
            assert t.stats()["enospc"] >= 1 and "no space" in caplog.text
            assert t.used_bytes == sum(ok) * len(payload(0))
            stored = [k for k, good in zip(keys, ok) if good]
            dst = np.zeros(len(payload(0)), np.uint8)
            assert all(t.read_into([k], [dst])[0] for k in stored)
            t.delete(stored[:4])   # room again: later writes succeed in the freed space
            assert all(t.write(make_keys(4, salt="again"), [payload(i) for i in range(4)]))
        finally:
            t.close()


def test_buffered_fallback_where_o_direct_is_refused(no_direct_dir, caplog):
    with caplog.at_level("WARNING"):
        t = open_tier(no_direct_dir)
    try:
        assert t.stats()["io_mode"] == "buffered"
        assert "O_DIRECT refused" in caplog.text
        keys = make_keys(3)
        assert t.write(keys, [payload(i) for i in range(3)]) == [True] * 3
        dst = np.zeros(len(payload(0)), np.uint8)
        assert t.read_into(keys[1:2], [dst]) == [True] and np.array_equal(dst, payload(1))
    finally:
        t.close()
    t = open_tier(no_direct_dir)   # and it recovers there too
    try:
        assert set(t.keys()) == set(keys)
    finally:
        t.close()


def test_aligned_and_odd_sized_blocks(tier):
    sizes = [4096, 4096 * 3 + 17, 1, 0, 65536 - 5]
    keys = make_keys(len(sizes), salt="odd")
    srcs = []
    for i, n in enumerate(sizes):
        src = aligned_empty(n)
        src[:] = payload(i, n)
        srcs.append(src if i % 2 else payload(i, n))
    assert tier.write(keys, srcs) == [True] * len(sizes)
    for key, src in zip(keys, srcs):
        for dst in (aligned_empty(src.nbytes), np.zeros(src.nbytes + 1, np.uint8)[1:]):
            assert tier.read_into([key], [dst]) == [True]
            assert np.array_equal(dst, src)


def test_files_are_created_lazily(tmp_path):
    path = str(tmp_path / "lazy")
    t = open_tier(path, capacity=64 << 20, file_bytes=1 << 20)
    try:
        assert t.stats()["data_files"] == 0 and t.stats()["file_bytes"] == 0
        t.write(make_keys(1), [payload(0)])
        assert t.stats()["data_files"] == 1 and t.stats()["file_bytes"] == 1 << 20
        keys = make_keys(40, salt="more")
        assert all(t.write(keys, [payload(i) for i in range(40)]))
        assert t.stats()["data_files"] == -(-(41 * extent_bytes(65536)) // (1 << 20))
    finally:
        t.close()


def test_restart_keeps_keys_usage_and_order(tmp_path):
    path = str(tmp_path / "restart")
    keys = make_keys(10)
    t = open_tier(path, access_flush_s=3600)
    t.write(keys, [payload(i) for i in range(10)])
    dst = np.zeros(len(payload(0)), np.uint8)
    for k in (keys[3], keys[0], keys[7]):   # touched last: these become the newest
        assert t.read_into([k], [dst]) == [True]
    t.delete(keys[5:6])
    used = t.used_bytes
    t.close()
    t = open_tier(path)
    try:
        assert set(t.keys()) == set(keys) - {keys[5]}
        assert t.used_bytes == used
        order = [b.key for b in t.recover()]
        expected = [k for i, k in enumerate(keys) if i not in (3, 0, 7, 5)] + [keys[3], keys[0], keys[7]]
        assert order == expected
        assert [b.key.parent for b in t.recover()] == [k.parent for k in expected]
        for i, k in enumerate(keys):
            if i != 5:
                assert t.read_into([k], [dst]) == [True] and np.array_equal(dst, payload(i))
        assert t.stats()["allocated_bytes"] == 9 * extent_bytes(len(payload(0)))
    finally:
        t.close()


def test_lower_capacity_on_restart_drops_oldest(tmp_path):
    path = str(tmp_path / "shrink")
    keys = make_keys(8)
    t = open_tier(path)
    t.write(keys, [payload(i) for i in range(8)])
    t.close()
    t = open_tier(path, capacity=4 * len(payload(0)))
    try:
        assert set(t.keys()) == set(keys[4:])
        assert t.used_bytes == t.capacity_bytes
        assert t.stats()["dropped_at_open"] == 4
    finally:
        t.close()


def test_directory_is_locked_while_open(tier, tmp_path):
    with pytest.raises(TierUnavailableError, match="in use"):
        open_tier(str(tmp_path / "nvme"))


def test_bad_arguments(tmp_path):
    with pytest.raises(InvalidArgumentError):
        NvmeTier([], CAPACITY)
    with pytest.raises(InvalidArgumentError):
        NvmeTier(str(tmp_path), 0)
    with pytest.raises(InvalidArgumentError):
        NvmeTier([str(tmp_path), str(tmp_path)], CAPACITY)


def test_striping_uses_every_directory(tmp_path):
    dirs = [str(tmp_path / "s0"), str(tmp_path / "s1")]
    t = open_tier(dirs)
    try:
        keys = make_keys(8)
        assert all(t.write(keys, [payload(i) for i in range(8)]))
        for d in dirs:
            assert any(n.startswith("data-") for n in os.listdir(d))
    finally:
        t.close()


def test_read_only_destination_raises_and_keeps_the_block(tier):
    key = make_keys(1)
    tier.write(key, [payload(3)])
    with pytest.raises(InvalidArgumentError):
        tier.read_into(key, [bytes(len(payload(3)))])
    dst = np.zeros(len(payload(3)), np.uint8)
    assert tier.read_into(key, [dst]) == [True] and np.array_equal(dst, payload(3))
    assert tier.stats()["corrupt_blocks"] == 0 and tier.stats()["io_errors"] == 0


def test_adjacent_blocks_move_in_runs(tier, monkeypatch):
    """Page-aligned, page-multiple buffers of blocks adjacent on disk go in one vectored
    call per run; other buffers in the same batch go one by one; all round-trip."""
    calls = {"pwritev": 0, "preadv": 0}
    for name in calls:
        real = getattr(os, name)

        def counted(*args, _real=real, _name=name):
            calls[_name] += 1
            return _real(*args)
        monkeypatch.setattr(os, name, counted)
    block = 16 * 1024
    keys = make_keys(12, salt="runs")
    srcs = []
    for i in range(12):
        buf = aligned_empty(block)
        buf[:] = payload(i, block)
        srcs.append(buf)
    srcs[5] = payload(5, block)                 # not page-aligned: moved on its own
    srcs[9] = payload(9, block - 100)           # not a whole number of pages: on its own
    assert all(tier.write(keys, srcs))
    assert calls["pwritev"] < 12
    dsts = [aligned_empty(len(s)) for s in srcs]
    dsts[2] = np.zeros(block, np.uint8)         # unaligned destination: on its own
    assert all(tier.read_into(keys, dsts))
    assert calls["preadv"] < 12
    for i, (src, dst) in enumerate(zip(srcs, dsts)):
        assert np.array_equal(dst, src), i


def test_runs_carry_at_most_their_byte_cap():
    """Adjacent blocks are cut into runs of at most ``max_bytes`` of payload (reads use
    smaller runs than writes); a block larger than the cap is a run of its own, a block
    that cannot join a run is always alone."""
    mib = 1 << 20
    items = [(("a", 0), i * extent_bytes(mib), mib, True) for i in range(8)]
    assert plan_runs(items, 64, max_bytes=2 * mib) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan_runs(items, 64) == [list(range(8))]
    assert plan_runs(items, 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    big = [(("a", 0), i * extent_bytes(4 * mib), 4 * mib, True) for i in range(3)]
    assert plan_runs(big, 64, max_bytes=READ_RUN_BYTES) == [[0], [1], [2]]
    mixed = items[:3] + [(("a", 0), 3 * extent_bytes(mib), mib, False)]
    assert plan_runs(mixed, 64, max_bytes=2 * mib) == [[0, 1], [2], [3]]


def test_failed_index_commit_drops_its_blocks(tmp_path, monkeypatch):
    """A batch's index records are committed behind the write; when that commit fails
    (here: the index refuses it), the blocks it carried are dropped as if evicted, their
    space is reused, and nothing that was committed is lost."""
    path = str(tmp_path / "nvme")
    tier = open_tier(path)
    keys = make_keys(4, salt="commit")
    assert all(tier.write(keys[:2], [payload(i) for i in range(2)]))
    tier.flush_access()
    used = tier.used_bytes
    index = tier._shards[0].index

    def refused(items):
        list(items)
        raise TierIOError("index refused the commit")
    monkeypatch.setattr(index, "put", refused)
    assert all(tier.write(keys[2:], [payload(i) for i in range(2, 4)]))   # the data is on disk
    tier.flush_access()   # waits for the commit, which failed
    assert tier.contains(keys) == [True, True, False, False]
    assert tier.used_bytes == used and tier.stats()["io_errors"] == 1
    monkeypatch.undo()
    assert all(tier.write(keys[2:], [payload(i) for i in range(2, 4)]))
    tier.close()
    tier = open_tier(path)
    try:
        for i, key in enumerate(keys):
            dst = np.empty(len(payload(i)), np.uint8)
            assert tier.read_into([key], [dst]) == [True] and np.array_equal(dst, payload(i)), i
        assert tier.stats()["allocated_bytes"] == sum(extent_bytes(len(payload(i))) for i in range(4))
    finally:
        tier.close()


def test_delete_right_after_write_stays_deleted(tmp_path):
    """A delete issued while the write's index commit may still be in flight is applied
    after it: after a restart the key is gone and its space is free."""
    path = str(tmp_path / "nvme")
    tier = open_tier(path)
    keys = make_keys(20, salt="wd")
    for i, key in enumerate(keys):
        assert tier.write([key], [payload(i)]) == [True]
        assert tier.delete([key]) == 1
    tier.close()
    tier = open_tier(path)
    try:
        assert tier.contains(keys) == [False] * len(keys)
        assert tier.used_bytes == 0 and tier.stats()["allocated_bytes"] == 0
    finally:
        tier.close()
