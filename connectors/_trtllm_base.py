"""What the TensorRT-LLM connector's scheduler and worker share: TensorRT-LLM's connector
base classes (current and <= 1.2.x module paths), the store each process shares by
server URL, the key scheme read from ``llm_args``, and stream helpers."""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any, Sequence

try:
    from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import (
        KvCacheConnectorScheduler, KvCacheConnectorWorker)
except ImportError:
    try:  # TensorRT-LLM <= 1.2.x
        from tensorrt_llm._torch.pyexecutor.kv_cache_connector import (KvCacheConnectorScheduler,
                                                                       KvCacheConnectorWorker)
    except ImportError as exc:  # pragma: no cover - exercised only without TensorRT-LLM
        raise ImportError("connectors.trtllm needs TensorRT-LLM (PyTorch backend) with the KV cache "
                          "connector API; see docs/trtllm.md") from exc

from kvstore.connectors._store_handle import open_store, release_store
from kvstore.connectors._trtllm_plan import KeyScheme, RequestKey
from kvstore.api import StoreAPI
from kvstore.errors import ConfigError, RemoteError, StoreClosedError, TierError

log = logging.getLogger("kvstore.connectors.trtllm")
STORE_FAILURES = (TierError, RemoteError, StoreClosedError, OSError)
LEASE_S = 60.0
STAGING_BYTES = 256 << 20   # host staging per connector object (scheduler, each worker)


def load_staging_bytes(staging_bytes: int) -> int:
    """A worker's share of ``staging_bytes`` for loads (half; its saves get the rest),
    so queued saves never take the staging a promised load needs."""
    return int(staging_bytes) - int(staging_bytes) // 2

def connector_config(llm_args: Any) -> Any:
    return getattr(llm_args, "kv_connector_config", None) or getattr(llm_args, "connector_config", None)


def server_url(llm_args: Any) -> str | None:
    url = getattr(connector_config(llm_args), "server_url", None)
    if not url:
        return None
    return url.split("://", 1)[-1].rstrip("/")


def acquire_store(url: str | None) -> StoreAPI:
    """A Client of the server at ``url``, or without one the process's embedded Store
    (``$KVSTORE_CONFIG``, else the default), shared by scheduler and worker; hand it
    back with :func:`release_store` (see ``connectors/_store_handle.py``)."""
    return open_store({"server": url} if url else {}, owner="trtllm connector")


def text_of(value: Any) -> str:
    """A setting as key text: enums by name, ``None`` as empty."""
    if value is None:
        return ""
    return str(getattr(value, "name", None) or getattr(value, "value", None) or value)


def scheme_of(llm_args: Any) -> KeyScheme:
    """Every setting in ``llm_args`` that changes a block's bytes; the pool's resolved
    dtype and shape are added per rank (``PoolLayout``)."""
    kv_cfg = getattr(llm_args, "kv_cache_config", None)
    tokens_per_block = int(getattr(kv_cfg, "tokens_per_block", None) or 32)
    kv_dtype = text_of(getattr(kv_cfg, "dtype", None)) or "auto"
    tp = getattr(llm_args, "tensor_parallel_size", None)
    if tp is None:
        tp = getattr(getattr(llm_args, "parallel_config", None), "tp_size", 1)
    pp = int(getattr(llm_args, "pipeline_parallel_size", None) or 1)
    if pp > 1:
        raise ConfigError("trtllm connector: pipeline parallelism is not supported (TensorRT-LLM's KV cache "
                          "connector does not support it either)")
    quant = getattr(llm_args, "quant_config", None)
    if "FP4" in kv_dtype.upper() or "FP4" in text_of(getattr(quant, "kv_cache_quant_algo", None)).upper():
        raise ConfigError("trtllm connector: an NVFP4 KV cache is not supported: TensorRT-LLM keeps its block "
                          "scales in a second pool, and this connector moves only the primary pool (the scales "
                          "would not match the blocks)")
    check_vswa(llm_args)
    spec = getattr(llm_args, "speculative_config", None)
    if spec is not None and str(getattr(spec, "decoding_type", "")) != "NGram":
        raise ConfigError(f"trtllm connector: speculative decoding with a draft model (speculative_config "
                          f"{getattr(spec, 'decoding_type', type(spec).__name__)!r}) is not supported: MTP and "
                          "one-model EAGLE layers keep their KV in the same pool, and their KV at a block's last "
                          "position is built from the token after the block; use NGram or no speculative decoding")
    model = str(getattr(llm_args, "model", "") or "")
    if not model:
        raise ConfigError("trtllm connector: llm_args.model is empty; keys need a model name")
    fields = (("revision", text_of(getattr(llm_args, "revision", None))),
              ("model_dtype", text_of(getattr(llm_args, "dtype", None)) or "auto"),
              ("quant_algo", text_of(getattr(quant, "quant_algo", None))),
              ("kv_cache_quant_algo", text_of(getattr(quant, "kv_cache_quant_algo", None))),
              ("tp", str(int(tp or 1))), ("pp", str(pp)))
    return KeyScheme(model=model, dtype=kv_dtype, tokens_per_block=tokens_per_block, world_size=int(tp or 1),
                     fields=fields)


def _windows(llm_args: Any) -> list[int]:
    windows = getattr(getattr(llm_args, "kv_cache_config", None), "max_attention_window", None) or []
    return [int(windows)] if isinstance(windows, int) else [int(w) for w in windows]


def check_vswa(llm_args: Any) -> None:
    """Refuse variable sliding window attention (VSWA: ``max_attention_window`` names
    two or more window sizes, one of them shorter than the sequence). TensorRT-LLM then
    keeps one KV pool per window size, with blocks of each window freed at their own
    pace; this connector moves one pool through the documented connector API, so it
    could key only some layers' KV or load into pages one window no longer has."""
    windows = _windows(llm_args)
    max_seq_len = getattr(llm_args, "max_seq_len", None)
    if len(set(windows)) > 1 and (max_seq_len is None or min(windows) < int(max_seq_len)):
        raise ConfigError(f"trtllm connector: variable sliding window attention (VSWA: "
                          f"kv_cache_config.max_attention_window={windows}) is not supported: TensorRT-LLM keeps "
                          "one KV pool per window size and this connector moves a single pool; use one window "
                          "size for every layer, or serve this model without the kvstore connector")


def windowed_pool(llm_args: Any) -> bool:
    """Whether the pool holds a sliding (or chunked) attention window:
    ``kv_cache_config.max_attention_window`` names a window shorter than the sequence
    (or the sequence length is unknown). TensorRT-LLM reports the blocks such a
    window has passed as ``-1``."""
    windows = _windows(llm_args)
    max_seq_len = getattr(llm_args, "max_seq_len", None)
    return bool(windows) and (max_seq_len is None or min(windows) < int(max_seq_len))


def _present(value: Any) -> bool:
    if value is None:
        return False
    try:
        return len(value) > 0
    except TypeError:
        return True


def _hash_text(words: Sequence[int]) -> str:
    return "".join(f"{int(w) & 0xFFFFFFFF:08x}" for w in words)


def request_key(request: Any) -> RequestKey | None:
    """What ``request`` adds to its blocks' keys besides its tokens, read from
    TensorRT-LLM's ``LlmRequest``: ``cache_salt`` (or the binding's integer
    ``cache_salt_id`` where the text is not exposed), ``lora_task_id`` (with
    ``py_lora_path`` where set) and the multimodal items (``multimodal_hashes``,
    ``multimodal_positions``, ``multimodal_lengths``). ``None`` when the request
    carries input that changes its KV and that cannot be keyed on: a prompt-tuning
    table (``prompt_embedding_table``), or multimodal input without hashes and
    positions for every item; such a request is a miss and saves nothing."""
    if _present(getattr(request, "prompt_embedding_table", None)):
        return None
    hashes = getattr(request, "multimodal_hashes", None)
    positions = getattr(request, "multimodal_positions", None)
    lengths = getattr(request, "multimodal_lengths", None)
    items: tuple = ()
    if _present(hashes):
        if (positions is None or len(positions) != len(hashes)
                or (lengths is not None and len(lengths) != len(hashes))):
            return None
        items = tuple(sorted((int(pos), _hash_text(h), int(lengths[i]) if lengths is not None else -1)
                             for i, (pos, h) in enumerate(zip(positions, hashes))))
    elif any(_present(getattr(request, name, None))
             for name in ("multimodal_positions", "multimodal_embedding", "py_multimodal_data")):
        return None
    lora = getattr(request, "lora_task_id", None)
    lora_text = None
    if lora is not None:
        path = getattr(request, "py_lora_path", None)
        lora_text = str(int(lora)) + (f"@{path}" if path else "")
    salt = getattr(request, "cache_salt", None)
    salt_id = getattr(request, "cache_salt_id", None) if salt is None else None
    return RequestKey(salt=salt, lora=lora_text, mm_items=items,
                      salt_id=int(salt_id) if salt_id is not None else None)


def check_store_reach(llm_args: Any, scheme: KeyScheme) -> str | None:
    url = server_url(llm_args)
    if url is None and scheme.world_size > 1:
        raise ConfigError("trtllm connector: with tensor parallelism the scheduler and the workers live in "
                          "different processes and must share a kvstore server; set "
                          "kv_connector_config.server_url")
    return url


def leading(ok: Sequence[bool]) -> int:
    n = 0
    for good in ok:
        if not good:
            break
        n += 1
    return n


def on_stream(stream: Any) -> Any:
    """Issue copies on ``stream`` when it is a CUDA stream; host copies need none."""
    import torch

    if stream is not None and torch.cuda.is_available() and isinstance(stream, torch.cuda.Stream):
        return torch.cuda.stream(stream)
    return nullcontext()


def record_event(stream: Any, tensors: list) -> Any:
    """An event after the copies just issued, or ``None`` when they were host copies
    (already complete)."""
    import torch

    if not tensors or tensors[0].device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(stream if isinstance(stream, torch.cuda.Stream) else torch.cuda.current_stream())
    return event




__all__ = ["KvCacheConnectorScheduler", "KvCacheConnectorWorker", "LEASE_S", "STAGING_BYTES", "STORE_FAILURES",
           "load_staging_bytes",
           "acquire_store", "check_store_reach", "connector_config", "leading", "on_stream", "record_event",
           "release_store", "request_key", "scheme_of", "check_vswa", "server_url", "text_of", "windowed_pool"]
