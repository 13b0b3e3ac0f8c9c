"""The ``kvstore`` command line. Each subcommand lives in ``kvstore/cli/<name>.py``
and exposes ``register(subparsers)``; the handler it sets returns an exit code."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from kvstore.errors import KVStoreError

COMMANDS = ("config", "bench", "serve", "stats", "fsck", "doctor", "demo", "replay")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# A server says what it does (as Redis logs at "notice" by default); one-shot commands
# print their answer and log only what went wrong.
_DEFAULT_LOG_LEVEL = {"serve": "INFO"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstore", description="Tiered KV-cache block store")
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS,
                        help="DEBUG, INFO, WARNING or ERROR, on stderr (default: INFO for serve, which then logs "
                             "its start-up steps and its shutdown flush; WARNING for every other command)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"kvstore.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = args.log_level or _DEFAULT_LOG_LEVEL.get(args.command, "WARNING")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.handler(args) or 0)
    except KVStoreError as exc:
        print(f"kvstore: error: {exc}", file=sys.stderr)
        return 2

