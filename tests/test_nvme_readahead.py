"""The NVMe tier's sequential read-ahead: a stream of batches is read ahead and every
block still arrives checked; a block that changed after it was read ahead, or that is
corrupt, is never returned from the staging buffer."""

import os
import threading

import numpy as np
import pytest
import torch

from kvstore.testing import make_keys, payload
from kvstore.tiers.nvme.io import PAGE
from kvstore.tiers.nvme import NvmeTier

BLOCK = 64 * 1024
BATCH = 8
BATCHES = 6


def open_tier(path, **kw):
    kw.setdefault("readahead_bytes", 1 << 20)
    return NvmeTier(path, 4 * BATCHES * BATCH * BLOCK, name="nvme-ra", file_bytes=8 << 20, io_threads=4, **kw)


@pytest.fixture
def tier(tmp_path):
    t = open_tier(str(tmp_path / "d"))
    if t.io_mode != "direct":
        t.close()
        pytest.skip(f"read-ahead needs O_DIRECT; the test directory gives {t.io_mode}")
    yield t
    t.close()


def fill(t, n=BATCHES * BATCH, salt=""):
    keys = make_keys(n, salt=salt)
    for s in range(0, n, BATCH):   # written batch by batch: laid out one after another
        assert all(t.write(keys[s:s + BATCH], [payload(i, BLOCK) for i in range(s, s + BATCH)]))
    return keys


def read_batch(t, keys, first, dsts=None):
    dsts = dsts if dsts is not None else [np.zeros(BLOCK, np.uint8) for _ in keys]
    ok = t.read_into(keys, dsts)
    for i, (good, dst) in enumerate(zip(ok, dsts)):
        got = dst.numpy() if isinstance(dst, torch.Tensor) else dst
        assert not good or np.array_equal(got, payload(first + i, BLOCK)), "wrong bytes returned"
    return ok


def test_a_stream_of_batches_is_read_ahead(tier):
    keys = fill(tier)
    for s in range(0, len(keys), BATCH):
        assert read_batch(tier, keys[s:s + BATCH], s) == [True] * BATCH
    # the first two batches are read directly (the second shows a stream); each later
    # batch was read ahead while the one before it was handed back
    assert tier.stats()["readahead_hits"] == (BATCHES - 2) * BATCH
    assert tier.stats()["corrupt_blocks"] == 0


def test_torch_buffers_are_served_from_the_read_ahead(tier):
    keys = fill(tier)
    for s in range(0, len(keys), BATCH):
        dsts = [torch.zeros(BLOCK, dtype=torch.uint8) for _ in range(BATCH)]
        assert read_batch(tier, keys[s:s + BATCH], s, dsts) == [True] * BATCH
    assert tier.stats()["readahead_hits"] == (BATCHES - 2) * BATCH


@pytest.mark.parametrize("window", [0, 2 * BLOCK], ids=["off", "batch-longer-than-window"])
def test_no_read_ahead_when_off_or_batches_exceed_the_window(tmp_path, window):
    t = open_tier(str(tmp_path / "d"), readahead_bytes=window)
    try:
        keys = fill(t)
        for s in range(0, len(keys), BATCH):
            assert read_batch(t, keys[s:s + BATCH], s) == [True] * BATCH
        assert t.stats()["readahead_hits"] == 0
    finally:
        t.close()


def test_random_batches_are_not_read_ahead(tier):
    keys = fill(tier)
    order = np.random.default_rng(7).permutation(len(keys)).tolist()
    for s in range(0, len(order), BATCH):
        idx = order[s:s + BATCH]
        dsts = [np.zeros(BLOCK, np.uint8) for _ in idx]
        assert all(tier.read_into([keys[i] for i in idx], dsts))
        assert all(np.array_equal(d, payload(i, BLOCK)) for i, d in zip(idx, dsts))
    assert tier.stats()["readahead_hits"] == 0


def test_a_block_rewritten_after_it_was_read_ahead_is_read_again(tier):
    keys = fill(tier)
    read_batch(tier, keys[:BATCH], 0)
    read_batch(tier, keys[BATCH:2 * BATCH], BATCH)   # the third batch is now read ahead
    tier._readahead.window.wait()
    victim = keys[2 * BATCH + 3]
    where = (tier._entries[victim].file_no, tier._entries[victim].offset)
    assert tier.delete([victim]) == 1
    new = make_keys(1, salt="rewritten")[0]
    assert tier.write([new], [payload(999, BLOCK)]) == [True]
    assert (tier._entries[new].file_no, tier._entries[new].offset) == where, \
        "precondition: the new block took the freed extent"
    batch = keys[2 * BATCH:3 * BATCH]
    batch[3] = new
    dsts = [np.zeros(BLOCK, np.uint8) for _ in batch]
    assert tier.read_into(batch, dsts) == [True] * BATCH
    assert np.array_equal(dsts[3], payload(999, BLOCK))   # not the stale bytes read ahead
    for i, dst in enumerate(dsts):
        if i != 3:
            assert np.array_equal(dst, payload(2 * BATCH + i, BLOCK))
    stats = tier.stats()
    assert stats["readahead_hits"] == BATCH - 1
    assert stats["corrupt_blocks"] == 0


@pytest.mark.parametrize("where_in_block", ["payload", "header"])
def test_a_corrupt_block_in_the_read_ahead_is_a_miss(tier, where_in_block):
    keys = fill(tier)
    victim = keys[2 * BATCH + 5]
    e = tier._entries[victim]
    path = os.path.join(e.shard.path, f"data-{e.file_no:05d}.kvd")
    with open(path, "r+b") as f:   # damaged before the read-ahead reads it
        f.seek(e.offset + (PAGE + 11 if where_in_block == "payload" else 40))
        f.write(b"\xde\xad")
    read_batch(tier, keys[:BATCH], 0)
    read_batch(tier, keys[BATCH:2 * BATCH], BATCH)
    ok = read_batch(tier, keys[2 * BATCH:3 * BATCH], 2 * BATCH)
    assert ok == [i != 5 for i in range(BATCH)]
    stats = tier.stats()
    assert stats["corrupt_blocks"] == 1
    assert stats["readahead_hits"] == BATCH - 1
    assert tier.contains([victim]) == [False]


def test_concurrent_streams_get_their_own_bytes(tier):
    streams = [fill(tier, n=3 * BATCH, salt=f"s{k}") for k in range(4)]
    errors = []

    def reader(keys):
        try:
            for _ in range(3):
                for s in range(0, len(keys), BATCH):
                    assert read_batch(tier, keys[s:s + BATCH], s) == [True] * BATCH
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(keys,)) for keys in streams]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert tier.stats()["corrupt_blocks"] == 0
