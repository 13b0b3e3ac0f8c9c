"""Builders for tests that drive the vLLM connector with vLLM's real classes: a tiny
local model config (no hub access), VllmConfig, KVCacheConfig, Scheduler, requests, and
the worker-side step order. Import :func:`require_vllm` first: it skips the module when
vLLM is missing locally and fails it in CI."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvstore.testing import IN_CI

LAYERS = 2
BLOCK = 16
HEADS = 4
HEAD_SIZE = 16


def require_vllm():
    if IN_CI:
        import vllm  # noqa: F401  (CI installs it: a missing vLLM must fail, not skip)
        return vllm
    return pytest.importorskip("vllm")


def model_dir(root: Path) -> str:
    """A 2-layer OPT config; vLLM reads only config.json (no weights, no tokenizer)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    d = root / "tiny-opt"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": HEADS * HEAD_SIZE,
        "num_attention_heads": HEADS, "num_hidden_layers": LAYERS, "ffn_dim": 128, "vocab_size": 1000,
        "max_position_embeddings": 1 << 18, "word_embed_proj_dim": HEADS * HEAD_SIZE, "torch_dtype": "float16",
        "do_layer_norm_before": True, "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2}))
    return str(d)


def store_config(capacity: str = "64MiB", name: str = "hot") -> dict[str, Any]:
    return {"tiers": [{"name": name, "kind": "dram", "capacity": capacity}]}


def vllm_config(model: str, extra: dict[str, Any] | None, *, layout: str = "LBHNC",
                connector: str = "KVStoreConnector", module: str | None = "kvstore.connectors.vllm",
                prefix_caching: bool = True, policy: str = "recompute", max_model_len: int = 4096,
                parallel=None, role: str = "kv_both"):
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, VllmConfig)

    mc = ModelConfig(model=model, skip_tokenizer_init=True, max_model_len=max_model_len, dtype="float16")
    cc = CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching)
    cc.kv_cache_layout = layout
    sc = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=max_model_len,
                         enable_chunked_prefill=True, is_encoder_decoder=False)
    kt = KVTransferConfig(kv_connector=connector, kv_connector_module_path=module, kv_role=role,
                          kv_connector_extra_config=extra or {}, kv_load_failure_policy=policy)
    return VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc, device_config=DeviceConfig("cpu"),
                      kv_transfer_config=kt, parallel_config=parallel or ParallelConfig())


def kv_cache_config(vc, num_blocks: int = 64, *, layers: int = LAYERS, heads: int = HEADS,
                    head_size: int = HEAD_SIZE):
    import torch
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=head_size, dtype=torch.float16)
    names = [f"model.decoder.layers.{i}.self_attn.attn" for i in range(layers)]
    return get_kv_cache_config_from_groups(vc, [KVCacheGroupSpec(names, spec)],
                                           spec.page_size_bytes * layers * num_blocks)


def kv_caches(kcc, layout: str, *, seed: int | None = None):
    """Real per-layer CPU KV caches from vLLM's allocator, random when ``seed`` is set."""
    import torch
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    caches = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout[layout])
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        for t in caches.values():
            t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype))
    return caches


def scheduler(vc, kcc, *, async_scheduling: bool = False):
    """vLLM's Scheduler, or with ``async_scheduling`` its AsyncScheduler (the engine then
    schedules step N+1 before it processes step N's output: see :func:`pipelined`)."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    vc.cache_config.num_gpu_blocks = kcc.num_blocks
    vc.scheduler_config.async_scheduling = async_scheduling
    cls = AsyncScheduler if async_scheduling else Scheduler
    return cls(vllm_config=vc, kv_cache_config=kcc, structured_output_manager=StructuredOutputManager(vc),
                     block_size=BLOCK, log_stats=False)


def request(req_id: str, tokens: list[int], *, max_tokens: int = 1, cache_salt: str | None = None,
            kv_transfer_params: dict | None = None):
    """A vLLM Request; ``kv_transfer_params`` ride in ``SamplingParams.extra_args``, as
    vLLM's offline API carries them."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
    params = SamplingParams(max_tokens=max_tokens, extra_args=extra)
    return Request(req_id, list(tokens), params, None, cache_salt=cache_salt,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


def worker_connector(vc, kcc):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    return KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kcc)


class Engines:
    """Scheduler + worker pairs of vLLM's real classes on CPU caches, shut down together:
    ``make(vc, seed=None)`` returns ``(scheduler, worker connector, caches)``."""

    def __init__(self, layout: str = "LBHNC"):
        self.layout = layout
        self.made: list[tuple[Any, Any]] = []

    def make(self, vc, seed: int | None = None):
        kcc = kv_cache_config(vc)
        sched, worker = scheduler(vc, kcc), worker_connector(vc, kcc)
        caches = kv_caches(kcc, self.layout, seed=seed)
        worker.register_kv_caches(caches)
        self.made.append((sched, worker))
        return sched, worker, caches

    def shutdown(self) -> None:
        for sched, worker in self.made:
            worker.shutdown()
            sched.connector.shutdown()


_tok = itertools.count(100)


def run_worker_step(worker, meta, finished: set[str] = frozenset(), *, layerwise_layers=None):
    """vLLM's worker step order around a (model-less) forward; returns the
    KVConnectorOutput the model runner would send back."""
    from vllm.v1.outputs import KVConnectorOutput

    worker.handle_preemptions(meta)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    for name in layerwise_layers or ():
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, None, object())
    worker.wait_for_save()
    sending, recving = worker.get_finished(set(finished))
    errors = worker.get_block_ids_with_load_errors()
    worker_meta = worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    return KVConnectorOutput(finished_sending=sending, finished_recving=recving, invalid_block_ids=errors,
                             kv_connector_worker_meta=worker_meta)


def model_output(sched_out, kv_out=None):
    """One sampled token per scheduled request."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(sched_out.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[next(_tok) % 900 + 10] for _ in ids],
                             kv_connector_output=kv_out)


def layer_names() -> list[str]:
    return [f"model.decoder.layers.{i}.self_attn.attn" for i in range(LAYERS)]
