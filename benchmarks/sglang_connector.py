"""SGLang connector: page save/load throughput through SGLang's v0 (flat page) and v1
(zero-copy) storage paths, side by side with a raw copy of the same pages.

The pages live in SGLang's real ``MHATokenToKVPoolHost`` (CPU). The baseline copies
exactly the segments the pool reports for those pages (``get_page_buffer_meta``)
to and from a pre-touched buffer of the same size: the floor any storage backend
pays. The v0 path is timed as SGLang's controller runs it (``get_data_page`` gather
then ``batch_set``; ``batch_get`` into fresh flat pages then
``set_from_flat_data_page``). Everything is measured in one run; ratios are what
to compare across machines.

Usage: python benchmarks/sglang_connector.py [--pages 64] [--layers 16] [--rounds 5]
       [--server HOST:PORT]   (through a running kvstore serve instead of an embedded Store)
Writes benchmarks/results/sglang_connector.json and .png.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from tests._sglang_env import make_mha_host_pool  # noqa: E402  (torchvision placeholder; see there)

RESULTS = os.path.join(ROOT, "benchmarks", "results")


def _storage_config(layout: str, v1: bool, capacity: int, server: str | None):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    extra = {"backend_name": "kvstore", "module_path": "kvstore.connectors.sglang", "class_name": "KVStoreHiCacheStorage"}
    if server:
        extra["server"] = server
    else:
        extra["store"] = {"tiers": [{"name": "hot", "kind": "dram", "capacity": capacity}]}
    if v1:
        extra["interface_v1"] = 1
    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False,
                                is_page_first_layout=layout != "layer_first", model_name="bench/model",
                                extra_config=extra)


def _segments(pool, indices) -> list[np.ndarray]:
    """In-place views of the pool segments of the pages at ``indices``."""
    arena = pool.kv_buffer.view(-1).view(torch.uint8).numpy()
    base = pool.kv_buffer.data_ptr()
    ptrs, sizes = pool.get_page_buffer_meta(indices)
    return [arena[p - base:p - base + s] for p, s in zip(ptrs, sizes)]


def _clock(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


class _Path:
    """One storage path (v0 or v1) through its own backend on the shared pool."""

    def __init__(self, name: str, pool, layout: str, capacity: int, args, src_idx, dst_idx) -> None:
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        self.name, self.pool, self.layout, self.n = name, pool, layout, args.pages
        self.src_idx, self.dst_idx, self.P = src_idx, dst_idx, args.page_tokens
        cfg = _storage_config(layout, name == "v1", capacity, args.server)
        self.backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
        self.backend.register_mem_pool_host(pool)

    def keys(self, tag) -> list[str]:
        # A stored key is not written again, so each timed save gets fresh keys.
        return [hashlib.sha256(f"{self.layout}/{self.name}/{tag}/{i}".encode()).hexdigest() for i in range(self.n)]

    def save(self, keys) -> None:
        b, pool, P = self.backend, self.pool, self.P
        if self.name == "v1":
            ok = b.batch_set_v1(keys, self.src_idx)
        else:   # what SGLang's controller does on the generic path
            ok = [b.batch_set(keys, [pool.get_data_page(int(self.src_idx[i * P])) for i in range(self.n)])]
        assert all(ok), f"{self.name} save failed"

    def load(self, keys) -> None:
        b, pool, P = self.backend, self.pool, self.P
        if self.name == "v1":
            ok = b.batch_get_v1(keys, self.dst_idx)
        else:
            pages = b.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in range(self.n)])
            ok = [p is not None for p in pages]
            for i, page in enumerate(pages):
                pool.set_from_flat_data_page(int(self.dst_idx[i * P]), page)
        assert all(ok), f"{self.name} load missed pages"


def bench_layout(layout: str, args) -> dict:
    P, n = args.page_tokens, args.pages
    pool = make_mha_host_pool(layout, layers=args.layers, heads=args.heads, head_dim=args.head_dim,
                              page_size=P, device_tokens=n * P)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, dtype=torch.float32).to(torch.float16))
    src_idx, dst_idx = torch.arange(0, n * P), torch.arange(n * P, 2 * n * P)
    page_bytes = pool.get_data_page(0).numel() * pool.dtype.itemsize
    total = n * page_bytes

    # Raw copy of the same segments to/from a pre-touched staging area.
    src_segs, dst_segs = _segments(pool, src_idx), _segments(pool, dst_idx)
    staging = np.ones(total, np.uint8)
    offs = np.cumsum([0] + [s.nbytes for s in src_segs])
    stage_views = [staging[offs[i]:offs[i + 1]] for i in range(len(src_segs))]

    def raw_save():
        for d, s in zip(stage_views, src_segs):
            np.copyto(d, s)

    def raw_load():
        for d, s in zip(dst_segs, stage_views):
            np.copyto(d, s)

    paths = [_Path(name, pool, layout, total + (64 << 20), args, src_idx, dst_idx) for name in ("v0", "v1")]
    for path in paths:                      # warm-up: touch each store's memory once
        path.save(path.keys("warm-up"))
    times: dict[str, list[float]] = {f"{c}_{op}_s": [] for c in ("raw", "v0", "v1") for op in ("save", "load")}
    # Interleaved rounds, so load from other processes on the machine hits all alike.
    for r in range(args.rounds):
        times["raw_save_s"].append(_clock(raw_save))
        times["raw_load_s"].append(_clock(raw_load))
        for path in paths:
            path.backend.clear()            # embedded Store: bounded memory; a server keeps all rounds
            keys = path.keys(r)
            times[f"{path.name}_save_s"].append(_clock(path.save, keys))
            times[f"{path.name}_load_s"].append(_clock(path.load, keys))
            assert torch.equal(pool.get_data_page(int(dst_idx[0])), pool.get_data_page(int(src_idx[0])))
    for path in paths:
        path.backend.close()

    row = {"layout": layout, "page_bytes": page_bytes, "pages": n, "segments_per_page": len(src_segs) // n,
           "total_bytes": total, "store": f"server {args.server}" if args.server else "embedded DRAM Store",
           **times}
    for op in ("save", "load"):
        raw = total / statistics.median(row[f"raw_{op}_s"]) / 1e9
        row[f"raw_{op}_gbps"] = raw
        for name in ("v0", "v1"):
            gbps = total / statistics.median(row[f"{name}_{op}_s"]) / 1e9
            row[f"{name}_{op}_gbps"] = gbps
            row[f"{name}_{op}_vs_raw"] = gbps / raw
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--page-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layouts", default="layer_first,page_first")
    parser.add_argument("--server", help="host:port of a running kvstore serve (default: an embedded Store)")
    args = parser.parse_args()

    rows = [bench_layout(layout, args) for layout in args.layouts.split(",")]
    print(f"\nSGLang connector, {args.pages} pages x {rows[0]['page_bytes'] / 2**20:.1f} MiB "
          f"({args.layers} layers, {args.heads} heads x {args.head_dim}, page {args.page_tokens} tokens, fp16), "
          f"{rows[0]['store']}, median of {args.rounds}; GB/s and ratio to a raw copy of the same pages")
    print(f"{'layout':<12} {'op':<5} {'raw copy':>9} {'v0':>8} {'v0/raw':>7} {'v1':>8} {'v1/raw':>7}")
    for r in rows:
        for op in ("save", "load"):
            print(f"{r['layout']:<12} {op:<5} {r[f'raw_{op}_gbps']:9.2f} {r[f'v0_{op}_gbps']:8.2f} "
                  f"{r[f'v0_{op}_vs_raw']:7.2f} {r[f'v1_{op}_gbps']:8.2f} {r[f'v1_{op}_vs_raw']:7.2f}")
    os.makedirs(RESULTS, exist_ok=True)
    out = {"benchmark": "sglang_connector", "args": vars(args), "target": "v1 >= 0.8x raw copy", "rows": rows}
    with open(os.path.join(RESULTS, "sglang_connector.json"), "w") as f:
        json.dump(out, f, indent=2)
    _plot(rows)
    return 0


def _plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['layout']}\n{op}" for r in rows for op in ("save", "load")]
    x = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(8, 4))
    for k, (name, color) in enumerate((("raw", "grey"), ("v0", "tab:orange"), ("v1", "tab:blue"))):
        vals = [r[f"{name}_{op}_gbps"] for r in rows for op in ("save", "load")]
        ax.bar(x + (k - 1) * 0.27, vals, 0.27, label="raw copy" if name == "raw" else name, color=color)
    ax.set_xticks(x, labels)
    ax.set_ylabel("GB/s")
    ax.set_title("SGLang connector page throughput vs raw copy (same run)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "sglang_connector.png"), dpi=100)


if __name__ == "__main__":
    sys.exit(main())
