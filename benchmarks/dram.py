"""DRAM tier save+load throughput vs numpy memcpy of the same bytes, same run.

    python -m benchmarks.dram [--total 256MiB] [--repeat 5]

All buffers are page-aligned. For each block size the same total bytes move (a) with ``np.copyto`` into and back out of
a pre-touched pool — the memcpy baseline, two copies per block just like a save+load —
(b) through ``DramTier.write``/``read_into`` and (c) through ``Store.save``/``load`` with
batches of 64. Interleaved repetitions, medians. Target: (b) and (c) >= 0.8x (a).
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks._common import median_time, print_table, write_json
from kvstore.config import parse_size
from kvstore.keys import Namespace
from kvstore.store import Store
from kvstore.tiers.dram import DramTier

SIZES = {"64KiB": 64 << 10, "256KiB": 256 << 10, "1MiB": 1 << 20, "4MiB": 4 << 20}
BATCH = 64


def _page_aligned(nbytes: int) -> np.ndarray:
    """A pre-touched, page-aligned buffer. Every buffer in the run is page-aligned (like
    pinned or mmap'ed engine memory), so no side gains or loses from memcpy's penalty
    when source and destination sit a few bytes apart modulo 4 KiB."""
    raw = np.ones(nbytes + 4096, np.uint8)
    start = (-raw.ctypes.data) % 4096
    return raw[start:start + nbytes]


def run(total: int, repeat: int) -> dict:
    rows, results = [], []
    for label, size in SIZES.items():
        n = max(BATCH, total // size)
        srcs = [_page_aligned(size) for _ in range(BATCH)]
        for i, src in enumerate(srcs):
            src[:] = np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)
        dsts = [_page_aligned(size) for _ in range(BATCH)]
        pool = _page_aligned(n * size)
        keys = Namespace(model="bench", dtype="u8", chunk_tokens=1).chunk_keys(np.arange(n))
        tier = DramTier(n * size + (1 << 20), name="bench")
        store = Store.from_config({"tiers": [{"name": "hot", "kind": "dram", "capacity": n * size + (1 << 20)}],
                                   "io_threads": 1})

        def memcpy():
            for i in range(n):
                np.copyto(pool[i * size:(i + 1) * size], srcs[i % BATCH])
            for i in range(n):
                np.copyto(dsts[i % BATCH], pool[i * size:(i + 1) * size])

        def tier_round():
            for b in range(0, n, BATCH):
                tier.write(keys[b:b + BATCH], srcs[:len(keys[b:b + BATCH])])
            for b in range(0, n, BATCH):
                assert all(tier.read_into(keys[b:b + BATCH], dsts[:len(keys[b:b + BATCH])]))

        def store_round():
            for b in range(0, n, BATCH):
                store.save(keys[b:b + BATCH], srcs[:len(keys[b:b + BATCH])]).result()
            for b in range(0, n, BATCH):
                assert all(store.load(keys[b:b + BATCH], dsts[:len(keys[b:b + BATCH])]).result())

        t = {"memcpy": [], "tier": [], "store": []}
        for _ in range(repeat):  # interleaved so machine noise hits all three alike
            t["memcpy"].append(median_time(memcpy, 1, 0))
            tier.delete(keys)  # emptying is setup, not part of the timed save+load
            t["tier"].append(median_time(tier_round, 1, 0))
            store.delete(keys)
            t["store"].append(median_time(store_round, 1, 0))
        moved = 2 * n * size
        gbps = {k: moved / float(np.median(v)) / 1e9 for k, v in t.items()}
        tier.close()
        store.close()
        entry = {"block": label, "block_bytes": size, "blocks": n, **{f"{k}_gbps": v for k, v in gbps.items()},
                 "tier_vs_memcpy": gbps["tier"] / gbps["memcpy"], "store_vs_memcpy": gbps["store"] / gbps["memcpy"]}
        results.append(entry)
        rows.append([label, gbps["memcpy"], gbps["tier"], gbps["store"], entry["tier_vs_memcpy"],
                     entry["store_vs_memcpy"]])
    print_table(["block", "memcpy GB/s", "tier GB/s", "store GB/s", "tier/memcpy", "store/memcpy"], rows)
    return {"target": ">= 0.8x memcpy", "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total", default="256MiB", help="bytes moved per size and repetition")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    out = run(parse_size(args.total), args.repeat)
    print("wrote", write_json("dram", out))


if __name__ == "__main__":
    main()
