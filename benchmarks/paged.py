"""Paged gather/scatter (:class:`kvstore.paged.PagedLayers`) with many chunks per call,
against one contiguous ``copy_`` of the same bytes (the memory-bandwidth ceiling), on
the device given (CPU by default).

Each row is one call shape: whole chunks (``gather``/``scatter``, all layers in one op
where the layers share an allocation) and layer by layer (``gather_layer`` /
``scatter_layer`` for every layer, as vLLM's layer-wise hooks call them), with and
without a keep mask, for a cache whose pages are one run (LBHNC), one run per head
(LHBNC), separate per-layer tensors, and a cache that needs the typed fallback (pages
that are not whole runs of its storage).

Usage: ``python benchmarks/paged.py [--device cuda] [--chunks 64] [--threads 1] [--label x]``;
writes ``benchmarks/results/paged.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._common import print_table, write_json  # noqa: E402
from kvstore.paged import PagedLayers  # noqa: E402

L, H, N, C = 8, 2, 16, 64        # layers, heads, tokens per page, head dim: 4 KiB fp16 pages


def caches(kind: str, blocks: int, dev: torch.device) -> list[torch.Tensor]:
    if kind == "LBHNC":
        buf = torch.randn(L * blocks * H * N * C, device=dev).half()
        return list(buf.view(L, blocks, H, N, C))
    if kind == "LHBNC":
        buf = torch.randn(L * blocks * H * N * C, device=dev).half()
        return list(buf.view(L, H, blocks, N, C).transpose(1, 2))
    if kind == "separate":
        return [torch.randn(blocks, H, N, C, device=dev).half() for _ in range(L)]
    if kind == "typed":      # the last dim sliced: pages are not whole runs
        return [torch.randn(blocks, H, N, C + 1, device=dev).half()[..., :C] for _ in range(L)]
    raise ValueError(kind)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _best(fn, rounds: int, dev: torch.device) -> float:
    fn()
    _sync(dev)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return min(times)


def run(dev: torch.device, chunks: int, per: int, rounds: int) -> list[dict]:
    blocks = 2 * chunks * per
    rows = []
    for kind in ("LBHNC", "LHBNC", "separate", "typed"):
        cs = caches(kind, blocks, dev)
        p = PagedLayers(cs, blocks_per_chunk=per)
        ids = torch.randperm(blocks)[: chunks * per].view(chunks, per)     # host ids, as the connectors pass
        keep = torch.ones(chunks, per, dtype=torch.bool)
        keep[0, : per // 2] = False
        buf = torch.empty(chunks * p.chunk_bytes, dtype=torch.uint8, device=dev)
        flat = torch.empty_like(buf)
        src = torch.randint(0, 255, (buf.numel(),), dtype=torch.uint8, device=dev)
        calls = {
            "gather": lambda: p.gather(ids, buf),
            "scatter": lambda: p.scatter(ids, buf),
            "scatter keep": lambda: p.scatter(ids, buf, keep=keep),
            "gather_layer x L": lambda: [p.gather_layer(i, ids, buf) for i in range(L)],
            "scatter_layer x L": lambda: [p.scatter_layer(i, ids, buf) for i in range(L)],
            "scatter_layer keep x L": lambda: [p.scatter_layer(i, ids, buf, keep=keep) for i in range(L)],
        }
        t_base = _best(lambda: flat.copy_(src), rounds, dev)
        for name, fn in calls.items():
            t = _best(fn, rounds, dev)
            rows.append({"layout": kind, "call": name, "chunks": chunks, "blocks_per_chunk": per,
                         "bytes": buf.numel(), "ms": t * 1e3, "gbps": buf.numel() / t / 1e9,
                         "copy_gbps": buf.numel() / t_base / 1e9, "ratio": t_base / t})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--blocks-per-chunk", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's)")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=None, help="result file (default benchmarks/results/paged.json)")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = run(dev, args.chunks, args.blocks_per_chunk, args.rounds)
    print_table(["layout", "call", "chunks", "ms", "GB/s", "copy_ GB/s", "ratio"],
                [[r["layout"], r["call"], r["chunks"], r["ms"], r["gbps"], r["copy_gbps"], r["ratio"]] for r in rows])
    payload = {"device": str(dev), "label": args.label, "threads": torch.get_num_threads(),
               "loadavg_1m": os.getloadavg()[0], "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(payload, indent=2))
    else:
        print(write_json("paged", payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
