"""``kvstore config validate|show [FILE]``."""

from __future__ import annotations

import argparse

from kvstore.config import dump_config, load_config


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("config", help="validate or show the effective config")
    parser.add_argument("action", choices=("validate", "show"))
    parser.add_argument("file", nargs="?", help="YAML config (default: $KVSTORE_CONFIG or built-in)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    config = load_config(args.file)
    if args.action == "show":
        print(dump_config(config), end="")
    else:
        print(f"ok: {len(config.tiers)} tier(s): " + ", ".join(f"{t.name} ({t.kind})" for t in config.tiers))
    return 0
