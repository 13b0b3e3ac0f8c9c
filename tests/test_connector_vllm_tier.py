"""KVStoreTier under vLLM's real OffloadingConnector + TieringOffloadingSpec, scheduler
side: one engine's CPU-tier chunks cascade into kvstore; a second engine (its own,
empty CPU tier) promotes them back and gets the prefix as external tokens.

Lookups are answered from one lease-taking store call per scheduler pass, made off the
scheduler thread: a pass asks, the next answers. Tests call ``tier.wait_idle()``
between steps (it waits for the tier's loads, stores and lookups), so every run is the
same sequence of passes."""

import threading
import uuid

import numpy as np
import pytest

from tests import vllm_support as vs

vs.require_vllm()
servers = pytest.importorskip("tests._servers", reason="the cache server is not in this build")

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata  # noqa: E402
from vllm.v1.kv_offload.base import make_offload_key  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

PROMPT = list(range(10, 110))      # 3 full 32-token chunks + 4 tokens
CHUNK_TOKENS = 32
TOKEN = "tier-test-token"


@pytest.fixture
def engine(tmp_path):
    model = vs.model_dir(tmp_path)
    store = vs.store_config(name=f"t{uuid.uuid4().hex[:8]}")
    made = []

    def make(*, server=None, canonical=False, **tier_kwargs):
        tier_cfg = {"type": "KVStoreTier", "module_path": "kvstore.connectors.vllm", **tier_kwargs}
        tier_cfg.update({"server": server, "token": TOKEN} if server else {"store": store})
        extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 20, "block_size": CHUNK_TOKENS,
                 "secondary_tiers": [tier_cfg]}
        if canonical:
            extra["canonical_layout"] = True
        vc = vs.vllm_config(model, extra, connector="OffloadingConnector", module=None)
        sched = vs.scheduler(vc, vs.kv_cache_config(vc))
        (tier,) = sched.connector.connector_scheduler.manager.secondary_tiers
        made.append(sched)
        return sched, tier

    yield make
    for sched in made:
        sched.connector.shutdown()


@pytest.fixture
def server():
    srv = servers.ThreadServer(servers.config_dict(token=TOKEN))
    yield srv
    srv.stop()


def step(sched, on_store=None):
    """One scheduler step; the (absent) worker completes every transfer at once."""
    out = sched.schedule()
    meta = out.kv_connector_metadata
    for job in meta.store_jobs.values():
        if on_store is not None:
            on_store(job)
    done = {jid: 1 for jid in (*meta.store_jobs, *meta.load_jobs)}
    recving = {job.req_id for job in meta.load_jobs.values()}
    kv_out = KVConnectorOutput(kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=done),
                               finished_recving=recving or None)
    sched.update_from_output(out, vs.model_output(out, kv_out))
    return out


def run(sched, tier, until, on_store=None, steps=12):
    """Step (waiting for the tier between steps) until ``until(out)``; returns every
    output. A bounded number of steps, never a clock."""
    outs = []
    for _ in range(steps):
        outs.append(step(sched, on_store))
        tier.wait_idle()
        if until(outs[-1]):
            return outs
    raise AssertionError(f"not reached in {steps} scheduler steps")


def scheduled(out, req_id):
    return next((r for r in out.scheduled_new_reqs if r.req_id == req_id), None)


def cascade(make, **kw):
    """Engine 1 computes PROMPT; its three full chunks cascade into kvstore. Returns the
    tier, the request and the row bytes per chunk index."""
    s1, tier1 = make(**kw)
    written = {}

    def fill(job):   # stands in for the worker's GPU -> CPU copy
        for c in job.dst_spec.chunk_ids:
            tier1._rows[int(c)][:] = (int(c) * 7 + 3) % 251
            written[len(written)] = tier1._rows[int(c)].copy()

    req = vs.request("r1", PROMPT)
    s1.add_request(req)
    run(s1, tier1, lambda out: len(written) == 3 and tier1.store.stats()["blocks"] >= 3, fill)
    return tier1, req, written


def chunk_key(tier, req, i):
    """The store key of chunk ``i`` of ``req`` (two 16-token blocks per chunk)."""
    return tier._key(make_offload_key(req.block_hashes[2 * i + 1], 0))


def counters(store):
    return store.stats()["connectors"]["vllm_tier"]


def test_chunks_cascade_into_kvstore_and_promote_for_another_engine(engine):
    tier1, _, written = cascade(engine)
    assert type(tier1).__name__ == "KVStoreTier"
    s2, tier2 = engine()
    assert tier2.store is tier1.store          # embedded mode: one Store per config and process
    s2.add_request(vs.request("r2", PROMPT[:96] + list(range(600, 640))))
    outs = run(s2, tier2, lambda out: scheduled(out, "r2"))
    assert scheduled(outs[-1], "r2").num_computed_tokens == 96
    assert outs[-1].num_scheduled_tokens["r2"] == 40
    loaded = [int(c) for out in outs for job in out.kv_connector_metadata.load_jobs.values()
              for c in job.src_spec.chunk_ids]
    assert len(loaded) == 3
    assert all(np.array_equal(tier2._rows[c], w) for c, w in zip(loaded, written.values()))
    step(s2)
    tier2.wait_idle()
    stats = tier2.store.stats()
    assert stats["leases"] == 0
    assert counters(tier2.store)["hit_tokens"] == 96
    assert counters(tier2.store)["loaded_tokens"] == 96
    assert counters(tier2.store)["failed_loads"] == 0


def test_unknown_prefix_is_a_miss(engine):
    s, tier = engine()
    assert tier.store.stats()["blocks"] == 0
    s.add_request(vs.request("r", list(range(3000, 3100))))
    outs = run(s, tier, lambda out: scheduled(out, "r"))
    assert scheduled(outs[-1], "r").num_computed_tokens == 0
    assert not any(out.kv_connector_metadata.load_jobs for out in outs)
    assert tier.store.stats()["leases"] == 0


def test_one_leasing_lookup_per_pass_for_every_request_asking(engine):
    tier1, req, _ = cascade(engine)
    s2, tier2 = engine()
    store = tier2.store
    for rid, tail in (("a", 600), ("b", 700), ("c", None)):
        tokens = PROMPT[:96] + list(range(tail, tail + 40)) if tail else list(range(3000, 3100))
        s2.add_request(vs.request(rid, tokens))
    before = store.stats()["lookups"]
    out = step(s2)
    assert not out.scheduled_new_reqs          # the pass asks; nothing waits on the store
    tier2.wait_idle()
    stats = store.stats()
    # Nine chunks asked by three requests: one lease-taking lookup, and the three
    # chunks held (shared by "a" and "b") are leased.
    assert stats["lookups"] - before == 1
    assert stats["leases"] == 3
    done = set()
    run(s2, tier2, lambda out: done.update(r.req_id for r in out.scheduled_new_reqs) or done == {"a", "b", "c"})
    step(s2)
    tier2.wait_idle()
    assert store.stats()["leases"] == 0
    assert counters(store)["hit_tokens"] == 96      # offered once: "b" found them promoted
    assert counters(store)["loaded_tokens"] == 96


def test_a_lease_is_released_when_its_request_goes_away(engine):
    tier1, req, _ = cascade(engine)
    store = tier1.store
    s2, tier2 = engine()
    s2.add_request(vs.request("r2", PROMPT[:96] + [5] * 20))
    step(s2)
    tier2.wait_idle()
    assert store.stats()["leases"] == 3
    keys = [chunk_key(tier1, req, i) for i in range(3)]
    assert store.lookup(keys, lease_s=60) == 3      # another client leases the same chunks
    s2.finish_requests("r2", RequestStatus.FINISHED_ABORTED)
    step(s2)
    tier2.wait_idle()
    assert store.stats()["leases"] == 3             # the tier gave back its own leases only
    store.release(keys)
    assert store.stats()["leases"] == 0
    assert counters(store)["hit_tokens"] == 0


def test_server_mode_lookup_never_waits_for_the_server(engine, server):
    tier1, _, written = cascade(engine, server=server.address)
    assert server.store.stats()["blocks"] == 3
    s2, tier2 = engine(server=server.address)
    s2.add_request(vs.request("r2", PROMPT[:96] + list(range(600, 640))))
    s2.add_request(vs.request("r3", PROMPT[:64] + list(range(700, 740))))
    # Stop the server answering: its event loop waits on `gate`.
    gate, paused = threading.Event(), threading.Event()
    server.loop.call_soon_threadsafe(lambda: (paused.set(), gate.wait()))
    assert paused.wait(10)
    try:
        out = step(s2)                          # returns although the server is silent
        assert not out.scheduled_new_reqs
        assert tier2.has_pending_work()
    finally:
        gate.set()
    computed = {}
    outs = run(s2, tier2, lambda out: computed.update({r.req_id: r.num_computed_tokens
                                                       for r in out.scheduled_new_reqs}) or len(computed) == 2)
    assert computed == {"r2": 96, "r3": 64}
    loaded = [int(c) for out in outs for job in out.kv_connector_metadata.load_jobs.values()
              for c in job.src_spec.chunk_ids]
    assert all(np.array_equal(tier2._rows[c], w) for c, w in zip(loaded, written.values()))
    step(s2)
    tier2.wait_idle()
    # The server keeps a lease until it expires unless the tier gives it back.
    assert server.store.stats()["leases"] == 0
    assert counters(tier2.store)["loaded_tokens"] == 96


def test_a_chunk_that_cannot_load_is_a_miss_not_a_retry_loop(engine):
    tier1, req, _ = cascade(engine)
    store = tier1.store
    bad = chunk_key(tier1, req, 1)
    assert store.delete([bad]) == 1
    # A block of the wrong size under chunk 1's key: the load is refused.
    assert store.save([bad], [np.zeros(tier1._rows.shape[1] - 8, np.uint8)]).result() == [True]
    s2, tier2 = engine()
    s2.add_request(vs.request("r2", PROMPT[:96] + list(range(600, 640))))
    outs = run(s2, tier2, lambda out: scheduled(out, "r2"))
    assert scheduled(outs[-1], "r2").num_computed_tokens == 0
    assert counters(store)["failed_loads"] == 3
    assert counters(store)["loaded_tokens"] == 0
    step(s2)
    tier2.wait_idle()
    assert store.stats()["leases"] == 0


def test_canonical_and_direct_rows_never_share_keys(engine):
    tier1, _, _ = cascade(engine)
    s2, tier2 = engine(canonical=True)        # same model, dtype and row size; other byte order
    s2.add_request(vs.request("r2", PROMPT[:96] + list(range(600, 640))))
    outs = run(s2, tier2, lambda out: scheduled(out, "r2"))
    assert scheduled(outs[-1], "r2").num_computed_tokens == 0
    assert tier2.namespace != tier1.namespace


def test_redeployed_weights_with_a_new_weights_version_never_share_keys(engine):
    tier1, _, _ = cascade(engine)
    s2, tier2 = engine(weights_version="v2")   # same path, dtype and rows; other weights
    s2.add_request(vs.request("r2", PROMPT[:96] + list(range(600, 640))))
    outs = run(s2, tier2, lambda out: scheduled(out, "r2"))
    assert scheduled(outs[-1], "r2").num_computed_tokens == 0
    assert tier2.namespace.model == tier1.namespace.model + ";weights=v2"


def test_shutdown_detaches_counters_and_releases_leases(engine):
    cascade(engine)
    s2, tier2 = engine()
    store = tier2.store
    s2.add_request(vs.request("r2", PROMPT[:96] + [5] * 20))
    step(s2)
    tier2.wait_idle()
    assert store.stats()["leases"] == 3
    step(s2)                                    # the hits are offered, their load submitted
    assert counters(store)["hit_tokens"] == 96
    tier2.shutdown()
    assert store.stats()["leases"] == 0
    assert counters(store)["hit_tokens"] == 0   # only engine 1's counters are left
