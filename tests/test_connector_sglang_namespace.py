"""The SGLang connector's namespace over a matrix of engine configurations, built with
SGLang's real ServerArgs, HiCacheStorageConfig, host pool and page hashes: any two
configurations that change the KV bytes of the same tokens never share a key, a uint8
(fp8) pool needs its logical KV dtype, and the default configuration keeps its keys."""

from __future__ import annotations

import json

import pytest

from kvstore.errors import ConfigError
from kvstore.keys import Namespace
from tests.test_connector_sglang import DYNAMIC, SMALL_STORE, host_pool_factory  # noqa: F401  (fixture)

torch = pytest.importorskip("torch")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str, storage_namespace_seed  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

MODEL = "org/tiny-model"
ROPE_2X = json.dumps({"rope_scaling": {"rope_type": "linear", "factor": 2.0}})
ROPE_4X = json.dumps({"rope_scaling": {"rope_type": "linear", "factor": 4.0}})


@pytest.fixture
def backend_for(monkeypatch, host_pool_factory):  # noqa: F811
    made = []

    def make(*, server_args=None, tp=(0, 1), pp=(0, 1), pool_dtype=torch.float16, served=MODEL, **extra):
        monkeypatch.setattr("kvstore.connectors.sglang._server_args", lambda: server_args)
        cfg = HiCacheStorageConfig(tp_rank=tp[0], tp_size=tp[1], pp_rank=pp[0], pp_size=pp[1], attn_cp_rank=0,
                                   attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                                   is_page_first_layout=True, model_name=served,
                                   extra_config={**DYNAMIC, "interface_v1": 1, "store": SMALL_STORE, **extra})
        backend = StorageBackendFactory.create_backend("dynamic", cfg, None)
        made.append(backend)
        backend.register_mem_pool_host(host_pool_factory("page_first", dtype=pool_dtype))
        return backend

    yield make
    for b in made:
        b.close()


def sa(**kw) -> ServerArgs:
    return ServerArgs(**{"model_path": MODEL, **kw})


def test_configurations_that_change_kv_bytes_never_share_a_key(backend_for):
    engines = {
        "default": {},
        "bfloat16": {"pool_dtype": torch.bfloat16, "server_args": sa(dtype="bfloat16")},
        "fp8_e4m3": {"pool_dtype": torch.uint8, "server_args": sa(kv_cache_dtype="fp8_e4m3")},
        "fp8_e5m2": {"pool_dtype": torch.uint8, "server_args": sa(kv_cache_dtype="fp8_e5m2")},
        "fp8_e4m3 bf16": {"pool_dtype": torch.uint8, "server_args": sa(kv_cache_dtype="fp8_e4m3", dtype="bfloat16")},
        "quant fp8": {"server_args": sa(quantization="fp8")},
        "rope2x": {"server_args": sa(json_model_override_args=ROPE_2X)},
        "rope4x": {"server_args": sa(json_model_override_args=ROPE_4X)},
        "revision r1": {"server_args": sa(revision="r1")},
        "revision r2": {"server_args": sa(revision="r2")},
        "path a": {"server_args": sa(model_path="/models/a", served_model_name=MODEL)},
        "path b": {"server_args": sa(model_path="/models/b", served_model_name=MODEL)},
        "weights v2": {"weights_version": "v2"},
        "tp2 rank0": {"tp": (0, 2)},
        "tp2 rank1": {"tp": (1, 2)},
        "pp2 rank1": {"pp": (1, 2)},
    }
    # Requests: SGLang seeds a page chain with the LoRA id (extra_key) and cache salt.
    seeds = {"plain": None, "salt": storage_namespace_seed(None, "tenant-a"),
             "lora-a": storage_namespace_seed("lora-a", None), "lora-b": storage_namespace_seed("lora-b", None)}
    tokens = list(range(100, 104))   # one page (page_size 4)
    seen: dict[bytes, str] = {}
    for name, kw in engines.items():
        backend = backend_for(**kw)
        for rname, seed in seeds.items():
            page = get_hash_str(tokens, prior_hash=seed)
            for space, keys in (("v0", backend._v0), ("v1", backend._v1)):
                for key in keys.keys([page]):
                    where = f"{name} {rname} {space}"
                    assert key.digest not in seen, f"{where} shares a key with {seen[key.digest]}"
                    seen[key.digest] = where


def test_a_uint8_pool_needs_the_logical_kv_dtype(backend_for):
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        backend_for(pool_dtype=torch.uint8)
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        backend_for(pool_dtype=torch.uint8, server_args=sa())   # kv_cache_dtype "auto"
    # extra_config names it where SGLang's ServerArgs are not published; the same format
    # from either place is the same bytes and the same namespace.
    given = backend_for(pool_dtype=torch.uint8, kv_cache_dtype="fp8_e5m2")
    read = backend_for(pool_dtype=torch.uint8, server_args=sa(kv_cache_dtype="fp8_e5m2"))
    assert given._v1.ns.dtype == "uint8/fp8_e5m2"
    assert given._v1.ns == read._v1.ns


def test_the_default_configuration_keeps_its_namespace(backend_for):
    for kw in ({}, {"server_args": sa()}, {"server_args": sa(served_model_name=MODEL)}):
        ns = backend_for(**kw)._v1.ns
        # What earlier releases derived: served name, pool dtype, shard and user salt only.
        assert ns == Namespace(MODEL, "float16", ns.chunk_tokens, ns.layout, 0, 1,
                               json.dumps({"shard": "", "user": ""}, sort_keys=True))


def test_a_base_model_served_under_its_variants_name_does_not_share_its_identity():
    """The served name ``org/Llama-3-8B-Instruct`` over the path ``org/Llama-3-8B`` is not
    the instruct model: the path goes into the identity whenever the name is not it."""
    from types import SimpleNamespace

    from kvstore.connectors._sglang_pages import engine_identity

    base_as_instruct = engine_identity(SimpleNamespace(model_path="org/Llama-3-8B"), "org/Llama-3-8B-Instruct", None)
    instruct = engine_identity(SimpleNamespace(model_path="org/Llama-3-8B-Instruct"), "org/Llama-3-8B-Instruct", None)
    assert base_as_instruct != instruct


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3", "NEXTN", "STANDALONE"])
def test_speculative_decoding_with_a_draft_model_is_refused_by_name(backend_for, algo):
    """Issue 33 item 12: the draft's KV travels in HiCache's pages, and an EAGLE/MTP
    draft's KV at a page's last position depends on the next token."""
    args = sa()
    args.speculative_algorithm = algo          # as SGLang holds it after parsing --speculative-algorithm
    with pytest.raises(ConfigError, match=rf"speculative decoding with a draft model.*{algo}"):
        backend_for(server_args=args)


def test_model_free_drafting_is_accepted(backend_for):
    args = sa()
    args.speculative_algorithm = "NGRAM"
    backend_for(server_args=args)
