"""``kvstore stats --server ADDR``: a live summary of a running cache server."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from kvstore.config.base import format_size


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("stats", help="print a running server's tiers, hit rates and traffic")
    parser.add_argument("--server", default="127.0.0.1:7480", help="server address host:port or socket path")
    parser.add_argument("--token", default=os.environ.get("KVSTORE_TOKEN"),
                        help="shared-secret token (default: $KVSTORE_TOKEN)")
    parser.add_argument("--tls-ca", metavar="PEM",
                        help="connect over TLS (a server with server.tls), verifying it against this CA")
    parser.add_argument("--tls-cert", metavar="PEM", help="client certificate, for a server that requires one")
    parser.add_argument("--tls-key", metavar="PEM", help="the client certificate's key")
    parser.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS until Ctrl-C")
    parser.add_argument("--json", action="store_true", help="print the raw JSON")
    parser.set_defaults(handler=run)


def render(stats: dict[str, Any]) -> str:
    srv = stats.get("server", {})
    lines = [f"kvstore {srv.get('version', '?')}  up {srv.get('uptime_s', 0):.0f} s  "
             f"connections {srv.get('connections', 0)}  blocks {stats['blocks']}  leases {stats['leases']}",
             f"{'tier':<12}{'kind':<8}{'used':>12}{'capacity':>12}{'blocks':>9}{'hits':>10}{'misses':>9}"
             f"{'hit %':>7}{'evicted':>9}{'corrupt':>8}"]
    for t in stats["tiers"]:
        asked = t["hits"] + t["misses"]
        rate = f"{100 * t['hits'] / asked:.1f}" if asked else "-"
        lines.append(f"{t['name']:<12}{t['kind']:<8}{format_size(t['used_bytes']):>12}"
                     f"{format_size(t['capacity_bytes']):>12}{t['blocks']:>9}{t['hits']:>10}{t['misses']:>9}"
                     f"{rate:>7}{t['evictions']:>9}{t['corruptions']:>8}")
    for name, tenant in stats.get("tenants", {}).items():   # server.tenants: this token's own, or all
        held = "  ".join(f"{tier} {format_size(v['used_bytes'])}"
                         + (f" of {format_size(v['quota_bytes'])}" if v["quota_bytes"] is not None else "")
                         for tier, v in tenant["tiers"].items())
        evicted = sum(v["evictions"] for v in tenant["tiers"].values())
        lines.append(f"tenant {name}: hits {tenant['hits']}  misses {tenant['misses']}  evicted {evicted}  {held}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from kvstore.net.client import Client

    tls = None
    if args.tls_ca or args.tls_cert or args.tls_key:
        tls = {"ca": args.tls_ca, "cert": args.tls_cert, "key": args.tls_key}
    with Client(args.server, token=args.token, transport="tcp", pool_size=1, tls=tls) as client:
        while True:
            stats = client.stats()
            print(json.dumps(stats, indent=2, default=str) if args.json else render(stats), flush=True)
            if not args.watch:
                return 0
            try:
                time.sleep(args.watch)
            except KeyboardInterrupt:
                return 0
            print()
