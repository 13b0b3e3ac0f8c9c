"""What retention hints cost the eviction walk, per policy.

    python -m benchmarks.hint_walk

Saves 8,192 distinct 4 KiB blocks, 16 per call, into a one-tier DRAM Store of 1,024
blocks, with 0 % (the baseline, same run), 25 % and 50 % of the calls hinted
(``Hint(retain_s=1e6)``: the hinted blocks stay live and pile up at the eviction end).
A victim walk steps over the live-hinted blocks ahead of the first unhinted one
(``policies/retention.py``; over LRU and FIFO only once, as it parks them), so this is
the steady state that costs most.

A second table shows how that cost grows with the tier: a tier of N blocks (2,000,
20,000, 200,000) filled with blocks saved under a hint that stays live, then 51 unhinted
saves of one block each (each evicts one), timed per save: the first (over LRU and FIFO
its walk parks the hinted blocks, ``policies/_parking.py``; once per block) and the
median of the rest. S3-FIFO and lineage walk past every hinted block each time.
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


SCALES, SCALE_POLICIES, SCALE_SAVES = (2000, 20000, 200000), ("lru", "fifo", "s3fifo", "lineage"), 50


def ms_per_unhinted_save(policy: str, n: int, buf: np.ndarray) -> tuple[float, float]:
    """ms of the first one-block unhinted save into a tier of ``n`` blocks all held by
    live hints, and the median of the next ``SCALE_SAVES`` (each evicts one)."""
    ns = Namespace(model="bench", dtype="u8", chunk_tokens=1, salt=f"scale-{policy}-{n}")
    keys = ns.chunk_keys(np.arange(n + SCALE_SAVES + 1))
    config = {"tiers": [{"name": "t", "kind": "dram", "capacity": n * NBYTES, "eviction": policy}],
              "io_threads": 1}
    with Store.from_config(config) as store:
        for lo in range(0, n, 500):
            batch = keys[lo:min(lo + 500, n)]
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
    for policy in SCALE_POLICIES:
        for n in SCALES:
            first, median = ms_per_unhinted_save(policy, n, buf)
            scaling.append({"policy": policy, "hinted_blocks": n, "first_save_ms": first, "median_save_ms": median})
    print()
    print("ms per unhinted one-block save into a tier of N blocks all held by live hints: the first save "
          f"(LRU, FIFO: its walk parks them), then the median of the next {SCALE_SAVES}")
    print_table(["policy", *(f"{w} N = {n:,}" for n in SCALES for w in ("first", "then"))],
                [[p, *(f"{r[k]:.2f}" for r in scaling if r["policy"] == p for k in ("first_save_ms", "median_save_ms"))]
                 for p in SCALE_POLICIES])
    write_json("hint_walk", {"blocks": BLOCKS, "capacity_blocks": CAPACITY, "batch": BATCH, "nbytes": NBYTES,
                             "rows": out, "scaling": scaling, "command": "python -m benchmarks.hint_walk"})


if __name__ == "__main__":
    main()
