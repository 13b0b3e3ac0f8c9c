"""The server soak of issues 20 and 34: a well-behaved client's p99 of 4 KiB GETs quiet
and under bounded attack loops together, and the server's RSS (see
``benchmarks/_server_soak.py``); then each attack loop alone (issue 20's and issue 34's,
``benchmarks/_soak_attacks.py``) beside a well-behaved tenant, one row per attack: its
GET p99 and success, its saves' success, new sessions and ``/healthz``
(``benchmarks/_server_soak_each.py``).

    python -m benchmarks.server_soak [--runs 3] [--attack-s 8] [--only flood,...] [--each-s 4]
                                     [--each-only trickle_puts,...] [--out NAME]

Writes ``benchmarks/results/server_soak.json`` (or ``NAME.json``): every run's figures,
the medians of the p99 ratio and of the RSS growth over the runs, and the per-attack
rows (``each``; ``--each-s 0`` skips them, ``--runs 0`` the runs together).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from benchmarks import _server_soak as soak
from benchmarks import _server_soak_each as each
from benchmarks._common import print_table, write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--attack-s", type=float, default=soak.ATTACK_S)
    parser.add_argument("--only", help=f"comma-separated attack loops to run alone ({', '.join(soak.ATTACKS)})")
    parser.add_argument("--each-s", type=float, default=each.EACH_S,
                        help="seconds of each attack alone beside the good tenant (0: none)")
    parser.add_argument("--each-only", help=f"comma-separated attacks for the per-attack rows ({', '.join(each.ORDER[1:])})")
    parser.add_argument("--out", default="server_soak", help="result name under benchmarks/results")
    args = parser.parse_args()
    only = args.only.split(",") if args.only else None
    runs = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as d:
            r = soak.run(Path(d), attack_s=args.attack_s, only=only)
        print(f"run {i + 1}: {soak.summary(r)}", flush=True)
        runs.append(r)
    per_attack = None
    if args.each_s > 0:
        print("each attack alone, beside a well-behaved tenant:", flush=True)
        with tempfile.TemporaryDirectory() as d:
            per_attack = each.run_each(Path(d), window_s=args.each_s,
                                       only=args.each_only.split(",") if args.each_only else None)
    mib = 1 << 20
    if runs:
        print_table(["run", "quiet p99 us", "attack p99 us", "ratio", "good ops", "failed", "RSS quiet MiB",
                 "RSS peak MiB", "growth MiB", "bound MiB"],
                    [[i + 1, r["quiet"]["p99_us"], r["under_attack"]["p99_us"], r["p99_ratio"],
                      r["under_attack"]["ops"], r["under_attack"]["failed"] + r["under_attack"]["wrong"],
                      r["rss_quiet_bytes"] / mib, r["rss_peak_bytes"] / mib, r["rss_growth_bytes"] / mib,
                      r["rss_bound_bytes"] / mib] for i, r in enumerate(runs)])
    if per_attack is not None:
        print_table(each.TABLE_HEADERS, each.table_rows(per_attack["rows"]))
    path = write_json(args.out, {
        "what": "one well-behaved TCP client (4 KiB GETs, one at a time) beside bounded attack loops against a "
                "kvstore serve on 127.0.0.1; the attacker is its own process on 127.0.0.2-9. each: every attack "
                "alone beside a well-behaved tenant (GETs and saves, new sessions, /healthz)",
        "median_p99_ratio": statistics.median(r["p99_ratio"] for r in runs) if runs else None,
        "median_rss_growth_bytes": statistics.median(r["rss_growth_bytes"] for r in runs) if runs else None,
        "rss_bound_bytes": soak.RSS_BOUND_BYTES,
        "runs": runs, "each": per_attack})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
