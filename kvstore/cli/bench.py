"""``kvstore bench``: save and load throughput, one row per tier of a config (each tier
benched alone, in a one-tier Store built from its config), or of a running server
(``--server ADDR``, through :class:`kvstore.Client`).

Every run uses fresh keys (:func:`kvstore.cli._bench.fresh_namespace`), checks every
loaded block byte for byte, and deletes the keys it wrote. The built-in config's NVMe
tier goes into a temporary directory removed at the end (``--data-dir DIR``: that
directory, kept); a ``--config`` is used as given, each tier benched only within the room
it has free, so nothing of the user's is evicted."""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import tempfile
from typing import Any, Iterator

from tqdm import tqdm

from kvstore.cli._bench import Workload, measure
from kvstore.config import DEFAULT_CONFIG, StoreConfig, load_config, parse_size
from kvstore.errors import KVStoreError

PROGRESS_DELAY_S = 2.0    # the progress bar shows only on runs longer than this


def _size(text: str) -> int:
    try:
        n = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return n


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {n}")
    return n


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("bench", help="measure save/load throughput per tier of a config, or of a server")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--config", help="YAML config, benched tier by tier as given (default: $KVSTORE_CONFIG "
                                         "or the built-in DRAM + NVMe in a temporary directory)")
    target.add_argument("--server", metavar="ADDR", help="bench a running `kvstore serve` at host:port or socket path")
    parser.add_argument("--data-dir", metavar="DIR",
                        help="the built-in config's NVMe directory (kept; default: a temporary one, removed)")
    parser.add_argument("--token", default=os.environ.get("KVSTORE_TOKEN"),
                        help="with --server: shared-secret token (default: $KVSTORE_TOKEN)")
    parser.add_argument("--tls-ca", metavar="PEM", help="with --server: connect over TLS, verifying against this CA")
    parser.add_argument("--tls-cert", metavar="PEM", help="with --server: client certificate")
    parser.add_argument("--tls-key", metavar="PEM", help="with --server: the client certificate's key")
    parser.add_argument("--block-size", type=_size, default="1MiB", help="bytes per block (default 1MiB)")
    count = parser.add_mutually_exclusive_group()
    count.add_argument("--blocks", type=_positive, help="blocks per round (default 256)")
    count.add_argument("--total", type=_size, metavar="SIZE", help="bytes per round, instead of --blocks")
    parser.add_argument("--batch", type=_positive, default=32, help="blocks per save/load call (default 32)")
    parser.add_argument("--rounds", type=_positive, default=3, help="rounds, each with fresh keys (default 3)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(handler=run, _parser=parser)


def run(args: argparse.Namespace) -> int:
    if args.server and args.data_dir:
        args._parser.error("--data-dir is for the built-in config, not --server")
    source = args.config or os.environ.get("KVSTORE_CONFIG")
    if source and args.data_dir:
        args._parser.error("--data-dir is for the built-in config; a --config names its own paths")
    blocks = args.blocks if args.blocks is not None else 256
    if args.total is not None:
        blocks = max(1, -(-args.total // args.block_size))
    work = Workload(args.block_size, blocks, min(args.batch, blocks), args.rounds)
    report: dict[str, Any] = {"block_bytes": work.block_bytes, "blocks": work.blocks, "rounds": work.rounds,
                              "batch": work.batch}
    if args.server:
        report.update(mode="server", server=args.server, rows=[_bench_server(args, work)])
    else:
        report["mode"] = "store"
        with _config(source, args.data_dir) as (config, where):
            report.update(where)
            report["rows"] = list(_bench_tiers(config, work))
    report["hits"] = sum(row.get("hits", 0) for row in report["rows"])
    print(json.dumps(report, indent=2, default=str) if args.json else render(report))
    bad = [row for row in report["rows"] if row.get("error") or row.get("corrupt") or not row.get("saved")]
    return 1 if bad else 0


class _config:
    """The config to bench and where its data lives: the given one as is, or the
    built-in one with its NVMe tiers in ``data_dir`` (kept) or a temporary directory
    (removed on the way out)."""

    def __init__(self, source: str | None, data_dir: str | None) -> None:
        self.source, self.data_dir, self.temp = source, data_dir, None

    def __enter__(self) -> tuple[StoreConfig, dict[str, Any]]:
        if self.source:
            return load_config(self.source), {"config": str(self.source)}
        raw = copy.deepcopy(DEFAULT_CONFIG)
        if self.data_dir:
            path = os.path.abspath(self.data_dir)
            os.makedirs(path, exist_ok=True)
        else:
            path = self.temp = tempfile.mkdtemp(prefix="kvstore-bench-")
        for tier in raw["tiers"]:
            if tier["kind"] == "nvme":
                tier["path"] = path
        try:
            config = load_config(raw)
        except BaseException:
            self.__exit__()
            raise
        return config, {"config": "built-in", "data_dir": path, "data_dir_kept": self.temp is None}

    def __exit__(self, *exc: object) -> None:
        if self.temp is not None:
            shutil.rmtree(self.temp, ignore_errors=True)


def _bench_tiers(config: StoreConfig, work: Workload) -> Iterator[dict[str, Any]]:
    """One row per tier: a Store of that tier alone (no trace, no events: the bench's
    keys are nobody's business), benched within the room the tier has free."""
    from kvstore.store import Store

    for tier in config.tiers:
        row: dict[str, Any] = {"tier": tier.name, "kind": tier.kind, "block_bytes": work.block_bytes}
        one = config.model_copy(update={"tiers": [tier], "trace": None, "events": None})
        try:
            with Store(one) as store:
                dev = store.tiers[0]
                free = dev.capacity_bytes - dev.used_bytes
                fits = min(work.blocks, free // work.block_bytes)
                row["free_bytes"] = free
                if fits < 1:
                    row["error"] = f"no room: {free} bytes free, a block is {work.block_bytes}"
                    yield row
                    continue
                row["capped"] = fits < work.blocks
                run = Workload(work.block_bytes, fits, min(work.batch, fits), work.rounds)
                with _bar(run, tier.name) as bar:
                    row.update(measure(store, run, bar=bar))
                tstats = store.stats()["tiers"][0]
                row["io"] = tstats.get("io_mode")
                row["stats"] = tstats
        except Exception as exc:     # a tier that cannot be benched here is a row saying why
            row["error"] = f"{type(exc).__name__}: {exc}"
        yield row


def _bench_server(args: argparse.Namespace, work: Workload) -> dict[str, Any]:
    from kvstore.client import Client

    tls = None
    if args.tls_ca or args.tls_cert or args.tls_key:
        tls = {"ca": args.tls_ca, "cert": args.tls_cert, "key": args.tls_key}
    row: dict[str, Any] = {"tier": args.server, "kind": "server", "block_bytes": work.block_bytes}
    try:
        with Client(args.server, token=args.token, tls=tls) as client:
            row["io"] = client.transport
            with _bar(work, "server") as bar:
                row.update(measure(client, work, lookup=True, bar=bar))
            row["server_blocks"] = client.stats()["blocks"]
    except (KVStoreError, OSError) as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
    return row


def _bar(work: Workload, name: str) -> tqdm:
    return tqdm(total=2 * work.blocks * work.rounds, unit="block", desc=f"bench {name}", file=sys.stderr,
                delay=PROGRESS_DELAY_S, leave=False)


def _fmt_size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << (shift - 10)) == 0:
            return f"{n / (1 << shift):g}{unit}"
    return f"{n}B"


def _fmt_gbps(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def render(report: dict[str, Any]) -> str:
    if report["mode"] == "server":
        head = f"server {report['server']}"
    elif report["config"] == "built-in":
        kept = "kept" if report["data_dir_kept"] else "removed"
        head = f"built-in config, data dir {report['data_dir']} ({kept})"
    else:
        head = f"config {report['config']}"
    width = max([len("tier")] + [len(str(row["tier"])) for row in report["rows"]]) + 2
    lines = [f"kvstore bench: {head}; {report['rounds']} rounds, fresh keys, deleted after",
             f"{'tier':<{width}}{'kind':<8}{'io':<9}{'block':>8}{'blocks':>8}{'save GB/s':>11}{'load GB/s':>11}"
             f"  verified"]
    for row in report["rows"]:
        start = f"{row['tier']:<{width}}{row['kind']:<8}"
        if "save_s" not in row:
            lines.append(f"{start}error: {row['error']}")
            continue
        verified = f"{row['verified']}/{row['saved']}"
        for what in ("corrupt", "missing"):
            if row[what]:
                verified += f" ({row[what]} {what})"
        if "found" in row and row["found"] != row["saved"]:
            verified += f" (lookup found {row['found']})"
        if row.get("capped"):
            verified += "  (blocks capped by free room)"
        if row.get("error"):
            verified += f"  error: {row['error']}"
        lines.append(f"{start}{row.get('io') or '-':<9}{_fmt_size(row['block_bytes']):>8}{row['blocks']:>8}"
                     f"{_fmt_gbps(row['save_gbps']):>11}{_fmt_gbps(row['load_gbps']):>11}  {verified}")
    return "\n".join(lines)
