"""Cross-node hits (the ``cross`` table of ``benchmarks/cluster.py``): a batch of blocks
saved on node A and read on node B through each shared path, everything on loopback,
every service started and stopped here.

- ``remote``: node A is a ``kvstore serve`` process (DRAM); A's blocks are saved through a
  ``Client``; node B reads them through a ``remote`` tier on A's server over TCP (what a
  node on another host gets: no shared memory).
- ``redis``: a 3-master Redis Cluster; A writes through its redis tier, B reads through
  a redis tier of its own (same prefix, an index that has never seen the keys).
- ``mooncake``: a Mooncake Store pool (master + one storage node holding the segment);
  A and B are two mooncake tiers on it, over TCP.
- ``s3``: an S3 tier per node on one Swift bucket.

B's tier is a fresh instance that did not write the blocks: before timing, B finds them
(``Tier.find`` for the shared tiers, ``contains`` for the remote one) and one untimed
read checks every block byte-exact. Every timed read verifies each block (the tiers'
header and checksum, the client's end-to-end checksum for ``remote``). Reported per
batch: GB/s at the median batch time, p50 and p99 of the batch times (``--cross-repeat``
batches; with 20, p99 is close to the slowest).
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable

import numpy as np

from kvstore.testing import make_keys

PATHS = ("remote", "redis", "mooncake", "s3")


def _time_reads(read: Callable[[], list[bool]], repeat: int) -> list[float]:
    read()   # warm connections and pages
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        ok = read()
        times.append(time.perf_counter() - t0)
        if not all(ok):
            raise RuntimeError(f"a cross-node read missed {ok.count(False)} block(s)")
    return times


def _row(path: str, detail: str, block_bytes: int, blocks: int, times: list[float]) -> dict:
    batch = block_bytes * blocks
    t = np.asarray(times)
    return {"path": path, "detail": detail, "block_bytes": block_bytes, "blocks": blocks, "batch_bytes": batch,
            "batches": len(times), "gbps": batch / float(np.median(t)) / 1e9,
            "p50_ms": float(np.percentile(t, 50)) * 1e3, "p99_ms": float(np.percentile(t, 99)) * 1e3,
            "max_ms": float(t.max()) * 1e3, "verified": True}


def _check(ok: list[bool], dsts, srcs) -> None:
    if not all(ok) or not all(np.array_equal(d, s) for d, s in zip(dsts, srcs)):
        raise RuntimeError("node B did not read node A's blocks byte-exact")


def _remote(tmp: Path, keys, srcs, dsts, repeat: int) -> dict:
    from kvstore.client import Client
    from tests._servers import ProcessServer
    from kvstore.tiers.remote import RemoteTier

    batch = sum(s.nbytes for s in srcs)
    raw = {"tiers": [{"name": "hot", "kind": "dram", "capacity": 4 * batch, "pin": False}],
           "server": {"host": "127.0.0.1", "port": 0, "admin_port": 0, "socket_path": str(tmp / "a.sock")}}
    node_a = ProcessServer(raw, tmp)
    try:
        with Client(node_a.address, transport="tcp") as client_a:
            assert client_a.save(keys, srcs).result(60) == [True] * len(keys)
        tier = RemoteTier(node_a.address, 4 * batch, name="remote",
                          client=Client(node_a.address, transport="tcp", timeout_s=60))
        try:
            assert tier.contains(keys) == [True] * len(keys)
            _check(tier.read_into(keys, dsts), dsts, srcs)
            times = _time_reads(lambda: tier.read_into(keys, dsts), repeat)
        finally:
            tier.close()
    finally:
        node_a.kill()
    return _row("remote tier (node A's server, TCP)", "kvstore serve (DRAM) <- remote tier, Client over TCP",
                srcs[0].nbytes, len(keys), times)


def _redis(tmp: Path, keys, srcs, dsts, repeat: int) -> dict:
    from tests._redis import RedisCluster
    from kvstore.tiers.redis import RedisTier

    batch = sum(s.nbytes for s in srcs)
    cluster = RedisCluster(tmp / "redis")
    try:
        kw = dict(nodes=cluster.nodes_list, prefix="cross", concurrency=4, timeout_s=10.0)
        node_a, node_b = RedisTier(4 * batch, name="a", **kw), RedisTier(4 * batch, name="b", **kw)
        try:
            assert node_a.write(keys, srcs) == [True] * len(keys)
            assert node_b.find(keys) == [s.nbytes for s in srcs]
            _check(node_b.read_into(keys, dsts), dsts, srcs)
            times = _time_reads(lambda: node_b.read_into(keys, dsts), repeat)
        finally:
            node_a.close()
            node_b.close()
    finally:
        cluster.stop()
    return _row("Redis Cluster (3 masters)", "redis tier on node A -> redis tier on node B (hiredis, RESP2)",
                srcs[0].nbytes, len(keys), times)


def _mooncake(tmp: Path, keys, srcs, dsts, repeat: int) -> dict:
    from tests._mooncake import MooncakePool, missing
    from kvstore.tiers.mooncake import MooncakeTier

    if missing():
        raise ImportError(missing())

    batch = sum(s.nbytes for s in srcs)
    pool = MooncakePool(tmp, segment_mib=max(256, 4 * batch >> 20))
    try:
        kw = dict(master=pool.master, metadata_server=pool.metadata, staging_bytes=batch + len(keys) * 4096,
                  prefix="cross")
        node_a, node_b = MooncakeTier(4 * batch, name="a", **kw), MooncakeTier(4 * batch, name="b", **kw)
        try:
            assert node_a.write(keys, srcs) == [True] * len(keys)
            assert node_b.find(keys) == [s.nbytes for s in srcs]
            _check(node_b.read_into(keys, dsts), dsts, srcs)
            times = _time_reads(lambda: node_b.read_into(keys, dsts), repeat)
        finally:
            node_a.close()
            node_b.close()
    finally:
        pool.stop()
    return _row("Mooncake Store (TCP, 1 storage node)", "mooncake tier on node A -> mooncake tier on node B",
                srcs[0].nbytes, len(keys), times)


def _s3(tmp: Path, keys, srcs, dsts, repeat: int) -> dict:
    from tests._swift import REGION, SwiftServer, aws_env
    from kvstore.tiers.s3 import S3Tier

    batch = sum(s.nbytes for s in srcs)
    saved = dict(os.environ)
    server = SwiftServer(tmp / "swift").start()
    try:
        os.environ.update(aws_env(server, tmp / "swift"))
        server.client().create_bucket(Bucket="kvstore-cross")
        kw = dict(bucket="kvstore-cross", endpoint_url=server.endpoint_url, region=REGION, addressing_style="path",
                  prefix=f"cross-{uuid.uuid4().hex[:8]}", concurrency=8)
        node_a, node_b = S3Tier(4 * batch, name="a", **kw), S3Tier(4 * batch, name="b", **kw)
        try:
            assert node_a.write(keys, srcs) == [True] * len(keys)
            assert node_b.find(keys) == [s.nbytes for s in srcs]
            _check(node_b.read_into(keys, dsts), dsts, srcs)
            times = _time_reads(lambda: node_b.read_into(keys, dsts), repeat)
        finally:
            node_a.close()
            node_b.close()
    finally:
        server.stop()
        os.environ.clear()
        os.environ.update(saved)
    return _row("S3 (Swift, 8 requests in flight)", "s3 tier on node A -> s3 tier on node B, one bucket",
                srcs[0].nbytes, len(keys), times)


RUNNERS = {"remote": _remote, "redis": _redis, "mooncake": _mooncake, "s3": _s3}


def cross_rows(paths: list[str], block_bytes: int = 1 << 20, blocks: int = 64, repeat: int = 20
               ) -> tuple[list[dict], dict[str, str]]:
    """``(rows, skipped)``: one row per path; a path whose service or package is not
    installed here is skipped with the reason (said, never silent)."""
    rng = np.random.default_rng(21)
    srcs = [rng.integers(0, 256, block_bytes, dtype=np.uint8) for _ in range(blocks)]
    rows, skipped = [], {}
    for path in paths:
        keys = make_keys(blocks, salt=f"cross-{path}-{uuid.uuid4().hex[:6]}")
        dsts = [np.zeros(block_bytes, np.uint8) for _ in range(blocks)]
        with tempfile.TemporaryDirectory() as tmp:
            try:
                rows.append(RUNNERS[path](Path(tmp), keys, srcs, dsts, repeat))
            except (ImportError, FileNotFoundError) as exc:
                skipped[path] = f"{type(exc).__name__}: {exc}"
                print(f"cross {path}: skipped ({skipped[path]})")
    return rows, skipped


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["path"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 0.8 + 0.7 * len(rows)), sharey=True)
    y = np.arange(len(rows))
    ax1.barh(y, [r["gbps"] for r in rows], color="tab:blue")
    ax1.set_yticks(y, names)
    ax1.invert_yaxis()
    ax1.set_xlabel("GB/s (median batch)")
    ax1.set_xlim(0, 1.2 * max(r["gbps"] for r in rows))
    for i, r in enumerate(rows):
        ax1.text(r["gbps"], i, f" {r['gbps']:.2f}", va="center")
    ax2.barh(y - 0.2, [r["p50_ms"] for r in rows], height=0.4, color="tab:gray", label="p50")
    ax2.barh(y + 0.2, [r["p99_ms"] for r in rows], height=0.4, color="tab:red", label="p99")
    ax2.set_xscale("log")
    ax2.set_xlabel("ms per batch (log)")
    ax2.set_xlim(right=4 * max(r["p99_ms"] for r in rows))
    ax2.legend(loc="upper right")
    for i, r in enumerate(rows):
        ax2.text(r["p99_ms"], i + 0.2, f" {r['p99_ms']:.0f}", va="center")
    batch = rows[0]["batch_bytes"] >> 20 if rows else 0
    fig.suptitle(f"Cross-node hit: {batch} MiB batch saved on node A, read (verified) on node B, loopback")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
