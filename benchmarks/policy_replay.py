"""Replay a prefix-cache trace through every eviction policy and Belady's optimum.

Each request's ``hash_ids`` become its token stream, one token per chunk, so the
chained keys of ``Namespace(model="trace", dtype="none", chunk_tokens=1)`` reproduce
the trace's prefix tree (every id stands for one 512-token block). For each request:
the prefix hit is the number of leading blocks held (a block is a hit only while every
block before it hit); hits are reported to the policy as accesses; then the missing
blocks are saved: a block already held counts as an access, a new block is inserted
after evicting the policy's first candidates until there is room. Capacity counts
blocks (payloads are tiny), as a fraction of the distinct blocks of the replayed trace.

This drives the policies through a small model of the Store's eviction loop (insert,
``victims()`` with nothing skipped, ``on_remove``). ``--through-store lru,lineage`` also
replays those policies through a real :class:`~kvstore.store.Store` (one DRAM tier of
``capacity × 4 KiB``; per request ``lookup``, ``load`` of the hit prefix, ``save`` of the
rest) and reports them as ``store:<name>`` beside the model, to show the two agree.

Belady's offline optimum for prefix hits runs in the same replay
(:func:`kvstore._replay.belady`, shared with ``kvstore replay``).

``--ttl-bound`` adds an offline estimate of how far any policy that ranks blocks only
by reference count and recency can get (see :func:`count_ttl_bound`).

``--hints`` replays instead LRU with simulated client retention hints ("this
conversation continues") at precision/recall 1.0/1.0, 1.0/0.8, 0.8/0.8, 0.6/0.6, a
wrong-hint client at precision 0.3 (at five client seeds: ``--seed`` and
``--wrong-seeds``) and one that hints everything, at 1%, 5% and 25% of the distinct
blocks, beside LRU and Belady (``benchmarks/_policy_hints.py``; ``--hint-scope`` picks
the blocks a hint covers; writes ``policy_replay_hints.json``), on ``--trace`` and on
the two generated traces of ``benchmarks/trace_gen.py`` (single-turn, agent; seeded by
``--trace-seed``, cached in the temp dir; ``--no-generated`` skips them). Each trace's
table ends with the two target figures: the share of the P1.0/R0.8 client's gain over
LRU that the P0.8/R0.8 client keeps, and the worst wrong-hint seed.

``--synthetic`` adds a seeded synthetic workload (Zipf-popular shared system prompts,
multi-turn conversations that extend their own previous prompt, one-off requests) to
show whether a policy's gain carries over to a trace it was not designed on.

Usage (from the repository root)::

    python benchmarks/policy_replay.py [--trace PATH] [--requests N] [--synthetic] [--ttl-bound]

Prints one table, writes ``benchmarks/results/policy_replay.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
import time
from pathlib import Path
from typing import Hashable, Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
if sys.path[:1] != [str(REPO_ROOT)]:
    sys.path.insert(0, str(REPO_ROOT))  # this checkout first, not an installed copy

from kvstore._replay import PAYLOAD_BYTES, belady, replay_store, to_keys  # noqa: E402
from kvstore.policies import EVICTION_NAMES, make_eviction  # noqa: E402

DEFAULT_TRACE = REPO_ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results"
CAPACITY_FRACTIONS = (0.01, 0.05, 0.10, 0.25)
BLOCK_NBYTES = 1

Trace = list[list[Hashable]]


def load_trace(path: Path, max_requests: int | None) -> list[list[int]]:
    """The ``hash_ids`` of each request, in arrival order."""
    requests = []
    with open(path) as lines:
        for line in lines:
            if max_requests is not None and len(requests) >= max_requests:
                break
            if line.strip():
                requests.append(json.loads(line)["hash_ids"])
    return requests


def replay(policy_name: str, trace: Trace, capacity_blocks: int) -> float:
    """Prefix hit rate (hit blocks / referenced blocks) of one policy."""
    policy = make_eviction(policy_name)
    policy.set_capacity(capacity_blocks * BLOCK_NBYTES)
    held: set[Hashable] = set()
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
                policy.on_insert(key, BLOCK_NBYTES, parent)
                held.add(key)
            parent = key
    return hits / refs if refs else 0.0


def replay_through_store(policy_name: str, trace: Trace, capacity_blocks: int) -> float:
    """Prefix hit rate of one policy driven through a real Store (one DRAM tier of
    ``capacity_blocks`` slots; see :func:`kvstore._replay.replay_store`)."""
    config = {"tiers": [{"name": "replay", "kind": "dram", "capacity": capacity_blocks * PAYLOAD_BYTES,
                         "eviction": policy_name}], "io_threads": 1}
    return replay_store(config, trace).hit_rate


def _evict_one(policy, held: set[Hashable]) -> None:
    for victim in policy.victims():
        if victim not in held:
            raise AssertionError(f"{policy.name} offered {victim!r}, which it does not hold")
        held.discard(victim)
        policy.on_remove(victim)
        return
    raise AssertionError(f"{policy.name} offered no victim while holding {len(held)} keys")


def count_ttl_bound(trace: Trace, capacity_blocks: int) -> float:
    """Offline estimate of the best prefix hit rate of policies that rank blocks only by
    reference count and time since last use, to tell how far such a policy can get.

    Blocks are split by reference count (1, 2, 3, 4 or more, counted over the whole
    history, as with an unbounded ghost) and each class keeps a block for a fixed time
    after its last use, the time chosen per class with full knowledge of the trace (a
    mix of two times where that helps) so that the average number of blocks held fits
    the capacity. A per-class TTL is what the best such policy amounts to when reuse
    is independent of load. Time is counted in requests; prefix contiguity is not
    modelled, so this is an estimate, not a proof.
    """
    import numpy as np

    count: dict[Hashable, int] = {}
    last_use: dict[Hashable, int] = {}
    gaps: dict[int, list[int]] = {c: [] for c in (1, 2, 3, 4)}
    for index, keys in enumerate(trace):
        for key in keys:
            if key in last_use:
                gaps[min(count[key], 4)].append(index - last_use[key])
            count[key] = count.get(key, 0) + 1
            last_use[key] = index
    tails: dict[int, list[int]] = {c: [] for c in (1, 2, 3, 4)}
    for key, index in last_use.items():
        tails[min(count[key], 4)].append(len(trace) - index)
    ttls = np.unique(np.geomspace(1, max(len(trace), 2), 200).astype(np.int64))
    slopes = []  # (hits per block-request, block-requests, hits) along each class's hull
    for cls in gaps:
        gap = np.sort(np.asarray(gaps[cls], dtype=np.float64))
        tail = np.sort(np.asarray(tails[cls], dtype=np.float64))
        gap_sums = np.concatenate(([0.0], np.cumsum(gap)))
        tail_sums = np.concatenate(([0.0], np.cumsum(tail)))
        hit_counts = np.searchsorted(gap, ttls, side="right")
        tail_counts = np.searchsorted(tail, ttls, side="right")
        costs = (gap_sums[hit_counts] + ttls * (len(gap) - hit_counts)
                 + tail_sums[tail_counts] + ttls * (len(tail) - tail_counts))
        hull = [(0.0, 0.0)]
        for point in zip(costs.tolist(), hit_counts.tolist()):
            while len(hull) >= 2 and ((hull[-1][1] - hull[-2][1]) * (point[0] - hull[-2][0])
                                      <= (point[1] - hull[-2][1]) * (hull[-1][0] - hull[-2][0])):
                hull.pop()
            hull.append(point)
        for (cost0, hits0), (cost1, hits1) in zip(hull, hull[1:]):
            if hits1 > hits0:
                slopes.append(((hits1 - hits0) / max(cost1 - cost0, 1e-9), cost1 - cost0, hits1 - hits0))
    budget, hits = float(capacity_blocks * len(trace)), 0.0
    for slope, cost, gained in sorted(slopes, reverse=True):
        take = min(1.0, budget / cost) if cost > 0 else 1.0
        hits += take * gained
        budget -= take * cost
        if budget <= 0:
            break
    refs = sum(map(len, trace))
    return hits / refs if refs else 0.0


def synthetic_trace(seed: int, num_requests: int = 12000, *, conversation_share: float = 0.45,
                    return_p: float = 0.6, think_mean: float = 400, zipf_s: float = 1.1,
                    num_prompts: int = 64) -> list[list[int]]:
    """A seeded conversation workload with the structure of the real one.

    - 64 shared system prompts of 1-8 blocks, chosen by Zipf popularity (s = 1.1);
    - 45% of arrivals open a conversation: prompt + 1-30 new blocks; each conversation
      then returns with probability 0.6 per turn, after an exponential think time
      (mean 400 arrivals), extending its previous request by 1-12 blocks. As in the
      real trace a request's last block is partial, so the next turn re-hashes it;
    - the other arrivals are one-off requests: prompt + 1-60 new blocks.

    The keyword arguments change those figures (:data:`SECOND_TRACE`: a workload with
    other statistics, to check a policy's gain is not tuned to one trace).
    """
    rng = random.Random(seed)
    next_id = iter(range(1, 1 << 62))
    prompt_ranks = range(1, num_prompts + 1)
    prompts = [[next(next_id) for _ in range(rng.randint(1, 8))] for _ in prompt_ranks]
    weights = [1.0 / rank ** zipf_s for rank in prompt_ranks]
    returning: list[tuple[float, int, list[int]]] = []  # (due arrival, tiebreak, ids)
    requests: list[list[int]] = []
    for arrival in range(num_requests):
        if returning and returning[0][0] <= arrival:
            _, _, previous = heapq.heappop(returning)
            ids = previous[:-1] + [next(next_id) for _ in range(1 + rng.randint(1, 12))]
        else:
            prompt = rng.choices(prompts, weights)[0]
            conversation = rng.random() < conversation_share
            length = rng.randint(1, 30) if conversation else rng.randint(1, 60)
            ids = [0] + prompt + [next(next_id) for _ in range(length)]
            if not conversation:
                requests.append(ids)
                continue
        requests.append(ids)
        if rng.random() < return_p:
            due = arrival + 1 + rng.expovariate(1 / think_mean)
            heapq.heappush(returning, (due, arrival, ids))
    return requests


# A second synthetic workload with other statistics: more, shorter-lived conversations
# that come back more often and sooner, and a flatter spread over four times the prompts.
SECOND_TRACE = {"conversation_share": 0.7, "return_p": 0.75, "think_mean": 120, "zipf_s": 0.8,
                "num_prompts": 256}


def run(traces: dict[str, list[list[int]]], policies: Sequence[str],
        fractions: Sequence[float], bounds: Sequence[str] = ("belady",)) -> dict:
    results = {"policies": list(policies), "bounds": list(bounds), "traces": {}, "rows": []}
    for trace_name, requests in traces.items():
        trace = to_keys(requests)
        distinct = len({key for keys in trace for key in keys})
        refs = sum(map(len, trace))
        results["traces"][trace_name] = {"requests": len(trace), "distinct_blocks": distinct,
                                         "block_refs": refs}
        for fraction in fractions:
            capacity = max(1, int(distinct * fraction))
            for name in [*policies, *bounds]:
                started = time.perf_counter()
                rate = (belady(trace, capacity) if name == "belady" else
                        count_ttl_bound(trace, capacity) if name == "ttl-cls" else
                        replay_through_store(name[6:], trace, capacity) if name.startswith("store:") else
                        replay(name, trace, capacity))
                results["rows"].append({
                    "trace": trace_name, "capacity_fraction": fraction, "capacity_blocks": capacity,
                    "policy": name, "prefix_hit_rate": rate,
                    "seconds": round(time.perf_counter() - started, 2)})
                print(f"  {trace_name} {fraction:>5.0%} {name:<8} {rate:6.2%}", file=sys.stderr, flush=True)
    return results


def table(results: dict) -> str:
    """One row per (trace, capacity): every policy's prefix hit rate and the bounds,
    then the best online policy's ratio to LRU and its share of Belady's rate."""
    policies = results["policies"]
    names = [*policies, *results["bounds"]]
    header = f"{'trace':<20}{'cache':>6}  " + "".join(f"{n:>8}" for n in names) + "   best/LRU  best/OPT"
    lines = [header, "-" * len(header)]
    cells: dict[tuple[str, float], dict[str, float]] = {}
    for row in results["rows"]:
        cells.setdefault((row["trace"], row["capacity_fraction"]), {})[row["policy"]] = row["prefix_hit_rate"]
    for (trace_name, fraction), rates in cells.items():
        online = {n: rates[n] for n in policies}
        best = max(online, key=online.get)
        lru = rates.get("lru")
        ratio = f"{online[best] / lru:5.2f}x" if lru else "   - "
        share = f"{online[best] / rates['belady']:6.0%}" if rates["belady"] else "    - "
        lines.append(f"{trace_name:<20}{fraction:>6.0%}  " + "".join(f"{rates[n]:>8.2%}" for n in names)
                     + f"   {ratio} {best:<8}{share}")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trace_names = list(results["traces"])
    figure, axes = plt.subplots(1, len(trace_names), figsize=(6.5 * len(trace_names), 4.5), squeeze=False)
    for axis, trace_name in zip(axes[0], trace_names):
        for name in [*results["policies"], *results["bounds"]]:
            rows = [r for r in results["rows"] if r["trace"] == trace_name and r["policy"] == name]
            axis.plot([100 * r["capacity_fraction"] for r in rows], [100 * r["prefix_hit_rate"] for r in rows],
                      marker="o", linestyle="--" if name in results["bounds"] else "-",
                      linewidth=2.5 if name == "lineage" else 1.2, label=name)
        axis.set_xscale("log")
        percents = sorted({100 * r["capacity_fraction"] for r in results["rows"]})
        axis.set_xticks(percents, [f"{p:g}" for p in percents])
        axis.minorticks_off()
        axis.set_xlabel("cache size (% of distinct blocks)")
        axis.set_ylabel("prefix hit rate (% of block references)")
        axis.set_title(trace_name)
        axis.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="JSONL trace with hash_ids")
    parser.add_argument("--requests", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--synthetic", action="store_true", help="also replay a seeded synthetic trace")
    parser.add_argument("--seed", type=int, default=1, help="seed of the synthetic trace")
    parser.add_argument("--policies", default=",".join(EVICTION_NAMES), help="comma-separated names")
    parser.add_argument("--capacities", default=None,
                        help="comma-separated fractions of the distinct blocks (default "
                             f"{','.join(map(str, CAPACITY_FRACTIONS))}; with --hints 0.01,0.05,0.25)")
    parser.add_argument("--ttl-bound", action="store_true",
                        help="also estimate the best count-and-recency policy (column ttl-cls)")
    parser.add_argument("--through-store", default="",
                        help="comma-separated policies to replay through a real Store as well")
    parser.add_argument("--hints", action="store_true",
                        help="instead: LRU with simulated client retention hints at several accuracies "
                             "(benchmarks/_policy_hints.py), through a real Store")
    parser.add_argument("--hint-retain-s", type=float, default=600.0,
                        help="the retain_s a hinting client sends (default 600)")
    parser.add_argument("--wrong-seeds", default="2,3,4,5",
                        help="with --hints: client seeds at which the wrong-hint client is replayed again "
                             "(comma-separated; default 2,3,4,5)")
    parser.add_argument("--no-generated", action="store_true",
                        help="with --hints: only --trace, not also the generated single-turn and agent "
                             "traces (benchmarks/trace_gen.py, cached in the temp dir)")
    parser.add_argument("--trace-seed", type=int, default=1,
                        help="with --hints: seed of the generated traces (default 1)")
    parser.add_argument("--hint-scope", choices=("full-blocks", "request"), default="full-blocks",
                        help="the blocks a hint covers: up to the request's last full block (default), "
                             "or every block of the request")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for JSON and PNG")
    args = parser.parse_args(argv)
    command = " ".join(["python", "-m", "benchmarks.policy_replay", *(argv or sys.argv[1:])])
    if args.hints:
        from benchmarks import trace_gen
        from benchmarks._policy_hints import hints_table, load_timed_trace, run_hints

        fractions = [float(f) for f in (args.capacities or "0.01,0.05,0.25").split(",") if f]
        paths = {} if args.no_generated else {
            name: trace_gen.cached(name, args.trace_seed) for name in trace_gen.WORKLOADS}
        paths[args.trace.stem] = args.trace
        everything = {"command": command, "traces": {}}
        for name, path in paths.items():
            requests, times = load_timed_trace(path, args.requests)
            print(f"{name} ({path}):", file=sys.stderr, flush=True)
            results = run_hints(requests, times, args.hint_retain_s, args.seed, fractions, args.hint_scope,
                                [int(x) for x in args.wrong_seeds.split(",") if x])
            results["path"] = str(path)
            everything["traces"][name] = results
            print(f"== {name}\n{hints_table(results)}", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "policy_replay_hints.json").write_text(json.dumps(everything, indent=2) + "\n")
        print(f"wrote {args.out / 'policy_replay_hints.json'}")
        return 0

    policies = [name for name in args.policies.split(",") if name]
    fractions = [float(f) for f in (args.capacities or ",".join(map(str, CAPACITY_FRACTIONS))).split(",") if f]
    traces = {args.trace.stem: load_trace(args.trace, args.requests)}
    if args.synthetic:
        traces["synthetic"] = synthetic_trace(args.seed, args.requests or 12000)

    bounds = ["belady", "ttl-cls"] if args.ttl_bound else ["belady"]
    bounds += [f"store:{name}" for name in args.through_store.split(",") if name]
    results = run(traces, policies, fractions, bounds)
    results["command"] = command
    print(table(results))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "policy_replay.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out / "policy_replay.png")
    print(f"wrote {args.out / 'policy_replay.json'} and {args.out / 'policy_replay.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
