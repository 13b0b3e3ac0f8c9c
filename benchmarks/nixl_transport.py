"""NIXL path vs TCP path of the kvstore cache server, and Mooncake Store over TCP, in one
run: 1 MiB blocks, 1/4/16 concurrent client processes.

    python benchmarks/nixl_transport.py [--clients 1 4 16] [--blocks 32] [--rounds 4]

Each client process owns ``--blocks`` keys and buffers allocated once, page-aligned and
pre-touched (for NIXL they are registered, as an engine registers its KV-cache pool). After an
untimed warm-up (save and load once), it saves ``--blocks`` new keys (put) and loads
its blocks ``--rounds`` times (get). Throughput is all clients'
bytes over the wall time from the first start to the last finish (a barrier lines the
clients up). Mooncake runs when ``mooncake.store`` imports in ``.venv/peers`` (``bash
benchmarks/install_peers.sh``). Prints one table, writes benchmarks/results/nixl_transport.json
and nixl_transport.png. (Not named nixl.py: it would shadow the nixl package.)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
BLOCK = 1 << 20
PEERS_PY = ROOT / ".venv" / "peers" / "bin" / "python"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if not os.path.isdir("/sys/class/infiniband"):
        env.setdefault("UCX_MODULES", "^ib")
    env.pop("KVSTORE_CONFIG", None)
    return env


# -- kvstore ---------------------------------------------------------------------------------

def start_server(capacity: str, tmp: Path) -> tuple[subprocess.Popen, str]:
    import yaml

    port = _free_port()
    cfg = {"tiers": [{"name": "hot", "kind": "dram", "capacity": capacity, "pin": False}],
           "server": {"host": "127.0.0.1", "port": port, "admin_port": None, "transport": "nixl",
                      "max_inflight_bytes": "1GiB"}}
    path = tmp / "server.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "kvstore", "serve", "--config", str(path)], cwd=ROOT,
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    if "serving on" not in line:
        proc.kill()
        raise SystemExit(f"server did not start: {line!r}")
    return proc, f"127.0.0.1:{port}"


def kvstore_worker(address: str, transport: str, idx: int, blocks: int, rounds: int, barrier, out) -> None:
    import numpy as np

    from kvstore.client import Client
    from kvstore.keys import Namespace

    keys = Namespace(model="bench", dtype="uint8", chunk_tokens=1, salt=f"{transport}-{idx}").chunk_keys(
        np.arange(blocks, dtype=np.int64))
    raw = np.empty(blocks * BLOCK + 4096, np.uint8)  # page-aligned, like an engine's KV pool
    pool = raw[(-raw.ctypes.data) % 4096:][:blocks * BLOCK]
    pool[:] = idx % 251  # touched once, before timing
    bufs = [pool[i * BLOCK:(i + 1) * BLOCK] for i in range(blocks)]
    with Client(address, transport=transport, timeout_s=120, pool_size=2) as c:
        assert c.transport == transport, f"wanted {transport}, got {c.transport}"
        c.register(pool)
        fresh = Namespace(model="bench", dtype="uint8", chunk_tokens=1, salt=f"{transport}-{idx}-put").chunk_keys(
            np.arange(blocks, dtype=np.int64))
        # warm-up, untimed: connections, NIXL metadata, UCX endpoints and caches
        assert all(c.save(keys, bufs).result()) and all(c.load(keys, bufs).result())
        barrier.wait()
        t0 = time.perf_counter()
        ok = c.save(fresh, bufs).result()
        t1 = time.perf_counter()
        for _ in range(rounds):
            got = c.load(keys, bufs).result()
        t2 = time.perf_counter()
        assert all(ok) and all(got), "a block was not stored or loaded"
        assert c.fallbacks.total == 0, c.fallbacks.stats()
        c.delete(keys + fresh)  # the next run starts with an empty server
    out.put((t0, t1, t2))


def run_kvstore(address: str, transport: str, clients: int, blocks: int, rounds: int) -> dict:
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(clients), ctx.Queue()
    procs = [ctx.Process(target=kvstore_worker, args=(address, transport, i, blocks, rounds, barrier, out))
             for i in range(clients)]
    for p in procs:
        p.start()
    times = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
        if p.exitcode:
            raise SystemExit(f"{transport} client exited with {p.exitcode}")
    return _rates(times, clients, blocks, rounds)


def _rates(times: list, clients: int, blocks: int, rounds: int) -> dict:
    start = min(t[0] for t in times)
    put_end = max(t[1] for t in times)
    get_start = min(t[1] for t in times)
    end = max(t[2] for t in times)
    nbytes = clients * blocks * BLOCK
    return {"put_GBps": nbytes / (put_end - start) / 1e9, "get_GBps": nbytes * rounds / (end - get_start) / 1e9}


# -- Mooncake --------------------------------------------------------------------------------

MOONCAKE_WORKER = r"""
import sys, time, json, numpy as np
from mooncake.store import MooncakeDistributedStore
meta, master, idx, blocks, rounds, start_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
import socket
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
st = MooncakeDistributedStore()
rc = st.setup(f"127.0.0.1:{port}", meta, 0, (blocks + 1) << 20, "tcp", "", master)
assert rc == 0, rc
raw = np.empty((blocks << 20) + 4096, np.uint8); buf = raw[(-raw.ctypes.data) % 4096:][:blocks << 20]; buf[:] = idx % 251
assert st.register_buffer(buf.ctypes.data, buf.nbytes) == 0
keys = [f"b{idx}-{i}" for i in range(blocks)]
ptrs = [buf.ctypes.data + (i << 20) for i in range(blocks)]
sizes = [1 << 20] * blocks
wk = [f"w{idx}-{i}" for i in range(blocks)]
assert all(x == 0 for x in st.batch_put_from(wk, ptrs, sizes))  # warm-up, untimed
st.batch_get_into(wk, ptrs, sizes)
while time.time() < start_at:
    time.sleep(0.001)
t0 = time.perf_counter()
r = st.batch_put_from(keys, ptrs, sizes)
t1 = time.perf_counter()
assert all(x == 0 for x in r), r
for _ in range(rounds):
    g = st.batch_get_into(keys, ptrs, sizes)
    assert all(x == (1 << 20) for x in g), g
t2 = time.perf_counter()
print(json.dumps([t0, t1, t2, time.time() - time.perf_counter()]))
"""


def run_mooncake(clients: int, blocks: int, rounds: int) -> dict | None:
    if not PEERS_PY.exists() or subprocess.run([str(PEERS_PY), "-c", "import mooncake.store"],
                                               capture_output=True).returncode:
        return None
    bindir = PEERS_PY.parent
    env = {**_env(), "MC_LEGACY_RPC_PORT_BINDING": "1", "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    p1, p2, p3, p4, p5 = (_free_port() for _ in range(5))
    master = subprocess.Popen([str(bindir / "mooncake_master"), "--enable_http_metadata_server=true",
                               "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={p1}",
                               "--rpc_address=127.0.0.1", f"--rpc_port={p2}", "--metrics_host=127.0.0.1",
                               f"--metrics_port={p3}"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    segment = max(512, clients * blocks * 3 + 256)
    store = None
    try:
        time.sleep(2)
        store = subprocess.Popen([str(bindir / "mooncake_client"), f"--host=127.0.0.1:{p4}", f"--port={p5}",
                                  f"--global_segment_size={segment}MB", "--local_buffer_size=0",
                                  f"--master_server_address=127.0.0.1:{p2}",
                                  f"--metadata_server=http://127.0.0.1:{p1}/metadata", "--protocol=tcp",
                                  "--threads=2"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(3)
        start_at = time.time() + 5 + clients * 0.5
        workers = [subprocess.Popen([str(PEERS_PY), "-c", MOONCAKE_WORKER, f"http://127.0.0.1:{p1}/metadata",
                                     f"127.0.0.1:{p2}", str(i), str(blocks), str(rounds), str(start_at)],
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for i in range(clients)]
        times = []
        for w in workers:
            outp, errp = w.communicate(timeout=600)
            if w.returncode:
                lines = [ln for ln in errp.strip().splitlines() if ln.strip()]
                why = next((ln for ln in reversed(lines) if "failed" in ln or "Error" in ln), lines[-1] if lines else "?")
                print(f"mooncake worker failed: {why[-300:]}", file=sys.stderr)
                for other in workers:
                    other.kill()
                return {"error": why[-300:]}
            t0, t1, t2, offset = json.loads(outp.strip().splitlines()[-1])
            times.append((t0 + offset, t1 + offset, t2 + offset))  # one clock across processes
        return _rates(times, clients, blocks, rounds)
    finally:
        for p in (store, master):
            if p is not None:
                p.kill()
                p.wait(10)


# -- main ------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--blocks", type=int, default=32, help="1 MiB blocks per client")
    ap.add_argument("--rounds", type=int, default=4, help="loads of all blocks per client")
    ap.add_argument("--no-mooncake", action="store_true")
    args = ap.parse_args()
    capacity = f"{max(args.clients) * args.blocks * 2 + 256}MiB"
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-nixl-") as tmp:
        proc, address = start_server(capacity, Path(tmp))
        try:
            for n in args.clients:
                row = {"clients": n}
                for transport in ("nixl", "tcp"):
                    row[transport] = run_kvstore(address, transport, n, args.blocks, args.rounds)
                row["mooncake_tcp"] = None if args.no_mooncake else run_mooncake(n, args.blocks, args.rounds)
                rows.append(row)
                print(_line(row), flush=True)
        finally:
            proc.kill()
            proc.wait(10)
    report(rows, args)


def _fmt(r: dict | None, k: str) -> str:
    return f"{r[k]:7.2f}" if r and k in r else "    n/a"


def _val(r: dict | None, k: str) -> float:
    return r[k] if r and k in r else float("nan")


def _line(row: dict) -> str:
    n, x, t, m = row["clients"], row["nixl"], row["tcp"], row["mooncake_tcp"]
    return (f"{n:>7} | get GB/s: nixl {_fmt(x, 'get_GBps')} tcp {_fmt(t, 'get_GBps')} mooncake {_fmt(m, 'get_GBps')}"
            f"  ({x['get_GBps'] / t['get_GBps']:.2f}x) | put GB/s: nixl {_fmt(x, 'put_GBps')} "
            f"tcp {_fmt(t, 'put_GBps')} mooncake {_fmt(m, 'put_GBps')}  ({x['put_GBps'] / t['put_GBps']:.2f}x)")


def report(rows: list[dict], args: argparse.Namespace) -> None:
    print()
    print("1 MiB blocks; GB/s, all clients together (nixl/tcp = speed-up of the NIXL path over our TCP path)")
    print(f"{'clients':>7} | {'get nixl':>8} {'get tcp':>8} {'get mc':>8} {'nixl/tcp':>8} | "
          f"{'put nixl':>8} {'put tcp':>8} {'put mc':>8} {'nixl/tcp':>8}")
    for r in rows:
        x, t, m = r["nixl"], r["tcp"], r["mooncake_tcp"]
        print(f"{r['clients']:>7} | {x['get_GBps']:8.2f} {t['get_GBps']:8.2f} "
              f"{_val(m, 'get_GBps'):8.2f} {x['get_GBps'] / t['get_GBps']:8.2f} | "
              f"{x['put_GBps']:8.2f} {t['put_GBps']:8.2f} {_val(m, 'put_GBps'):8.2f} "
              f"{x['put_GBps'] / t['put_GBps']:8.2f}")
        if m and "error" in m:
            print(f"{'':>7}   (Mooncake failed with {r['clients']} clients: {m['error'][:120]})")
    out_dir = ROOT / "benchmarks" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"block_bytes": BLOCK, "blocks_per_client": args.blocks, "rounds": args.rounds, "rows": rows,
              "command": " ".join(["python", "benchmarks/nixl_transport.py"] + sys.argv[1:])}
    (out_dir / "nixl_transport.json").write_text(json.dumps(result, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, op in zip(axes, ("get", "put")):
            xs = [r["clients"] for r in rows]
            for name, label in (("nixl", "kvstore NIXL"), ("tcp", "kvstore TCP"), ("mooncake_tcp", "Mooncake TCP")):
                ys = [_val(r[name], f"{op}_GBps") for r in rows]
                ax.plot(xs, ys, marker="o", label=label)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("clients")
            ax.set_ylabel("GB/s")
            ax.set_title(f"{op}, 1 MiB blocks")
            ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "nixl_transport.png", dpi=100)
    except ImportError:
        pass
    print(f"\nwrote {out_dir / 'nixl_transport.json'}")


if __name__ == "__main__":
    main()
