"""Tiers on distributed engines against those engines' own clients, and cross-node hits
through each shared path, side by side in one run (issue 21, "Measured").

    python -m benchmarks.cluster [--paths redis,mooncake] [--cross remote,redis,mooncake,s3]
                                 [--block-kib 1024] [--blocks 64] [--repeat 7] [--cross-repeat 20]

Ratio table: each path contributes rows of one batch put and got through the kvstore
tier and through the raw client on the same server or pool.

Paths (each a ``rows`` function returning a list of dicts with ``path, op, block_bytes,
blocks, kvstore_gbps, baseline, baseline_gbps, ratio``; add a path by adding one):
- ``redis``: the redis tier vs raw redis-py pipelines, standalone and a 3-master Cluster
  (``benchmarks/_cluster_redis.py``; needs redis-server, scripts/deps/25-redis.sh);
- ``mooncake``: the mooncake tier vs Mooncake's Python client on one pool
  (``benchmarks/_cluster_mooncake.py``; needs the Mooncake wheel).

Target: ratio (raw time / tier time) >= 0.9 for every row.

The mooncake path also prices the block format with Mooncake's client alone (rows with
``raw_framed_gbps``, printed as their own table and kept as ``mooncake_format_cost``,
no target): its put of the same payloads 64 bytes longer, in one piece and as two
pieces (header, payload), against its plain put.

Cross-node table (``benchmarks/_cluster_cross.py``): a batch saved on node A and read,
verified, on node B through the remote tier (A's server over TCP), a 3-master Redis
Cluster, a Mooncake pool and S3 on Swift: GB/s and p50/p99 per batch.

Prints both tables and writes benchmarks/results/cluster.json and cluster.png (the
cross-node table). Every server is started and stopped here, on loopback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._common import RESULTS, print_table, write_json  # noqa: E402


def _redis(block_bytes: int, blocks: int, repeat: int) -> list[dict]:
    from benchmarks._cluster_redis import redis_rows

    return redis_rows(block_bytes, blocks, repeat)


def _mooncake(block_bytes: int, blocks: int, repeat: int) -> list[dict]:
    from benchmarks._cluster_mooncake import mooncake_rows
    from tests._mooncake import missing

    if missing():
        raise ImportError(missing())

    return mooncake_rows(block_bytes, blocks, repeat)


PATHS = {"redis": _redis, "mooncake": _mooncake}
CROSS = ("remote", "redis", "mooncake", "s3")
TARGET = 0.9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paths", default="redis,mooncake", help="comma-separated: " + ", ".join(PATHS))
    ap.add_argument("--block-kib", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--cross", default=",".join(CROSS), help="cross-node paths (empty: none): " + ", ".join(CROSS))
    ap.add_argument("--cross-repeat", type=int, default=20, help="timed batches per cross-node path")
    args = ap.parse_args(argv)
    rows: list[dict] = []
    skipped: dict[str, str] = {}
    for name in filter(None, args.paths.split(",")):
        if name not in PATHS:
            ap.error(f"unknown path {name!r}; choose from {', '.join(PATHS)}")
        try:
            rows += PATHS[name](args.block_kib << 10, args.blocks, args.repeat)
        except ImportError as exc:   # a peer that is not installed here: said, never silent
            skipped[name] = f"{type(exc).__name__}: {exc}"
            print(f"{name}: skipped ({skipped[name]})")
    format_cost = [r for r in rows if "raw_framed_gbps" in r]   # raw vs raw: no target
    rows = [r for r in rows if "raw_framed_gbps" not in r]
    if rows:
        print_table(["path", "op", "kvstore GB/s", "baseline", "baseline GB/s", "ratio", "target"],
                    [[r["path"], r["op"], r["kvstore_gbps"], r["baseline"], r["baseline_gbps"], r["ratio"],
                      "ok" if r["ratio"] >= TARGET else f"< {TARGET}"] for r in rows])
    if format_cost:
        print()
        print("the block format's cost in Mooncake (its own client alone, vs its plain put of the same payloads)")
        print_table(["op", "raw, 64 B longer GB/s", "raw plain GB/s", "ratio"],
                    [[r["op"], r["raw_framed_gbps"], r["raw_gbps"], r["ratio"]] for r in format_cost])
    cross: list[dict] = []
    cross_skipped: dict[str, str] = {}
    wanted = [p for p in args.cross.split(",") if p]
    for name in wanted:
        if name not in CROSS:
            ap.error(f"unknown cross-node path {name!r}; choose from {', '.join(CROSS)}")
    if wanted:
        from benchmarks._cluster_cross import cross_rows, plot

        cross, cross_skipped = cross_rows(wanted, args.block_kib << 10, args.blocks, args.cross_repeat)
        print()
        print(f"cross-node hit: {args.blocks} x {args.block_kib} KiB saved on node A, read (verified) on node B")
        if cross:
            print_table(["path", "GB/s", "p50 ms", "p99 ms", "batches"],
                        [[r["path"], r["gbps"], r["p50_ms"], r["p99_ms"], r["batches"]] for r in cross])
            plot(cross, RESULTS / "cluster.png")
            print(f"wrote {RESULTS / 'cluster.png'}")
    path = write_json("cluster", {"command": "python -m benchmarks.cluster " + " ".join(argv or sys.argv[1:]),
                                  "target_ratio": TARGET, "rows": rows, "skipped": skipped,
                                  "mooncake_format_cost": format_cost,
                                  "cross_node": cross, "cross_skipped": cross_skipped})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
