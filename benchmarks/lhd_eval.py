"""Does learned hit density per block class (LHD, ``benchmarks/_lhd.py``) beat LRU at small caches?

Issue 22 asks for one policy that beats LRU at small caches, or none: ship LHD only if it
beats LRU at 1% of the distinct blocks on both the production conversation trace and a
second synthetic trace with other statistics (``policy_replay.SECOND_TRACE``), and does
not lose at 5% and 25%. Lineage (the shipped prefix-aware policy) and Belady are beside
it. Same replay model as ``policy_replay.py`` (prefix hits, block-counted capacity).

Usage: ``python -m benchmarks.lhd_eval [--requests N]``; writes
``benchmarks/results/lhd_eval.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Sequence

from benchmarks._lhd import LhdPolicy
from benchmarks.policy_replay import DEFAULT_OUT, DEFAULT_TRACE, SECOND_TRACE, _evict_one, load_trace, synthetic_trace
from kvstore._replay import Trace, belady, to_keys
from kvstore.policies.base import EvictionPolicy
from kvstore.policies.lineage import LineagePolicy
from kvstore.policies.lru import LruPolicy

POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LruPolicy, "lhd": LhdPolicy, "lineage": LineagePolicy}
FRACTIONS = (0.01, 0.05, 0.25)


def replay(policy: EvictionPolicy, trace: Trace, capacity_blocks: int) -> float:
    """``policy_replay.replay`` for a policy object (one not registered by name)."""
    policy.set_capacity(capacity_blocks)
    held: set = set()
    hits = refs = 0
    for keys in trace:
        refs += len(keys)
        hit = 0
        while hit < len(keys) and keys[hit] in held:
            policy.on_access(keys[hit])
            hit += 1
        hits += hit
        parent = keys[hit - 1] if hit else None
        for key in keys[hit:]:
            if key in held:
                policy.on_access(key)
            else:
                while len(held) >= capacity_blocks:
                    _evict_one(policy, held)
                policy.on_insert(key, 1, parent)
                held.add(key)
            parent = key
    return hits / refs if refs else 0.0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="the production trace (JSONL)")
    parser.add_argument("--requests", type=int, default=12000, help="requests per trace (default 12000)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the synthetic trace")
    args = parser.parse_args(argv)
    traces = {"conversation": load_trace(args.trace, args.requests),
              "synthetic2": synthetic_trace(args.seed, args.requests, **SECOND_TRACE)}
    rows = []
    for name, requests in traces.items():
        trace = to_keys(requests)
        distinct = len({key for keys in trace for key in keys})
        for fraction in FRACTIONS:
            capacity = max(1, int(distinct * fraction))
            row = {"trace": name, "capacity_fraction": fraction, "capacity_blocks": capacity,
                   **{p: replay(make(), trace, capacity) for p, make in POLICIES.items()},
                   "belady": belady(trace, capacity)}
            rows.append(row)
            print(f"{name:<13}{fraction:>5.0%}  " + "  ".join(
                f"{p} {row[p]:6.2%} ({row[p] / row['lru']:4.2f}x)" for p in POLICIES) + f"  belady {row['belady']:6.2%}",
                flush=True)
    ships = all(r["lhd"] > r["lru"] for r in rows if r["capacity_fraction"] == 0.01) and all(
        r["lhd"] >= r["lru"] for r in rows if r["capacity_fraction"] > 0.01)
    print("LHD " + ("meets" if ships else "does not meet") + " the bar (beats LRU at 1% on both traces, "
          "no loss at 5%/25%)")
    DEFAULT_OUT.mkdir(parents=True, exist_ok=True)
    (DEFAULT_OUT / "lhd_eval.json").write_text(json.dumps(
        {"command": " ".join(["python", "-m", "benchmarks.lhd_eval", *(argv or sys.argv[1:])]),
         "second_trace": SECOND_TRACE, "rows": rows, "lhd_ships": ships}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
