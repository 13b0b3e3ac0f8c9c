"""``policy_replay.py --hints``: what client retention hints are worth, through a real Store.

A client that knows its conversation continues (a chat session still open) says so with
``Hint(retain_s=…)`` on the request's lookup and save. Here the client is simulated at a
given precision and recall against the trace's truth: a request's conversation
*continues* when its last full block (the one before its last, partial block) is asked
for again by a later request. Of the requests that continue, a share ``recall`` is
hinted; then requests that do not continue are hinted too until ``precision`` of all
hints are right. ``precision 0.3`` is a bad client: most of what it asks to keep is
never used again; so is one that hints every request (the last column).

Every run replays the trace through a real :class:`~kvstore.store.Store` (one DRAM tier
of LRU, the Store's hint ordering on top), its clock following the trace's timestamps so
hints expire as they would have. LRU without hints and Belady's optimum are beside it.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Sequence

from kvstore import Hint
from kvstore._replay import PAYLOAD_BYTES, Trace, belady, replay_store, to_keys

# (precision, recall); precision 0 stands for a client that hints every request (its
# precision is the share of requests that continue). Precision 0.3 needs a recall low
# enough that the requests which do not continue can make up 70% of the hints.
ACCURACIES = ((1.0, 1.0), (0.8, 0.8), (0.6, 0.6), (0.3, 0.5), (0.0, 1.0))
FRACTIONS = (0.01, 0.05, 0.25)


def load_timed_trace(path: Path, max_requests: int | None) -> tuple[list[list[int]], list[float]]:
    """``hash_ids`` and arrival time in seconds of each request."""
    requests, times = [], []
    with open(path) as lines:
        for line in lines:
            if max_requests is not None and len(requests) >= max_requests:
                break
            if line.strip():
                record = json.loads(line)
                requests.append(record["hash_ids"])
                times.append(record.get("timestamp", 0) / 1000)
    return requests, times


def continues(trace: Trace) -> list[bool]:
    """Whether each request's last full block is referenced again later."""
    later: set = set()
    out = [False] * len(trace)
    for index in range(len(trace) - 1, -1, -1):
        keys = trace[index]
        out[index] = keys[-2 if len(keys) >= 2 else -1] in later
        later.update(keys)
    return out


def simulate(truth: Sequence[bool], precision: float, recall: float, seed: int) -> tuple[list[bool], float, float]:
    """Which requests a client of this precision and recall hints, and the precision and
    recall it reached (precision is capped by how many requests do not continue)."""
    if precision <= 0:
        share = sum(truth) / len(truth) if truth else 1.0
        return [True] * len(truth), share, 1.0
    rng = random.Random(seed)
    positives = [i for i, t in enumerate(truth) if t]
    negatives = [i for i, t in enumerate(truth) if not t]
    right = [i for i in positives if rng.random() < recall]
    wrong = rng.sample(negatives, min(len(negatives), round(len(right) * (1 - precision) / precision)))
    hinted = [False] * len(truth)
    for i in right + wrong:
        hinted[i] = True
    given = len(right) + len(wrong)
    return hinted, (len(right) / given if given else 1.0), (len(right) / len(positives) if positives else 1.0)


def run_hints(requests: list[list[int]], times: list[float], retain_s: float, seed: int,
              fractions: Sequence[float] = FRACTIONS) -> dict:
    trace = to_keys(requests)
    distinct = len({key for keys in trace for key in keys})
    truth = continues(trace)
    hint = Hint(retain_s=retain_s)
    results = {"requests": len(trace), "distinct_blocks": distinct, "retain_s": retain_s,
               "continuing_share": sum(truth) / len(truth), "rows": []}
    for fraction in fractions:
        capacity = max(1, int(distinct * fraction))
        config = {"tiers": [{"name": "replay", "kind": "dram", "capacity": capacity * PAYLOAD_BYTES,
                             "eviction": "lru"}], "io_threads": 1}
        row = {"capacity_fraction": fraction, "capacity_blocks": capacity,
               "lru": replay_store(config, trace).hit_rate, "belady": belady(trace, capacity), "hinted": []}
        for precision, recall in ACCURACIES:
            hinted, got_precision, got_recall = simulate(truth, precision, recall, seed)
            rate = replay_store(config, trace, hints=[hint if h else None for h in hinted], times_s=times).hit_rate
            row["hinted"].append({"precision": precision, "recall": recall, "achieved_precision": got_precision,
                                  "achieved_recall": got_recall, "prefix_hit_rate": rate})
            print(f"  {fraction:>4.0%} P={precision} R={recall}: {rate:6.2%} (LRU {row['lru']:6.2%})",
                  file=sys.stderr, flush=True)
        results["rows"].append(row)
    return results


def hints_table(results: dict) -> str:
    head = f"{'cache':>6}{'LRU':>9}{'Belady':>9}" + "".join(
        f"{f'P{h[0]:g}/R{h[1]:g}' if h[0] else 'hint all':>18}" for h in ACCURACIES)
    lines = [f"{results['requests']} requests, {results['distinct_blocks']} distinct blocks, "
             f"{results['continuing_share']:.0%} continue; hint retain_s={results['retain_s']:g}; "
             "each cell: hit rate (x LRU)", head, "-" * len(head)]
    for row in results["rows"]:
        cells = "".join(f"{h['prefix_hit_rate']:>9.2%} ({h['prefix_hit_rate'] / row['lru']:4.2f}x)"
                        if row["lru"] else f"{h['prefix_hit_rate']:>18.2%}" for h in row["hinted"])
        lines.append(f"{row['capacity_fraction']:>6.0%}{row['lru']:>9.2%}{row['belady']:>9.2%}{cells}")
    return "\n".join(lines)
