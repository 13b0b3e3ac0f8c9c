"""``kvstore doctor [--config FILE] [--path DIR]... [--json]``: what this node can use."""

from __future__ import annotations

import argparse
import json

from kvstore.config import load_config
from kvstore.doctor import Check, run_checks


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("doctor", help="list RDMA devices, NIXL backends, CUDA/GDS and direct I/O support")
    parser.add_argument("--config", help="YAML config whose NVMe directories are probed "
                        "(default: $KVSTORE_CONFIG or built-in)")
    parser.add_argument("--path", action="append", default=[], metavar="DIR",
                        help="also probe O_DIRECT in this directory (repeatable)")
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    checks = run_checks(config, extra_paths=args.path)
    if args.json:
        print(json.dumps([c.to_dict() for c in checks], indent=2))
    else:
        print(format_report(checks), end="")
    return 0  # absence of a capability is a finding, not a failure


def format_report(checks: list[Check]) -> str:
    from kvstore.net.client.selection import describe_selection

    lines = []
    width = max(len(f"{c.area} {c.name}") for c in checks)
    for c in checks:
        mark = "ok" if c.ok else "--"
        lines.append(f"[{mark}] {f'{c.area} {c.name}':<{width}}  {c.detail}")
    lines.append("")
    lines.append(describe_selection(checks))
    return "\n".join(lines) + "\n"
