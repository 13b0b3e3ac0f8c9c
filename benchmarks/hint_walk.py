"""What retention hints cost the eviction walk, per policy.

    python -m benchmarks.hint_walk

Saves 8,192 distinct 4 KiB blocks, 16 per call, into a one-tier DRAM Store of 1,024
blocks, with 0 % (the baseline, same run), 25 % and 50 % of the calls hinted
(``Hint(retain_s=1e6)``: the hinted blocks stay live and pile up at the eviction end).
A victim walk steps over the live-hinted blocks ahead of the first unhinted one
(``policies/retention.py``; over LRU, FIFO and lineage only once, as it parks or holds
them), so this is the steady state that costs most.

A second table shows how that cost grows with the tier: a tier of N blocks (2,000,
20,000, 200,000) filled with requests of 16 chained blocks saved under a hint that stays
live, then 51 unhinted saves of one block each (each evicts one), timed per save: the
first (over LRU, FIFO and lineage its walk parks or holds the hinted blocks once) and the
median of the rest. S3-FIFO walks past every hinted block each time. Lineage is shown
again over one chain of N blocks, the saves extending it: its worst case, as every
eviction then takes an interior block and the walk passes the chain's held blocks.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from benchmarks._common import print_table, write_json
from kvstore import Hint, Namespace, Store
from kvstore.policies import EVICTION_NAMES

BLOCKS, CAPACITY, BATCH, NBYTES = 8192, 1024, 16, 4096
SHARES = (0.0, 0.25, 0.5)


def saves_per_s(policy: str, share: float, keys: list, buf: np.ndarray) -> tuple[float, dict]:
    config = {"tiers": [{"name": "t", "kind": "dram", "capacity": CAPACITY * NBYTES, "eviction": policy}],
              "io_threads": 1}
    rng = np.random.default_rng(0)
    with Store.from_config(config) as store:
        t0 = time.perf_counter()
        for lo in range(0, BLOCKS, BATCH):
            hint = Hint(1e6) if rng.random() < share else None
            store.save(keys[lo:lo + BATCH], [buf] * BATCH, hint=hint).result()
        elapsed = time.perf_counter() - t0
        stats = store.stats()
    return BLOCKS / elapsed, {"evictions": stats["tiers"][0]["evictions"], "live_hints": stats["hints"]["live"]}


SCALES, SCALE_SAVES, REQUEST_BLOCKS = (2000, 20000, 200000), 50, 16
# (policy, blocks per chain): requests of 16 chained blocks each, and for lineage (the one
# policy that reads the chains) also the whole tier as one chain, its worst case
SCALE_ROWS = (("lru", REQUEST_BLOCKS), ("fifo", REQUEST_BLOCKS), ("s3fifo", REQUEST_BLOCKS),
              ("lineage", REQUEST_BLOCKS), ("lineage", None))


def ms_per_unhinted_save(policy: str, n: int, chain: int | None, buf: np.ndarray) -> tuple[float, float]:
    """ms of the first one-block unhinted save into a tier of ``n`` blocks all held by
    live hints (chains of ``chain`` blocks, ``None``: one chain, the saves extending it),
    and the median of the next ``SCALE_SAVES`` (each evicts one)."""
    ns = Namespace(model="bench", dtype="u8", chunk_tokens=1, salt=f"scale-{policy}-{n}")
    if chain is None:
        keys = ns.chunk_keys(np.arange(n + SCALE_SAVES + 1))
    else:
        keys = [key for lo in range(0, n, chain) for key in ns.chunk_keys(np.arange(lo, min(lo + chain, n)))]
        keys += [ns.chunk_keys([n + i])[0] for i in range(SCALE_SAVES + 1)]
    config = {"tiers": [{"name": "t", "kind": "dram", "capacity": n * NBYTES, "eviction": policy}],
              "io_threads": 1}
    with Store.from_config(config) as store:
        for lo in range(0, n, 512):
            batch = keys[lo:min(lo + 512, n)]
            store.save(batch, [buf] * len(batch), hint=Hint(1e6)).result()
        times = []
        for key in keys[n:]:
            t0 = time.perf_counter()
            store.save([key], [buf]).result()
            times.append((time.perf_counter() - t0) * 1e3)
        return times[0], statistics.median(times[1:])


def main() -> None:
    ns = Namespace(model="bench", dtype="u8", chunk_tokens=1)
    keys = [ns.chunk_keys([i])[0] for i in range(BLOCKS)]
    buf = np.zeros(NBYTES, np.uint8)
    rows, out = [], []
    for policy in EVICTION_NAMES:
        rates = []
        for share in SHARES:
            rate, extra = saves_per_s(policy, share, keys, buf)
            rates.append(rate)
            out.append({"policy": policy, "hinted_share": share, "saves_per_s": rate, **extra})
        rows.append([policy, *(f"{r:,.0f}" for r in rates), *(f"{r / rates[0]:.2f}x" for r in rates[1:])])
    print_table(["policy", "0% hinted", "25% hinted", "50% hinted", "25% vs 0%", "50% vs 0%"], rows)
    scaling = []
    for policy, chain in SCALE_ROWS:
        for n in SCALES:
            first, median = ms_per_unhinted_save(policy, n, chain, buf)
            scaling.append({"policy": policy, "chain_blocks": chain, "hinted_blocks": n,
                            "first_save_ms": first, "median_save_ms": median})
    print()
    print("ms per unhinted one-block save into a tier of N blocks all held by live hints: the first save "
          f"(LRU, FIFO, lineage: its walk parks or holds them), then the median of the next {SCALE_SAVES}")
    print_table(["policy", "chains", *(f"{w} N = {n:,}" for n in SCALES for w in ("first", "then"))],
                [[p, f"{c} blocks" if c else "one", *(f"{r[k]:.2f}" for r in scaling
                                                      if (r["policy"], r["chain_blocks"]) == (p, c)
                                                      for k in ("first_save_ms", "median_save_ms"))]
                 for p, c in SCALE_ROWS])
    write_json("hint_walk", {"blocks": BLOCKS, "capacity_blocks": CAPACITY, "batch": BATCH, "nbytes": NBYTES,
                             "rows": out, "scaling": scaling, "command": "python -m benchmarks.hint_walk"})


if __name__ == "__main__":
    main()
