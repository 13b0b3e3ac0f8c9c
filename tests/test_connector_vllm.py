"""The vLLM connector driven by vLLM's real Scheduler (loaded by module path), with the
worker hooks run on real CPU KV caches from vLLM's allocator."""

import time
import uuid

import pytest
import torch

from tests import vllm_support as vs

vs.require_vllm()

CHUNK = 32                       # two vLLM blocks of 16 tokens
PROMPT = list(range(10, 110))    # 100 tokens: 3 full chunks


@pytest.fixture
def engines(tmp_path):
    """Factory of (scheduler, worker connector, kv caches) that share one embedded store
    per test, like two engines in front of one kvstore server."""
    model = vs.model_dir(tmp_path)
    tier = f"t{uuid.uuid4().hex[:8]}"   # a store of its own for this test
    made = []

    def make(layout="LBHNC", seed=None, **options):
        extra = {"store": vs.store_config(name=tier), "chunk_tokens": CHUNK, **options}
        vc = vs.vllm_config(model, extra, layout=layout)
        kcc = vs.kv_cache_config(vc)
        sched = vs.scheduler(vc, kcc)
        worker = vs.worker_connector(vc, kcc)
        caches = vs.kv_caches(kcc, layout, seed=seed)
        worker.register_kv_caches(caches)
        made.append((sched, worker))
        return sched, worker, caches

    yield make
    for sched, worker in made:
        worker.shutdown()
        sched.connector.shutdown()


def step(sched, worker):
    out = sched.schedule()
    kv_out = vs.run_worker_step(worker, out.kv_connector_metadata, out.finished_req_ids)
    sched.update_from_output(out, vs.model_output(out, kv_out))
    return out, kv_out


def run_to_completion(sched, worker, req, *, landed=True):
    """Schedule ``req`` until it finishes and its async saves are reported done (and,
    with ``landed``, until the store holds them); the connector's saves of it."""
    sched.add_request(req)
    saves = []
    deadline = time.monotonic() + 30
    while sched.has_unfinished_requests() or req.request_id in sched.requests:
        out, _ = step(sched, worker)
        saves += out.kv_connector_metadata.saves
        if not out.num_scheduled_tokens:
            time.sleep(0.005)    # only async saves left: let the store's threads run
        assert time.monotonic() < deadline, "request did not finish"
    # A finished request's blocks are free at once (saves read staging copies): wait
    # until the store holds what was saved, as a later engine would find it.
    keys = [k for t in saves for k in t.keys_for(0)] if landed else []
    while keys and not all(worker.store.contains(keys)):
        assert time.monotonic() < deadline, "saves did not land"
        time.sleep(0.005)
    return saves


def blocks_of(transfers):
    return [b for t in transfers for b in t.block_ids]


def same_pages(src, src_blocks, dst, dst_blocks):
    return all(torch.equal(src[n][torch.tensor(src_blocks)], dst[n][torch.tensor(dst_blocks)]) for n in src)


def test_first_request_saves_and_second_gets_exactly_the_cached_prefix(engines):
    s1, w1, c1 = engines(seed=1)
    saves = run_to_completion(s1, w1, vs.request("r1", PROMPT))
    assert [t.num_chunks for t in saves] == [3] and w1.store.stats()["blocks"] == 3

    s2, w2, c2 = engines()
    run_to_completion(s2, w2, vs.request("other", list(range(500, 540))))  # shifts block ids
    s2.add_request(vs.request("r2", PROMPT[:96] + list(range(600, 640))))
    out, kv_out = step(s2, w2)
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 96                 # 3 chunks from the store
    assert out.num_scheduled_tokens["r2"] == 136 - 96
    (load,) = out.kv_connector_metadata.loads
    assert not kv_out.invalid_block_ids
    assert blocks_of([load]) == list(new.block_ids[0][:6])
    assert blocks_of([load]) != blocks_of(saves)
    assert same_pages(c1, blocks_of(saves), c2, blocks_of([load]))


def test_last_prompt_token_is_never_served_from_the_store(engines):
    s1, w1, _ = engines(seed=1)
    run_to_completion(s1, w1, vs.request("r1", PROMPT))
    s2, w2, _ = engines()
    s2.add_request(vs.request("r2", PROMPT[:96]))        # the whole prompt is cached
    out, _ = step(s2, w2)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 64
    assert out.num_scheduled_tokens["r2"] == 32


def test_async_load_moves_request_from_waiting_to_running(engines):
    from vllm.v1.request import RequestStatus

    s1, w1, c1 = engines(seed=2)
    saves = run_to_completion(s1, w1, vs.request("r1", PROMPT))
    s2, w2, c2 = engines(load_async=True)
    req = vs.request("r2", PROMPT[:64] + list(range(700, 720)))
    s2.add_request(req)
    out, kv_out = step(s2, w2)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert out.num_scheduled_tokens == {}
    (load,) = out.kv_connector_metadata.loads
    assert load.is_async and load.num_chunks == 2
    recving = kv_out.finished_recving or set()
    deadline = time.monotonic() + 30
    while "r2" not in recving and time.monotonic() < deadline:
        time.sleep(0.005)
        out, kv_out = step(s2, w2)
        recving = kv_out.finished_recving or set()
    assert recving == {"r2"} and not kv_out.invalid_block_ids
    out = s2.schedule()
    assert req.status == RequestStatus.RUNNING and req in s2.running
    assert out.num_scheduled_tokens["r2"] == 84 - 64
    assert same_pages(c1, blocks_of(saves)[:4], c2, blocks_of([load]))


def test_other_cache_salt_gets_no_hit(engines):
    s1, w1, _ = engines(seed=3)
    run_to_completion(s1, w1, vs.request("r1", PROMPT, cache_salt="tenant-a"))
    s2, w2, _ = engines()
    s2.add_request(vs.request("b", PROMPT, cache_salt="tenant-b"))
    s2.add_request(vs.request("none", PROMPT))
    s2.add_request(vs.request("a", PROMPT, cache_salt="tenant-a"))
    out, _ = step(s2, w2)
    computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
    assert computed == {"b": 0, "none": 0, "a": 96}


def test_failed_chunk_is_recomputed_by_vllm(engines):
    """A chunk that cannot be loaded is reported as a load error; vLLM's scheduler then
    treats the request as computed only up to that chunk and recomputes the rest."""
    s1, w1, _ = engines(seed=4)
    run_to_completion(s1, w1, vs.request("r1", PROMPT))
    s2, w2, c2 = engines()
    sentinel = {n: t.clone() for n, t in c2.items()}
    req = vs.request("r2", PROMPT[:96] + list(range(800, 810)))
    s2.add_request(req)
    out = s2.schedule()
    (load,) = out.kv_connector_metadata.loads
    w2.store.delete([load.keys[0][1]])                  # lost after the plan: chunk 1 of 3
    kv_out = vs.run_worker_step(w2, out.kv_connector_metadata)
    bad = load.chunk(1) + load.chunk(2)
    assert kv_out.invalid_block_ids == set(bad)
    assert all(torch.equal(c2[n][torch.tensor(bad)], sentinel[n][torch.tensor(bad)]) for n in c2)
    s2.update_from_output(out, vs.model_output(out, kv_out))
    assert req.num_computed_tokens == CHUNK               # only chunk 0 counts as loaded
    out = s2.schedule()
    assert out.num_scheduled_tokens["r2"] == 106 - CHUNK
    (resave,) = out.kv_connector_metadata.saves           # the recomputed chunks heal the store
    assert resave.keys[0] == load.keys[0][1:] and resave.block_ids == load.block_ids[load.per:]


def test_bad_extra_config_names_the_problem(tmp_path):
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    from kvstore.connectors.vllm import KVStoreConnector
    from kvstore.errors import ConfigError

    model = vs.model_dir(tmp_path)
    for extra, words in [({"chunk_tokens": 32}, "exactly one of"),
                         ({"store": vs.store_config(), "chunk_tokens": 24}, "multiple of"),
                         ({"store": vs.store_config(), "chunk_size": 32}, "chunk_size: unknown field")]:
        vc = vs.vllm_config(model, extra)
        with pytest.raises(ConfigError, match=words):
            KVStoreConnector(vc, KVConnectorRole.SCHEDULER, vs.kv_cache_config(vc))
    vc = vs.vllm_config(model, {"store": vs.store_config(), "chunk_tokens": 32})
    vc.parallel_config.tensor_parallel_size = 2      # workers in other processes
    with pytest.raises(ConfigError, match="use 'server'"):
        KVStoreConnector(vc, KVConnectorRole.SCHEDULER, vs.kv_cache_config(vc))


def test_server_mode_without_a_client_module_is_a_clear_error(tmp_path):
    """Until kvstore.client lands in this install, 'server' names what is missing."""
    import importlib.util

    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    from kvstore.connectors.vllm import KVStoreConnector
    from kvstore.errors import ConfigError

    if importlib.util.find_spec("kvstore.client") is not None:
        pytest.skip("kvstore.client is installed; server mode is tested with the server")
    vc = vs.vllm_config(vs.model_dir(tmp_path), {"server": "127.0.0.1:1", "chunk_tokens": 32})
    with pytest.raises(ConfigError, match="kvstore client is not available"):
        KVStoreConnector(vc, KVConnectorRole.SCHEDULER, vs.kv_cache_config(vc))
