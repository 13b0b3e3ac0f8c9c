"""LMCache 0.5.6's multiprocess server as a benchmark peer, driven by its own client
(``lmcache bench server --mode cpu``): 512 tokens of its default KV shape
``(2,1024,16,8,128):float16:32`` per request = 64 MiB, stored then retrieved, every
retrieve checksum-verified by LMCache itself.

Its client times each request and does not run for a fixed duration, so throughput is
derived from its own measurements: each client's bytes retrieved / the sum of its
retrieve latencies, summed over the clients running at once. Its chunks are 256 tokens
(32 MiB) whatever block size the other systems use.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from benchmarks._server_peers import PEERS_VENV, Peer, _peers_python, _spawn, _wait_port, free_port

REQUEST_BYTES = 512 * 2 * 8 * 128 * 2 * 32   # tokens x (K,V) x heads x head dim x fp16 x layers


class LmcachePeer(Peer):
    self_driven = True

    def __init__(self, tmp: Path, max_clients: int) -> None:
        super().__init__()
        self.python = _peers_python()
        exe = PEERS_VENV / "bin" / "lmcache"
        if not exe.exists():
            raise RuntimeError("lmcache not installed; run benchmarks/install_peers.sh")
        self.env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1"}
        self.port, self.http_port = free_port(), free_port()
        self.exe = str(exe)
        self.procs.append(_spawn([self.exe, "server", "--host", "127.0.0.1", "--port", str(self.port),
                                  "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
                                  "--l1-size-gb", "2", "--no-l1-use-lazy", "--eviction-policy", "LRU",
                                  "--chunk-size", "256", "--supported-transfer-mode", "auto",
                                  "--shm-name", f"kvstore-bench-{os.getpid()}"], tmp / "lmcache.log", self.env))
        _wait_port(self.port, self.procs[-1], "lmcache server", timeout_s=120)
        _wait_port(self.http_port, self.procs[-1], "lmcache server http", timeout_s=120)
        self._done: dict[int, dict] = {}
        self.client_counts: set[int] = {1, 4}

    def describe(self) -> str:
        return f"tcp://127.0.0.1:{self.port} (shm transfers)"

    def run(self, system: str, block: int, clients: int, seconds: float, tmp: Path, cell: int) -> dict:
        if clients in self._done:  # its request shape ignores our block size: measured once per count
            return {**self._done[clients], "note": "same LMCache run as the other block size"}
        if clients not in self.client_counts:
            return {"error": [f"skipped: LMCache runs with {sorted(self.client_counts)} clients "
                              f"(--lmcache-clients); each of its clients loads torch"]}
        requests = 3
        procs, outs = [], []
        for w in range(clients):
            out = tmp / f"lmcache-{cell}-{w}.json"
            outs.append(out)
            start = (cell * 100 + w) * 1000
            procs.append(subprocess.Popen(
                [self.exe, "bench", "server", "--mode", "cpu", "--rpc-url", f"tcp://127.0.0.1:{self.port}",
                 "--url", f"http://127.0.0.1:{self.http_port}", "--num-tokens", "512", "--start", str(start),
                 "--end", str(start + requests), "--interval", "0", "--format", "json", "--output", str(out), "-q"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=self.env))
        try:
            return self._collect(procs, outs, clients, requests)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()

    def _collect(self, procs: list, outs: list, clients: int, requests: int) -> dict:
        t0 = time.time()
        rates, lat, verified = [], [], True
        for p, out in zip(procs, outs):
            try:
                _, err = p.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                return {"error": ["lmcache bench server timed out"]}
            if p.returncode != 0 or not out.exists():
                return {"error": [(err or "no output").strip().splitlines()[-1][:200]]}
            m = json.loads(out.read_text())["metrics"]
            r = m["warm_retrieve"]
            verified &= m["results"]["checksum_fail"] == 0 and m["results"]["checksum_ok"] == r["warm_retrieve_count"]
            rates.append(r["warm_retrieve_count"] * REQUEST_BYTES / (r["warm_retrieve_mean"] * r["warm_retrieve_count"] / 1e3))
            lat.append((r["warm_retrieve_p50"], r["warm_retrieve_p99"]))
            put = m["cold_store"]
        result = {"get_gbps": sum(rates) / 1e9, "p50_ms": max(x[0] for x in lat), "p99_ms": max(x[1] for x in lat),
                  "put_gbps": clients * REQUEST_BYTES / (put["cold_store_mean"] / 1e3) / 1e9,
                  "requests": clients * requests, "verified": verified, "wall_s": time.time() - t0,
                  "method": "from LMCache's own per-request retrieve latencies (64 MiB requests, 32 MiB chunks)"}
        self._done[clients] = result
        return result
