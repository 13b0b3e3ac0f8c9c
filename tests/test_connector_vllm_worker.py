"""Worker hooks of the vLLM connector on real CPU KV caches built by vLLM's
``allocate_kv_cache`` in several physical layouts; leases; fail-closed loads."""

import time
import uuid

import numpy as np
import pytest
import torch

from tests import vllm_support as vs

vs.require_vllm()

from kvstore.connectors._vllm_meta import ChunkTransfer, KVStoreConnectorMetadata  # noqa: E402

CHUNK = 32
LAYOUTS = ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BHLNC"]


@pytest.fixture
def make_worker(tmp_path):
    model = vs.model_dir(tmp_path)
    made = []

    def make(layout="LBHNC", *, tier=None, capacity="64MiB", **options):
        extra = {"store": vs.store_config(capacity, name=tier or f"t{uuid.uuid4().hex[:8]}"),
                 "chunk_tokens": CHUNK, **options}
        vc = vs.vllm_config(model, extra, layout=layout)
        kcc = vs.kv_cache_config(vc)
        worker = vs.worker_connector(vc, kcc)
        caches = vs.kv_caches(kcc, layout, seed=7)
        worker.register_kv_caches(caches)
        made.append(worker)
        return worker, caches, vc, kcc

    yield make
    for w in made:
        w.shutdown()


def keys_for(worker, n, salt=""):
    tokens = np.arange(1000, 1000 + n * CHUNK, dtype=np.uint32)
    return worker.shape.namespace(0, salt).chunk_keys(tokens)


def flat(blocks):
    return [b for chunk in blocks for b in chunk]


def pages(caches, blocks):
    return {n: t[torch.tensor(flat(blocks))].clone() for n, t in caches.items()}


def save(worker, keys, blocks, layers=None):
    meta = KVStoreConnectorMetadata(saves=[ChunkTransfer("saver", [keys], blocks)])
    vs.run_worker_step(worker, meta, layerwise_layers=layers)
    _wait_stored(worker, keys)


def load(worker, keys, blocks, layers=None, *, skip=0, is_async=False):
    meta = KVStoreConnectorMetadata(loads=[ChunkTransfer("loader", [keys], blocks, skip, is_async)])
    return vs.run_worker_step(worker, meta, layerwise_layers=layers)


def _wait_stored(worker, keys):
    deadline = time.monotonic() + 30
    while not all(worker.store.contains(keys)):
        assert time.monotonic() < deadline, "save never completed"
        time.sleep(0.005)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_save_from_some_blocks_load_into_others(make_worker, layout):
    worker, caches, _, kcc = make_worker(layout)
    src, dst = [[3, 4], [9, 10], [5, 6]], [[20, 21], [40, 41], [30, 31]]
    keys = keys_for(worker, 3)
    before = pages(caches, src)
    save(worker, keys, src)
    for t in caches.values():
        t[torch.tensor(flat(dst))] = 0
    out = load(worker, keys, dst)
    assert not out.invalid_block_ids
    after = pages(caches, dst)
    for name in caches:           # bytes identical, layer by layer
        assert torch.equal(before[name].view(torch.uint8), after[name].view(torch.uint8)), name
    assert worker._worker.pages.chunk_bytes == vs.LAYERS * 2 * kcc.kv_cache_groups[0].kv_cache_spec.page_size_bytes


@pytest.mark.parametrize("layout", ["LBHNC", "LHBNC", "BLHNC"])
def test_layerwise_gives_the_same_bytes(make_worker, layout):
    tier = f"t{uuid.uuid4().hex[:8]}"
    whole, caches, *_ = make_worker(layout, tier=tier)
    layered, caches2, *_ = make_worker(layout, tier=tier, layerwise=True)
    assert all(torch.equal(caches[n], caches2[n]) for n in caches)   # same seed, same start
    src, dst = [[1, 2], [7, 8]], [[50, 51], [60, 61]]
    k_whole, k_layer = keys_for(whole, 2, "whole"), keys_for(whole, 2, "layered")
    save(whole, k_whole, src)
    save(layered, k_layer, src, layers=list(reversed(vs.layer_names())))
    stored = []
    for keys in (k_whole, k_layer):   # the stored chunks are byte-identical
        bufs = [np.empty(whole._worker.pages.chunk_bytes, np.uint8) for _ in keys]
        assert whole.store.load(keys, bufs).result() == [True, True]
        stored.append(np.concatenate(bufs))
    assert np.array_equal(*stored)
    expected = pages(caches2, src)
    for t in caches2.values():
        t[torch.tensor(flat(dst))] = 0
    out = load(layered, k_layer, dst, layers=vs.layer_names())
    assert not out.invalid_block_ids
    assert all(torch.equal(expected[n], pages(caches2, dst)[n]) for n in caches2)


def test_partial_first_chunk_keeps_blocks_the_request_holds(make_worker):
    worker, caches, *_ = make_worker()
    keys = keys_for(worker, 2)
    save(worker, keys, [[1, 2], [3, 4]])
    held = pages(caches, [[10]])
    out = load(worker, keys, [[10, 11], [12, 13]], skip=1)
    assert not out.invalid_block_ids
    assert all(torch.equal(held[n], pages(caches, [[10]])[n]) for n in caches)
    assert all(torch.equal(pages(caches, [[2, 3, 4]])[n], pages(caches, [[11, 12, 13]])[n]) for n in caches)


@pytest.mark.parametrize("is_async", [False, True])
@pytest.mark.parametrize("groups", [1, 3])
def test_missing_chunk_fails_closed(make_worker, is_async, groups):
    """Chunk 1 of 3 is gone between the plan and the load: its blocks and those after
    it are reported as load errors and not a byte of them is written; chunk 0 loads.
    (``groups``: the store is asked in one batch, or per chunk as for device caches.)"""
    worker, caches, *_ = make_worker(load_async=is_async)
    worker._worker.load_parts = groups
    keys = keys_for(worker, 3)
    src, dst = [[1, 2], [3, 4], [5, 6]], [[20, 21], [22, 23], [24, 25]]
    save(worker, keys, src)
    for t in caches.values():
        t[torch.tensor(flat(dst))] = 0
    untouched = pages(caches, dst[1:])
    worker.store.delete([keys[1]])
    out = load(worker, keys, dst, is_async=is_async)
    deadline = time.monotonic() + 30
    while is_async and not out.finished_recving:
        assert time.monotonic() < deadline
        time.sleep(0.005)
        out = vs.run_worker_step(worker, KVStoreConnectorMetadata())
    assert out.invalid_block_ids == set(flat(dst[1:]))
    if is_async:
        assert out.finished_recving == {"loader"}
    assert all(torch.equal(untouched[n], pages(caches, dst[1:])[n]) for n in caches)
    assert all(torch.equal(pages(caches, src[:1])[n], pages(caches, dst[:1])[n]) for n in caches)


def test_store_failure_reports_every_block(make_worker):
    worker, caches, *_ = make_worker()
    keys = keys_for(worker, 2)
    save(worker, keys, [[1, 2], [3, 4]])
    worker.store.close()
    out = load(worker, keys, [[10, 11], [12, 13]])
    assert out.invalid_block_ids == {10, 11, 12, 13}


def test_lease_keeps_planned_chunks_while_the_store_fills(tmp_path):
    """The scheduler leases the chunks it plans to load; filling the store meanwhile
    evicts other chunks but not those, and the load then succeeds."""
    model = vs.model_dir(tmp_path)
    extra = {"store": vs.store_config("128KiB", name=f"t{uuid.uuid4().hex[:8]}"), "chunk_tokens": CHUNK}
    vc = vs.vllm_config(model, extra)
    kcc = vs.kv_cache_config(vc)
    sched, worker = vs.scheduler(vc, kcc), vs.worker_connector(vc, kcc)
    caches = vs.kv_caches(kcc, "LBHNC", seed=5)
    worker.register_kv_caches(caches)
    try:
        store = worker.store
        chunk = worker._worker.pages.chunk_bytes                 # 16 KiB: 8 fit
        prompt = list(range(10, 110))
        ns = worker.shape.namespace(0, "")
        keys = ns.chunk_keys(np.asarray(prompt[:96], np.uint32))
        src = [[1, 2], [3, 4], [5, 6]]
        save(worker, keys, src)
        expected = pages(caches, src)
        bystander = ns.chunk_keys(np.arange(5000, 5000 + CHUNK, dtype=np.uint32))
        assert store.save(bystander, [np.ones(chunk, np.uint8)]).result() == [True]

        sched.add_request(vs.request("r", prompt))
        out = sched.schedule()                                   # plans the load, leases 3 chunks
        (planned,) = out.kv_connector_metadata.loads
        assert planned.keys[0] == keys
        filler = ns.chunk_keys(np.arange(9000, 9000 + 20 * CHUNK, dtype=np.uint32))
        store.save(filler, [np.full(chunk, i, np.uint8) for i in range(20)]).result()
        assert store.contains(bystander) == [False]              # the store did evict
        assert store.contains(keys) == [True, True, True]        # but not the leased chunks
        kv_out = vs.run_worker_step(worker, out.kv_connector_metadata)
        assert not kv_out.invalid_block_ids
        got = pages(caches, [planned.block_ids])
        assert all(torch.equal(expected[n], got[n]) for n in caches)
        assert store.stats()["leases"] == 0                      # the load released them
    finally:
        worker.shutdown()
        sched.connector.shutdown()


def _two_tier(make_worker, top_chunks, **options):
    probe, *_ = make_worker()
    chunk = probe._worker.pages.chunk_bytes
    store = {"tiers": [{"name": f"t{uuid.uuid4().hex[:8]}", "kind": "dram", "capacity": top_chunks * chunk},
                       {"name": f"b{uuid.uuid4().hex[:8]}", "kind": "dram", "capacity": 16 * chunk}],
             "placement": {"write": options.pop("write", "back")}}
    return make_worker(store=store, **options)


def test_async_save_into_a_full_first_tier_uses_free_slots_then_staging(make_worker):
    """Chunks that find free first-tier slots are gathered into them; the rest go
    through staging and evict (spill) behind the step. Every chunk loads back."""
    worker, caches, *_ = _two_tier(make_worker, 2, save_async=True)
    keys, src, dst = keys_for(worker, 3), [[1, 2], [3, 4], [5, 6]], [[20, 21], [22, 23], [24, 25]]
    expected = pages(caches, src)
    save(worker, keys, src)
    tiers = worker.store.stats()["tiers"]
    assert tiers[0]["writes"] == 3 and tiers[0]["spills"] == 1 and tiers[1]["blocks"] == 1
    for t in caches.values():
        t[torch.tensor(flat(dst))] = 0
    out = load(worker, keys, dst)
    assert not out.invalid_block_ids
    assert all(torch.equal(expected[n], pages(caches, dst)[n]) for n in caches)


def test_load_takes_first_tier_chunks_in_place_and_the_rest_from_below(make_worker):
    worker, caches, *_ = _two_tier(make_worker, 4, write="through")
    keys, src, dst = keys_for(worker, 3), [[1, 2], [3, 4], [5, 6]], [[20, 21], [22, 23], [24, 25]]
    expected = pages(caches, src)
    save(worker, keys, src)
    deadline = time.monotonic() + 30          # write-through runs on the store's threads
    while worker.store.tiers[1].contains(keys) != [True] * 3:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    worker.store.tiers[0].delete([keys[2]])   # chunk 2 now only in the lower tier
    for t in caches.values():
        t[torch.tensor(flat(dst))] = 0
    out = load(worker, keys, dst)
    assert not out.invalid_block_ids
    assert all(torch.equal(expected[n], pages(caches, dst)[n]) for n in caches)
    assert worker.store.stats()["tiers"][1]["hits"] == 1


def test_staging_pool_reuses_a_buffer_among_idle_ones_of_other_sizes():
    """Taking a pooled buffer finds it by identity: ``list.remove`` compared the free
    list's tensors elementwise and raised for two of different sizes."""
    import torch

    from kvstore.connectors._staging import StagingPool

    pool = StagingPool(torch.device("cpu"), 1 << 20)
    small, big = pool.take(16), pool.take(48)
    pool.give(small)
    pool.give(big)
    again = pool.take(40)
    assert again is not None and again.data_ptr() == big.data_ptr() and again.numel() == 40
    assert pool.take(16).data_ptr() == small.data_ptr()
