"""``kvstore config validate|show [FILE]``."""

from __future__ import annotations

import argparse

from kvstore.config import dump_config, load_config, preflight


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("config", help="validate or show the effective config")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, text in (("validate", "check it as `kvstore serve` would, short of binding its ports"),
                         ("show", "print the effective config (secrets masked)")):
        one = actions.add_parser(action, help=text)
        one.add_argument("file", nargs="?", help="YAML config (default: $KVSTORE_CONFIG or built-in)")
        if action == "show":
            one.add_argument("--secrets", action="store_true",
                             help="print tokens, salts and passwords in clear (masked otherwise)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    config = load_config(args.file)
    if args.action == "show":
        print(dump_config(config, secrets=args.secrets), end="")
    else:
        preflight(config)   # every check `kvstore serve` makes before it binds its ports
        print(f"ok: {len(config.tiers)} tier(s): " + ", ".join(f"{t.name} ({t.kind})" for t in config.tiers))
    return 0
