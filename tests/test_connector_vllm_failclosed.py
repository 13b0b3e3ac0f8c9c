"""Never wrong KV through vLLM's engine path: a load that fails while the same request
(or one sharing its blocks) computes and saves later chunks must never leave those
chunks stored over garbage, and a load must put exactly the tokens vLLM accepted where
vLLM counts them as computed.

Driven by vLLM's real Scheduler and the connector's worker hooks on real CPU caches. A
stand-in "forward" writes, for every block a step computes, the prompt's true pages, or
a SENTINEL when an earlier block of the request does not hold true KV (computed over
garbage, as a real model would)."""

import time
import uuid
from types import SimpleNamespace

import pytest
import torch

from tests import vllm_support as vs

vs.require_vllm()

from kvstore.connectors._vllm_meta import ChunkTransfer, KVStoreConnectorMetadata  # noqa: E402

CHUNK = 32                              # two vLLM blocks
PROMPT = list(range(10, 212))           # 202 tokens: 6 full chunks
CHUNKS = 6
SCRATCH = [60, 61]                      # blocks no request gets in these tests
SENTINEL = 7.0


class Forward:
    """Writes what a model would compute into one engine's caches."""

    def __init__(self, caches, truth):
        self.caches, self.truth = caches, truth
        self.blocks: dict[str, list[int]] = {}

    def track(self, out):
        for new in out.scheduled_new_reqs:
            self.blocks[new.req_id] = list(new.block_ids[0])
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self.blocks[req_id] = list(ids[0]) if ids else []
            elif ids:
                self.blocks[req_id].extend(ids[0])

    def compute(self, out, layers=None):
        names = layers or list(self.caches)
        cached = out.scheduled_cached_reqs
        starts = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, n in out.num_scheduled_tokens.items():
            blocks, start = self.blocks[req_id], starts[req_id]
            lo, hi = start // vs.BLOCK, min(-(-(start + n) // vs.BLOCK), len(PROMPT) // vs.BLOCK)
            for name in names:
                cache, truth = self.caches[name], self.truth[name]
                valid = all(torch.equal(cache[blocks[j]], truth[j]) for j in range(lo))
                for j in range(lo, hi):
                    cache[blocks[j]] = truth[j] if valid else SENTINEL


@pytest.fixture
def engine(tmp_path):
    """Factory of (scheduler, worker, caches, forward) over one embedded store per test."""
    model = vs.model_dir(tmp_path)
    tier = f"t{uuid.uuid4().hex[:8]}"
    gen = torch.Generator().manual_seed(5)
    truth = {}
    made = []

    def make(policy="recompute", prefix_caching=True, async_scheduling=False, **options):
        extra = {"store": vs.store_config(name=tier), "chunk_tokens": CHUNK, **options}
        vc = vs.vllm_config(model, extra, policy=policy, prefix_caching=prefix_caching)
        kcc = vs.kv_cache_config(vc)
        sched = vs.scheduler(vc, kcc, async_scheduling=async_scheduling)
        worker = vs.worker_connector(vc, kcc)
        caches = vs.kv_caches(kcc, "LBHNC")
        for name, t in caches.items():
            if name not in truth:
                shape = (len(PROMPT) // vs.BLOCK, *t.shape[1:])
                truth[name] = torch.randn(shape, generator=gen).to(t.dtype)
        worker.register_kv_caches(caches)
        made.append((sched, worker))
        return sched, worker, caches, Forward(caches, truth)

    yield make
    for sched, worker in made:
        worker.shutdown()
        sched.connector.shutdown()


def step(sched, worker, fwd, *, layerwise=False, out=None, deferred=False):
    """One engine step. ``deferred``: vLLM's order with speculative decoding, where the
    step's results are collected before ``wait_for_save`` (finalize runs after drafting)."""
    from vllm.v1.outputs import KVConnectorOutput

    out = out or sched.schedule()
    fwd.track(out)
    meta = out.kv_connector_metadata
    worker.handle_preemptions(meta)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    if layerwise:
        for name in vs.layer_names():
            worker.wait_for_layer_load(name)
            fwd.compute(out, layers=[name])
            worker.save_kv_layer(name, None, object())
    else:
        fwd.compute(out)
    if not deferred:
        worker.wait_for_save()
    sending, recving = worker.get_finished(set(out.finished_req_ids))
    kv_out = KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                               invalid_block_ids=worker.get_block_ids_with_load_errors(),
                               kv_connector_worker_meta=worker.build_connector_worker_meta())
    if deferred:
        worker.wait_for_save()
    worker.clear_connector_metadata()
    sched.update_from_output(out, vs.model_output(out, kv_out))
    return out, kv_out


def run(sched, worker, fwd, req, **kw):
    sched.add_request(req)
    deadline = time.monotonic() + 30
    while sched.has_unfinished_requests() or req.request_id in sched.requests:
        out, _ = step(sched, worker, fwd, **kw)
        if not out.num_scheduled_tokens:
            time.sleep(0.005)
        assert time.monotonic() < deadline, "request did not finish"
    settle(worker.store)


def settle(store):
    """Wait until the store has finished the saves handed to it."""
    deadline = time.monotonic() + 30
    while True:
        before = store.stats()["saves"]
        time.sleep(0.05)
        if store.stats()["saves"] == before:
            return
        assert time.monotonic() < deadline


def prompt_keys(worker):
    import numpy as np

    return worker.shape.namespace(0, "").chunk_keys(np.array(PROMPT, dtype=np.uint32))


def expected_chunk(worker, caches, fwd, k):
    """The true bytes of chunk ``k`` as the connector lays chunks out."""
    for name, t in caches.items():
        t[SCRATCH] = fwd.truth[name][2 * k:2 * k + 2]
    pages = worker._worker.pages
    out = torch.empty(pages.chunk_bytes, dtype=torch.uint8)
    pages.gather(torch.tensor([SCRATCH]), out)
    return out


def stored_chunks(worker, caches, fwd):
    """For each prompt chunk: None (absent), True (the true bytes) or False (wrong KV)."""
    keys = prompt_keys(worker)
    found = []
    for k, key in enumerate(keys):
        buf = torch.empty(worker._worker.pages.chunk_bytes, dtype=torch.uint8)
        if not worker.store.contains([key])[0] or not worker.store.load([key], [buf]).result()[0]:
            found.append(None)
            continue
        found.append(bool(torch.equal(buf, expected_chunk(worker, caches, fwd, k))))
    return found


def seed_first_chunks(engine, n=3):
    """Engine 1 computes the prompt's first ``n`` chunks (true KV) into the store."""
    s1, w1, _, f1 = engine()
    run(s1, w1, f1, vs.request("seed", PROMPT[:n * CHUNK + 5]))
    keys = prompt_keys(w1)
    assert w1.store.contains(keys[:n]) == [True] * n and not any(w1.store.contains(keys[n:]))
    for key in keys[n:]:
        assert not w1.store.contains([key])[0]


@pytest.mark.parametrize("mode", ["sync", "layerwise", "async"])
@pytest.mark.parametrize("lost", [0, 1, 2])
def test_load_failure_never_leaves_chunks_computed_over_garbage_in_the_store(engine, mode, lost):
    """Chunks 0-2 load while 3-5 are computed and saved in the same step; chunk
    ``lost`` is evicted after planning. Every stored chunk of the prefix must end up
    holding the true (recomputed) bytes, and all six must be stored."""
    seed_first_chunks(engine)
    options = {"layerwise": True} if mode == "layerwise" else {"load_async": True} if mode == "async" else {}
    s2, w2, c2, f2 = engine(**options)
    req = vs.request("r2", PROMPT)
    s2.add_request(req)
    out = s2.schedule()
    (load,) = out.kv_connector_metadata.loads
    assert load.first_chunk == 0 and load.num_chunks == 3
    w2.store.delete([load.keys[0][lost]])                # evicted after the plan
    for t in c2.values():
        t.fill_(0.5)                                     # garbage where the load does not write
    out, kv_out = step(s2, w2, f2, out=out, layerwise=mode == "layerwise")
    invalid = set(kv_out.invalid_block_ids)
    deadline = time.monotonic() + 30
    while s2.has_unfinished_requests() or "r2" in s2.requests:
        out, kv_out = step(s2, w2, f2, layerwise=mode == "layerwise")
        invalid |= kv_out.invalid_block_ids
        if not out.num_scheduled_tokens:
            time.sleep(0.005)
        assert time.monotonic() < deadline
    assert invalid >= set(load.chunk(lost))
    settle(w2.store)
    assert stored_chunks(w2, c2, f2) == [True] * CHUNKS
    stats = w2.store.stats()["connectors"]["vllm"]
    assert stats["failed_loads"] >= 3 - lost


@pytest.mark.parametrize("bound", [True, False])
def test_saves_of_a_request_sharing_a_failed_loads_blocks_are_never_wrong(engine, bound):
    """r3 arrives while r2's load is planned; r2's chunk 1 then fails. With vLLM's KV
    cache manager bound, the connector holds r2's blocks out of vLLM's prefix cache
    until the load reports, so r3 loads its own; without it (an engine that binds
    none), r3 reuses r2's blocks through vLLM's prefix cache and computes over chunk 1
    in the same step: its saves must not store what it computed there."""
    seed_first_chunks(engine)
    s2, w2, c2, f2 = engine()
    if not bound:
        s2.connector._scheduler.kv_cache_manager = None
    s2.add_request(vs.request("r2", PROMPT[:3 * CHUNK + 10]))
    s2.add_request(vs.request("r3", PROMPT))
    out = s2.schedule()
    loads = out.kv_connector_metadata.loads
    r3 = next(n for n in out.scheduled_new_reqs if n.req_id == "r3")
    if bound:
        assert [t.req_id for t in loads] == ["r2", "r3"]
        assert not set(r3.block_ids[0]) & set(loads[0].block_ids)
    else:
        assert [t.req_id for t in loads] == ["r2"]
        assert r3.block_ids[0][:6] == loads[0].block_ids and r3.num_computed_tokens >= 3 * CHUNK   # shares them
    w2.store.delete([loads[0].keys[0][1]])
    for t in c2.values():
        t.fill_(0.5)
    step(s2, w2, f2, out=out)
    deadline = time.monotonic() + 30
    while s2.has_unfinished_requests():
        step(s2, w2, f2)
        assert time.monotonic() < deadline
    settle(w2.store)
    found = stored_chunks(w2, c2, f2)
    assert False not in found and found[0] is True


def test_fail_policy_fails_the_request_and_stores_nothing_wrong(engine, caplog):
    seed_first_chunks(engine)
    with caplog.at_level("WARNING"):
        s2, w2, c2, f2 = engine(policy="fail")
    assert "kv_load_failure_policy is 'fail'" in caplog.text
    req = vs.request("r2", PROMPT)
    s2.add_request(req)
    out = s2.schedule()
    (load,) = out.kv_connector_metadata.loads
    w2.store.delete([load.keys[0][1]])
    step(s2, w2, f2, out=out)
    assert req.is_finished() and req.status.name == "FINISHED_ERROR"
    for _ in range(3):
        step(s2, w2, f2)
    settle(w2.store)
    assert stored_chunks(w2, c2, f2) == [True, None, True, None, None, None]


def test_a_capped_offer_loads_exactly_the_accepted_tokens_where_vllm_counts_them(engine):
    """vLLM may accept fewer external tokens than offered: the load must cover
    [num_computed, num_computed + accepted), never the tail of the offer."""
    from vllm.v1.core.sched.output import CachedRequestData

    seed_first_chunks(engine)
    s2, w2, c2, f2 = engine()
    conn = s2.connector
    req = vs.request("r2", PROMPT)
    s2.requests[req.request_id] = req
    conn.on_new_request(req)
    assert conn.get_num_new_matched_tokens(req, 0) == (3 * CHUNK, False)
    accepted = CHUNK + vs.BLOCK                  # a chunk and a half
    km = s2.kv_cache_manager
    blocks = km.allocate_slots(req, len(PROMPT) - accepted, num_external_computed_tokens=accepted)
    conn.update_state_after_alloc(req, km.get_blocks(req.request_id), accepted)
    meta = conn.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}, scheduled_new_reqs=[],
                                                     scheduled_cached_reqs=CachedRequestData.make_empty()))
    (load,) = meta.loads
    assert blocks is not None
    ids = km.get_block_ids(req.request_id)[0]
    assert load.first_chunk == 0 and load.num_chunks == 2 and load.block_ids == ids[0:3]
    for t in c2.values():
        t.fill_(0.5)
    kv_out = vs.run_worker_step(w2, meta)
    assert not kv_out.invalid_block_ids
    for name, t in c2.items():
        assert torch.equal(t[ids[:3]], f2.truth[name][:3])       # exactly the accepted blocks
        assert torch.equal(t[ids[3]], torch.full_like(t[ids[3]], 0.5))   # nothing beyond


def test_staging_stays_under_staging_bytes_while_batches_grow(engine):
    s2, w2, c2, f2 = engine(staging_bytes=3 * 4096 * 2 * 2 * vs.LAYERS, save_async=True)
    pages = w2._worker.pages
    budget = w2._worker.config.staging_bytes
    w2._worker.in_place = False                   # the staging path itself
    import numpy as np

    ns = w2._worker.shape.namespace(0, "staging")
    seen = []
    for n in (1, 2, 4, 8, 16):
        keys = ns.chunk_keys(np.arange(1000 * n, 1000 * n + n * CHUNK, dtype=np.uint32))
        blocks = [[2 * i, 2 * i + 1] for i in range(n)]
        meta = KVStoreConnectorMetadata(saves=[ChunkTransfer(f"s{n}", [keys], blocks)])
        vs.run_worker_step(w2, meta)
        seen.append(w2.store.stats()["connectors"]["vllm"]["staging_bytes"])
        settle(w2.store)
    assert max(seen) <= budget and pages.chunk_bytes * 16 > budget
    stats = w2.store.stats()["connectors"]["vllm"]
    assert stats["dropped_saves"] >= 8 + 16            # the batches that could not fit


def test_mla_across_two_ranks_stores_one_copy_read_by_both(tmp_path):
    import numpy as np
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MLAAttentionSpec

    from kvstore.connectors._metrics import ConnectorMetrics
    from kvstore.connectors._store_handle import open_store, release_store
    from kvstore.connectors._vllm_config import KVShape, VllmConnectorConfig
    from kvstore.connectors._vllm_worker import WorkerSide

    extra = {"store": vs.store_config(name=f"t{uuid.uuid4().hex[:8]}"), "chunk_tokens": CHUNK}
    vc = vs.vllm_config(vs.model_dir(tmp_path), extra)
    vc.parallel_config.tensor_parallel_size = 2
    spec = MLAAttentionSpec(block_size=vs.BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float16)
    names = vs.layer_names()
    kcc = get_kv_cache_config_from_groups(vc, [KVCacheGroupSpec(names, spec)], spec.page_size_bytes * 2 * 64)
    config = VllmConnectorConfig.parse(extra)
    shape = KVShape(vc, kcc, CHUNK, None)
    assert shape.mla and shape.key_ranks == 1
    assert shape.key_rank(0) == shape.key_rank(1) == 0 and shape.writes(0) and not shape.writes(1)
    store = open_store({"store": config.store}, owner="test")
    try:
        workers, caches = [], []
        for tp_rank in (0, 1):
            w = WorkerSide(config, shape, store, ConnectorMetrics(store, "vllm"), shape.key_rank(tp_rank),
                           writes=shape.writes(tp_rank))
            cache = {n: torch.randn(64, vs.BLOCK, 64).to(torch.float16) for n in names}
            w.register_kv_caches(cache, 64)
            w.in_place = False
            workers.append(w)
            caches.append(cache)
        keys = shape.namespace(0, "").chunk_keys(np.arange(500, 500 + 2 * CHUNK, dtype=np.uint32))
        saves = KVStoreConnectorMetadata(saves=[ChunkTransfer("r", [keys], [[1, 2], [3, 4]])])
        workers[1].wait_for_save(saves)                      # the replica: stores nothing
        settle(store)
        assert store.stats()["blocks"] == 0
        workers[0].wait_for_save(saves)
        settle(store)
        assert store.stats()["blocks"] == 2
        for w, cache in zip(workers, caches):
            w.start_load(KVStoreConnectorMetadata(loads=[ChunkTransfer("l", [keys], [[10, 11], [12, 13]])]))
            assert not w.take_load_errors()
            for n in names:
                assert torch.equal(cache[n][[10, 11, 12, 13]], caches[0][n][[1, 2, 3, 4]])
    finally:
        release_store(store)


def test_two_kv_dtypes_never_share_keys(tmp_path):
    import numpy as np

    from kvstore.connectors._vllm_config import KVShape

    model = vs.model_dir(tmp_path)
    tokens = np.arange(100, 100 + CHUNK, dtype=np.uint32)
    keys = set()
    for cache_dtype, dtype in (("auto", torch.float16), ("auto", torch.bfloat16), ("fp8_e4m3", torch.uint8),
                               ("fp8_e5m2", torch.uint8)):
        vc = vs.vllm_config(model, {"store": vs.store_config(), "chunk_tokens": CHUNK})
        vc.cache_config.cache_dtype = cache_dtype
        kcc = vs.kv_cache_config(vc)
        kcc.kv_cache_groups[0].kv_cache_spec = type(kcc.kv_cache_groups[0].kv_cache_spec)(
            block_size=vs.BLOCK, num_kv_heads=vs.HEADS, head_size=vs.HEAD_SIZE, dtype=dtype)
        shape = KVShape(vc, kcc, CHUNK, None)
        assert "auto" not in shape.dtype
        keys.add(shape.namespace(0, "").chunk_keys(tokens)[0])
    assert len(keys) == 4


def test_an_aborted_request_during_an_async_load_frees_its_blocks_and_leases(engine):
    from vllm.v1.request import RequestStatus

    seed_first_chunks(engine)
    s2, w2, c2, f2 = engine(load_async=True)
    free_before = s2.kv_cache_manager.block_pool.get_num_free_blocks()
    s2.add_request(vs.request("r2", PROMPT))
    out = s2.schedule()
    assert out.kv_connector_metadata.loads and w2.store.stats()["leases"] == 3
    s2.finish_requests(["r2"], RequestStatus.FINISHED_ABORTED)
    deadline = time.monotonic() + 30
    step(s2, w2, f2, out=out)
    while "r2" in s2.requests:
        step(s2, w2, f2)
        time.sleep(0.005)
        assert time.monotonic() < deadline, "the aborted request's blocks were never freed"
    assert s2.kv_cache_manager.block_pool.get_num_free_blocks() == free_before
    assert w2.store.stats()["leases"] == 0


@pytest.mark.parametrize("deferred", [False, True])
def test_saves_held_for_a_load_are_stored_when_the_request_finishes_in_that_step(engine, deferred):
    """r2 loads chunks 0-2 and computes 3-5 in one step, then finishes (one token):
    its held saves go out at the finish, its blocks are kept until the workers report
    them copied, and then freed."""
    seed_first_chunks(engine)
    s2, w2, c2, f2 = engine()
    free_before = s2.kv_cache_manager.block_pool.get_num_free_blocks()
    req = vs.request("r2", PROMPT)
    s2.add_request(req)
    out, kv_out = step(s2, w2, f2, deferred=deferred)
    assert out.kv_connector_metadata.loads and not out.kv_connector_metadata.saves   # held
    assert req.is_finished() and "r2" in s2.requests                               # blocks kept
    out, kv_out = step(s2, w2, f2, deferred=deferred)
    (final,) = out.kv_connector_metadata.saves
    assert final.first_chunk == 3 and final.num_chunks == 3 and final.hold
    assert kv_out.finished_sending == {"r2"} and "r2" not in s2.requests
    assert s2.kv_cache_manager.block_pool.get_num_free_blocks() == free_before
    settle(w2.store)
    assert stored_chunks(w2, c2, f2) == [True] * CHUNKS


# -- two tensor-parallel ranks: a load that fails on one rank only -------------------------------

@pytest.fixture
def tp2(tmp_path, monkeypatch):
    """Factory of (scheduler, [worker rank 0, worker rank 1], [caches], truth) over one
    cache server, as vLLM runs TP=2: one scheduler, a worker per rank, outputs merged
    by vLLM's own KVOutputAggregator."""
    import kvstore.connectors.vllm as vllm_mod
    from tests._servers import ThreadServer, config_dict

    server = ThreadServer(config_dict("64MiB"))
    model = vs.model_dir(tmp_path)
    gen = torch.Generator().manual_seed(11)
    truth: dict = {}
    made = []

    def make():
        vc = vs.vllm_config(model, {"server": server.address, "chunk_tokens": CHUNK})
        vc.parallel_config.tensor_parallel_size = 2
        kcc = vs.kv_cache_config(vc)
        sched = vs.scheduler(vc, kcc)
        workers, caches = [], []
        for rank in (0, 1):
            monkeypatch.setattr(vllm_mod, "_worker_rank", lambda vc, shape, r=rank: (r, shape.key_rank(r)))
            w = vs.worker_connector(vc, kcc)
            c = vs.kv_caches(kcc, "LBHNC")
            for name, t in c.items():
                truth.setdefault((rank, name), torch.randn((len(PROMPT) // vs.BLOCK, *t.shape[1:]),
                                                           generator=gen).to(t.dtype))
            w.register_kv_caches(c)
            workers.append(w)
            caches.append(c)
        made.append((sched, workers))
        return sched, workers, caches, truth

    yield make
    for sched, workers in made:
        for w in workers:
            w.shutdown()
        sched.connector.shutdown()
    server.stop()


def tp_step(sched, workers, caches, truth, blocks, out=None):
    """One step on both ranks; a rank's new KV is true only if every rank's earlier
    blocks hold true KV (attention outputs are all-reduced across ranks)."""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput

    out = out or sched.schedule()
    for new in out.scheduled_new_reqs:
        blocks[new.req_id] = list(new.block_ids[0])
    cached = out.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        if cached.new_block_ids[i]:
            blocks.setdefault(req_id, []).extend(cached.new_block_ids[i][0])
    meta = out.kv_connector_metadata
    for w in workers:
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
    starts = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
    starts.update(zip(cached.req_ids, cached.num_computed_tokens))
    for req_id, n in out.num_scheduled_tokens.items():
        ids, start = blocks[req_id], starts[req_id]
        lo, hi = start // vs.BLOCK, min(-(-(start + n) // vs.BLOCK), len(PROMPT) // vs.BLOCK)
        valid = all(torch.equal(caches[r][name][ids[j]], truth[(r, name)][j])
                    for r in (0, 1) for name in caches[r] for j in range(lo))
        for r in (0, 1):
            for name, cache in caches[r].items():
                for j in range(lo, hi):
                    cache[ids[j]] = truth[(r, name)][j] if valid else SENTINEL
    outputs = []
    for w in workers:
        w.wait_for_save()
        sending, recving = w.get_finished(set(out.finished_req_ids))
        kv_out = KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                   invalid_block_ids=w.get_block_ids_with_load_errors(),
                                   kv_connector_worker_meta=w.build_connector_worker_meta())
        w.clear_connector_metadata()
        outputs.append(vs.model_output(out, kv_out))
    merged = KVOutputAggregator(2).aggregate(outputs)
    sched.update_from_output(out, merged)
    return out


def tp_stored(workers, caches, truth):
    """Per rank, per prompt chunk: None (absent), True (true bytes) or False (wrong KV)."""
    import numpy as np

    found = []
    for rank, (w, cache) in enumerate(zip(workers, caches)):
        keys = w.shape.namespace(w._worker.rank, "").chunk_keys(np.array(PROMPT, dtype=np.uint32))
        pages = w._worker.pages
        row = []
        for k, key in enumerate(keys):
            buf = torch.empty(pages.chunk_bytes, dtype=torch.uint8)
            if not w.store.load([key], [buf]).result()[0]:
                row.append(None)
                continue
            for name, t in cache.items():
                t[SCRATCH] = truth[(rank, name)][2 * k:2 * k + 2]
            want = torch.empty(pages.chunk_bytes, dtype=torch.uint8)
            pages.gather(torch.tensor([SCRATCH]), want)
            row.append(bool(torch.equal(buf, want)))
        found.append(row)
    return found


def tp_run(sched, workers, caches, truth, req, blocks):
    sched.add_request(req)
    deadline = time.monotonic() + 30
    while sched.has_unfinished_requests() or req.request_id in sched.requests:
        tp_step(sched, workers, caches, truth, blocks)
        assert time.monotonic() < deadline


@pytest.mark.parametrize("lost", [0, 1, 2])
def test_a_load_failing_on_one_rank_leaves_no_rank_storing_kv_computed_over_it(tp2, lost):
    """Rank 1 cannot load chunk ``lost``; rank 0 loads everything. Both compute chunks
    3-5 over rank 1's garbage (all-reduce): neither rank may store them."""
    s1, w1, c1, truth = tp2()
    tp_run(s1, w1, c1, truth, vs.request("seed", PROMPT[:3 * CHUNK + 5]), {})
    s2, w2, c2, _ = tp2()
    for c in c2:
        for t in c.values():
            t.fill_(0.5)
    s2.add_request(vs.request("r2", PROMPT))
    out = s2.schedule()
    (load,) = out.kv_connector_metadata.loads
    w2[1].store.delete([load.keys[1][lost]])               # lost on rank 1's copy only
    blocks: dict = {}
    tp_step(s2, w2, c2, truth, blocks, out=out)
    deadline = time.monotonic() + 30
    while s2.has_unfinished_requests() or "r2" in s2.requests:
        tp_step(s2, w2, c2, truth, blocks)
        assert time.monotonic() < deadline
    settle_deadline = time.monotonic() + 30
    while True:
        found = tp_stored(w2, c2, truth)
        if found == [[True] * CHUNKS] * 2 or time.monotonic() > settle_deadline:
            break
        time.sleep(0.05)
    assert False not in found[0] + found[1]
    assert found == [[True] * CHUNKS] * 2                   # recomputed, then stored


def test_an_async_load_after_a_preemption_writes_the_new_blocks_never_the_freed_ones(engine):
    """R runs (and saves), is preempted (its blocks freed), and comes back with an async
    load of what it saved: the load must target the blocks vLLM allocated now."""
    s2, w2, c2, f2 = engine(load_async=True, prefix_caching=False)
    req = vs.request("r", PROMPT, max_tokens=50)
    s2.add_request(req)
    out, _ = step(s2, w2, f2)
    old = list(out.scheduled_new_reqs[0].block_ids[0])
    step(s2, w2, f2)
    settle(w2.store)
    assert all(w2.store.contains(prompt_keys(w2)))
    s2.running.remove(req)
    s2._preempt_request(req, time.monotonic())           # what memory pressure does
    for t in c2.values():
        t.fill_(0.5)
    out, _ = step(s2, w2, f2)
    (load,) = out.kv_connector_metadata.loads
    n = len(load.block_ids)
    now = list(s2.kv_cache_manager.get_block_ids("r")[0][:n])
    assert load.is_async and now != old[:n]              # the scenario: other blocks this time
    assert load.block_ids == now
    deadline = time.monotonic() + 30
    while req.status.name == "WAITING_FOR_REMOTE_KVS":
        step(s2, w2, f2)
        assert time.monotonic() < deadline
    for name, t in c2.items():                           # the loaded KV is where vLLM reads it
        assert torch.equal(t[now], f2.truth[name][:n])


def test_a_load_over_the_staging_budget_fails_closed(engine):
    """A load that does not fit in staging_bytes writes nothing and reports every block
    for recompute (never a partial or stale staging buffer as KV)."""
    seed_first_chunks(engine)
    s2, w2, c2, f2 = engine()
    w2._worker.pool.budget_bytes = 4096                    # load staging smaller than one chunk (the
    w2._worker.in_place = False                            # scheduler would offer none); the staging path
    s2.add_request(vs.request("r2", PROMPT))
    out = s2.schedule()
    (load,) = out.kv_connector_metadata.loads
    for t in c2.values():
        t.fill_(0.5)
    before = {n: t.clone() for n, t in c2.items()}
    kv_out = vs.run_worker_step(w2, out.kv_connector_metadata)
    assert kv_out.invalid_block_ids == set(load.block_ids)
    assert all(torch.equal(c2[n], before[n]) for n in c2)
    assert w2.store.stats()["connectors"]["vllm"]["failed_loads"] == 3


def test_a_failed_sync_load_leaves_no_unwritten_block_in_vllms_prefix_cache(engine, monkeypatch):
    """Issue 33 item 4. r2's sync load of chunks 0-2 fails on chunk 0 under
    ``recompute``; vLLM cached r2's blocks at allocation and evicts none under
    ``recompute``. With chunked prefill (32 tokens a step) r2 recomputes over several
    steps, and r3, with the same prompt, arrives meanwhile: vLLM's prefix cache must not
    give it blocks that were never written (or were computed over them). Every block
    r3 counts as computed must hold the true KV after every step."""
    seed_first_chunks(engine)
    s2, w2, c2, f2 = engine()
    s2.scheduler_config.long_prefill_token_threshold = 32
    s2.adaptive_long_prefill_threshold = False
    sample = vs.model_output

    def model_output(out, kv_out=None):   # a partial prefill samples nothing (as vLLM's model runner)
        mo = sample(out, kv_out)
        for i, req_id in enumerate(mo.req_ids):
            req = s2.requests.get(req_id)
            if req is not None and req.num_computed_tokens < req.num_prompt_tokens:
                mo.sampled_token_ids[i] = []
        return mo

    monkeypatch.setattr(vs, "model_output", model_output)
    s2.add_request(vs.request("r2", PROMPT))
    out = s2.schedule()
    (load,) = out.kv_connector_metadata.loads
    assert load.first_chunk == 0 and load.num_chunks == 3
    w2.store.delete([load.keys[0][0]])                   # evicted after the plan
    for t in c2.values():
        t.fill_(0.5)                                     # never-written blocks hold garbage
    _, kv_out = step(s2, w2, f2, out=out)
    assert set(load.chunk(0)) <= kv_out.invalid_block_ids
    r2 = s2.requests["r2"]
    assert r2.num_computed_tokens == 0                   # vLLM recomputes it from the first block

    r3 = vs.request("r3", PROMPT)
    s2.add_request(r3)
    deadline = time.monotonic() + 30
    seen = False
    while s2.has_unfinished_requests():
        out = s2.schedule()
        cached = out.scheduled_cached_reqs
        starts = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        step(s2, w2, f2, out=out)
        if "r3" in starts:
            # What r3 counted as computed when scheduled must hold true KV once the step's
            # forward (which also writes what r2 recomputes in it) has run.
            seen = True
            blocks = f2.blocks["r3"]
            for name, cache in c2.items():
                for j in range(starts["r3"] // vs.BLOCK):
                    assert torch.equal(cache[blocks[j]], f2.truth[name][j]), \
                        f"r3 was given block {j} as computed; it holds no true KV ({name})"
        assert time.monotonic() < deadline
    assert seen
    settle(w2.store)
    assert False not in stored_chunks(w2, c2, f2)


def execute(sched, worker, fwd, out):
    """The worker side of one scheduled step (what the model runner does with it)."""
    from vllm.v1.outputs import KVConnectorOutput

    fwd.track(out)
    meta = out.kv_connector_metadata
    worker.handle_preemptions(meta)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    fwd.compute(out)
    worker.wait_for_save()
    sending, recving = worker.get_finished(set(out.finished_req_ids))
    kv_out = KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                               invalid_block_ids=worker.get_block_ids_with_load_errors(),
                               kv_connector_worker_meta=worker.build_connector_worker_meta())
    worker.clear_connector_metadata()
    return kv_out


@pytest.mark.parametrize("arrival", ["same_step", "next_step"])
def test_no_request_computes_over_a_sync_loads_blocks_before_the_load_reports(engine, monkeypatch, arrival):
    """Issue 33 item 4, the window before the report. r2's sync load of chunks 0-2
    fails on chunk 0; r2 recomputes 32 tokens a step (chunked prefill). r3, with the
    same prompt, is scheduled before the failure is reported: in the same step
    (``same_step``, any scheduler), or in the next one under vLLM's async scheduling,
    which schedules step N+1 before it processes step N's output (``next_step``). vLLM
    cached r2's blocks at allocation, so r3 would be given them as computed and compute
    over blocks that were never written. Every block r3 counts as computed must hold the
    true KV once the step that scheduled it has run."""
    from collections import deque

    seed_first_chunks(engine)
    s2, w2, c2, f2 = engine(async_scheduling=arrival == "next_step")
    s2.scheduler_config.long_prefill_token_threshold = 32
    s2.adaptive_long_prefill_threshold = False
    sample = vs.model_output

    def model_output(out, kv_out=None):   # a partial prefill samples nothing (as vLLM's model runner)
        mo = sample(out, kv_out)
        for i, req_id in enumerate(mo.req_ids):
            req = s2.requests.get(req_id)
            if req is not None and req.num_computed_tokens < req.num_prompt_tokens:
                mo.sampled_token_ids[i] = []
        return mo

    s2.add_request(vs.request("r2", PROMPT))
    if arrival == "same_step":
        s2.add_request(vs.request("r3", PROMPT))
    depth = 2 if arrival == "next_step" else 1     # vLLM's batch queue under async scheduling
    in_flight: deque = deque()
    seen = False
    first = True
    deadline = time.monotonic() + 30
    while s2.has_unfinished_requests() or in_flight:
        if len(in_flight) < depth and s2.has_requests():
            out = s2.schedule()
            if first:
                (load,) = [t for t in out.kv_connector_metadata.loads if t.req_id == "r2"]
                assert load.first_chunk == 0 and load.num_chunks == 3 and not load.is_async
                w2.store.delete([load.keys[0][0]])                   # evicted after the plan
                for t in c2.values():
                    t.fill_(0.5)                                     # never-written blocks hold garbage
                first = False
                if arrival == "next_step":
                    s2.add_request(vs.request("r3", PROMPT))         # before step 1's output is processed
            cached = out.scheduled_cached_reqs
            starts = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
            starts.update(zip(cached.req_ids, cached.num_computed_tokens))
            in_flight.append((out, execute(s2, w2, f2, out)))        # the worker runs steps in order
            if "r3" in starts:
                # r3's own load, if it fails, is reported and recomputed like r2's.
                own = {b for t in out.kv_connector_metadata.loads if t.req_id == "r3" for b in t.block_ids}
                seen = True
                blocks = f2.blocks["r3"]
                for name, cache in c2.items():
                    for j in range(starts["r3"] // vs.BLOCK):
                        assert blocks[j] in own or torch.equal(cache[blocks[j]], f2.truth[name][j]), \
                            f"r3 was given block {j} as computed; it holds no true KV ({name})"
            if len(in_flight) < depth and s2.has_requests():
                continue
        out, kv_out = in_flight.popleft()
        s2.update_from_output(out, model_output(out, kv_out))
        assert time.monotonic() < deadline
    assert seen
    settle(w2.store)
    assert False not in stored_chunks(w2, c2, f2)


def test_a_sync_loads_blocks_return_to_vllms_prefix_cache_once_it_reports_success(engine):
    """The hold above costs no reuse: once r2's sync load reports success, its blocks
    (and those computed after them) are in vLLM's prefix cache again, and r4 with the
    same prompt is given them by vLLM itself, true KV, with no load of its own."""
    seed_first_chunks(engine)
    s2, w2, c2, f2 = engine()
    s2.add_request(vs.request("r2", PROMPT, max_tokens=4))
    out = s2.schedule()
    (load,) = out.kv_connector_metadata.loads
    manager = s2.kv_cache_manager
    assert all(manager.block_pool.blocks[b].block_hash is None for b in load.block_ids)   # held out
    step(s2, w2, f2, out=out)
    assert all(manager.block_pool.blocks[b].block_hash is not None for b in load.block_ids)  # back
    s2.add_request(vs.request("r4", PROMPT))
    out, _ = step(s2, w2, f2)
    r4 = next(n for n in out.scheduled_new_reqs if n.req_id == "r4")
    assert not [t for t in out.kv_connector_metadata.loads if t.req_id == "r4"]
    assert r4.num_computed_tokens >= 3 * CHUNK and r4.block_ids[0][:6] == load.block_ids
    for name, cache in c2.items():
        for j in range(r4.num_computed_tokens // vs.BLOCK):
            assert torch.equal(cache[r4.block_ids[0][j]], f2.truth[name][j])


def test_a_partly_failed_sync_load_puts_back_only_the_chunks_before_the_failure(engine):
    """r2's load of chunks 0-2 fails on chunk 1: chunk 0's blocks were loaded and
    verified and go back into vLLM's prefix cache; chunk 1's and 2's (never written) and
    every block computed after them stay out."""
    seed_first_chunks(engine)
    s2, w2, c2, f2 = engine()
    s2.add_request(vs.request("r2", PROMPT))
    out = s2.schedule()
    (load,) = out.kv_connector_metadata.loads
    w2.store.delete([load.keys[0][1]])
    for t in c2.values():
        t.fill_(0.5)
    _, kv_out = step(s2, w2, f2, out=out)
    assert set(load.chunk(1)) <= kv_out.invalid_block_ids
    hashed = [s2.kv_cache_manager.block_pool.blocks[b].block_hash is not None for b in load.block_ids]
    assert hashed == [True, True, False, False, False, False]
    s2.add_request(vs.request("r4", PROMPT))
    out = s2.schedule()
    r4 = next(n for n in out.scheduled_new_reqs if n.req_id == "r4")
    assert r4.block_ids[0][:2] == load.block_ids[:2] and not set(r4.block_ids[0][2:]) & set(load.block_ids)
    for name, cache in c2.items():
        for j in range(2):
            assert torch.equal(cache[r4.block_ids[0][j]], f2.truth[name][j])
