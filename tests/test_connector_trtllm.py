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
    import connectors.trtllm as trt

    yield trt
    standin.uninstall()


def llm_args(tp: int = 1, server_url: str | None = None) -> standin.TorchLlmArgs:
    return standin.TorchLlmArgs(
        model="org/tiny", tensor_parallel_size=tp,
        kv_cache_config=standin.KvCacheConfig(tokens_per_block=BS, dtype="float16"),
        kv_connector_config=standin.KvCacheConnectorConfig(
            connector_module="connectors.trtllm", connector_scheduler_class="KVStoreConnectorScheduler",
            connector_worker_class="KVStoreConnectorWorker", server_url=server_url))


def expected_block(tokens: list[int], idx: int, rank: int) -> "torch.Tensor":
    """What the model would compute for block ``idx``: depends on the whole prefix."""
    seed = int.from_bytes(hashlib.sha256(repr((tokens[:(idx + 1) * BS], rank)).encode()).digest()[:8], "little")
    data = np.random.default_rng(seed).standard_normal((LAYERS, 2, WIDTH)).astype(np.float16)
    return torch.from_numpy(data)


class MiniEngine:
    """Calls the connector in TensorRT-LLM's order: match, allocate, build metadata,
    load, per-layer hooks around the model's work, save, finish."""

    def __init__(self, trt, args, *, num_blocks: int = 32) -> None:
        tp = args.tensor_parallel_size
        self.scheduler = trt.KVStoreConnectorScheduler(args)
        self.workers = [trt.KVStoreConnectorWorker(args, rank=r) for r in range(tp)]
        self.pools = [torch.zeros(num_blocks, LAYERS, 2, WIDTH, dtype=torch.float16) for _ in range(tp)]
        for w, p in zip(self.workers, self.pools):
            w.register_kv_caches(p)
        self.free = list(range(num_blocks))
        self.blocks: dict[int, list[int]] = {}

    def _forward(self, meta, req, start_tok: int, end_tok: int) -> None:
        tokens = req.get_tokens(0)
        for w in self.workers:
            w.bind_connector_meta(meta)
            w.start_load_kv(None)
        for layer in range(LAYERS):
            for rank, w in enumerate(self.workers):
                w.wait_for_layer_load(layer, None)
                for idx in range(start_tok // BS, (end_tok + BS - 1) // BS):
                    self.pools[rank][self.blocks[req.request_id][idx], layer] = expected_block(tokens, idx, rank)[layer]
                w.save_kv_layer(layer, None)
        for w in self.workers:
            w.wait_for_save(None)
            w._clear_connector_meta()

    def prefill(self, req, device_matched: int = 0) -> int:
        tokens = req.get_tokens(0)
        matched, is_async = self.scheduler.get_num_new_matched_tokens(req, device_matched)
        assert is_async is False
        blocks = self.blocks[req.request_id] = [self.free.pop(0) for _ in range((len(tokens) + BS - 1) // BS)]
        for rank in range(len(self.workers)):     # the device prefix cache already holds these
            for idx in range(device_matched // BS):
                self.pools[rank][blocks[idx]] = expected_block(tokens, idx, rank)
        self.scheduler.update_state_after_alloc(req, blocks)
        data = standin.RequestData(req.request_id, list(tokens), list(blocks), computed_position=device_matched,
                                   num_scheduled_tokens=len(tokens) - device_matched - matched,
                                   cache_salt=req.cache_salt)
        meta = self.scheduler.build_connector_meta(standin.SchedulerOutput(new_requests=[data]))
        self.last_meta = meta
        self._forward(meta, req, device_matched + matched, len(tokens))
        return matched

    def decode(self, req, token: int) -> None:
        req.add_new_token(token, 0)
        tokens = req.get_tokens(0)
        new_blocks = []
        if len(tokens) > len(self.blocks[req.request_id]) * BS:
            new_blocks = [self.free.pop(0)]
            self.blocks[req.request_id] += new_blocks
        data = standin.RequestData(req.request_id, [token], new_blocks, computed_position=len(tokens) - 1,
                                   num_scheduled_tokens=1)
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
        import connectors.trtllm as trt

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
    assert [t.block_id for t in eng.last_meta.loads] == eng.blocks[2][:4]
    assert eng.last_meta.saves == []              # nothing new became full
    for idx in range(4):
        assert torch.equal(eng.block(b, idx), expected_block(PROMPT, idx, 0))
    assert eng.workers[0].counters["blocks_loaded"] == 4
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
    assert [t.block_id for t in eng.last_meta.loads] == eng.blocks[2][2:4]
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


def test_a_block_lost_after_lookup_fails_loudly(engine):
    eng = engine()
    a = standin.LlmRequest(1, PROMPT)
    eng.prefill(a)
    eng.finish(a)
    b = standin.LlmRequest(2, PROMPT)
    matched, _ = eng.scheduler.get_num_new_matched_tokens(b, 0)
    assert matched == 4 * BS
    keys = eng.scheduler.scheme.rank_keys(eng.scheduler._pending[2].content, 0)
    eng.scheduler.store.delete(keys[1:2])
    blocks = eng.blocks[2] = [eng.free.pop(0) for _ in range(5)]
    data = standin.RequestData(2, PROMPT, blocks, computed_position=0, num_scheduled_tokens=len(PROMPT) - matched)
    meta = eng.scheduler.build_connector_meta(standin.SchedulerOutput(new_requests=[data]))
    w = eng.workers[0]
    w.bind_connector_meta(meta)
    w.start_load_kv(None)
    with pytest.raises(KVStoreError, match="could not be loaded"):
        w.wait_for_layer_load(0, None)


def test_tensor_parallel_needs_a_server(trt):
    with pytest.raises(ConfigError, match="server_url"):
        trt.KVStoreConnectorScheduler(llm_args(tp=2))


def test_keys_depend_on_rank_and_salt(trt):
    from connectors._trtllm_plan import KeyScheme

    scheme = KeyScheme(model="org/tiny", dtype="float16", tokens_per_block=BS, world_size=2)
    content = [k.digest for k in scheme.content_keys(PROMPT, None)]
    salted = [k.digest for k in scheme.content_keys(PROMPT, "s")]
    assert len(content) == 4 and not set(content) & set(salted)
    assert scheme.rank_keys(content, 0)[0] == scheme.rank_keys(content, 0)[0]
    assert scheme.rank_keys(content, 0)[0] != scheme.rank_keys(content, 1)[0]


@pytest.mark.skipif(importlib.util.find_spec("kvstore.client") is None
                    or importlib.util.find_spec("kvstore.server") is None,
                    reason="tensor parallelism needs the kvstore cache server (kvstore.client/server)")
def test_tensor_parallel_ranks_through_a_server(engine, tmp_path):
    from tests._serve import start_server as _start, stop_server as _stop
    from kvstore.testing import free_port

    port = free_port()
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"server: {{host: 127.0.0.1, port: {port}, admin_port: null}}\n"
                   "tiers:\n  - {name: hot, kind: dram, capacity: 16MiB}\n")
    proc = _start(str(cfg), port, tmp_path / "serve.log")
    try:
        eng = engine(llm_args(tp=2, server_url=f"kvstore://127.0.0.1:{port}"))
        a = standin.LlmRequest(1, PROMPT)
        eng.prefill(a)
        eng.finish(a)
        # rank 1 loses its copy of block 2: the scheduler only promises what every rank has
        keys = eng.scheduler.scheme.rank_keys([k.digest for k in eng.scheduler.scheme.content_keys(PROMPT, None)], 1)
        eng.scheduler.store.delete(keys[2:3])
        for p in eng.pools:
            p.zero_()
        b = standin.LlmRequest(2, PROMPT)
        assert eng.prefill(b) == 2 * BS
        for rank in (0, 1):
            for idx in range(4):
                assert torch.equal(eng.block(b, idx, rank), expected_block(PROMPT, idx, rank))
    finally:
        _stop(proc)
