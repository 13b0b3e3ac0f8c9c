"""What retention hints cost the eviction walk, per policy.

    python -m benchmarks.hint_walk

Saves 8,192 distinct 4 KiB blocks, 16 per call, into a one-tier DRAM Store of 1,024
blocks, with 0 % (the baseline, same run), 25 % and 50 % of the calls hinted
(``Hint(retain_s=1e6)``: the hinted blocks stay live and pile up at the eviction end).
A victim walk steps over the live-hinted blocks ahead of the first unhinted one
(``policies/retention.py``), so this is the steady state that costs most.
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
    write_json("hint_walk", {"blocks": BLOCKS, "capacity_blocks": CAPACITY, "batch": BATCH, "nbytes": NBYTES,
                             "rows": out, "command": "python -m benchmarks.hint_walk"})


if __name__ == "__main__":
    main()
