"""``kvstore serve``: run the cache server until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import copy
import importlib.util
import logging
import os
import sys
from pathlib import Path
from typing import Any, Mapping

import yaml

from kvstore.config import DEFAULT_CONFIG, load_config
from kvstore.config.base import load_yaml
from kvstore.errors import ConfigError, KVStoreError


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
    from kvstore.config import preflight
    from kvstore.net.server import run_server

    source = args.config or os.environ.get("KVSTORE_CONFIG") or default_config(args.data_dir)
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port), ("admin_port", args.admin_port),
                                   ("socket_path", args.socket_path)) if v is not None}
    started = False
    try:
        # the flags override the file as KVSTORE_SERVER__… do: on the source, before validation
        config = load_config(_with_server_overrides(source, overrides) if overrides else source)
        preflight(config)   # what `kvstore config validate` checks: refused before anything is built
    except KVStoreError as exc:
        return _start_failed(exc, 2)

    logging.getLogger("kvstore.cli").info(
        "config: %s", args.config or os.environ.get("KVSTORE_CONFIG") or f"built-in default (data dir {args.data_dir})")

    def on_ready(server: Any) -> None:
        from kvstore.net.server import start_line

        nonlocal started
        started = True
        print(start_line(server), flush=True)

    try:
        run_server(config, on_ready)
    except Exception as exc:
        if started:
            raise
        # a start that failed (a port taken, a tier that cannot open): one line, nothing
        # left behind (the server closes what it built)
        return _start_failed(exc, 2 if isinstance(exc, ConfigError) else 1)
    print("kvstore: stopped", file=sys.stderr, flush=True)
    return 0


def _with_server_overrides(source: Any, overrides: dict[str, Any]) -> Any:
    """The raw config of ``source`` (a path or a mapping) with ``server:`` keys replaced."""
    if isinstance(source, Mapping):
        raw = copy.deepcopy(dict(source))
    else:
        try:
            raw = load_yaml(Path(source).read_text()) or {}
        except OSError:
            return source      # load_config reports it
        except yaml.YAMLError:
            return source
        if not isinstance(raw, dict):
            return source
    server = raw.get("server")
    raw["server"] = {**(server if isinstance(server, dict) else {}), **overrides}
    return raw


def _start_failed(exc: BaseException, code: int) -> int:
    """``kvstore: error: …`` on one line (a validation error's lines joined), the tier it
    concerns first when the error carries one."""
    if isinstance(exc, OSError) and not isinstance(exc, KVStoreError) and exc.strerror:
        text = exc.strerror + (f": {exc.filename}" if exc.filename else "")
    else:
        text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
        if not isinstance(exc, KVStoreError):
            text = f"{type(exc).__name__}: {text}"
    notes = [n for n in getattr(exc, "__notes__", ()) if n]
    print(f"kvstore: error: {': '.join([*notes, text])}", file=sys.stderr, flush=True)
    return code
