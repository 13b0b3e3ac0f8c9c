"""Set-up shared by the NVMe tier's focused benchmarks (``nvme_ab``, ``nvme_overhead``,
``nvme_dram``, ``nvme_paired``): the same command-line options, a scratch directory on
the drive under test, page-aligned source and destination buffers cut into blocks, and
the results file."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from typing import Callable

import numpy as np

from benchmarks._common import write_json
from kvstore.config import parse_size
from kvstore.tiers.nvme.io import aligned_empty


def size_options(doc: str, *, bytes_default: str, reps_default: int) -> argparse.ArgumentParser:
    """``--dir``, ``--sizes``, ``--bytes`` and ``--reps``, with ``doc`` as the help text."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", help="directory on the drive under test (default: a temp dir in /var/tmp)")
    parser.add_argument("--sizes", default="256KiB,1MiB,4MiB")
    parser.add_argument("--bytes", type=parse_size, default=bytes_default, help="bytes per measurement")
    parser.add_argument("--reps", type=int, default=reps_default)
    return parser


def per_size(args: argparse.Namespace, name: str, bench: Callable[[str, int, int, int], dict]) -> list[dict]:
    """``bench(directory, block, bytes, reps)`` for each of ``--sizes``, in a scratch
    directory under ``--dir`` that is removed afterwards."""
    base = tempfile.mkdtemp(prefix=f"kvstore-{name}-", dir=args.dir or "/var/tmp")
    try:
        return [bench(base, parse_size(s), args.bytes, args.reps) for s in args.sizes.split(",")]
    finally:
        shutil.rmtree(base, ignore_errors=True)


def block_buffers(block: int, n: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """A random source and a zeroed destination of ``n`` blocks (pages faulted in outside
    any timing), and their per-block views."""
    src = aligned_empty(block * n)
    src[:] = np.random.default_rng(0).integers(0, 256, src.nbytes, dtype=np.uint8)
    dst = aligned_empty(block * n)
    dst[:] = 0
    return (src, dst, [src[i * block:(i + 1) * block] for i in range(n)],
            [dst[i * block:(i + 1) * block] for i in range(n)])


def save_rows(name: str, rows: list[dict], **extra: object) -> None:
    """Write ``extra``, ``rows`` and the command line to ``benchmarks/results/<name>.json``
    and print where."""
    print(f"wrote {write_json(name, {**extra, 'rows': rows, 'argv': sys.argv[1:]})}")
