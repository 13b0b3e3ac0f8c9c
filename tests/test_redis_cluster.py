"""The redis tier against a real 3-master Redis Cluster on loopback (3 ``redis-server
--cluster-enabled yes`` joined by ``redis-cli --cluster create``): conformance, keys spread
over every master, a master killed in the middle of loads (misses, no exception, the fault
counted) and restarted (the tier comes back by itself, blocks byte-exact), recovery via
SCAN of every master."""

import threading
import time
import uuid

import numpy as np
import pytest

from kvstore.store import Store
from kvstore.testing import CAPACITY, TierConformance, make_keys, payload
from tests._redis import running_cluster

pytest.importorskip("redis", reason="redis-py is installed by scripts/deps/00-python.sh")
pytestmark = pytest.mark.redis
BLOCK = 64 * 1024


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from running_cluster(tmp_path_factory, "redis-cluster")


def make_tier(cluster, capacity=CAPACITY, prefix=None, **kwargs):
    from kvstore.tiers.redis import RedisTier

    return RedisTier(capacity, name="cluster-test", nodes=cluster.nodes_list[:1], prefix=prefix or
                     f"c{uuid.uuid4().hex[:10]}", concurrency=4, timeout_s=1.0, **kwargs)


@pytest.fixture
def tier(cluster):
    t = make_tier(cluster)
    yield t
    t.close()


class TestRedisClusterConformance(TierConformance):
    CONCURRENCY_ROUNDS = 5


def test_cluster_detected_and_keys_spread_over_every_master(cluster):
    tier = make_tier(cluster, capacity=64 * BLOCK)
    assert tier.stats()["mode"] == "cluster"   # cluster: auto, from one seed node
    keys = make_keys(24, salt="spread")
    assert all(tier.write(keys, [payload(i) for i in range(24)]))
    per_node = [int(n.cli("DBSIZE").strip() or 0) for n in cluster.nodes]
    assert all(count > 0 for count in per_node), per_node
    fresh = make_tier(cluster, prefix=tier.prefix)
    try:
        found = fresh.recover()   # SCAN on every master
        assert {b.key for b in found} == set(keys)
        assert {b.key: b.key.parent for b in found} == {k: k.parent for k in keys}
    finally:
        fresh.close()
        tier.close()


def test_master_killed_mid_load_then_restarted(cluster):
    keys = make_keys(32, salt="kill")
    srcs = [payload(i, BLOCK) for i in range(32)]
    cfg = {"tiers": [{"name": "shared", "kind": "redis", "nodes": cluster.nodes_list, "capacity": "64MiB",
                      "prefix": f"k{uuid.uuid4().hex[:8]}", "timeout_s": 0.5, "max_attempts": 2}]}
    victim = cluster.nodes[1]
    with Store.from_config(cfg) as store:
        assert all(store.save(keys, srcs).result())
        results, errors, wrong = [], [], []
        stop = threading.Event()

        def loader():
            dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
            while not stop.is_set():
                try:
                    ok = store.load(keys, dsts).result()
                except BaseException as exc:   # must never happen: faults are misses
                    errors.append(exc)
                    return
                results.append(sum(ok))
                wrong.extend(j for j, good in enumerate(ok) if good and not np.array_equal(dsts[j], srcs[j]))

        thread = threading.Thread(target=loader)
        thread.start()
        try:
            time.sleep(0.3)
            victim.kill()
            time.sleep(1.0)
            down = store.stats()["tiers"][0]
            victim.start()
            cluster.wait_ok()
            deadline = time.monotonic() + 20
            while not store.stats()["tiers"][0]["healthy"]:
                assert time.monotonic() < deadline, "tier did not come back after the node did"
                time.sleep(0.1)
            time.sleep(0.3)
        finally:
            stop.set()
            thread.join(30)
        assert not errors, errors[0]
        assert not wrong, "a load reported True for bytes that differ from the block"
        assert down["faults"] >= 1 and down["outages"] >= 1
        assert 0 in results and results[-1] == len(keys)   # misses while down, all back after
        dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
        assert store.load(keys, dsts).result() == [True] * len(keys)
        assert all(np.array_equal(s, d) for s, d in zip(srcs, dsts))
