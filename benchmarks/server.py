"""Cache-server throughput and latency, side by side with the systems users would pick
instead, on this machine, with the same values, in one run.

    bash benchmarks/install_peers.sh            # once: Mooncake, LMCache, redis-server
    python benchmarks/server.py                 # ~5 minutes; --quick for a smoke run

Systems (a peer that cannot start is skipped, with the reason printed; no number is
ever invented):
  kvstore-tcp    ``kvstore serve`` + ``Client(transport="tcp")``, loopback TCP
  kvstore-shm    the same server, same-host shared-memory path (Unix socket control)
  kvstore-shm-unverified, kvstore-tcp-unverified
                 the same clients with ``Client(verify=False)``: received blocks not checked
                 against their checksums (measurement only), beside the verified default
  kvstore-tcp-tls
                 ``--tls``: a second, identical server with ``server.tls`` (a throwaway CA)
                 and ``Client(transport="tcp", tls=...)``: the same TCP path over TLS 1.3,
                 beside plain kvstore-tcp in the same run
  kvstore-nixl   the same server, NIXL path (UCX: cross-memory attach here, RDMA across
                 nodes); ``Client(transport="nixl")`` with registered buffers
  mooncake-tcp   ``mooncake_master`` + a ``mooncake_client`` storage node; its Python
                 client over TCP, ``batch_put_from`` / ``batch_get_into`` on registered buffers
  mooncake-shm   the same, its same-host shared-memory client (``setup_dummy``)
  redis          Debian ``redis-server``, ``redis[hiredis]`` pipelined SET/GET
  lmcache        ``lmcache server --shm-name`` driven by its own ``lmcache bench server
                 --mode cpu`` (its numbers are its own client's: 64 MiB store/retrieve requests)

Every cell: C concurrent client processes; each puts one batch of fresh 64 MiB (256 KiB
or 1 MiB blocks), verifies one read-back byte for byte, then gets the batch repeatedly
for ``--seconds``. Throughput = all bytes got / wall time; p50/p99 per batch request.
Systems are interleaved cell by cell so machine noise hits all of them alike.
Writes ``benchmarks/results/server.json`` and ``server.png`` (``--out NAME``: ``NAME.json``;
with ``--tls``, ``server_tls.json`` unless ``--out`` is given).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._server_peers import PEERS, Peer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BATCH = 64 << 20


def run_cell(peer: Peer, system: str, block: int, clients: int, seconds: float, tmp: Path, cell: int) -> dict:
    sync = str(tmp / f"sync-{cell}-{system}")
    procs: list[subprocess.Popen] = []
    try:
        for w in range(clients):
            spec = {"system": peer.worker_system, "repo": str(ROOT), "block": block, "nblocks": BATCH // block,
                    "seconds": seconds, "seed": 1000 * w + block, "tag": f"c{cell}-{system}-w{w}",
                    "sync": sync, "worker": w, **peer.client_spec(system, w)}
            procs.append(subprocess.Popen([peer.python, str(ROOT / "benchmarks" / "_server_worker.py"),
                                           json.dumps(spec)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, env=peer.env))
        for phase in ("ready", "put"):  # all clients start each phase together
            deadline = time.time() + 120
            while time.time() < deadline and not all(os.path.exists(f"{sync}-{phase}-{w}") for w in range(clients)):
                if any(p.poll() is not None for p in procs):
                    break
                time.sleep(0.005)
            Path(f"{sync}-{phase}-go").touch()
        return _collect(procs, clients, seconds)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _collect(procs: list, clients: int, seconds: float) -> dict:
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=seconds + 120)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        if p.returncode != 0 or not out.strip():
            return {"error": (err or out).strip().splitlines()[-1:] or ["no output"]}
        outs.append(json.loads(out.strip().splitlines()[-1]))
    lat = np.array([x for o in outs for x in o["lat"]])
    if not lat.size:
        return {"error": ["no get completed"]}
    wall = max(o["t_end"] for o in outs) - min(o["t_start"] for o in outs)
    return {"get_gbps": sum(o["bytes"] for o in outs) / wall / 1e9,
            "put_gbps": clients * BATCH / max(o["put_s"] for o in outs) / 1e9,
            "p50_ms": float(np.percentile(lat, 50) * 1e3), "p99_ms": float(np.percentile(lat, 99) * 1e3),
            "requests": int(lat.size), "verified": all(o["verified"] and o["put_ok"] for o in outs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems",
                    default="kvstore-shm,kvstore-shm-unverified,kvstore-nixl,kvstore-tcp,kvstore-tcp-unverified,"
                            "mooncake-shm,mooncake-tcp,redis,lmcache")
    ap.add_argument("--blocks", default="262144,1048576", help="block sizes in bytes")
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--seconds", type=float, default=2.5, help="get phase per cell")
    ap.add_argument("--quick", action="store_true", help="1 MiB, 1 and 4 clients, 0.5 s")
    ap.add_argument("--tls", action="store_true",
                    help="add kvstore-tcp-tls (TCP over TLS, a second server with server.tls) beside kvstore-tcp")
    ap.add_argument("--out", default=None,
                    help="results name: writes benchmarks/results/<out>.json and .png (default server, "
                         "server_tls with --tls; e.g. server_nixl for a NIXL-vs-TCP subset run, so the full "
                         "table in server.json stays)")
    ap.add_argument("--lmcache-clients", default="1,4",
                    help="client counts LMCache runs with (each of its clients loads torch: slow to start)")
    args = ap.parse_args()
    if args.quick:
        args.blocks, args.clients, args.seconds = "1048576", "1,4", 0.5
    systems = args.systems.split(",")
    if args.tls:
        for s in ("kvstore-tcp", "kvstore-tcp-tls"):
            if s not in systems:
                systems.insert(systems.index("kvstore-tcp") + 1 if "kvstore-tcp" in systems else len(systems), s)
    if args.out is None:
        args.out = "server_tls" if args.tls else "server"
    blocks = [int(b) for b in args.blocks.split(",")]
    counts = [int(c) for c in args.clients.split(",")]
    RESULTS.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-bench-server-"))
    peers: dict[str, Peer] = {}
    skipped: dict[str, str] = {}
    results: list[dict] = []
    try:
        for system in systems:
            family = system.split("-")[0]
            if family not in PEERS:
                skipped[system] = "unknown system"
                continue
            if family not in peers and family not in skipped:
                try:
                    extra = {"tls": any(s.endswith("-tls") for s in systems)} if family == "kvstore" else {}
                    peers[family] = PEERS[family](tmp, max(counts), **extra)
                    if family == "lmcache":
                        peers[family].client_counts = {int(c) for c in args.lmcache_clients.split(",")}
                    print(f"started {family}: {peers[family].describe()}", flush=True)
                except Exception as exc:  # a peer that cannot start is skipped, with the reason
                    skipped[family] = f"{type(exc).__name__}: {exc}"
            if family in skipped:
                skipped[system] = skipped[family]
                print(f"SKIP {system}: {skipped[system]}", flush=True)
        cell = 0
        for block in blocks:
            for c in counts:
                cell += 1
                order = [s for s in systems if s not in skipped]
                order = order[cell % len(order):] + order[:cell % len(order)] if order else []
                for system in order:
                    peer = peers[system.split("-")[0]]
                    r = peer.run(system, block, c, args.seconds, tmp, cell) if peer.self_driven else \
                        run_cell(peer, system, block, c, args.seconds, tmp, cell)
                    r.update(system=system, block=block, clients=c)
                    results.append(r)
                    print(_row(r), flush=True)
    finally:
        for peer in peers.values():
            peer.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    _report(results, skipped, blocks, counts, systems, args.out)
    return 0


def _row(r: dict) -> str:
    head = f"{r['system']:<23}{r['block'] >> 10:>6} KiB{r['clients']:>4} cl"
    if "error" in r:
        return f"{head}  error: {' '.join(r['error'])[:160]}"
    flag = "" if r.get("verified", True) else "  UNVERIFIED (bytes differed, or a get failed/timed out)"
    return (f"{head}  get {r['get_gbps']:6.2f} GB/s  p50 {r['p50_ms']:7.1f} ms  p99 {r['p99_ms']:7.1f} ms"
            f"  put {r['put_gbps']:6.2f} GB/s{flag}")


def _report(results: list[dict], skipped: dict, blocks: list[int], counts: list[int], systems: list[str],
            name: str) -> None:
    ok = {(r["system"], r["block"], r["clients"]): r for r in results if "error" not in r}
    print("\nget throughput GB/s (p99 ms) per 64 MiB request; ratios vs peers")
    cols = [s for s in systems if s not in skipped]
    print(f"{'block':>8}{'cl':>4}" + "".join(f"{s:>24}" for s in cols))
    for b in blocks:
        for c in counts:
            line = f"{b >> 10:>5}KiB{c:>4}"
            for s in cols:
                r = ok.get((s, b, c))
                line += f"{r['get_gbps']:>15.2f} ({r['p99_ms']:5.0f})" if r else f"{'-':>24}"
            print(line)
    ratios = {}
    for ours, theirs, target in (("kvstore-shm", "mooncake-shm", 1.0), ("kvstore-shm", "lmcache", 1.0),
                                 ("kvstore-shm", "redis", 3.0), ("kvstore-tcp", "mooncake-tcp", 1.5),
                                 ("kvstore-tcp", "redis", 1.0), ("kvstore-nixl", "kvstore-tcp", 2.0),
                                 ("kvstore-nixl", "mooncake-tcp", 1.0),
                                 ("kvstore-shm", "kvstore-shm-unverified", 0.9),
                                 ("kvstore-tcp", "kvstore-tcp-unverified", 0.9),
                                 ("kvstore-tcp-tls", "kvstore-tcp", None)):   # TLS: reported as measured
        vals = [ok[(ours, b, c)]["get_gbps"] / ok[(theirs, b, c)]["get_gbps"]
                for b in blocks for c in counts if (ours, b, c) in ok and (theirs, b, c) in ok]
        if vals:
            ratios[f"{ours}/{theirs}"] = {"min": min(vals), "median": float(np.median(vals)), "max": max(vals),
                                          "target": target}
            print(f"{ours} / {theirs}: median {np.median(vals):.2f}x (min {min(vals):.2f}x, "
                  f"max {max(vals):.2f}x; " + (f"target >= {target}x)" if target else "no target)"))
    for s, why in skipped.items():
        print(f"skipped {s}: {why}")
    out = {"machine": os.uname().nodename, "cpus": os.cpu_count(), "batch_bytes": BATCH, "results": results,
           "skipped": skipped, "ratios": ratios, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=2))
    _plot(ok, blocks, counts, cols, RESULTS / f"{name}.png")
    print(f"wrote {RESULTS / name}.json and {name}.png")


def _plot(ok: dict, blocks: list[int], counts: list[int], cols: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(blocks), figsize=(6 * len(blocks), 4.5), squeeze=False)
    width = 0.8 / max(1, len(cols))
    for ax, b in zip(axes[0], blocks):
        for i, s in enumerate(cols):
            vals = [ok[(s, b, c)]["get_gbps"] if (s, b, c) in ok else 0 for c in counts]
            ax.bar(np.arange(len(counts)) + i * width, vals, width, label=s)
        ax.set_xticks(np.arange(len(counts)) + width * (len(cols) - 1) / 2, [f"{c} clients" for c in counts])
        ax.set_title(f"batch get, {b >> 10} KiB blocks, 64 MiB per request")
        ax.set_ylabel("GB/s")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
