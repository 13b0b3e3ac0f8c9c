"""Cold NVMe reads into DRAM-tier memory: the DRAM tier's arena against a plain arena.

What the Store does on a promotion (and the vLLM connector on a load from disk): the
NVMe tier reads blocks with O_DIRECT straight into DRAM-tier slots. How the arena is
backed decides how the disk driver sees those reads. Contenders, same tier, same blocks,
interleaved repetitions:

- ``plain arena``: an anonymous ``mmap`` faulted in 4 KiB pages (the DRAM tier's arena
  before it asked for huge pages);
- ``kvstore arena``: the DRAM tier's arena (``tiers.dram._map_arena``: transparent huge
  pages where the kernel allows, faulted in at start-up).

    python benchmarks/nvme_dram.py [--dir DIR] [--sizes 256KiB,1MiB,4MiB] [--bytes 512MiB] [--reps 7]

Prints medians and per-repetition ratios; writes benchmarks/results/nvme_dram.json.
"""

from __future__ import annotations

import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from benchmarks._nvme_setup import save_rows, size_options  # noqa: E402
from kvstore.config import parse_size  # noqa: E402
from kvstore.keys import Namespace  # noqa: E402
from kvstore.tiers.nvme.io import aligned_empty, extent_bytes  # noqa: E402
from kvstore.tiers.dram import _map_arena  # noqa: E402
from kvstore.tiers.nvme import NvmeTier  # noqa: E402

BATCH = 64


def plain_arena(nbytes: int) -> np.ndarray:
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    return np.frombuffer(mm, dtype=np.uint8)


def run_size(directory: str, block: int, total: int, reps: int) -> dict:
    n = total // block
    tier = NvmeTier(directory, int(extent_bytes(block) * n * 1.1), name="bench", file_bytes=1 << 30,
                    io_threads=16)
    try:
        src = aligned_empty(total)
        src[:] = np.random.default_rng(block).integers(0, 256, total, dtype=np.uint8)
        keys = Namespace(model="bench", dtype="u8", chunk_tokens=1, salt=str(block)).chunk_keys(np.arange(n))
        for i in range(0, n, BATCH):
            assert all(tier.write(keys[i:i + BATCH], [src[j * block:(j + 1) * block]
                                                      for j in range(i, min(n, i + BATCH))]))
        os.sync()
        arenas = {"plain arena": plain_arena(total), "kvstore arena": np.frombuffer(_map_arena(total, None),
                                                                                    dtype=np.uint8)}
        rates: dict[str, list[float]] = {name: [] for name in arenas}
        for r in range(reps):
            order = list(arenas) if r % 2 == 0 else list(reversed(arenas))
            for name in order:
                dst = arenas[name]
                dst[::4096] = 0
                t0 = time.perf_counter()
                for i in range(0, n, BATCH):
                    assert all(tier.read_into(keys[i:i + BATCH], [dst[j * block:(j + 1) * block]
                                                                  for j in range(i, min(n, i + BATCH))]))
                rates[name].append(total / (time.perf_counter() - t0) / 1e9)
                assert np.array_equal(dst, src), f"{name}: wrong bytes"
        ratios = [k / p for k, p in zip(rates["kvstore arena"], rates["plain arena"])]
        return {"block_bytes": block, "blocks": n, "batch": BATCH, "reps": reps,
                "read_GBps": {name: statistics.median(v) for name, v in rates.items()},
                "samples": rates, "ratios": ratios, "median_ratio": statistics.median(ratios)}
    finally:
        tier.close()


def main() -> None:
    ap = size_options(__doc__, bytes_default="512MiB", reps_default=7)
    args = ap.parse_args()
    thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip() \
        if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled") else "absent"
    rows = []
    print(f"cold O_DIRECT reads, batches of {BATCH}, {args.bytes >> 20} MiB per measurement; THP: {thp}")
    print(f"{'block':>8} {'plain GB/s':>11} {'kvstore GB/s':>13} {'ratio':>6}   per-repetition ratios")
    for size in args.sizes.split(","):
        block = parse_size(size)
        directory = tempfile.mkdtemp(prefix="kvstore-nvme-dram-", dir=args.dir or "/var/tmp")
        try:
            row = run_size(directory, block, args.bytes, args.reps)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        rows.append(row)
        got = row["read_GBps"]
        print(f"{size:>8} {got['plain arena']:>11.2f} {got['kvstore arena']:>13.2f} {row['median_ratio']:>5.2f}x   "
              + " ".join(f"{r:.2f}" for r in row["ratios"]), flush=True)
    save_rows("nvme_dram", rows, thp=thp)


if __name__ == "__main__":
    main()
