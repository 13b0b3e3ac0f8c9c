"""``kvstore serve``: run the cache server until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import sys
from typing import Any

from kvstore.config import DEFAULT_CONFIG, load_config


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("serve", help="run the cache server (one Store shared by local and remote clients)")
    parser.add_argument("--config", help="YAML config (default: $KVSTORE_CONFIG, else DRAM + ./kvstore-data)")
    parser.add_argument("--host", help="override server.host")
    parser.add_argument("--port", type=int, help="override server.port (0: any free port)")
    parser.add_argument("--admin-port", type=int, help="override server.admin_port (0: any free port)")
    parser.add_argument("--socket-path", help="override server.socket_path (Unix socket for local clients)")
    parser.add_argument("--data-dir", default="kvstore-data",
                        help="data directory of the default config's disk tier (default ./kvstore-data)")
    parser.set_defaults(handler=run)


def default_config(data_dir: str) -> dict[str, Any]:
    """The embedded default: the built-in config (DRAM, plus a disk tier in
    ``data_dir`` when this build has the NVMe tier); no external service needed."""
    raw = copy.deepcopy(DEFAULT_CONFIG)
    disk = [t for t in raw["tiers"] if t["kind"] == "nvme"]
    if not disk and importlib.util.find_spec("kvstore.tiers.nvme") is not None:
        disk = [{"name": "disk", "kind": "nvme", "capacity": "8GiB", "eviction": "lru"}]
        raw["tiers"].append(disk[0])
    for tier in disk:
        os.makedirs(data_dir, exist_ok=True)
        tier["path"] = os.path.abspath(data_dir)
    return raw


def run(args: argparse.Namespace) -> int:
    from kvstore.net.server import run_server

    source = args.config or os.environ.get("KVSTORE_CONFIG") or default_config(args.data_dir)
    config = load_config(source)
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port), ("admin_port", args.admin_port),
                                   ("socket_path", args.socket_path)) if v is not None}
    if overrides:
        raw = config.model_dump()
        raw["server"].update(overrides)
        config = load_config(raw, env={})

    def ready(server: Any) -> None:
        from kvstore.net.server import start_line

        print(start_line(server), flush=True)

    run_server(config, ready)
    print("kvstore: stopped", file=sys.stderr, flush=True)
    return 0
