"""``kvstore fsck PATH... [--repair]``: verify NVMe tier directories offline."""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("fsck", help="verify (and repair) NVMe tier directories",
                            description="Verify every indexed block of NVMe tier directories; "
                            "report corrupt, missing and orphaned blocks. Exit status: 0 clean, "
                            "1 problems found and repaired, 4 problems left. Stop the Store first.")
    parser.add_argument("paths", nargs="+", metavar="PATH", help="an NVMe tier directory")
    parser.add_argument("--repair", action="store_true",
                        help="drop bad index records and wipe orphaned block headers")
    parser.add_argument("--json", action="store_true", help="print one JSON report per directory")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from kvstore.tiers.nvme.fsck import fsck

    status = 0
    for path in args.paths:
        report = fsck(path, repair=args.repair, progress=not args.no_progress)
        if args.json:
            print(json.dumps(report.as_dict()))
        else:
            print(f"{path}: {report.blocks} indexed, {report.verified} verified "
                  f"({report.verified_bytes / 1e6:.1f} MB), {len(report.corrupt)} corrupt, "
                  f"{len(report.missing)} missing, {report.damaged_records} damaged index records, "
                  f"{report.orphans} orphaned ({report.orphan_bytes / 1e6:.1f} MB)"
                  + ("; repaired" if report.repaired else ""))
            for digest in report.corrupt:
                print(f"  corrupt {digest}")
            for digest in report.missing:
                print(f"  missing {digest}")
        if report.problems:
            status = max(status, 1 if report.repaired else 4)
    return status
