"""Damaged NVMe tier directories: loads miss (never wrong bytes), counters say so,
fsck reports and repairs."""

import os

import lmdb
import numpy as np
import pytest

from kvstore.cli import main as cli_main
from kvstore.testing import make_keys, payload
from kvstore.tiers.nvme.fsck import fsck
from kvstore.tiers.nvme.index import Record
from kvstore.tiers.nvme.io import PAGE, extent_bytes
from kvstore.tiers.nvme import NvmeTier

BLOCK = 64 * 1024
N = 8


def open_tier(path):
    return NvmeTier(path, 64 * BLOCK, name="nvme-corrupt", file_bytes=1 << 20, io_threads=2)


@pytest.fixture
def filled(tmp_path):
    """A closed tier directory holding N blocks; returns (path, keys, locations)."""
    path = str(tmp_path / "d")
    keys = make_keys(N)
    t = open_tier(path)
    assert all(t.write(keys, [payload(i, BLOCK) for i in range(N)]))
    where = {k: (e.file_no, e.offset) for k, e in t._entries.items()}
    t.close()
    return path, keys, where


def data_path(path, file_no):
    return os.path.join(path, f"data-{file_no:05d}.kvd")


def flip(path, offset, nbytes=3):
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(nbytes)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in old))


def load_all(t, keys):
    out = []
    for i, k in enumerate(keys):
        dst = np.zeros(BLOCK, np.uint8)
        ok = t.read_into([k], [dst])[0]
        assert not ok or np.array_equal(dst, payload(i, BLOCK)), "wrong bytes returned"
        out.append(ok)
    return out


@pytest.mark.parametrize("where_in_block", ["payload", "header"])
def test_flipped_bytes_are_a_miss(filled, where_in_block):
    path, keys, where = filled
    file_no, off = where[keys[2]]
    flip(data_path(path, file_no), off + (PAGE + 1000 if where_in_block == "payload" else 20))
    t = open_tier(path)
    try:
        assert load_all(t, keys) == [i != 2 for i in range(N)]
        assert t.stats()["corrupt_blocks"] == 1
        assert t.contains(keys[2:3]) == [False]
        assert t.used_bytes == (N - 1) * BLOCK
    finally:
        t.close()
    t = open_tier(path)   # the drop was committed to the index
    try:
        assert t.contains(keys[2:3]) == [False] and len(list(t.keys())) == N - 1
    finally:
        t.close()


def test_corruption_while_open_is_caught_on_read(filled):
    path, keys, where = filled
    t = open_tier(path)
    try:
        file_no, off = where[keys[0]]
        flip(data_path(path, file_no), off + PAGE + BLOCK - 2, 1)   # the payload's last byte
        assert load_all(t, keys)[0] is False
        assert t.stats()["corrupt_blocks"] == 1
    finally:
        t.close()


def test_truncated_data_file(filled):
    path, keys, where = filled
    cut = where[keys[4]][1] + PAGE + 100   # inside block 4: blocks placed at or after it are lost
    lost = {k for k, (_, off) in where.items() if off + extent_bytes(BLOCK) > cut}
    os.truncate(data_path(path, 0), cut)
    report = fsck(path, progress=False)
    assert sorted(report.missing) == sorted(k.hex() for k in lost) and report.problems == len(lost)
    t = open_tier(path)
    try:
        assert load_all(t, keys) == [k not in lost for k in keys]
        assert t.stats()["corrupt_blocks"] == len(lost)
        assert t.used_bytes == (N - len(lost)) * BLOCK
        # the file is back to its full size and its space usable again
        assert all(t.write(make_keys(4, salt="after"), [payload(i, BLOCK) for i in range(4)]))
    finally:
        t.close()
    assert fsck(path, progress=False).problems == 0


def test_truncated_while_open(filled):
    path, keys, where = filled
    t = open_tier(path)
    try:
        last = max(keys, key=lambda k: where[k][1])
        os.truncate(data_path(path, 0), where[last][1] + PAGE)
        ok = load_all(t, keys)
        assert ok[keys.index(last)] is False and sum(ok) == N - 1
        assert t.stats()["corrupt_blocks"] == 1
    finally:
        t.close()


def _lmdb_put(path, digest, value):
    env = lmdb.open(os.path.join(path, "index"), max_dbs=4, subdir=True)
    try:
        db = env.open_db(b"blocks")
        with env.begin(write=True) as txn:
            txn.put(digest, value, db=db)
    finally:
        env.close()


def _lmdb_get(path, digest):
    env = lmdb.open(os.path.join(path, "index"), max_dbs=4, subdir=True, readonly=True)
    try:
        with env.begin(db=env.open_db(b"blocks", create=False)) as txn:
            return bytes(txn.get(digest))
    finally:
        env.close()


def test_damaged_index_value(filled):
    path, keys, _ = filled
    value = bytearray(_lmdb_get(path, keys[1].digest))
    value[10] ^= 0x55
    _lmdb_put(path, keys[1].digest, bytes(value))
    report = fsck(path, progress=False)
    assert report.damaged_records == 1 and report.problems == 1
    t = open_tier(path)
    try:
        assert load_all(t, keys) == [i != 1 for i in range(N)]
        assert t.stats()["corrupt_blocks"] == 1
        assert t.used_bytes == (N - 1) * BLOCK
    finally:
        t.close()


def test_index_value_pointing_at_another_block(filled):
    """A well-formed record naming the wrong place: the header's key digest catches it."""
    path, keys, where = filled
    rec = Record.decode(keys[3].digest, _lmdb_get(path, keys[3].digest))
    victim = keys[5]
    # move block 5's record onto block 3's extent and drop block 3's record
    _lmdb_put(path, victim.digest, Record(rec.file_no, rec.offset, BLOCK, rec.checksum,
                                          victim.to_bytes()).encode())
    env = lmdb.open(os.path.join(path, "index"), max_dbs=4, subdir=True)
    db = env.open_db(b"blocks")   # before the write txn: py-lmdb's open_db needs its own
    with env.begin(write=True) as txn:
        txn.delete(keys[3].digest, db=db)
    env.close()
    report = fsck(path, progress=False)
    assert report.corrupt == [victim.hex()]
    t = open_tier(path)
    try:
        ok = load_all(t, keys)
        assert ok[5] is False and ok[3] is False and sum(ok) == N - 2
        assert t.stats()["corrupt_blocks"] == 1
    finally:
        t.close()


def test_fsck_repair_then_clean(filled, capsys):
    path, keys, where = filled
    file_no, off = where[keys[6]]
    flip(data_path(path, file_no), off + PAGE + 7)
    value = bytearray(_lmdb_get(path, keys[0].digest))
    value[-1] ^= 1
    _lmdb_put(path, keys[0].digest, bytes(value))
    assert cli_main(["fsck", "--no-progress", path]) == 4
    out = capsys.readouterr().out
    assert "1 corrupt" in out and "1 damaged index records" in out and keys[6].hex() in out
    assert cli_main(["fsck", "--no-progress", "--repair", path]) == 1
    capsys.readouterr()
    assert cli_main(["fsck", "--no-progress", path]) == 0
    t = open_tier(path)
    try:
        assert load_all(t, keys) == [i not in (0, 6) for i in range(N)]
        assert t.stats()["corrupt_blocks"] == 0
    finally:
        t.close()


def test_fsck_reports_orphans_and_refuses_a_live_directory(filled, capsys):
    path, keys, _ = filled
    t = open_tier(path)
    try:
        assert cli_main(["fsck", "--no-progress", path]) == 2   # locked by the live tier
        assert "in use" in capsys.readouterr().err
        t.delete(keys[:3])
    finally:
        t.close()
    report = fsck(path, progress=False)
    assert report.problems == 0 and report.orphans == 3 and report.orphan_bytes == 3 * BLOCK
    fsck(path, repair=True, progress=False)
    assert fsck(path, progress=False).orphans == 0


def test_fsck_rejects_a_non_tier_directory(tmp_path, capsys):
    assert cli_main(["fsck", str(tmp_path)]) == 2
    assert "not an NVMe tier directory" in capsys.readouterr().err


def test_bulk_index_load_agrees_with_the_row_scan(tmp_path):
    """Restart decodes the index in bulk; it must judge every record as the row-by-row
    scan (and fsck) does: damaged, resized, wrong-key and stray-access entries included."""
    from kvstore.tiers.nvme.index import BlockIndex

    path = str(tmp_path / "idx")
    os.makedirs(path)
    keys = make_keys(12)
    index = BlockIndex(path, sync=False)
    index.put((k.digest, Record(i % 2, i * 8192, 4096, i, k.to_bytes()), 100.0 + i)
              for i, k in enumerate(keys))
    env = index.env
    blocks, access = env.open_db(b"blocks"), env.open_db(b"access")
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(keys[2].digest, db=blocks))
        value[40] ^= 1
        txn.put(keys[2].digest, bytes(value), db=blocks)                      # bad checksum
        txn.put(keys[4].digest, txn.get(keys[4].digest, db=blocks)[:-1], db=blocks)  # short
        txn.put(keys[6].digest, txn.get(keys[7].digest, db=blocks), db=blocks)  # names another key
        txn.delete(keys[8].digest, db=access)                                 # no access time
        txn.put(b"\xff" * 32, b"\0" * 8, db=access)                           # stray access time
        txn.put(b"short key", txn.get(keys[9].digest, db=blocks), db=blocks)  # not a digest
    snap = index.load()
    rows = list(index.scan())
    assert snap.digests == [d for d, _, _ in rows]
    assert snap.ok.tolist() == [rec is not None for _, rec, _ in rows]
    assert snap.last.tolist() == [last for _, _, last in rows]
    for i, (_, rec, _) in enumerate(rows):
        if rec is not None:
            assert (snap.file_no[i], snap.offset[i], snap.length[i], snap.checksum[i]) == rec[:4]
            assert snap.has_parent[i] == (rec.key_bytes[32:64] != bytes(32))
    assert sorted(snap.stray) == sorted(index.stray_access()) == [b"\xff" * 32]
    index.close()


def test_overlapping_records_keep_only_the_first(filled):
    """Two records claiming overlapping space: the bulk restart path falls back to the
    row rules, keeps the first, drops the other, and the dropped block reads as a miss."""
    path, keys, where = filled
    a, b = sorted(keys, key=lambda k: where[k])[2:4]
    rec_b = Record.decode(b.digest, _lmdb_get(path, b.digest))
    file_no, off_a = where[a]
    _lmdb_put(path, b.digest, Record(file_no, off_a + PAGE, rec_b.length, rec_b.checksum,
                                     b.to_bytes()).encode())
    t = open_tier(path)
    try:
        assert t.stats()["corrupt_blocks"] == 1
        ok = load_all(t, keys)
        assert ok == [k != b for k in keys]
        assert t.used_bytes == (N - 1) * BLOCK
        # the space block b had is free again, and nothing overlaps: N - 1 extents in use
        assert t.stats()["allocated_bytes"] == (N - 1) * extent_bytes(BLOCK)
    finally:
        t.close()


def load_batch(t, keys):
    """One read_into for all keys into page-aligned buffers: adjacent blocks are read in
    runs (one preadv for several blocks), each still verified on its own."""
    from kvstore.tiers.nvme.io import aligned_empty

    dsts = [aligned_empty(BLOCK) for _ in keys]
    ok = t.read_into(keys, dsts)
    for i, (good, dst) in enumerate(zip(ok, dsts)):
        assert not good or np.array_equal(dst, payload(i, BLOCK)), "wrong bytes returned"
    return ok


@pytest.mark.parametrize("where_in_block", ["payload", "header"])
def test_corrupt_block_inside_a_run_is_the_only_miss(filled, where_in_block):
    path, keys, where = filled
    victim = sorted(keys, key=lambda k: where[k])[N // 2]   # neighbours on both sides
    file_no, off = where[victim]
    flip(data_path(path, file_no), off + (PAGE + 7 if where_in_block == "payload" else 40))
    t = open_tier(path)
    try:
        assert load_batch(t, keys) == [k != victim for k in keys]
        assert t.stats()["corrupt_blocks"] == 1
        assert t.contains([victim]) == [False]
    finally:
        t.close()


def test_truncation_inside_a_run(filled):
    """A run whose read comes back short: blocks wholly read are returned, the rest miss."""
    path, keys, where = filled
    t = open_tier(path)
    try:
        order = sorted(keys, key=lambda k: where[k])
        os.truncate(data_path(path, 0), where[order[5]][1] + PAGE + 10)
        assert load_batch(t, keys) == [order.index(k) < 5 for k in keys]
        assert t.stats()["corrupt_blocks"] == N - 5
    finally:
        t.close()
