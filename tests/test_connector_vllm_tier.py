"""KVStoreTier under vLLM's real OffloadingConnector + TieringOffloadingSpec, scheduler
side: one engine's CPU-tier chunks cascade into kvstore; a second engine (its own,
empty CPU tier) promotes them back and gets the prefix as external tokens."""

import time
import uuid

import numpy as np
import pytest

from tests import vllm_support as vs

vs.require_vllm()

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402

PROMPT = list(range(10, 110))


@pytest.fixture
def engine(tmp_path):
    model = vs.model_dir(tmp_path)
    store = vs.store_config(name=f"t{uuid.uuid4().hex[:8]}")
    made = []

    def make():
        extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 20, "block_size": 32,
                 "secondary_tiers": [{"type": "KVStoreTier", "module_path": "connectors.vllm", "store": store}]}
        vc = vs.vllm_config(model, extra, connector="OffloadingConnector", module=None)
        sched = vs.scheduler(vc, vs.kv_cache_config(vc))
        (tier,) = sched.connector.connector_scheduler.manager.secondary_tiers
        made.append(sched)
        return sched, tier

    yield make
    for sched in made:
        sched.connector.shutdown()


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


def test_chunks_cascade_into_kvstore_and_promote_for_another_engine(engine):
    s1, tier1 = engine()
    assert type(tier1).__name__ == "KVStoreTier"
    written = {}

    def fill(job):   # stands in for the worker's GPU -> CPU copy
        for c in job.dst_spec.chunk_ids:
            tier1._rows[int(c)][:] = (int(c) * 7 + 3) % 251
            written[int(c)] = tier1._rows[int(c)].copy()

    s1.add_request(vs.request("r1", PROMPT))
    step(s1, fill)
    deadline = time.monotonic() + 30
    while tier1.store.stats()["blocks"] < 3:
        assert time.monotonic() < deadline, "chunks never reached kvstore"
        step(s1)
        time.sleep(0.005)
    assert len(written) == 3

    s2, tier2 = engine()
    assert tier2.store is tier1.store          # embedded mode: one Store per config and process
    s2.add_request(vs.request("r2", PROMPT[:96] + list(range(600, 640))))
    loaded = []
    deadline = time.monotonic() + 30
    while True:
        out = step(s2)
        loaded += [int(c) for job in out.kv_connector_metadata.load_jobs.values() for c in job.src_spec.chunk_ids]
        if out.scheduled_new_reqs:
            break
        assert time.monotonic() < deadline, "r2 never scheduled"
        time.sleep(0.005)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 96
    assert out.num_scheduled_tokens["r2"] == 40
    assert len(loaded) == 3
    promoted = [tier2._rows[c] for c in loaded]
    assert all(np.array_equal(p, w) for p, w in zip(promoted, written.values()))


def test_unknown_prefix_is_a_miss(engine):
    s, tier = engine()
    assert tier.store.stats()["blocks"] == 0
    s.add_request(vs.request("r", list(range(3000, 3100))))
    out = step(s)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    assert not out.kv_connector_metadata.load_jobs
