"""``policy_replay.py --hints``: what client retention hints are worth, through a real Store.

A client that knows its conversation continues (a chat session still open) says so with
``Hint(retain_s=…)`` on the request's lookup and save. Here the client is simulated at a
given precision and recall against the trace's truth: a request's conversation
*continues* when its last full block (the one before its last, partial block) is asked
for again by a later request. Of the requests that continue, a share ``recall`` is
hinted; then requests that do not continue are hinted too until ``precision`` of all
hints are right. ``precision 0.3`` is a bad client: most of what it asks to keep is
never used again; so is one that hints every request (the last column).

A hint covers the request's blocks up to its last full block (``scope="full-blocks"``,
the default): the trace's last block of a request is partial, and the next turn
re-hashes it with the new tokens, so a continuation never reads it again, and an engine
hashes and saves only full blocks, so its hint never covers a partial one.
``scope="request"`` hints every block of the request, the last partial one too (what
this benchmark did before; kept to compare).

Every run replays the trace through a real :class:`~kvstore.store.Store` (one DRAM tier
of LRU, the Store's hint ordering and its feedback on top: ``policies/retention.py``),
its clock following the trace's timestamps so hints expire as they would have. LRU
without hints and Belady's optimum are beside it. Each hinted cell also records the
tier's ``hint_trust`` at the end of the replay (``protect_s``: ``None`` = hints protect
in full; a number = hints protect only until that old).
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
ACCURACIES = ((1.0, 1.0), (1.0, 0.8), (0.8, 0.8), (0.6, 0.6), (0.3, 0.5), (0.0, 1.0))
FRACTIONS = (0.01, 0.05, 0.25)
SCOPES = ("full-blocks", "request")


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


def hint_scope(trace: Trace, scope: str) -> list[int] | None:
    """How many leading blocks of each request its hint covers (``None``: all)."""
    if scope not in SCOPES:
        raise ValueError(f"unknown hint scope {scope!r}; choose one of {', '.join(SCOPES)}")
    if scope == "request":
        return None
    return [len(keys) - 1 if len(keys) >= 2 else len(keys) for keys in trace]


WRONG = (0.3, 0.5)   # the wrong-hint client, replayed at every seed in ``wrong_seeds`` too
# the target pair: the P0.8/R0.8 client keeps >= 75% of the never-wrong client's gain
NEAR, EXACT = (0.8, 0.8), (1.0, 0.8)


def run_hints(requests: list[list[int]], times: list[float], retain_s: float, seed: int,
              fractions: Sequence[float] = FRACTIONS, scope: str = "full-blocks",
              wrong_seeds: Sequence[int] = ()) -> dict:
    """Every client of :data:`ACCURACIES` at ``seed``, beside LRU and Belady, per cache
    size; the wrong-hint client again at each of ``wrong_seeds`` (how much its figure
    moves with the draw of which requests it hints: the noise around LRU)."""
    trace = to_keys(requests)
    distinct = len({key for keys in trace for key in keys})
    truth = continues(trace)
    hint = Hint(retain_s=retain_s)
    blocks = hint_scope(trace, scope)
    results = {"requests": len(trace), "distinct_blocks": distinct, "retain_s": retain_s,
               "hint_scope": scope, "seed": seed, "continuing_share": sum(truth) / len(truth), "rows": []}
    for fraction in fractions:
        capacity = max(1, int(distinct * fraction))
        config = {"tiers": [{"name": "replay", "kind": "dram", "capacity": capacity * PAYLOAD_BYTES,
                             "eviction": "lru"}], "io_threads": 1}
        row = {"capacity_fraction": fraction, "capacity_blocks": capacity,
               "lru": replay_store(config, trace).hit_rate, "belady": belady(trace, capacity), "hinted": []}
        for precision, recall in ACCURACIES:
            hinted, got_precision, got_recall = simulate(truth, precision, recall, seed)
            got = replay_store(config, trace, hints=[hint if h else None for h in hinted], times_s=times,
                               hint_blocks=blocks)
            rate = got.hit_rate
            row["hinted"].append({"precision": precision, "recall": recall, "achieved_precision": got_precision,
                                  "achieved_recall": got_recall, "prefix_hit_rate": rate,
                                  "hint_trust": got.tier_hint_trust[0]})
            print(f"  {fraction:>4.0%} P={precision} R={recall}: {rate:6.2%} (LRU {row['lru']:6.2%})",
                  file=sys.stderr, flush=True)
        row["wrong_hints_by_seed"] = [{"seed": seed, "prefix_hit_rate": next(
            h["prefix_hit_rate"] for h in row["hinted"] if (h["precision"], h["recall"]) == WRONG)}]
        for other in wrong_seeds:
            hinted, _, _ = simulate(truth, *WRONG, other)
            got = replay_store(config, trace, hints=[hint if h else None for h in hinted], times_s=times,
                               hint_blocks=blocks)
            row["wrong_hints_by_seed"].append({"seed": other, "prefix_hit_rate": got.hit_rate})
            print(f"  {fraction:>4.0%} P={WRONG[0]} R={WRONG[1]} seed {other}: {got.hit_rate:6.2%}",
                  file=sys.stderr, flush=True)
        results["rows"].append(row)
    return results


def hints_table(results: dict) -> str:
    head = f"{'cache':>6}{'LRU':>9}{'Belady':>9}" + "".join(
        f"{f'P{h[0]:g}/R{h[1]:g}' if h[0] else 'hint all':>18}" for h in ACCURACIES)
    lines = [f"{results['requests']} requests, {results['distinct_blocks']} distinct blocks, "
             f"{results['continuing_share']:.0%} continue; hint retain_s={results['retain_s']:g}, "
             f"scope {results.get('hint_scope', 'request')}, client seed {results.get('seed', 1)}; "
             "each cell: hit rate (x LRU)", head, "-" * len(head)]
    for row in results["rows"]:
        cells = "".join(f"{h['prefix_hit_rate']:>9.2%} ({h['prefix_hit_rate'] / row['lru']:4.2f}x)"
                        if row["lru"] else f"{h['prefix_hit_rate']:>18.2%}" for h in row["hinted"])
        lines.append(f"{row['capacity_fraction']:>6.0%}{row['lru']:>9.2%}{row['belady']:>9.2%}{cells}")
    seeds = [row.get("wrong_hints_by_seed", []) for row in results["rows"]]
    if any(len(s) > 1 for s in seeds):
        lines.append(f"wrong hints (P{WRONG[0]:g}/R{WRONG[1]:g}) by client seed "
                     f"{', '.join(str(e['seed']) for e in seeds[0])}, x LRU: " + "; ".join(
                         f"{row['capacity_fraction']:.0%} " + " ".join(
                             f"{e['prefix_hit_rate'] / row['lru']:.3f}" for e in s) if row["lru"] else ""
                         for row, s in zip(results["rows"], seeds)))
    for row in results["rows"]:
        if not row["lru"]:
            continue
        rate = {(h["precision"], h["recall"]): h["prefix_hit_rate"] for h in row["hinted"]}
        gain = rate[EXACT] - row["lru"]
        kept = (rate[NEAR] - row["lru"]) / gain if gain > 0 else float("nan")
        worst = min(e["prefix_hit_rate"] for e in row["wrong_hints_by_seed"]) / row["lru"]
        lines.append(f"{row['capacity_fraction']:>6.0%}: P0.8/R0.8 keeps {kept:.0%} of the P1/R0.8 gain over LRU "
                     f"(target >= 75%); wrong hints worst of {len(row['wrong_hints_by_seed'])} seeds "
                     f"{worst:.3f}x LRU (target >= 0.995)")
    return "\n".join(lines)
