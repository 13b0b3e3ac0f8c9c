"""Seeded prefix-cache traces in the format of ``shared/traces/conversation_trace.jsonl``,
with statistics unlike it, to check that a policy or hint rule holds on traffic it was
not tuned on.

    python -m benchmarks.trace_gen single-turn --seed 1 --out /tmp/single_turn.jsonl
    python -m benchmarks.trace_gen agent --seed 1 --out /tmp/agent.jsonl

One JSON object per line, as in the conversation trace: ``timestamp`` (arrival, ms from
the start, non-decreasing), ``input_length`` and ``output_length`` (tokens),
``hash_ids`` (one id per 512-token block; equal ids are equal blocks and an id always
has the same parent id, so the ids of a request form a path in one prefix tree). As in
the real trace a request's last block is partial: a later turn of the same session
re-hashes it with its new tokens (its ids are the previous request's minus the last,
then new ones), so a continuation reads up to the previous request's last full block.

Two workloads (:data:`WORKLOADS`):

``single-turn`` (mostly one-off chat/API calls, long gaps), about an hour:
  - 3,600 requests, arrivals a Poisson process (mean gap 1 s);
  - every request starts with one of 24 shared system prompts of 2-12 blocks, chosen
    by Zipf popularity (s = 1.2), then 1-8 blocks of its own;
  - 12% of requests come back once or more (a second turn), after an exponential
    think time of mean 600 s, adding 1-6 blocks; a returning session comes back
    again with probability 0.3.

``agent`` (agent loops: short gaps, long shared prefixes), 30 minutes:
  - sessions start as a Poisson process (mean gap 3 s);
  - each picks one of 6 agents, whose prefix (system prompt + tool definitions) is
    8-24 blocks, and adds a task of 1-4 blocks;
  - a session then loops: each step returns after an exponential gap of mean 4 s
    (tool call + model time), or for 30% of steps of mean 200 s (a slow tool, a
    human in the loop), and appends 1-3 blocks (tool output, next call) to its
    previous request; it runs 2-12 steps (uniform); 15% of sessions branch once,
    the branch restarting from the task (same agent prefix and task, new blocks).

Requests are emitted in arrival order, ties broken by creation order. Deterministic
for a seed (``random.Random(seed)``, nothing else). :func:`stats` gives the figures
the tests check: share of requests that continue an earlier one, mean gap, blocks per
request, share of block references that fall in a shared prefix.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

BLOCK_TOKENS = 512
VERSION = 2            # bumped whenever a workload changes (the cache file names carry it)


def _new_ids(counter: list[int], n: int) -> list[int]:
    start = counter[0]
    counter[0] += n
    return list(range(start, start + n))


def _input_length(rng: random.Random, blocks: int) -> int:
    """Tokens of a request of ``blocks`` blocks, its last one partial."""
    return (blocks - 1) * BLOCK_TOKENS + rng.randint(1, BLOCK_TOKENS)


def _emit(events: list, rng: random.Random) -> list[dict[str, Any]]:
    out = []
    for t_s, _, ids in sorted(events, key=lambda e: (e[0], e[1])):
        out.append({"timestamp": int(round(t_s * 1000)), "input_length": _input_length(rng, len(ids)),
                    "output_length": rng.randint(1, 800), "hash_ids": ids})
    return out


def single_turn(seed: int, num_requests: int = 3600, *, mean_gap_s: float = 1.0, num_prompts: int = 24,
                zipf_s: float = 1.2, return_p: float = 0.12, again_p: float = 0.3,
                think_mean_s: float = 600.0) -> list[dict[str, Any]]:
    """Mostly single-turn requests with long gaps and shared system prompts (see the
    module docstring)."""
    rng = random.Random(seed)
    counter = [0]
    prompts = [_new_ids(counter, rng.randint(2, 12)) for _ in range(num_prompts)]
    weights = [1.0 / rank ** zipf_s for rank in range(1, num_prompts + 1)]
    events: list = []
    pending: list[tuple[float, int, list[int]]] = []   # (due, tiebreak, previous ids)
    order = 0
    t = 0.0
    while len(events) < num_requests:
        t += rng.expovariate(1.0 / mean_gap_s)
        while pending and pending[0][0] <= t and len(events) < num_requests:
            due, _, previous = heapq.heappop(pending)
            ids = previous[:-1] + _new_ids(counter, 1 + rng.randint(1, 6))
            events.append((due, order, ids))
            order += 1
            if rng.random() < again_p:
                heapq.heappush(pending, (due + rng.expovariate(1.0 / think_mean_s), order, ids))
        if len(events) >= num_requests:
            break
        ids = rng.choices(prompts, weights)[0] + _new_ids(counter, rng.randint(1, 8))
        events.append((t, order, ids))
        order += 1
        if rng.random() < return_p:
            heapq.heappush(pending, (t + rng.expovariate(1.0 / think_mean_s), order, ids))
    return _emit(events, rng)


def agent(seed: int, duration_s: float = 1800.0, *, session_gap_s: float = 3.0, num_agents: int = 6,
          step_gap_s: float = 4.0, max_steps: int = 12, branch_p: float = 0.15,
          slow_p: float = 0.3, slow_gap_s: float = 200.0) -> list[dict[str, Any]]:
    """Agent loops with short gaps and long shared prefixes (see the module docstring)."""
    rng = random.Random(seed)
    counter = [0]
    agents = [_new_ids(counter, rng.randint(8, 24)) for _ in range(num_agents)]
    events: list = []
    order = 0
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / session_gap_s)
        if t >= duration_s:
            break
        base = rng.choice(agents) + _new_ids(counter, rng.randint(1, 4))
        branches = [base + _new_ids(counter, 1)]
        if rng.random() < branch_p:
            branches.append(base + _new_ids(counter, 1))
        start = t
        for ids in branches:
            at = start
            steps = rng.randint(2, max_steps)
            for _ in range(steps):
                events.append((at, order, ids))
                order += 1
                at += rng.expovariate(1.0 / (slow_gap_s if rng.random() < slow_p else step_gap_s))
                ids = ids[:-1] + _new_ids(counter, 1 + rng.randint(1, 3))
            start = at
    return _emit(events, rng)


WORKLOADS: dict[str, Callable[[int], list[dict[str, Any]]]] = {"single-turn": single_turn, "agent": agent}


def stats(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """``continuing_share``: requests whose last full block (the one before the last,
    partial one) a later request reads again, the truth a hinting client predicts
    (``benchmarks/_policy_hints.continues``); ``mean_gap_s``: between arrivals;
    ``blocks_per_request``; ``shared_share``: block references to blocks that more than
    one request holds; ``distinct_blocks``; ``requests``."""
    later: set[int] = set()
    continuing = 0
    for record in reversed(records):
        ids = record["hash_ids"]
        continuing += ids[-2 if len(ids) >= 2 else -1] in later
        later.update(ids)
    counts: dict[int, int] = {}
    for record in records:
        for i in record["hash_ids"]:
            counts[i] = counts.get(i, 0) + 1
    times = [r["timestamp"] / 1000 for r in records]
    refs = sum(len(r["hash_ids"]) for r in records)
    n = len(records)
    return {"requests": n, "distinct_blocks": len(counts),
            "continuing_share": continuing / n if n else 0.0,
            "mean_gap_s": (times[-1] - times[0]) / (n - 1) if n > 1 else 0.0,
            "blocks_per_request": refs / n if n else 0.0,
            "shared_share": sum(c for c in counts.values() if c > 1) / refs if refs else 0.0}


def write(records: Sequence[dict[str, Any]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as out:
        for record in records:
            out.write(json.dumps(record) + "\n")
    return path


def cached(name: str, seed: int = 1, directory: Path | None = None) -> Path:
    """The ``name`` workload at ``seed`` as a JSONL file in ``directory`` (default: the
    system temp dir), generated on first use."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    directory = directory or Path(tempfile.gettempdir()) / "kvstore-traces"
    path = directory / f"{name}-v{VERSION}-seed{seed}.jsonl"
    if not path.exists():
        tmp = write(WORKLOADS[name](seed), path.with_suffix(".tmp"))
        tmp.replace(path)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", choices=list(WORKLOADS))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    args = parser.parse_args(argv)
    records = WORKLOADS[args.workload](args.seed)
    write(records, args.out)
    print(json.dumps({"workload": args.workload, "seed": args.seed, **stats(records)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
