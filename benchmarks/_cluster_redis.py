"""The redis tier against raw redis-py on the same server (the redis rows
``benchmarks/cluster.py`` prints), standalone and as a 3-master Cluster.

One batch of blocks put and got. The tier goes through its verified block format
(header + XXH3 checksum on write, verification on read) and its own pipelined RESP
path; raw redis-py is a non-transactional pipeline of ``SET name <payload>`` /
``GET name`` (``RedisCluster.pipeline()`` for the Cluster), with the same client
settings (RESP2, hiredis, timeouts, pool size), nothing verified, and GET results left
as the ``bytes`` redis-py returns (not copied into a caller's buffer). Each repeat runs
the two back to back, alternating which goes first; the ratio is the median of the
per-pair ratios, so load from other jobs on a shared machine cancels out.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

from kvstore.testing import make_keys


def _paired(ours: tuple[Callable, Callable, Callable], theirs: tuple[Callable, Callable, Callable],
            repeat: int) -> tuple[float, float, float]:
    """``(median s ours, median s theirs, median ratio theirs/ours)``; each side is
    ``(setup, timed, teardown)`` and only ``timed`` is measured."""
    t_ours, t_theirs, ratios = [], [], []
    for r in range(repeat + 1):
        pair = []
        for setup, timed, teardown in ((ours, theirs) if r % 2 else (theirs, ours)):
            state = setup()
            t0 = time.perf_counter()
            timed(state)
            pair.append(time.perf_counter() - t0)
            teardown(state)
        a, b = pair if r % 2 else pair[::-1]   # a: ours, b: theirs
        if r:   # the first pair warms connections and pages up
            t_ours.append(a)
            t_theirs.append(b)
            ratios.append(b / a)
    return statistics.median(t_ours), statistics.median(t_theirs), statistics.median(ratios)


def _rows_for(label: str, tier, raw, block_bytes: int, blocks: int, repeat: int) -> list[dict]:
    batch = block_bytes * blocks
    rng = np.random.default_rng(0)
    srcs = [rng.integers(0, 256, block_bytes, dtype=np.uint8) for _ in range(blocks)]
    dsts = [np.zeros(block_bytes, np.uint8) for _ in range(blocks)]
    runs = iter(range(1 << 30))

    def tier_setup():
        return make_keys(blocks, salt=f"put{next(runs)}")

    def tier_put(keys):
        assert tier.write(keys, srcs) == [True] * blocks

    def raw_setup():
        return [f"rawput{next(runs)}:{i}" for i in range(blocks)]

    def raw_put(names):
        pipe = raw.pipeline(transaction=False) if not hasattr(raw, "nodes_manager") else raw.pipeline()
        for name, src in zip(names, srcs):
            pipe.set(name, memoryview(src))
        assert all(pipe.execute())

    get_keys = make_keys(blocks, salt="get")
    assert tier.write(get_keys, srcs) == [True] * blocks
    get_names = [f"rawget:{i}" for i in range(blocks)]
    raw_put(get_names)

    def tier_get(_):
        assert tier.read_into(get_keys, dsts) == [True] * blocks

    def raw_get(_):
        pipe = raw.pipeline(transaction=False) if not hasattr(raw, "nodes_manager") else raw.pipeline()
        for name in get_names:
            pipe.get(name)
        assert all(len(v) == block_bytes for v in pipe.execute())

    def nothing():
        return None

    rows = []
    for op, ours, theirs in (
            ("put", (tier_setup, tier_put, tier.delete), (raw_setup, raw_put, lambda names: raw.delete(*names)
                                                          if not hasattr(raw, "nodes_manager")
                                                          else [raw.delete(n) for n in names])),
            ("get", (nothing, tier_get, lambda _: None), (nothing, raw_get, lambda _: None))):
        t_ours, t_raw, ratio = _paired(ours, theirs, repeat)
        rows.append({"path": f"redis ({label})", "op": op, "block_bytes": block_bytes, "blocks": blocks,
                     "kvstore_gbps": batch / t_ours / 1e9, "baseline": "raw redis-py pipeline (hiredis, RESP2)",
                     "baseline_gbps": batch / t_raw / 1e9, "ratio": ratio})
    assert all(np.array_equal(s, d) for s, d in zip(srcs, dsts))
    return rows


def redis_rows(block_bytes: int = 1 << 20, blocks: int = 64, repeat: int = 7, concurrency: int = 4) -> list[dict]:
    """Rows for a standalone server and a 3-master Cluster, started here and stopped after."""
    import redis
    from redis.cluster import ClusterNode, RedisCluster as RawCluster

    from tests._redis import RedisCluster, RedisServer
    from kvstore.tiers.redis import RedisTier

    batch = block_bytes * blocks
    client_kw = dict(protocol=2, socket_timeout=10.0, socket_connect_timeout=10.0, max_connections=4 * concurrency)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp) / "standalone")
        try:
            tier = RedisTier(8 * batch, url=server.url, prefix="bench", concurrency=concurrency, timeout_s=10.0)
            raw = redis.Redis(host="127.0.0.1", port=server.port, **client_kw)
            rows += _rows_for("standalone", tier, raw, block_bytes, blocks, repeat)
            tier.close()
            raw.close()
        finally:
            server.stop()
        cluster = RedisCluster(Path(tmp) / "cluster")
        try:
            tier = RedisTier(8 * batch, nodes=cluster.nodes_list, prefix="bench", concurrency=concurrency,
                             timeout_s=10.0)
            raw = RawCluster(startup_nodes=[ClusterNode("127.0.0.1", n.port) for n in cluster.nodes], **client_kw)
            rows += _rows_for("3-master Cluster", tier, raw, block_bytes, blocks, repeat)
            tier.close()
            raw.close()
        finally:
            cluster.stop()
    return rows
