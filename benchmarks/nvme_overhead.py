"""What the NVMe tier adds to a cold read, beside bare readers of the same extents.

The tier writes the blocks once per repetition; then each contender reads them all
cold (O_DIRECT), in batches of 64, interleaved (the order rotates every repetition):

- ``kvstore``: ``NvmeTier.read_into``: index lookups, runs of adjacent blocks, one
  ``preadv`` per run on the tier's I/O threads, header and XXH3 check of every block,
  access bookkeeping, and the read-ahead of a sequential stream (these batches are one);
- ``kvstore, no read-ahead``: the same tier with its read-ahead switched off;
- ``bare reader``: the same extents, one ``preadv`` (header page + payload) per block on
  a 16-thread pool, the same header and XXH3 check (``tiers.nvme.io.read_block``) and
  nothing else: what a minimal Python reader with the same verification does;
- ``bare, unverified``: the same ``preadv`` per block, no check at all.

``kvstore`` against ``kvstore, no read-ahead`` is what the read-ahead gains; against
``bare reader``, what the tier's own work costs or gains; ``bare reader`` against
``bare, unverified`` is what verification costs.

    python benchmarks/nvme_overhead.py [--dir DIR] [--sizes 256KiB,1MiB,4MiB] [--bytes 512MiB] [--reps 7]

Prints medians and kvstore's per-repetition ratios; writes
benchmarks/results/nvme_overhead.json.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from benchmarks._nvme_setup import block_buffers, per_size, save_rows, size_options  # noqa: E402
from kvstore.keys import Namespace  # noqa: E402
from kvstore.tiers.nvme.io import PAGE, aligned_empty, extent_bytes, read_block  # noqa: E402
from kvstore.tiers.nvme import NvmeTier  # noqa: E402

BATCH = 64
THREADS = 16
CONTENDERS = ("kvstore", "kvstore, no read-ahead", "bare reader", "bare, unverified")


def read_all(name: str, tier: NvmeTier, pool: ThreadPoolExecutor, keys: list, dsts: list) -> float:
    """Seconds to read every block cold with contender ``name``."""
    extents = [tier._entries[k] for k in keys]
    header = aligned_empty(PAGE * THREADS * 4).reshape(-1, PAGE)   # the unverified reader's header pages

    def verified(i: int) -> None:
        e = extents[i]
        read_block(e.shard.data.fd(e.file_no), e.offset, keys[i].digest, e.length, e.checksum, dsts[i])

    def unverified(i: int) -> None:
        e = extents[i]
        got = os.preadv(e.shard.data.fd(e.file_no), [header[i % len(header)], dsts[i]], e.offset)
        assert got == extent_bytes(e.length)

    one = verified if name == "bare reader" else unverified
    readahead = tier._readahead
    if name == "kvstore, no read-ahead":
        tier._readahead = None
    try:
        t0 = time.perf_counter()
        for s in range(0, len(keys), BATCH):
            if name.startswith("kvstore"):
                assert all(tier.read_into(keys[s:s + BATCH], dsts[s:s + BATCH]))
            else:
                list(pool.map(one, range(s, min(s + BATCH, len(keys)))))
        return time.perf_counter() - t0
    finally:
        tier._readahead = readahead


def bench_size(base: str, block: int, total: int, reps: int) -> dict:
    n = max(BATCH, total // block // BATCH * BATCH)
    src, dst, srcs, dsts = block_buffers(block, n)
    path = os.path.join(base, f"kv-{block}")
    tier = NvmeTier(path, int(extent_bytes(block) * n * 1.1), name="bench", file_bytes=1 << 30,
                    io_threads=THREADS)
    got: dict[str, list[float]] = {c: [] for c in CONTENDERS}
    try:
        with ThreadPoolExecutor(THREADS) as pool:
            for rep in range(reps):
                keys = Namespace(model="bench", dtype="u8", chunk_tokens=1,
                                 salt=f"{block}-{rep}").chunk_keys(np.arange(n))
                for s in range(0, n, BATCH):
                    assert all(tier.write(keys[s:s + BATCH], srcs[s:s + BATCH]))
                order = CONTENDERS[rep % len(CONTENDERS):] + CONTENDERS[:rep % len(CONTENDERS)]
                for name in order:
                    os.sync()
                    dst[:] = 0
                    got[name].append(block * n / read_all(name, tier, pool, keys, dsts))
                    assert np.array_equal(dst, src), f"{name} read different bytes"
                tier.delete(keys)
                print(f"  {block >> 10} KiB rep {rep + 1}/{reps} done", file=sys.stderr)
    finally:
        tier.close()
        shutil.rmtree(path, ignore_errors=True)
    row = {"block_bytes": block, "blocks": n, "batch": BATCH, "reps": reps,
           "read_GBps": {c: statistics.median(v) / 1e9 for c, v in got.items()},
           "samples_GBps": {c: [x / 1e9 for x in v] for c, v in got.items()}}
    row["kvstore_ratio"] = {c: statistics.median(k / o for k, o in zip(got["kvstore"], got[c]))
                            for c in CONTENDERS[1:]}
    return row


def main() -> int:
    parser = size_options(__doc__, bytes_default="512MiB", reps_default=7)
    args = parser.parse_args()
    rows = per_size(args, "nvme-overhead", bench_size)
    print(f"{'block':>8} | " + " | ".join(f"{c:>22}" for c in CONTENDERS)
          + " | kvstore / each other column")
    for row in rows:
        print(f"{row['block_bytes'] >> 10:>5} Ki | "
              + " | ".join(f"{row['read_GBps'][c]:>17.2f} GB/s" for c in CONTENDERS)
              + " | " + ", ".join(f"{row['kvstore_ratio'][c]:.2f}" for c in CONTENDERS[1:]))
    print("(cold reads, medians; ratios are medians of per-repetition ratios)")
    save_rows("nvme_overhead", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
