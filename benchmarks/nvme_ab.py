"""Paired A/Bs of two NVMe tier choices, each against the alternative it replaced.

- **read runs**: a read batch moves in runs of at most 2 MiB of payload (the tier's
  ``READ_RUN_BYTES``) against 8 MiB runs (the write size, what reads used before). Each
  batch of 64 is read cold by one variant, the variants alternating batch by batch (the
  first one alternating by repetition), so the disk's drift hits both alike.
- **write commit**: a batch's index records are committed behind ``write()`` on the
  tier's index thread (the fsync overlaps the next batch's data) against the commit
  inside the call (``write()`` then ``flush_access()``, which waits for it). Whole
  repetitions alternate here: a commit left running by one variant would otherwise be
  absorbed by the other's next batch.

The read-ahead is off for the read A/B (these batches are a sequential stream; it is
measured by ``benchmarks/nvme_overhead.py``).

    python benchmarks/nvme_ab.py [--dir DIR] [--sizes 256KiB,1MiB,4MiB] [--bytes 1GiB] [--reps 8]

Prints per-size medians and the median of per-repetition ratios (default variant over
the old one); writes benchmarks/results/nvme_ab.json.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

import kvstore.tiers.nvme.tier as nvme  # noqa: E402
from benchmarks._common import print_table  # noqa: E402
from benchmarks._nvme_setup import block_buffers, per_size, save_rows, size_options  # noqa: E402
from kvstore.keys import Namespace  # noqa: E402
from kvstore.tiers.nvme.io import MAX_RUN_BYTES, extent_bytes  # noqa: E402

BATCH = 64
READS = {"2 MiB read runs": nvme.READ_RUN_BYTES, "8 MiB read runs": MAX_RUN_BYTES}
WRITES = ("commit behind write", "commit in the call")


def bench_size(base: str, block: int, total: int, reps: int) -> dict:
    n = max(2 * BATCH, total // block // BATCH * BATCH)
    src, dst, srcs, dsts = block_buffers(block, n)
    path = os.path.join(base, f"kv-{block}")
    tier = nvme.NvmeTier(path, int(extent_bytes(block) * n * 1.1), name="bench", file_bytes=2 << 30,
                         io_threads=16, readahead_bytes=0)
    reads: dict[str, list[float]] = {v: [] for v in READS}
    writes: dict[str, list[float]] = {v: [] for v in WRITES}
    try:
        for rep in range(reps):
            keys = Namespace(model="bench", dtype="u8", chunk_tokens=1,
                             salt=f"ab-{block}-{rep}").chunk_keys(np.arange(n))
            writer = WRITES[rep % 2]
            os.sync()
            t0 = time.perf_counter()
            for s in range(0, n, BATCH):
                assert all(tier.write(keys[s:s + BATCH], srcs[s:s + BATCH]))
                if writer == "commit in the call":
                    tier.flush_access()
            tier.flush_access()   # the last commit belongs to this repetition
            writes[writer].append(block * n / (time.perf_counter() - t0))
            os.sync()
            spent = dict.fromkeys(READS, 0.0)
            for b, s in enumerate(range(0, n, BATCH)):
                variant = list(READS)[(b + rep) % 2]
                nvme.READ_RUN_BYTES = READS[variant]
                t0 = time.perf_counter()
                assert all(tier.read_into(keys[s:s + BATCH], dsts[s:s + BATCH]))
                spent[variant] += time.perf_counter() - t0
            for v in READS:
                reads[v].append(block * n / 2 / spent[v])
            assert np.array_equal(dst, src), "a read returned different bytes"
            dst[:] = 0
            tier.delete(keys)
            print(f"  {block >> 10} KiB rep {rep + 1}/{reps} done", file=sys.stderr)
    finally:
        nvme.READ_RUN_BYTES = READS["2 MiB read runs"]
        tier.close()
        shutil.rmtree(path, ignore_errors=True)
    new_r, old_r = reads.values()
    new_w, old_w = writes.values()
    return {"block_bytes": block, "blocks": n, "batch": BATCH, "reps": reps,
            "read_GBps": {v: statistics.median(x) / 1e9 for v, x in reads.items()},
            "write_GBps": {v: statistics.median(x) / 1e9 for v, x in writes.items()},
            "read_ratio": statistics.median(a / b for a, b in zip(new_r, old_r)),
            # repetitions alternate, so a write ratio pairs each repetition with the next
            "write_ratio": statistics.median(a / b for a, b in zip(new_w, old_w)),
            "samples_GBps": {v: [x / 1e9 for x in s] for v, s in {**reads, **writes}.items()}}


def main() -> int:
    parser = size_options(__doc__, bytes_default="1GiB", reps_default=8)
    args = parser.parse_args()
    if args.reps < 2:
        parser.error("--reps must be at least 2 (the write variants alternate by repetition)")
    rows = per_size(args, "nvme-ab", bench_size)
    print_table(["block", *(f"{v} GB/s" for v in (*READS, *WRITES)), "reads new/old", "writes new/old"],
                [[f"{row['block_bytes'] >> 10} KiB", *(row["read_GBps"][v] for v in READS),
                  *(row["write_GBps"][v] for v in WRITES), row["read_ratio"], row["write_ratio"]] for row in rows])
    print("(cold reads and writes, medians; ratios are medians of paired per-repetition ratios)")
    save_rows("nvme_ab", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
