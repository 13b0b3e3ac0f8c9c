"""The TensorRT-LLM connector's keys over a matrix of engine configurations and request
inputs (issue 33, "done when"): any two that change the KV bytes of the same tokens
never share a key, on any rank. Built from the stand-in of TensorRT-LLM's documented
``TorchLlmArgs`` / ``LlmRequest`` (TensorRT-LLM cannot be installed here), through the
connector's own key scheme and the pool layout a worker registers."""

import itertools

import pytest

from tests import test_connector_trtllm as base

standin = base.standin
trt = base.trt                         # fixture
torch = base.torch
BS, LAYERS, WIDTH = base.BS, base.LAYERS, base.WIDTH


def args(*, model="org/tiny", tp=1, dtype="auto", kv_dtype="auto", revision=None, quant=None, kv_quant=None,
         tokens_per_block=BS):
    return standin.TorchLlmArgs(
        model=model, tensor_parallel_size=tp, dtype=dtype, revision=revision,
        quant_config=standin.QuantConfig(quant_algo=quant, kv_cache_quant_algo=kv_quant),
        kv_cache_config=standin.KvCacheConfig(tokens_per_block=tokens_per_block, dtype=kv_dtype))


def layout(pool_dtype=torch.float16, kv_factor=2):
    from kvstore.connectors._trtllm_plan import PoolLayout

    block = torch.empty(LAYERS, kv_factor, WIDTH, dtype=pool_dtype)
    return PoolLayout(str(pool_dtype), tuple(block.shape), block.numel() * block.element_size())


def test_configurations_that_change_kv_bytes_never_share_a_key(trt):
    from kvstore.connectors._trtllm_base import request_key, scheme_of

    engines = {
        "default": (args(), layout()),
        "model b": (args(model="org/other"), layout()),
        "revision r1": (args(revision="r1"), layout()),
        "revision r2": (args(revision="r2"), layout()),
        "dtype bf16": (args(dtype="bfloat16"), layout(torch.bfloat16)),
        "kv fp8": (args(kv_dtype="fp8"), layout(torch.uint8)),
        "kv int8": (args(kv_dtype="int8"), layout(torch.uint8)),
        "quant fp8": (args(quant="FP8"), layout()),
        "quant w4a16": (args(quant="W4A16_AWQ"), layout()),
        "kv quant fp8": (args(kv_quant="FP8"), layout(torch.uint8)),
        "tokens per block 8": (args(tokens_per_block=2 * BS), layout()),
        "pool bf16 (auto dtype)": (args(), layout(torch.bfloat16)),
        "tp2": (args(tp=2), layout()),
        "tp4": (args(tp=4), layout()),
    }
    requests = {
        "plain": {},
        "salt a": {"cache_salt": "tenant-a"},
        "salt b": {"cache_salt": "tenant-b"},
        "lora 1": {"lora_task_id": 1},
        "lora 2": {"lora_task_id": 2},
        "lora 1 other path": {"lora_task_id": 1, "py_lora_path": "/adapters/x"},
        "image a": {"multimodal_hashes": [[1] * 8], "multimodal_positions": [2], "multimodal_lengths": [4]},
        "image b": {"multimodal_hashes": [[2] * 8], "multimodal_positions": [2], "multimodal_lengths": [4]},
        "salt a + lora 1": {"cache_salt": "tenant-a", "lora_task_id": 1},
    }
    tokens = list(range(100, 100 + 4 * BS))
    seen: dict[bytes, str] = {}
    for (name, (llm_args, pool)), (rname, fields) in itertools.product(engines.items(), requests.items()):
        scheme = scheme_of(llm_args)
        ident = request_key(standin.LlmRequest(1, tokens, **fields))
        assert ident is not None, rname
        content = [k.digest for k in scheme.content_keys(tokens, ident)]
        for rank in range(scheme.world_size):
            key = scheme.rank_keys(content, rank, pool)[-1]      # the last block: the whole prefix
            where = f"{name} rank {rank} {rname}"
            assert key.digest not in seen, f"{where} shares a key with {seen[key.digest]}"
            seen[key.digest] = where
    assert len(seen) == sum(scheme_of(a).world_size for a, _ in engines.values()) * len(requests)


def test_mla_ranks_share_one_copy_but_not_with_mha(trt):
    """The one intended sharing: MLA's latent is the same on every TP rank."""
    from kvstore.connectors._trtllm_base import scheme_of

    scheme = scheme_of(args(tp=2))
    content = [k.digest for k in scheme.content_keys(list(range(100, 100 + BS)), None)]
    mla = layout(kv_factor=1)
    assert scheme.rank_keys(content, 0, mla) == scheme.rank_keys(content, 1, mla)
    assert scheme.rank_keys(content, 0, mla) != scheme.rank_keys(content, 0, layout())
