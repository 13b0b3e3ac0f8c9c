"""The vLLM connector's own config (``kv_connector_extra_config``) and the namespace
that ties stored bytes to a model, KV dtype, layout and parallel rank.

Only what ``kv_connector_extra_config`` says is used; nothing is read from the
environment.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from array import array
from typing import Any, Mapping

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvstore.config import Size
from kvstore.errors import ConfigError, InvalidArgumentError
from kvstore.keys import Namespace


class VllmConnectorConfig(BaseModel):
    """Options of :class:`connectors.vllm.KVStoreConnector` (see docs/vllm.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    store: dict[str, Any] | str | None = None   # embedded StoreConfig dict or YAML path
    server: str | None = None                   # "host:port" of a kvstore server
    token: str | None = None                    # server auth token
    tls: bool | dict[str, Any] | None = None    # TLS to a server with server.tls (remote tier's tls settings)
    chunk_tokens: int = Field(256, gt=0)        # tokens per stored chunk (multiple of block size)
    model_id: str | None = None                 # namespace model name; default: the served model
    weights_version: str | None = None          # bump when new weights are deployed under one path
    lease_s: float = Field(60.0, gt=0)          # how long a planned load protects its chunks
    load_async: bool = False                    # load while the request waits (WAITING_FOR_REMOTE_KVS)
    save_async: bool = True                     # saves finish in the background
    layerwise: bool = False                     # per-layer load/save in the attention hooks
    save: bool | None = None                    # default: kv_role is kv_producer or kv_both
    load: bool | None = None                    # default: kv_role is kv_consumer or kv_both
    timeout_s: float = Field(60.0, gt=0)        # longest wait for one store operation
    staging_bytes: Size = Field(1 << 30, gt=0)  # per worker: host staging, and as much on the device
    handoff_wait_s: float = Field(10.0, gt=0, le=3600)  # P/D: how long a consumer may wait for the saves
    handoff_lease_s: float = Field(60.0, gt=0, le=86400)  # P/D: how long the producer keeps them leased

    @model_validator(mode="after")
    def _one_backend(self) -> "VllmConnectorConfig":
        if (self.store is None) == (self.server is None):
            raise ValueError("set exactly one of 'store' (embedded StoreConfig) and 'server' ('host:port')")
        return self

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> "VllmConnectorConfig":
        try:
            return cls.model_validate(dict(extra or {}))
        except ValidationError as exc:
            lines = [f"  {'.'.join(map(str, e['loc'])) or '<root>'}: "
                     f"{'unknown field' if e['type'] == 'extra_forbidden' else e['msg'].removeprefix('Value error, ')}"
                     for e in exc.errors()]
            raise ConfigError("invalid kv_connector_extra_config for the kvstore connector:\n"
                              + "\n".join(lines)) from None


def load_staging_bytes(config: "VllmConnectorConfig") -> int:
    """The share of ``staging_bytes`` kept for loads (half; saves get the rest), so
    queued saves never take the staging a load needs."""
    return int(config.staging_bytes) - int(config.staging_bytes) // 2


def save_staging_bytes(config: "VllmConnectorConfig") -> int:
    return int(config.staging_bytes) // 2


def check_speculative(spec_config: Any) -> None:
    """Refuse speculative decoding whose draft model keeps KV in vLLM's cache (EAGLE,
    EAGLE3, MTP, DFlash, a draft model...): its layers would be stored in every chunk.
    An EAGLE-style draft builds a position's KV from that position's hidden state and
    the *next* token (vLLM shifts the draft's input ids by one; its own prefix cache
    drops the trailing block for it: ``needs_eagle_block_drop``), so a chunk's draft KV
    at its last position belongs to one continuation only; and no draft model's
    identity is in the namespace. Drafting without a model (``ngram``, ``suffix``)
    keeps no KV and is fine."""
    if spec_config is None:
        return
    try:
        draft_kv = bool(spec_config.uses_draft_kv_cache())
    except Exception:   # a vLLM whose SpeculativeConfig cannot say: assume it keeps draft KV
        draft_kv = True
    if draft_kv:
        raise ConfigError(f"the kvstore connector does not support speculative decoding with a draft model "
                          f"(speculative_config.method={getattr(spec_config, 'method', None)!r}): the draft's "
                          "layers share vLLM's KV cache, and an EAGLE/MTP draft's KV at a chunk's last position "
                          "depends on the token after the chunk; use a model-free method (ngram, suffix) or no "
                          "speculative decoding with this connector")


class KVShape:
    """What one block means, read from vLLM's ``KVCacheConfig`` and ``VllmConfig`` the
    same way in the scheduler and in the workers."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, chunk_tokens: int, model_id: str | None,
                 weights_version: str | None = None) -> None:
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            specs = ", ".join(type(g.kv_cache_spec).__name__ for g in groups)
            raise ConfigError(f"the kvstore connector supports one KV cache group, got {len(groups)} ({specs}; "
                              "hybrid models with the hybrid KV cache manager are not supported)")
        check_speculative(getattr(vllm_config, "speculative_config", None))
        spec = groups[0].kv_cache_spec
        check_spec(spec, groups[0])
        self.block_size = int(spec.block_size)
        if chunk_tokens % self.block_size:
            raise ConfigError(f"chunk_tokens ({chunk_tokens}) must be a multiple of vLLM's block size "
                              f"({self.block_size})")
        self.chunk_tokens = chunk_tokens
        self.blocks_per_chunk = chunk_tokens // self.block_size
        self.layer_names = list(groups[0].layer_names)
        # At most what one worker moves per chunk (layers sharing a tensor, and PP
        # stages, move less): sizes the load offer against the load staging share.
        self.chunk_bytes = len(self.layer_names) * self.blocks_per_chunk * int(spec.page_size_bytes)
        mc = vllm_config.model_config
        self.model = model_identity(mc, model_id, weights_version,
                                    str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto"))
        # The resolved element type of the cache (never "auto"), plus the cache dtype
        # vLLM was asked for where it adds a quantisation (fp8 variants share torch dtypes).
        self.dtype = str(spec.dtype).removeprefix("torch.")
        cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto")
        if cache_dtype != "auto":
            self.dtype += f"/{cache_dtype}"
        layout = (getattr(kv_cache_config, "kv_cache_layout", None)
                  or getattr(vllm_config.cache_config, "kv_cache_layout", None) or "default")
        pc = vllm_config.parallel_config
        self.tp_size = int(pc.tensor_parallel_size)
        self.pp_size = int(pc.pipeline_parallel_size)
        self.pcp_size = int(getattr(pc, "prefill_context_parallel_size", 1) or 1)
        self.dcp_size = int(getattr(pc, "decode_context_parallel_size", 1) or 1)
        self.world_size = self.tp_size * self.pp_size * self.pcp_size
        # MLA keeps one latent KV replicated on every TP rank (split only by DCP): one
        # copy is stored, written by the first replica and read by all.
        self.mla = type(spec).__name__ == "MLAAttentionSpec"
        self.tp_shards = self.dcp_size if self.mla else self.tp_size
        self.key_ranks = self.tp_shards * self.pp_size * self.pcp_size
        parts = [f"vllm:{layout}", type(spec).__name__, f"L{len(self.layer_names)}",
                 f"bs{self.block_size}", f"page{spec.page_size_bytes}",
                 f"tp{self.tp_shards}", f"pp{self.pp_size}", f"pcp{self.pcp_size}", f"dcp{self.dcp_size}"]
        for attr in ("num_kv_heads", "head_size", "head_size_v", "use_mla", "cache_dtype_str"):
            if getattr(spec, attr, None) is not None:
                parts.append(f"{attr}={getattr(spec, attr)}")
        self.layout = ";".join(parts)

    def key_rank(self, tp_rank: int, pp_rank: int = 0, pcp_rank: int = 0) -> int:
        """Which stored copy a worker reads and writes. For MLA, TP ranks that hold the
        same DCP shard share one (vLLM forms DCP groups from consecutive TP ranks)."""
        shard = tp_rank % self.dcp_size if self.mla else tp_rank
        return (pp_rank * self.pcp_size + pcp_rank) * self.tp_shards + shard

    def writes(self, tp_rank: int) -> bool:
        """Whether this TP rank stores its copy (MLA: only the first replica does)."""
        return not self.mla or tp_rank < self.dcp_size

    def namespace(self, rank: int, salt: str) -> Namespace:
        return Namespace(self.model, self.dtype, self.chunk_tokens, self.layout, rank, self.key_ranks, salt)


# The KV cache specs whose blocks the connector moves: every block a request was given
# holds its positions' KV until the request ends. Matched by exact type name: a subclass
# (sink, RSWA, hidden-state caches) keeps its blocks differently.
SUPPORTED_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")


def check_spec(spec: Any, group: Any) -> None:
    """Refuse, by name, a KV cache spec the connector does not handle: a sliding-window
    or chunked-local group frees blocks behind the window (vLLM hands them to other
    requests), Mamba keeps a state rather than per-token KV, cross-attention KV comes
    from the encoder."""
    name = type(spec).__name__
    if name not in SUPPORTED_SPECS:
        layers = list(getattr(group, "layer_names", None) or [])
        shown = ", ".join(layers[:3]) + (f", ... ({len(layers)} layers)" if len(layers) > 3 else "")
        raise ConfigError(f"the kvstore connector does not support KV cache spec {name} (layer group: "
                          f"{shown or '<no layers>'}); it supports {' and '.join(SUPPORTED_SPECS)} only")


def _hub_commit(repo: str) -> str | None:
    """The commit of ``repo``'s default revision in the local Hugging Face cache, which
    is what vLLM loaded (it downloads before any connector starts); None for a local
    directory, or when the cache does not hold it. Never touches the network."""
    if os.path.isdir(repo):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
        path = try_to_load_from_cache(repo, "config.json")
    except Exception:   # no huggingface_hub, or not a repo id: nothing to pin
        return None
    if not isinstance(path, str):
        return None
    parts = os.path.normpath(path).split(os.sep)
    if len(parts) >= 3 and parts[-3] == "snapshots":
        return parts[-2]
    return None


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if hasattr(value, "model_dump"):
        return value.model_dump()
    raise TypeError(f"{type(value).__name__} is not JSON")


def _fingerprint(value: Any, what: str) -> str:
    try:
        canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), default=_plain)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"the kvstore connector cannot fingerprint {what}: {exc}") from None
    return hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()


def model_identity(mc: Any, model_id: str | None, weights_version: str | None, cache_dtype: str) -> str:
    """The namespace's model field: the model and the weights' revision, plus every model
    setting that changes the KV bytes of the same tokens. Settings at their defaults add
    nothing, so a default deployment keeps its keys.

    - revision: ``revision``, else the cached commit of a hub repo's default branch
      (``main`` moves), else ``main``; ``weights_version`` for re-deployed local weights;
    - ``code_revision`` and ``model_weights`` (remote code and a separate weights path);
    - ``quantization`` and ``quantization_config`` (online or from the checkpoint);
    - ``hf_overrides`` (RoPE scaling and the like), as a digest of their canonical JSON; a
      callable's effect cannot be known, so it needs ``weights_version``;
    - the model dtype when the KV cache is stored in another one (fp8 KV computed in
      float16 or bfloat16 differs).
    """
    rev = getattr(mc, "revision", None) or _hub_commit(str(mc.model)) or "main"
    base = model_id or f"{mc.model}@{rev}"
    extra = []
    if weights_version:
        extra.append(f"weights={weights_version}")
    for attr, tag in (("code_revision", "code"), ("model_weights", "weights_path"), ("quantization", "quant")):
        value = getattr(mc, attr, None)
        if value:
            extra.append(f"{tag}={value}")
    overrides = getattr(mc, "hf_overrides", None)
    if callable(overrides):
        if not weights_version:
            raise ConfigError("the kvstore connector cannot tell what a callable hf_overrides changes; set "
                              "kv_connector_extra_config 'weights_version' to name this model variant")
        extra.append(f"hf=callable:{getattr(overrides, '__module__', '')}.{getattr(overrides, '__qualname__', '')}")
    elif overrides:
        extra.append(f"hf={_fingerprint(overrides, 'hf_overrides')}")
    quant_config = getattr(mc, "quantization_config", None)
    if quant_config:
        extra.append(f"qcfg={_fingerprint(quant_config, 'quantization_config')}")
    if cache_dtype != "auto":
        extra.append(f"act={str(getattr(mc, 'dtype', '')).removeprefix('torch.')}")
    return base + "".join(f";{e}" for e in extra)


def request_salt(request: Any) -> str:
    """Everything besides the token ids that changes a request's KV: its cache salt,
    its LoRA adapter and its multimodal inputs (hashes and positions)."""
    parts = [getattr(request, "cache_salt", None) or ""]
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora={getattr(lora, 'lora_name', '')}#{getattr(lora, 'lora_int_id', '')}")
    mm = getattr(request, "mm_features", None) or []
    if mm:
        h = hashlib.blake2b(digest_size=16)
        for f in mm:
            pos = getattr(f, "mm_position", None)
            h.update(f"{f.identifier}@{getattr(pos, 'offset', '')}+{getattr(pos, 'length', '')};".encode())
        parts.append(f"mm={h.hexdigest()}")
    return "|".join(parts)


def token_array(tokens: Any) -> np.ndarray:
    """A ``uint32`` array of token ids; ``array('I')`` converts a Python list about
    twice as fast as numpy does."""
    if isinstance(tokens, np.ndarray):
        return tokens
    try:
        return np.frombuffer(array("I", tokens), dtype=np.uint32)
    except (OverflowError, TypeError) as exc:
        raise InvalidArgumentError(f"token ids must be integers in [0, 2**32): {exc}") from exc


__all__ = ["SUPPORTED_SPECS", "KVShape", "VllmConnectorConfig", "check_spec", "check_speculative", "load_staging_bytes",
           "model_identity", "request_salt", "save_staging_bytes", "token_array"]
