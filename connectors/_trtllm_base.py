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
from kvstore.connectors._trtllm_plan import KeyScheme
from kvstore.api import StoreAPI
from kvstore.errors import ConfigError, RemoteError, StoreClosedError, TierError

log = logging.getLogger("kvstore.connectors.trtllm")
STORE_FAILURES = (TierError, RemoteError, StoreClosedError, OSError)
LEASE_S = 60.0
STAGING_BYTES = 256 << 20   # host staging per connector object (scheduler, each worker)

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
    model = str(getattr(llm_args, "model", "") or "")
    if not model:
        raise ConfigError("trtllm connector: llm_args.model is empty; keys need a model name")
    quant = getattr(llm_args, "quant_config", None)
    fields = (("revision", text_of(getattr(llm_args, "revision", None))),
              ("model_dtype", text_of(getattr(llm_args, "dtype", None)) or "auto"),
              ("quant_algo", text_of(getattr(quant, "quant_algo", None))),
              ("kv_cache_quant_algo", text_of(getattr(quant, "kv_cache_quant_algo", None))),
              ("tp", str(int(tp or 1))), ("pp", str(pp)))
    return KeyScheme(model=model, dtype=kv_dtype, tokens_per_block=tokens_per_block, world_size=int(tp or 1),
                     fields=fields)


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
           "acquire_store", "check_store_reach", "connector_config", "leading", "on_stream", "record_event",
           "release_store", "scheme_of", "server_url", "text_of"]
