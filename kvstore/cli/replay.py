"""``kvstore replay TRACE... --config FILE``: what would another policy, admission
setting or capacity have done with this traffic?

Replays a prefix-hash trace (one recorded by the Store's ``trace:`` section, or the
public format) through the real Store code against every eviction policy, admission
setting and tier capacity ×0.5/×1/×2/×4 of the config, one change at a time (see
:mod:`kvstore._replay_plan`), with Belady's offline optimum at each total capacity for
reference. Prints one table (prefix hit rate per tier, bytes written per tier), writes
a PNG (when matplotlib is installed) and ends with the change it recommends and the
gain it expects.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from tqdm import tqdm

from kvstore._extras import install_hint
from kvstore.errors import InvalidArgumentError

MAX_BLOCKS = 250_000   # distinct blocks a replay takes by default: about 1 GiB per replayed tier


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("replay", help="replay an access trace against policy, admission and capacity changes",
                            description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("traces", nargs="+", metavar="TRACE",
                        help="JSONL trace file(s), oldest first (a recorded path also reads its rotated files)")
    parser.add_argument("--config", help="YAML config (default: $KVSTORE_CONFIG or built-in)")
    parser.add_argument("--block-bytes", help="bytes per block (default: the block_bytes the trace recorded)")
    parser.add_argument("--limit", type=int, default=0,
                        help="replay only the first N trace lines (default 0: the whole trace)")
    parser.add_argument("--objective", default="hit",
                        help="what a recommended change must improve: 'hit' (default: prefix hit rate, or "
                             "a tenth fewer bytes written for under 0.1 point) or 'wear=W' (W points of hit "
                             "rate per 100%% change in a tier's bytes written; e.g. wear=1)")
    parser.add_argument("--max-blocks", type=int, default=MAX_BLOCKS,
                        help=f"refuse a trace of more distinct blocks than this (default {MAX_BLOCKS:,}; a "
                             "replay holds about 4 KiB per distinct block in each tier)")
    parser.add_argument("--policies", help="comma-separated eviction policies to try (default: all)")
    parser.add_argument("--png", default="kvstore-replay.png", help="where to write the chart ('' for none)")
    parser.add_argument("--json", dest="json_path", help="also write the figures as JSON here")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from kvstore._replay import belady, replay_store, to_keys
    from kvstore._replay_plan import Objective, recommend, replay_config, variants, why_not, yaml_change
    from kvstore.config import load_config, parse_size
    from kvstore.trace import read_trace, trace_files
    from kvstore.policies import EVICTION_NAMES

    try:
        objective = Objective.parse(args.objective)
    except ValueError as exc:
        raise InvalidArgumentError(f"--objective: {exc}") from None
    config = load_config(args.config)
    if args.limit < 0:
        raise InvalidArgumentError(f"--limit must be >= 0, got {args.limit}")
    policies = args.policies.split(",") if args.policies else list(EVICTION_NAMES)
    unknown = [p for p in policies if p not in EVICTION_NAMES]
    if unknown:
        raise InvalidArgumentError(f"--policies: unknown {', '.join(unknown)}; known: {', '.join(EVICTION_NAMES)}")
    if args.max_blocks < 1:
        raise InvalidArgumentError(f"--max-blocks must be >= 1, got {args.max_blocks}")
    paths = [f for trace in args.traces for f in trace_files(trace)]
    requests = _read(paths, args.limit or None, args.max_blocks, read_trace)
    if not any(not r.is_save and r.hash_ids for r in requests):
        raise InvalidArgumentError(f"trace {', '.join(args.traces)} holds no lookups to replay")
    block_bytes = _block_bytes(args.block_bytes, requests, parse_size)
    trace = to_keys([r.hash_ids for r in requests])
    saves = [r.is_save for r in requests]
    distinct = len({key for keys in trace for key in keys})
    if distinct > args.max_blocks:          # an id under two parents is two blocks
        raise _too_many(args.max_blocks, len(requests))

    tried = variants(config, block_bytes, policies)
    if not args.no_progress:
        print(f"replaying {len(requests)} trace lines through {len(tried)} configurations (and up to 3 "
              "combinations); the bar shows the time left", file=sys.stderr, flush=True)
    bar = tqdm(total=len(tried) * len(trace), unit="req", desc="replay", disable=args.no_progress,
               mininterval=0.5, file=sys.stderr,
               bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} requests [{elapsed}<{remaining} left, {rate_fmt}]")

    def replay(variant):
        return replay_store(replay_config(config, variant, distinct), trace, saves, bar.update)

    for variant in tried:
        variant.result = replay(variant)
    bar.total += 3 * len(trace)     # combinations the recommendation may replay
    best = recommend(config, tried, replay, objective)
    if best is not None:
        tried.append(best)
    bar.close()
    total_blocks = sum(s.capacity_blocks for s in tried[0].tiers)
    optimum = {scale: belady(trace, max(1, int(total_blocks * scale)), saves) for scale in (0.5, 1.0, 2.0, 4.0)}

    report = _report(config, tried, optimum, block_bytes, distinct, len(requests))
    print(_table(report))
    print()
    print(_advice(config, tried, best, block_bytes, yaml_change), flush=True)
    reasons = why_not(config, tried, best, objective)
    if reasons:
        print(f"\nNot recommended (--objective {objective}):")
        width = max(len(label) for label, _ in reasons)
        for label, reason in reasons:
            print(f"  {label:<{width}}  {reason}")
    report["objective"] = str(objective)
    report["not_recommended"] = [{"variant": label, "reason": reason} for label, reason in reasons]
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
    if args.png:
        _plot(report, args.png)
    return 0


def _read(paths, limit, max_blocks, read_trace) -> list:
    """The trace's lines, refused as soon as they name more than ``max_blocks`` distinct
    ids (before a replay would hold them all)."""
    requests, seen = [], set()
    for request in read_trace(paths, limit):
        seen.update(request.hash_ids)
        if len(seen) > max_blocks:
            raise _too_many(max_blocks, len(requests) + 1)
        requests.append(request)
    return requests


def _too_many(max_blocks: int, lines: int) -> InvalidArgumentError:
    return InvalidArgumentError(f"the trace names more than --max-blocks {max_blocks:,} distinct blocks (within its "
                                f"first {lines:,} lines); a replay holds about 4 KiB per distinct block in each "
                                "tier: replay fewer lines (--limit) or raise --max-blocks")


def _block_bytes(given: str | None, requests, parse_size) -> int:
    from kvstore.trace import MAX_BLOCK_BYTES

    if given is not None:
        try:
            size = parse_size(given)
        except ValueError as exc:
            raise InvalidArgumentError(f"--block-bytes: {exc}") from None
        if not 0 < size <= MAX_BLOCK_BYTES:
            raise InvalidArgumentError(f"--block-bytes must be positive and at most 1TiB, got {given!r}")
        return size
    recorded = [r.block_bytes for r in requests if r.block_bytes]
    if not recorded:
        raise InvalidArgumentError("the trace records no block sizes; give --block-bytes (e.g. 16MiB)")
    return int(statistics.median(recorded))


def _report(config, tried, optimum, block_bytes, distinct, lines) -> dict:
    names = [t.name for t in config.tiers]
    rows = []
    for v in tried:
        r = v.result
        rows.append({"variant": v.label, "kind": v.kind, "prefix_hit_rate": r.hit_rate,
                     "tier_hit_rates": dict(zip(names, r.tier_hit_rates())),
                     "tier_bytes_written": {n: w * block_bytes for n, w in zip(names, r.tier_blocks_written)},
                     "tier_capacity_blocks": {n: s.capacity_blocks for n, s in zip(names, v.tiers)}})
    return {"tiers": names, "block_bytes": block_bytes, "trace_lines": lines, "distinct_blocks": distinct,
            "block_refs": tried[0].result.refs, "rows": rows,
            "belady": {f"x{scale:g}": rate for scale, rate in optimum.items()}}


def _table(report: dict) -> str:
    names = report["tiers"]
    width = max(34, *(len(row["variant"]) + 1 for row in report["rows"]))
    head = (f"{'variant':<{width}}{'hit':>7}" + "".join(f"{'hit ' + n[:8]:>14}" for n in names)
            + "".join(f"{'GB to ' + n[:8]:>16}" for n in names))
    lines = [f"{report['trace_lines']} trace lines, {report['block_refs']} block references, "
             f"{report['distinct_blocks']} distinct blocks of {report['block_bytes']} bytes", head, "-" * len(head)]
    for row in report["rows"]:
        lines.append(f"{row['variant']:<{width}}{row['prefix_hit_rate']:>7.2%}"
                     + "".join(f"{row['tier_hit_rates'][n]:>14.2%}" for n in names)
                     + "".join(f"{row['tier_bytes_written'][n] / 1e9:>16.2f}" for n in names))
    lines.append("-" * len(head))
    lines.append("Belady (offline optimum, all tiers as one cache): "
                 + ", ".join(f"{k} {v:.2%}" for k, v in report["belady"].items()))
    return "\n".join(lines)


def _advice(config, tried, best, block_bytes, yaml_change) -> str:
    base = tried[0].result
    lines = []
    if best is None:
        lines.append(f"Recommendation: keep the configured policies and admission (prefix hit rate "
                     f"{base.hit_rate:.2%}); no eviction or admission change gained 0.1 point or cut writes.")
    else:
        r = best.result
        ratio = f", {r.hit_rate / base.hit_rate:.2f}x" if base.hit_rate else ""
        lines.append("Recommendation (same capacities):")
        lines.extend(f"  {line}" for line in yaml_change(config, best))
        lines.append(f"Expected: prefix hit rate {base.hit_rate:.2%} -> {r.hit_rate:.2%} "
                     f"({100 * (r.hit_rate - base.hit_rate):+.2f} points{ratio})")
        for i, tier in enumerate(config.tiers):
            before, after = base.tier_blocks_written[i], r.tier_blocks_written[i]
            if before != after:
                change = f" ({(after - before) / before:+.0%})" if before else ""
                lines.append(f"  bytes written to {tier.name}: {before * block_bytes / 1e9:.2f} GB -> "
                             f"{after * block_bytes / 1e9:.2f} GB{change}")
    grown = [v for v in tried if v.kind == "capacity" and v.label.endswith("x2")]
    if grown:
        lines.append("With twice the capacity (configured policies): " + ", ".join(
            f"{v.label.split(':')[0]} {100 * (v.result.hit_rate - base.hit_rate):+.2f} points" for v in grown))
    return "\n".join(lines)


def _plot(report: dict, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no chart ({install_hint('replay')})", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, names = report["rows"], report["tiers"]
    import textwrap

    labels = ["\n".join(textwrap.wrap(r["variant"], 44)) for r in rows]    # whole, never cut
    lines = sum(label.count("\n") + 1 for label in labels)
    figure, (hits, wear) = plt.subplots(1, 2, figsize=(15, 0.28 * lines + 2), sharey=True)
    left = [0.0] * len(rows)
    for name in names:
        values = [100 * r["tier_hit_rates"][name] for r in rows]
        hits.barh(labels, values, left=left, label=f"hits from {name}")
        left = [a + b for a, b in zip(left, values)]
    hits.axvline(100 * rows[0]["prefix_hit_rate"], color="black", linewidth=1, label="as configured")
    hits.axvline(100 * report["belady"]["x1"], color="red", linestyle="--", label="Belady (x1)")
    hits.set_xlabel("prefix hit rate (% of block references)")
    hits.invert_yaxis()
    hits.legend(fontsize=8)
    left = [0.0] * len(rows)
    for name in names:
        values = [r["tier_bytes_written"][name] / 1e9 for r in rows]
        wear.barh(labels, values, left=left, label=f"written to {name}")
        left = [a + b for a, b in zip(left, values)]
    wear.set_xlabel("GB written per tier (SSD wear)")
    wear.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    print(f"wrote {path}", file=sys.stderr)
