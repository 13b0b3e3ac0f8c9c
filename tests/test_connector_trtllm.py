"""The TensorRT-LLM connector's logic, driven the way TensorRT-LLM's executor drives a
connector.

TensorRT-LLM cannot be installed on these machines, so these tests run against a
minimal STAND-IN of its connector base classes and request records
(tests/_trtllm_standin.py, built from the documented signatures, installed into
sys.modules for these tests only). What they check is our adapter: keys, prefix
matching, load/save planning, the block moves and the finish protocol, against a
real kvstore Store (and a real ``kvstore serve`` for tensor parallelism). They do
not prove compatibility with a real TensorRT-LLM build.
"""

from __future__ import annotations

import hashlib
import importlib.util
import time

import numpy as np
import pytest

from kvstore.errors import ConfigError, KVStoreError
from tests import _trtllm_standin as standin

torch = pytest.importorskip("torch")

BS, LAYERS, WIDTH = 4, 2, 16   # tokens per block, layers, tokens_per_block*heads*head_dim


@pytest.fixture
def trt():
    standin.install(standin.CURRENT)
    import kvstore.connectors.trtllm as trt

    yield trt
    standin.uninstall()


def llm_args(tp: int = 1, server_url: str | None = None, kv_dtype: str = "float16") -> standin.TorchLlmArgs:
    return standin.TorchLlmArgs(
        model="org/tiny", tensor_parallel_size=tp,
        kv_cache_config=standin.KvCacheConfig(tokens_per_block=BS, dtype=kv_dtype),
        kv_connector_config=standin.KvCacheConnectorConfig(
            connector_module="kvstore.connectors.trtllm", connector_scheduler_class="KVStoreConnectorScheduler",
            connector_worker_class="KVStoreConnectorWorker", server_url=server_url))

@pytest.fixture
def kvstore_url(tmp_path):
    """A ``kvstore serve`` process on a free loopback port (TP>1 needs a server)."""
    from tests._serve import start_server, stop_server
    from kvstore.testing import free_port

    port = free_port()
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"server: {{host: 127.0.0.1, port: {port}, admin_port: null}}\n"
                   "tiers:\n  - {name: hot, kind: dram, capacity: 16MiB}\n")
    proc = start_server(str(cfg), port, tmp_path / "serve.log")
    yield f"kvstore://127.0.0.1:{port}"
    stop_server(proc)



def expected_block(tokens: list[int], idx: int, rank: int, kv_factor: int = 2,
                   dtype: "torch.dtype | None" = None) -> "torch.Tensor":
    """What the model would compute for block ``idx``: depends on the whole prefix (and
    the rank's heads; MLA's single latent, ``kv_factor == 1``, is the same on every rank)."""
    rank = 0 if kv_factor == 1 else rank
    seed = int.from_bytes(hashlib.sha256(repr((tokens[:(idx + 1) * BS], rank)).encode()).digest()[:8], "little")
    data = np.random.default_rng(seed).standard_normal((LAYERS, kv_factor, WIDTH)).astype(np.float32)
    return torch.from_numpy(data).to(dtype or torch.float16)


def loaded_ids(meta) -> list[int]:
    return [t.block_id for group in meta.loads for t in getattr(group, "transfers", [group])]


def rank_keys(eng, tokens, rank: int = 0) -> list:
    """The keys ``rank`` of ``eng`` stores the full blocks of ``tokens`` under."""
    scheme = eng.scheduler.scheme
    content = [k.digest for k in scheme.content_keys(tokens, None)]
    layout = getattr(eng.workers[rank], "layout", None)
    return scheme.rank_keys(content, rank, layout) if layout is not None else scheme.rank_keys(content, rank)


def trt_stats(store) -> dict:
    return store.stats().get("connectors", {}).get("trtllm", {})


class MiniEngine:
    """Calls the connector in TensorRT-LLM's order: match, allocate, build metadata,
    load, per-layer hooks around the model's work, save, finish."""

    def __init__(self, trt, args, *, num_blocks: int = 32, kv_factor: int = 2, dtype=None, **kw) -> None:
        tp = args.tensor_parallel_size
        self.kv_factor, self.dtype = kv_factor, dtype or torch.float16
        self.scheduler = trt.KVStoreConnectorScheduler(args, **kw)
        self.workers = [trt.KVStoreConnectorWorker(args, rank=r, **kw) for r in range(tp)]
        self.pools = [torch.zeros(num_blocks, LAYERS, kv_factor, WIDTH, dtype=self.dtype) for _ in range(tp)]
        for w, p in zip(self.workers, self.pools):
            w.register_kv_caches(p)
        self.free = list(range(num_blocks))
        self.blocks: dict[int, list[int]] = {}

    def expected(self, tokens, idx: int, rank: int) -> "torch.Tensor":
        return expected_block(tokens, idx, rank, self.kv_factor, self.dtype)

    def _forward(self, meta, req, start_tok: int, end_tok: int, stream=None) -> None:
        """The forward pass: the model writes the KV of tokens [start_tok, end_tok);
        the KV it reads for earlier positions is whatever the blocks hold (garbage
        where nothing was loaded), so a block computed over it differs from the truth."""
        tokens = req.get_tokens(0)
        for w in self.workers:
            w.bind_connector_meta(meta)
            w.start_load_kv(stream)
        for layer in range(LAYERS):
            for rank, w in enumerate(self.workers):
                w.wait_for_layer_load(layer, stream)
                ok = all(torch.equal(self.pools[rank][self.blocks[req.request_id][i]], self.expected(tokens, i, rank))
                         for i in range(start_tok // BS))
                for idx in range(start_tok // BS, (end_tok + BS - 1) // BS):
                    value = self.expected(tokens, idx, rank)[layer]
                    self.pools[rank][self.blocks[req.request_id][idx], layer] = value if ok else value + 1
                w.save_kv_layer(layer, stream)
        for w in self.workers:
            w.wait_for_save(stream)
            w._clear_connector_meta()

    def prefill(self, req, device_matched: int = 0, accept: int | None = None, stream=None,
                priorities: list[int] | None = None) -> int:
        """``accept``: tokens the runtime takes of the offer (KVCacheManagerV2 reports a
        shorter honour through ``cancel_load``); by default all of it. ``priorities``:
        per block, what TensorRT-LLM derives from the request's KvCacheRetentionConfig."""
        tokens = req.get_tokens(0)
        matched, is_async = self.scheduler.get_num_new_matched_tokens(req, device_matched)
        assert is_async is False
        self.offered = matched
        if accept is not None and accept < matched:
            self.scheduler.cancel_load(req, device_matched + accept, device_matched + matched)
            matched = accept
        blocks = self.blocks[req.request_id] = [self.free.pop(0) for _ in range((len(tokens) + BS - 1) // BS)]
        for rank in range(len(self.workers)):     # the device prefix cache already holds these (partial reuse:
            for idx in range((device_matched + BS - 1) // BS):    # a partly matched block holds the prefix's KV)
                self.pools[rank][blocks[idx]] = self.expected(tokens, idx, rank)
        self.scheduler.update_state_after_alloc(req, blocks)
        data = standin.RequestData(req.request_id, list(tokens), list(blocks), computed_position=device_matched,
                                   num_scheduled_tokens=len(tokens) - device_matched - matched,
                                   cache_salt=req.cache_salt, priorities=priorities)
        meta = self.scheduler.build_connector_meta(standin.SchedulerOutput(new_requests=[data]))
        self.last_meta = meta
        self._forward(meta, req, device_matched + matched, len(tokens), stream)
        return matched

    def decode(self, req, token: int, priority: int | None = None) -> None:
        req.add_new_token(token, 0)
        tokens = req.get_tokens(0)
        new_blocks = []
        if len(tokens) > len(self.blocks[req.request_id]) * BS:
            new_blocks = [self.free.pop(0)]
            self.blocks[req.request_id] += new_blocks
        data = standin.RequestData(req.request_id, [token], new_blocks, computed_position=len(tokens) - 1,
                                   num_scheduled_tokens=1,
                                   priorities=[priority] * len(new_blocks) if priority is not None else None)
        meta = self.scheduler.build_connector_meta(standin.SchedulerOutput(cached_requests=[data]))
        self._forward(meta, req, len(tokens) - 1, len(tokens))

    def finish(self, req) -> bool:
        delay = self.scheduler.request_finished(req, self.blocks[req.request_id])
        pending = {id(w): w for w in self.workers}
        first = True
        deadline = time.monotonic() + 10
        while pending and time.monotonic() < deadline:
            for key, w in list(pending.items()):
                saved, loaded = w.get_finished([req.request_id] if first else [], [])
                assert loaded == []
                if req.request_id in saved:
                    del pending[key]
            first = False
            time.sleep(0.01)
        assert not pending, "a worker never reported the request's saves as finished"
        return delay

    def block(self, req, idx: int, rank: int = 0) -> "torch.Tensor":
        return self.pools[rank][self.blocks[req.request_id][idx]]

    def stored(self, tokens, rank: int = 0) -> list:
        """What the store holds for each full block of ``tokens`` on ``rank``: the bytes
        as a pool entry, or ``None`` where it holds nothing."""
        sched = self.scheduler
        out = []
        for key in rank_keys(self, tokens, rank):
            dst = torch.empty(LAYERS, self.kv_factor, WIDTH, dtype=self.dtype)
            out.append(dst if sched.store.load([key], [dst]).result()[0] else None)
        return out

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.scheduler.close()


@pytest.fixture
def engine(trt):
    made = []

    def make(args=None, **kw):
        e = MiniEngine(trt, args or llm_args(), **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


PROMPT = list(range(100, 118))   # 18 tokens: 4 full blocks and 2 tokens


def test_classes_subclass_the_current_api(trt):
    base = __import__(standin.CURRENT, fromlist=["x"])
    assert issubclass(trt.KVStoreConnectorScheduler, base.KvCacheConnectorScheduler)
    assert issubclass(trt.KVStoreConnectorWorker, base.KvCacheConnectorWorker)


def test_legacy_module_path_is_supported():
    standin.install(standin.LEGACY)
    try:
        import kvstore.connectors.trtllm as trt

        base = __import__(standin.LEGACY, fromlist=["x"])
        assert issubclass(trt.KVStoreConnectorWorker, base.KvCacheConnectorWorker)
        worker = trt.KVStoreConnectorWorker(llm_args())   # rank from tensorrt_llm._utils.mpi_rank
        assert worker.rank == 0
        worker.close()
    finally:
        standin.uninstall()


def test_second_request_loads_the_stored_prefix(engine):
    eng = engine()
    a = standin.LlmRequest(1, PROMPT)
    assert eng.prefill(a) == 0
    assert [t.block_id for t in eng.last_meta.saves] == eng.blocks[1][:4]
    assert eng.finish(a) is True                  # blocks held until the saves are done

    eng.pools[0].zero_()
    b = standin.LlmRequest(2, PROMPT)
    assert eng.prefill(b) == 4 * BS
    assert loaded_ids(eng.last_meta) == eng.blocks[2][:4]
    assert eng.last_meta.saves == []              # nothing new became full
    for idx in range(4):
        assert torch.equal(eng.block(b, idx), expected_block(PROMPT, idx, 0))
    assert eng.finish(b) is False


def test_one_prompt_token_is_always_left_to_compute(engine):
    eng = engine()
    prompt = list(range(16))                      # exactly 4 blocks
    a = standin.LlmRequest(1, prompt)
    eng.prefill(a)
    eng.finish(a)
    assert eng.prefill(standin.LlmRequest(2, prompt)) == 3 * BS


def test_cache_salt_separates_tenants(engine):
    eng = engine()
    a = standin.LlmRequest(1, PROMPT, cache_salt="tenant-a")
    eng.prefill(a)
    eng.finish(a)
    assert eng.prefill(standin.LlmRequest(2, PROMPT, cache_salt="tenant-b")) == 0
    assert eng.prefill(standin.LlmRequest(3, PROMPT)) == 0
    assert eng.prefill(standin.LlmRequest(4, PROMPT, cache_salt="tenant-a")) == 4 * BS


def test_device_matched_blocks_are_not_reloaded(engine):
    eng = engine()
    a = standin.LlmRequest(1, PROMPT)
    eng.prefill(a)
    eng.finish(a)
    b = standin.LlmRequest(2, PROMPT)
    assert eng.prefill(b, device_matched=2 * BS) == 2 * BS
    assert loaded_ids(eng.last_meta) == eng.blocks[2][2:4]
    for idx in range(4):
        assert torch.equal(eng.block(b, idx), expected_block(PROMPT, idx, 0))


def test_decode_blocks_are_saved_when_full(engine):
    eng = engine()
    a = standin.LlmRequest(1, PROMPT)
    eng.prefill(a)
    for tok in (7, 8):                            # 18 -> 20 tokens: block 4 fills up
        eng.decode(a, tok)
    eng.finish(a)
    longer = PROMPT + [7, 8, 9]
    b = standin.LlmRequest(2, longer)
    assert eng.prefill(b) == 5 * BS
    assert torch.equal(eng.block(b, 4), expected_block(longer, 4, 0))


def _evict_after_lookup(store, monkeypatch, victims: list) -> None:
    """Evict ``victims`` right after the connector's lookup, before it loads them: the
    race leases exist to prevent, forced (a lost NVMe copy, a corrupt block, a dead
    server behave the same to the connector: the load comes back False)."""
    lookup = store.lookup

    def lookup_then_evict(keys, lease_s=None):
        n = lookup(keys, lease_s=lease_s)
        store.delete(victims)
        return n

    monkeypatch.setattr(store, "lookup", lookup_then_evict)


def test_a_failed_load_is_never_offered_and_never_stored_over(engine, monkeypatch):
    eng = engine()
    a = standin.LlmRequest(1, PROMPT)
    eng.prefill(a)
    eng.finish(a)
    store = eng.scheduler.store
    keys = rank_keys(eng, PROMPT)
    _evict_after_lookup(store, monkeypatch, keys[1:2])
    eng.pools[0].fill_(7)                         # stale bytes in every free block
    b = standin.LlmRequest(2, PROMPT)
    assert eng.prefill(b) == 1 * BS               # only block 0 was loaded and verified; no exception
    monkeypatch.undo()
    assert loaded_ids(eng.last_meta) == eng.blocks[2][:1]
    for idx in range(4):                          # the engine computed blocks 1.. itself, over valid KV
        assert torch.equal(eng.block(b, idx), expected_block(PROMPT, idx, 0))
    eng.finish(b)
    assert trt_stats(store)["failed_loads"] == 1
    for idx, held in enumerate(eng.stored(PROMPT)):
        assert held is None or torch.equal(held, expected_block(PROMPT, idx, 0))
    assert store.stats()["leases"] == 0


def test_a_rank_that_cannot_load_fails_before_the_forward_not_inside_it(engine, trt):
    """The path without scheduler staging (each rank loads its own shard, TP>1): a
    promised block that is gone makes ``start_load_kv`` raise, before the forward pass;
    the layer hooks, inside it, never raise and nothing is saved."""
    eng = engine()
    a = standin.LlmRequest(1, PROMPT)
    eng.prefill(a)
    eng.finish(a)
    w = eng.workers[0]
    content = [k.digest for k in eng.scheduler.scheme.content_keys(PROMPT, None)]
    eng.scheduler.store.delete(rank_keys(eng, PROMPT)[1:2])
    from kvstore.connectors._trtllm_plan import ConnectorMeta, LoadGroup, Transfer

    meta = ConnectorMeta(loads=[LoadGroup(2, [Transfer(2, 20 + i, content[i]) for i in range(4)], 4 * BS)])
    w.bind_connector_meta(meta)
    with pytest.raises(KVStoreError, match="could not load"):
        w.start_load_kv(None)
    w.wait_for_layer_load(0, None)
    w.save_kv_layer(0, None)
    w.wait_for_save(None)
    assert trt_stats(eng.scheduler.store)["failed_loads"] == 1


def test_non_aligned_computed_tokens_never_over_report(engine):
    eng = engine()
    a = standin.LlmRequest(1, PROMPT)
    eng.prefill(a)
    eng.finish(a)
    b = standin.LlmRequest(2, PROMPT)
    # partial block reuse: the device holds 6 tokens, 1.5 blocks; 4 blocks = 16 are stored
    assert eng.prefill(b, device_matched=6) == 16 - 6
    assert loaded_ids(eng.last_meta) == eng.blocks[2][1:4]
    for idx in range(5):
        assert torch.equal(eng.block(b, idx), expected_block(PROMPT, idx, 0))
    assert trt_stats(eng.scheduler.store)["hit_tokens"] == 16 - 6
    eng.finish(b)
    c = standin.LlmRequest(3, PROMPT)
    assert eng.scheduler.get_num_new_matched_tokens(c, 15) == (1, False)
    assert eng.scheduler.get_num_new_matched_tokens(c, 16) == (0, False)
    eng.scheduler.request_finished(c, [])


def test_an_accepted_count_below_the_offer_is_honoured(engine):
    eng = engine()
    a = standin.LlmRequest(1, PROMPT)
    eng.prefill(a)
    eng.finish(a)
    eng.pools[0].fill_(7)
    b = standin.LlmRequest(2, PROMPT)
    assert eng.prefill(b, accept=6) == 6          # offered 16, the runtime takes 6 (1.5 blocks)
    assert eng.offered == 16
    assert loaded_ids(eng.last_meta) == eng.blocks[2][:2]
    for idx in range(4):
        assert torch.equal(eng.block(b, idx), expected_block(PROMPT, idx, 0))
    assert trt_stats(eng.scheduler.store)["loaded_tokens"] == 6
    eng.finish(b)
    for idx, held in enumerate(eng.stored(PROMPT)):
        assert torch.equal(held, expected_block(PROMPT, idx, 0))
    assert eng.scheduler.store.stats()["leases"] == 0


def test_a_requery_releases_the_lease_it_replaces(engine):
    eng = engine()
    a = standin.LlmRequest(1, PROMPT)
    eng.prefill(a)
    eng.finish(a)
    store = eng.scheduler.store
    b = standin.LlmRequest(2, PROMPT)
    assert eng.scheduler.get_num_new_matched_tokens(b, 0)[0] == 4 * BS
    keys = rank_keys(eng, PROMPT)
    store.delete(keys[1:2])
    assert eng.scheduler.get_num_new_matched_tokens(b, 0)[0] == 1 * BS    # asked again: the answer shrank
    assert store.stats()["leases"] == 0           # nothing of the first answer (blocks 2, 3) still held
    eng.scheduler.request_finished(b, [])
    assert store.stats()["leases"] == 0
    from kvstore.connectors._trtllm_plan import LOCAL

    assert not LOCAL._tickets                     # the staged blocks of both answers went back


def test_two_kv_dtypes_never_share_keys(engine, trt):
    store = trt.acquire_store(None)              # keep the shared embedded Store across engines
    try:
        fp16 = engine(llm_args(kv_dtype="auto"))
        a = standin.LlmRequest(1, PROMPT)
        fp16.prefill(a)
        fp16.finish(a)
        fp16.close()
        bf16 = engine(llm_args(kv_dtype="auto"), dtype=torch.bfloat16)
        assert bf16.prefill(standin.LlmRequest(2, PROMPT)) == 0        # same bytes per block, other dtype
        bf16.close()
        fp8 = engine(llm_args(kv_dtype="fp8"))    # a quantised KV cache is another namespace too
        assert fp8.prefill(standin.LlmRequest(3, PROMPT)) == 0
        fp8.close()
        again = engine(llm_args(kv_dtype="auto"))
        assert again.prefill(standin.LlmRequest(4, PROMPT)) == 4 * BS
    finally:
        trt.release_store(store)


def test_saves_never_synchronize_the_forward_stream(engine):
    class Stream:
        synchronized = 0

        def synchronize(self):
            Stream.synchronized += 1

    eng = engine()
    a = standin.LlmRequest(1, PROMPT)
    eng.prefill(a, stream=Stream())
    assert Stream.synchronized == 0
    eng.finish(a)
    assert all(held is not None for held in eng.stored(PROMPT))


def test_loads_and_saves_are_copied_on_the_engines_stream(engine, monkeypatch):
    """The stream TensorRT-LLM hands start_load_kv / wait_for_save is the one the
    block copies are issued on (a CUDA stream there; a stand-in here)."""
    from kvstore.connectors import _trtllm_worker as worker_mod

    entered, recorded = [], []
    real_on, real_record = worker_mod.on_stream, worker_mod.record_event

    def on_stream(stream):
        entered.append(stream)
        return real_on(stream)

    def record_event(stream, tensors):
        recorded.append(stream)
        return real_record(stream, tensors)

    monkeypatch.setattr(worker_mod, "on_stream", on_stream)
    monkeypatch.setattr(worker_mod, "record_event", record_event)
    engine_stream = object()
    eng = engine()
    a = standin.LlmRequest(1, PROMPT)
    eng.prefill(a, stream=engine_stream)             # saves 4 blocks
    eng.finish(a)
    assert entered and all(s is engine_stream for s in entered + recorded)
    entered.clear()
    recorded.clear()
    eng.pools[0].zero_()
    b = standin.LlmRequest(2, PROMPT)
    assert eng.prefill(b, stream=engine_stream) == 4 * BS          # loads 4 blocks
    assert entered and all(s is engine_stream for s in entered + recorded)
    assert all(torch.equal(eng.block(b, i), expected_block(PROMPT, i, 0)) for i in range(4))
    eng.finish(b)


def test_counters_reach_store_stats(engine):
    eng = engine(staging_bytes=6 * LAYERS * 2 * WIDTH * 2)     # a worker's saves: room for 3 blocks
    store = eng.scheduler.store
    a = standin.LlmRequest(1, PROMPT)
    eng.prefill(a)                                # 4 full blocks to save, room for 3: dropped
    eng.finish(a)
    counts = trt_stats(store)
    assert counts["dropped_saves"] == 4 and counts["hit_tokens"] == 0
    b = standin.LlmRequest(2, list(range(9)))     # 2 full blocks fit
    eng.prefill(b)
    eng.finish(b)
    c = standin.LlmRequest(3, list(range(9)))
    assert eng.prefill(c) == 2 * BS
    eng.finish(c)
    counts = trt_stats(store)
    assert counts["hit_tokens"] == 2 * BS and counts["loaded_tokens"] == 2 * BS
    assert 0 < counts["staging_bytes"] <= 2 * 6 * LAYERS * 2 * WIDTH * 2     # scheduler + worker, bounded


def test_counters_detach_on_close(engine, trt):
    store = trt.acquire_store(None)
    try:
        eng = engine()
        assert "trtllm" in store.stats()["connectors"]
        eng.close()
        assert "trtllm" not in store.stats()["connectors"]
    finally:
        trt.release_store(store)


def test_tensor_parallel_needs_a_server(trt):
    with pytest.raises(ConfigError, match="server_url"):
        trt.KVStoreConnectorScheduler(llm_args(tp=2))


def test_keys_depend_on_rank_salt_and_layout(trt):
    from kvstore.connectors._trtllm_plan import KeyScheme, PoolLayout

    scheme = KeyScheme(model="org/tiny", dtype="float16", tokens_per_block=BS, world_size=2)
    mha = PoolLayout("torch.float16", (LAYERS, 2, WIDTH), LAYERS * 2 * WIDTH * 2)
    mla = PoolLayout("torch.float16", (LAYERS, 1, WIDTH), LAYERS * WIDTH * 2)
    content = [k.digest for k in scheme.content_keys(PROMPT, None)]
    salted = [k.digest for k in scheme.content_keys(PROMPT, "s")]
    assert len(content) == 4 and not set(content) & set(salted)
    assert scheme.rank_keys(content, 0, mha)[0] == scheme.rank_keys(content, 0, mha)[0]
    assert scheme.rank_keys(content, 0, mha)[0] != scheme.rank_keys(content, 1, mha)[0]
    assert scheme.rank_keys(content, 0, mla)[0] == scheme.rank_keys(content, 1, mla)[0]   # one MLA copy
    assert scheme.rank_keys(content, 0, mla)[0] != scheme.rank_keys(content, 0, mha)[0]


@pytest.mark.skipif(importlib.util.find_spec("kvstore.client") is None
                    or importlib.util.find_spec("kvstore.server") is None,
                    reason="tensor parallelism needs the kvstore cache server (kvstore.client/server)")
def test_tensor_parallel_ranks_through_a_server(engine, kvstore_url):
    eng = engine(llm_args(tp=2, server_url=kvstore_url))
    a = standin.LlmRequest(1, PROMPT)
    eng.prefill(a)
    eng.finish(a)
    # rank 1 loses its copy of block 2: the scheduler only promises what every rank has
    keys = rank_keys(eng, PROMPT, 1)
    eng.scheduler.store.delete(keys[2:3])
    for p in eng.pools:
        p.zero_()
    b = standin.LlmRequest(2, PROMPT)
    assert eng.prefill(b) == 2 * BS
    for rank in (0, 1):
        for idx in range(4):
            assert torch.equal(eng.block(b, idx, rank), expected_block(PROMPT, idx, rank))


@pytest.mark.skipif(importlib.util.find_spec("kvstore.client") is None
                    or importlib.util.find_spec("kvstore.server") is None,
                    reason="tensor parallelism needs the kvstore cache server (kvstore.client/server)")
def test_mla_two_ranks_store_one_copy_and_both_read_it(engine, kvstore_url):
    eng = engine(llm_args(tp=2, server_url=kvstore_url), kv_factor=1)
    a = standin.LlmRequest(1, PROMPT)
    eng.prefill(a)
    eng.finish(a)
    assert eng.scheduler.store.stats()["blocks"] == 4          # one replicated copy, not one per rank
    for p in eng.pools:
        p.zero_()
    b = standin.LlmRequest(2, PROMPT)
    assert eng.prefill(b) == 4 * BS
    for rank in (0, 1):
        for idx in range(4):
            assert torch.equal(eng.block(b, idx, rank), expected_block(PROMPT, idx, 0, kv_factor=1))
    eng.finish(b)
    assert eng.scheduler.store.stats()["leases"] == 0


def test_engine_runs_while_its_server_was_never_there(engine):
    """A cache is best effort (issue 35, finding 2): with ``server_url`` naming a port
    nothing listens on, the connector starts, every match is a miss, the saves are
    skipped (counted) and the request computes as without a cache."""
    from kvstore.testing import free_port

    eng = engine(llm_args(tp=1, server_url=f"kvstore://127.0.0.1:{free_port()}"))
    a = standin.LlmRequest(1, PROMPT)
    assert eng.prefill(a) == 0
    eng.finish(a)
    b = standin.LlmRequest(2, PROMPT)
    assert eng.prefill(b) == 0
    assert trt_stats(eng.scheduler.store)["unreachable_lookups"] >= 1
    deadline = time.monotonic() + 30
    while trt_stats(eng.workers[0].store)["dropped_saves"] == 0:
        assert time.monotonic() < deadline, "skipped saves were not counted"
        time.sleep(0.01)
    for idx in range(len(PROMPT) // BS):
        assert torch.equal(eng.block(b, idx), expected_block(PROMPT, idx, 0))
