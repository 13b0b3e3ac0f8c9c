"""Crash safety: a child process saves and deletes blocks in a loop and is SIGKILLed at
random moments; after each restart every indexed key loads byte-exact, usage matches
the index, and no space leaks from round to round."""

import os
import random
import signal
import subprocess
import sys
import time

import numpy as np

from kvstore.testing import make_keys, payload
from kvstore.tiers.nvme.fsck import fsck
from kvstore.tiers.nvme.io import extent_bytes
from kvstore.tiers.nvme import NvmeTier

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = (64 * 1024, 16 * 1024 + 123, 128 * 1024)
CAPACITY = 3 << 20
FILE_BYTES = 1 << 20
NKEYS = 120
ROUNDS = 4

CHILD = f"""
import random, sys
sys.path.insert(0, {ROOT!r})
from kvstore.testing import make_keys, payload
from kvstore.tiers.nvme import NvmeTier
SIZES = {SIZES!r}
keys = make_keys({NKEYS}, salt="crash")
tier = NvmeTier(sys.argv[1], {CAPACITY}, file_bytes={FILE_BYTES}, io_threads=4, access_flush_s=0.05)
rng = random.Random(int(sys.argv[2]))
print("ready", flush=True)
dst = {{}}
while True:
    batch = rng.sample(range({NKEYS}), 8)
    ok = tier.write([keys[i] for i in batch], [payload(i, SIZES[i % 3]) for i in batch])
    if not all(ok) or rng.random() < 0.3:
        tier.delete([keys[i] for i in rng.sample(range({NKEYS}), 12)])
    for i in rng.sample(range({NKEYS}), 2):
        import numpy as np
        tier.read_into([keys[i]], [np.empty(SIZES[i % 3], np.uint8)])
"""


def _check_restart(path, keys):
    tier = NvmeTier(path, CAPACITY, file_bytes=FILE_BYTES, io_threads=2)
    try:
        index = {k: i for i, k in enumerate(keys)}
        blocks = tier.recover()
        assert len(blocks) == len(set(b.key for b in blocks))
        for b in blocks:
            i = index[b.key]
            assert b.nbytes == SIZES[i % 3]
            assert b.key.parent == keys[i].parent and b.key.namespace == keys[i].namespace
            dst = np.empty(b.nbytes, np.uint8)
            ok = tier.read_into([b.key], [dst])[0]
            # a SIGKILL loses no page-cache writes, so every committed block must load
            assert ok, "an indexed block did not load after a crash"
            assert np.array_equal(dst, payload(i, b.nbytes)), "wrong bytes after a crash"
        stats = tier.stats()
        assert tier.used_bytes == sum(b.nbytes for b in blocks) <= CAPACITY
        assert stats["allocated_bytes"] == sum(extent_bytes(b.nbytes) for b in blocks)
        assert stats["corrupt_blocks"] == 0
        return stats, len(blocks)
    finally:
        tier.close()


def test_sigkill_rounds(tmp_path):
    path = str(tmp_path / "crash")
    keys = make_keys(NKEYS, salt="crash")
    rng = random.Random(1234)
    file_counts = []
    env = {**os.environ, "PYTHONPATH": ROOT}
    for round_no in range(ROUNDS):
        child = subprocess.Popen([sys.executable, "-c", CHILD, path, str(round_no)], stdout=subprocess.PIPE,
                                 text=True, env=env)
        try:
            assert child.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.3, 1.2))
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
        stats, count = _check_restart(path, keys)
        assert count > 0
        file_counts.append(stats["data_files"])
        # space does not leak: allocated == what the index names (checked above), and the
        # files never outgrow the directory's budget however often the writer dies
        assert stats["file_bytes"] <= CAPACITY + CAPACITY // 8 + (1 << 20)
    budget = CAPACITY + CAPACITY // 8 + (1 << 20)
    assert max(file_counts) <= budget // FILE_BYTES
    report = fsck(path, progress=False)
    assert report.problems == 0
