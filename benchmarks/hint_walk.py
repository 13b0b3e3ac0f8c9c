"""What retention hints cost the eviction walk, per policy.

    python -m benchmarks.hint_walk

Saves 8,192 distinct 4 KiB blocks, 16 per call, into a one-tier DRAM Store of 1,024
blocks, with 0 % (the baseline, same run), 25 % and 50 % of the calls hinted
(``Hint(retain_s=1e6)``: the hinted blocks stay live and pile up at the eviction end).
A victim walk steps over the live-hinted blocks ahead of the first unhinted one
(``policies/retention.py``), so this is the steady state that costs most.

A second table shows how that cost grows with the tier: a tier of N blocks (2,000 and
20,000) filled with blocks saved under a hint that stays live, then 50 unhinted saves of
one block each (each evicts one), timed per save, for LRU and lineage.
"""

from __future__ import annotations

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


SCALES, SCALE_POLICIES, SCALE_SAVES = (2000, 20000), ("lru", "lineage"), 50


def ms_per_unhinted_save(policy: str, n: int, buf: np.ndarray) -> float:
    """Mean ms per one-block unhinted save into a tier of ``n`` blocks all held by live hints."""
    ns = Namespace(model="bench", dtype="u8", chunk_tokens=1, salt=f"scale-{policy}-{n}")
    keys = ns.chunk_keys(np.arange(n + SCALE_SAVES))
    config = {"tiers": [{"name": "t", "kind": "dram", "capacity": n * NBYTES, "eviction": policy}],
              "io_threads": 1}
    with Store.from_config(config) as store:
        for lo in range(0, n, 500):
            batch = keys[lo:min(lo + 500, n)]
            store.save(batch, [buf] * len(batch), hint=Hint(1e6)).result()
        t0 = time.perf_counter()
        for key in keys[n:]:
            store.save([key], [buf]).result()
        return (time.perf_counter() - t0) / SCALE_SAVES * 1e3


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
    scaling = [{"policy": policy, "hinted_blocks": n, "ms_per_unhinted_save": ms_per_unhinted_save(policy, n, buf)}
               for policy in SCALE_POLICIES for n in SCALES]
    print()
    print(f"ms per unhinted one-block save into a tier of N blocks all held by live hints ({SCALE_SAVES} saves)")
    print_table(["policy", *(f"N = {n:,}" for n in SCALES)],
                [[p, *(f"{r['ms_per_unhinted_save']:.2f}" for r in scaling if r["policy"] == p)]
                 for p in SCALE_POLICIES])
    write_json("hint_walk", {"blocks": BLOCKS, "capacity_blocks": CAPACITY, "batch": BATCH, "nbytes": NBYTES,
                             "rows": out, "scaling": scaling, "command": "python -m benchmarks.hint_walk"})


if __name__ == "__main__":
    main()
