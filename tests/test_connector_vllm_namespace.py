"""The vLLM connector's namespace, derived from vLLM's real config classes over a
matrix of engine configurations: any two that change the KV bytes of the same tokens
never share a namespace, and the default configuration keeps the namespace it had."""

import itertools

import pytest

from tests import vllm_support as vs

vs.require_vllm()

import torch  # noqa: E402
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig,  # noqa: E402
                         VllmConfig)
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec  # noqa: E402

from kvstore.connectors._vllm_config import KVShape, VllmConnectorConfig, request_salt  # noqa: E402
from kvstore.errors import ConfigError  # noqa: E402
from kvstore.keys import Namespace  # noqa: E402

CHUNK = 32
ROPE_2X = {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}
ROPE_4X = {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}


def shape_of(model, *, extra=None, dtype="float16", cache_dtype="auto", tp=1, pp=1, **model_kw):
    mc = ModelConfig(model=model, skip_tokenizer_init=True, max_model_len=4096, dtype=dtype, **model_kw)
    cc = CacheConfig(block_size=vs.BLOCK, enable_prefix_caching=True, cache_dtype=cache_dtype)
    cc.kv_cache_layout = "LBHNC"
    sc = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=4096,
                         enable_chunked_prefill=True, is_encoder_decoder=False)
    extra = {"store": vs.store_config(), "chunk_tokens": CHUNK, **(extra or {})}
    kt = KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.connectors.vllm",
                          kv_role="kv_both", kv_connector_extra_config=extra)
    vc = VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc, device_config=DeviceConfig("cpu"),
                    kv_transfer_config=kt)
    vc.parallel_config.tensor_parallel_size = tp
    vc.parallel_config.pipeline_parallel_size = pp
    # The KV element type vLLM allocates: the model dtype, or uint8 for every fp8 format.
    kv_dtype = mc.dtype if cache_dtype == "auto" else torch.uint8
    spec = FullAttentionSpec(block_size=vs.BLOCK, num_kv_heads=vs.HEADS, head_size=vs.HEAD_SIZE, dtype=kv_dtype)
    kcc = get_kv_cache_config_from_groups(vc, [KVCacheGroupSpec(vs.layer_names(), spec)],
                                          spec.page_size_bytes * vs.LAYERS * 64)
    config = VllmConnectorConfig.parse(extra)
    return KVShape(vc, kcc, config.chunk_tokens, config.model_id, config.weights_version)


class _Req:
    def __init__(self, cache_salt=None, lora=None):
        self.cache_salt, self.lora_request, self.mm_features = cache_salt, lora, []


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return vs.model_dir(tmp_path_factory.mktemp("ns"))


def test_configurations_that_change_kv_bytes_never_share_a_namespace(model):
    engines = {
        "default": {},
        "bfloat16": {"dtype": "bfloat16"},
        "fp8_e4m3": {"cache_dtype": "fp8_e4m3"},
        "fp8_e5m2": {"cache_dtype": "fp8_e5m2"},
        "fp8_e4m3/bf16": {"cache_dtype": "fp8_e4m3", "dtype": "bfloat16"},
        "quant=fp8": {"quantization": "fp8"},
        "rope2x": {"hf_overrides": ROPE_2X},
        "rope4x": {"hf_overrides": ROPE_4X},
        "revision=r1": {"revision": "r1"},
        "revision=r2": {"revision": "r2"},
        "code_revision": {"code_revision": "c1"},
        "weights=v2": {"extra": {"weights_version": "v2"}},
        "weights=v3": {"extra": {"weights_version": "v3"}},
        "model_id": {"extra": {"model_id": "my-model"}},
        "model_id+quant": {"extra": {"model_id": "my-model"}, "quantization": "fp8"},
        "tp2": {"tp": 2},
        "pp2": {"pp": 2},
        "tp2pp2": {"tp": 2, "pp": 2},
    }
    requests = {"plain": _Req(), "salt": _Req(cache_salt="tenant-a"),
                "lora-a": _Req(lora=LoRARequest("adapter-a", 1, "/adapters/a")),
                "lora-b": _Req(lora=LoRARequest("adapter-b", 2, "/adapters/b"))}
    seen: dict[bytes, str] = {}
    for name, kw in engines.items():
        shape = shape_of(model, **kw)
        for rank, (rname, req) in itertools.product(range(shape.key_ranks), requests.items()):
            digest = shape.namespace(rank, request_salt(req)).digest
            where = f"{name} rank {rank} {rname}"
            assert digest not in seen, f"{where} shares a namespace with {seen.get(digest)}"
            seen[digest] = where
    assert len(seen) == sum(shape_of(model, **kw).key_ranks for kw in engines.values()) * len(requests)


def test_the_default_configuration_keeps_its_namespace(model):
    shape = shape_of(model)
    # What every earlier release derived for a local model at its defaults.
    assert shape.model == f"{model}@main" and shape.dtype == "float16"
    assert shape.namespace(0, "").digest == Namespace(f"{model}@main", "float16", CHUNK, shape.layout, 0, 1, "").digest
    # Settings at their defaults add nothing; the same settings give the same namespace.
    assert shape_of(model, hf_overrides={}).model == shape.model
    assert shape_of(model, hf_overrides=ROPE_2X).model == shape_of(model, hf_overrides=dict(ROPE_2X)).model


def test_a_callable_hf_override_needs_a_weights_version(model):
    def stretch(cfg):
        cfg.rope_scaling = {"rope_type": "linear", "factor": 2.0}
        return cfg

    with pytest.raises(ConfigError, match="weights_version"):
        shape_of(model, hf_overrides=stretch)
    named = shape_of(model, hf_overrides=stretch, extra={"weights_version": "rope2x"})
    assert "weights=rope2x" in named.model


def test_a_hub_model_on_its_default_branch_is_pinned_to_the_cached_commit(monkeypatch):
    from kvstore.connectors import _vllm_config

    snapshot = "/hf/hub/models--org--m/snapshots/0123456789abcdef0123456789abcdef01234567/config.json"
    monkeypatch.setattr("huggingface_hub.try_to_load_from_cache", lambda repo, name: snapshot)
    assert _vllm_config._hub_commit("org/m") == "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setattr("huggingface_hub.try_to_load_from_cache", lambda repo, name: None)
    assert _vllm_config._hub_commit("org/m") is None

