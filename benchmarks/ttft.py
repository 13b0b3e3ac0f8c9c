"""Time to first token: recomputing a prompt's prefill vs loading its KV from kvstore.

A random-weight Llama (``kvstore._ttft``) answers prompts of several lengths twice per
tier: once recomputing the prefill, once loading the prompt's KV from that tier, then
generating 32 tokens greedily. The tokens must be identical in every case (the run
fails otherwise). Tiers: DRAM always; NVMe when this build has the NVMe tier; the cache
server (TCP, and shared memory where offered) when this build has it; S3 or anything
else from ``--store NAME=CONFIG.yaml``.

    python benchmarks/ttft.py                         # CPU: ~5 min on 2 shared cores
    python benchmarks/ttft.py --model medium --device cuda

Writes benchmarks/results/ttft.json and ttft.png and prints one table.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kvstore import _ttft as T  # noqa: E402
from kvstore.buffers.device import resolve_device  # noqa: E402
from kvstore.errors import ConfigError, KVStoreError  # noqa: E402
from kvstore.store import Store  # noqa: E402

TARGET_SPEEDUP_4K = 10.0


@contextlib.contextmanager
def _server(workdir: str, capacity: str):
    """A ``kvstore serve`` child process with one DRAM tier; yields its address."""
    cfg = Path(workdir) / "serve.yaml"
    cfg.write_text(f"tiers:\n  - {{name: ram, kind: dram, capacity: {capacity}}}\n"
                   f"server:\n  host: 127.0.0.1\n  port: 0\n  admin_port: 0\n")
    proc = subprocess.Popen([sys.executable, "-m", "kvstore", "serve", "--config", str(cfg)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        address = None
        while time.monotonic() < deadline and address is None:
            line = proc.stdout.readline()
            if not line:
                break
            m = re.search(r"serving on (\S+:\d+)", line)
            address = m.group(1) if m else None
        if address is None:
            raise RuntimeError(f"kvstore serve did not start (exit code {proc.poll()})")
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


def backends(stack: contextlib.ExitStack, workdir: str, capacity: str, extra: list[str], skipped: dict):
    """(name, backend) for every tier this build and this machine can offer."""
    out = [("dram", stack.enter_context(Store.from_config(
        {"tiers": [{"name": "ram", "kind": "dram", "capacity": capacity}]})))]
    nvme_dir = Path(workdir) / "nvme"
    nvme_dir.mkdir()
    try:
        out.append(("nvme", stack.enter_context(Store.from_config(
            {"tiers": [{"name": "disk", "kind": "nvme", "path": str(nvme_dir), "capacity": capacity}]}))))
    except ConfigError as exc:
        skipped["nvme"] = f"no NVMe tier in this build ({exc})"
    for spec in extra:
        name, _, path = spec.partition("=")
        out.append((name, stack.enter_context(Store.from_config(path))))
    if "s3" not in {n for n, _ in out}:
        skipped["s3"] = "not configured (pass --store s3=CONFIG.yaml with an s3 tier)"
    if importlib.util.find_spec("kvstore.client") and importlib.util.find_spec("kvstore.cli.serve"):
        from kvstore.client import Client

        address = stack.enter_context(_server(workdir, capacity))
        tcp = Client(address, transport="tcp")
        stack.callback(tcp.close)
        out.append(("server-tcp", tcp))
        auto = Client(address)
        stack.callback(auto.close)
        if auto.transport == "shm":
            out.append(("server-shm", auto))
    else:
        skipped["server"] = "no cache server in this build (kvstore.client / kvstore serve absent)"
    return out


def break_even(lengths: list[int], recompute: list[float], load: list[float]) -> str:
    """Where loading starts to beat recomputing, from the measured points."""
    faster = [lo < rc for rc, lo in zip(recompute, load)]
    if all(faster):
        return f"faster at every measured length (from {lengths[0]} tokens)"
    if not any(faster):
        return f"never faster up to {lengths[-1]} tokens"
    i = next((i for i in range(1, len(lengths)) if faster[i] and not faster[i - 1]), None)
    if i is None:  # faster at short prompts only (noise at tiny sizes): no upward crossing
        return "faster only at " + ", ".join(str(n) for n, f in zip(lengths, faster) if f) + " tokens"
    # speedup crosses 1 between lengths[i-1] and lengths[i]: interpolate in log space
    import math

    s0, s1 = recompute[i - 1] / load[i - 1], recompute[i] / load[i]
    f = (0 - math.log(s0)) / (math.log(s1) - math.log(s0))
    at = math.exp(math.log(lengths[i - 1]) + f * (math.log(lengths[i]) - math.log(lengths[i - 1])))
    return f"about {at:.0f} tokens"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = result["lengths"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(lengths, [r["ttft_s"] for r in result["recompute"]], "k-o", label="recompute prefill")
    for name, rows in result["load"].items():
        ax.plot(lengths, [r["ttft_s"] for r in rows], "-o", label=f"load from {name}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(f"TTFT, {result['model']['size']} Llama ({result['model']['params_m']:.0f}M) on {result['device']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(result: dict) -> str:
    lengths = result["lengths"]
    names = list(result["load"])
    head = f"{'tokens':>7}{'recompute s':>13}" + "".join(f"{n + ' s':>13}{'x':>7}" for n in names)
    lines = [f"TTFT on {result['device']} ({result['device_name']}), {result['model']['size']} Llama "
             f"{result['model']['params_m']:.0f}M params, chunk {result['chunk_tokens']} tokens, "
             f"{result['new_tokens']} generated tokens per run", head]
    for i, n in enumerate(lengths):
        rc = result["recompute"][i]["ttft_s"]
        row = f"{n:>7}{rc:>13.3f}"
        for name in names:
            lo = result["load"][name][i]["ttft_s"]
            row += f"{lo:>13.3f}{rc / lo:>7.1f}"
        lines.append(row)
    lines.append("a tier beats recompute when it delivers the KV faster than (MB/s, by prompt length): "
                 + ", ".join(f"{n}: {g:.1f}" for n, g in zip(lengths, result["break_even_mbps"])))
    lines.append("tokens identical to recompute in every run: " + ("yes" if result["identical"] else "NO"))
    for name, text in result["break_even"].items():
        lines.append(f"break-even {name}: {text}")
    for name, why in result["skipped"].items():
        lines.append(f"skipped {name}: {why}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", choices=sorted(T.MODEL_SIZES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--lengths", default="128,256,1024,4096,16384", help="prompt lengths, comma-separated")
    parser.add_argument("--chunk-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="load runs per tier and length (best is kept)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: on shared 2-core VMs, 2 threads ran 4x slower)")
    parser.add_argument("--store", action="append", default=[], metavar="NAME=CONFIG.yaml",
                        help="another Store config to measure, e.g. s3=s3.yaml (repeatable)")
    parser.add_argument("--capacity", default="2GiB", help="capacity of each built-in tier")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ttft.json"))
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)  # a clear error when CUDA is asked for but absent
    lengths = [int(x) for x in args.lengths.split(",")]
    model = T.build_model(args.model, device=device, max_positions=max(lengths) + args.new_tokens + 64)
    T.warm_up(model, device)
    layout = T.KVLayout.of(model, args.chunk_tokens)
    ns = layout.namespace(f"ttft-bench-{args.model}")
    result = {"device": str(device), "threads": args.threads,
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
              "model": {"size": args.model, **T.MODEL_SIZES[args.model],
                        "params_m": sum(p.numel() for p in model.parameters()) / 1e6},
              "chunk_tokens": args.chunk_tokens, "block_bytes": layout.block_bytes, "new_tokens": args.new_tokens,
              "lengths": lengths, "recompute": [], "load": {}, "skipped": {}, "break_even": {}, "identical": True}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvstore-ttft-") as workdir, contextlib.ExitStack() as stack:
        tiers = backends(stack, workdir, args.capacity, args.store, result["skipped"])
        for name, _ in tiers:
            result["load"][name] = []
        for length in lengths:
            prompt = T.make_prompt(length, model.config.vocab_size, seed=length, device=device)
            ref, cache = T.run_recompute(model, prompt, layout, args.new_tokens)
            result["recompute"].append({"tokens": length, "ttft_s": ref.ttft_s, "total_s": ref.total_s})
            print(f"{length:>6} tokens  recompute  ttft {ref.ttft_s:8.3f} s", flush=True)
            scratch = torch.empty((layout.split(length) // layout.chunk_tokens, *layout.block_shape),
                                  dtype=layout.dtype, device=device).zero_()
            for name, backend in tiers:
                t0 = time.perf_counter()
                T.save_prompt(backend, ns, prompt, cache, layout)
                save_s = time.perf_counter() - t0
                runs = [T.run_load(model, backend, ns, prompt, layout, args.new_tokens, scratch)
                        for _ in range(args.repeats)]
                same = all(r.tokens == ref.tokens for r in runs)
                result["identical"] &= same
                best = min(runs, key=lambda r: r.ttft_s)
                result["load"][name].append({"tokens": length, "ttft_s": best.ttft_s, "total_s": best.total_s,
                                             "save_s": save_s, "cached_tokens": best.cached_tokens,
                                             "identical": same, **best.parts})
                print(f"{length:>6} tokens  {name:<10} ttft {best.ttft_s:8.3f} s  "
                      f"(x{ref.ttft_s / best.ttft_s:.1f}, identical={same})", flush=True)
            del cache, scratch
    result["wall_s"] = time.perf_counter() - t_start
    for name, rows in result["load"].items():
        result["break_even"][name] = break_even(lengths, [r["ttft_s"] for r in result["recompute"]],
                                                [r["ttft_s"] for r in rows])
    # A tier wins when it delivers the cached KV faster than recompute produces it:
    # KV bytes / (recompute TTFT - the last chunk's compute, which both paths pay).
    dram = result["load"]["dram"]
    result["break_even_mbps"] = [
        (r["cached_tokens"] // layout.chunk_tokens) * layout.block_bytes
        / max(rc["ttft_s"] - r["last_chunk_s"], 1e-9) / 1e6 for rc, r in zip(result["recompute"], dram)]
    if 4096 in lengths:
        i = lengths.index(4096)
        result["speedup_dram_4k"] = result["recompute"][i]["ttft_s"] / result["load"]["dram"][i]["ttft_s"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(table(result))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0 if result["identical"] else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KVStoreError as exc:
        print(f"ttft: error: {exc}", file=sys.stderr)
        sys.exit(2)
