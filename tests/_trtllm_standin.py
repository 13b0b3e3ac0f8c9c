"""A minimal stand-in for the parts of TensorRT-LLM the connector touches.

TensorRT-LLM cannot be installed on these machines (its PyPI package is a stub that
downloads the real wheel from NVIDIA's index; it needs CUDA, MPI and C++ bindings).
This module builds, in ``sys.modules`` only and only for the tests, the base classes
and data records with the signatures documented for TensorRT-LLM's KV cache connector
(shared/ENGINES.md section 3, read from TensorRT-LLM's ``main``):

- ``tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector`` (current) or
  ``tensorrt_llm._torch.pyexecutor.kv_cache_connector`` (<= 1.2.x):
  ``KvCacheConnectorWorker``, ``KvCacheConnectorScheduler``, ``RequestData``,
  ``SchedulerOutput``;
- ``tensorrt_llm.bindings.internal.batch_manager.LlmRequest``;
- ``tensorrt_llm.llmapi.llm_args``: ``TorchLlmArgs``, ``KvCacheConfig``,
  ``KvCacheConnectorConfig``, the speculative-decoding configs (``MTPDecodingConfig``,
  ``EagleDecodingConfig``, ``NGramDecodingConfig``, ``DraftTargetDecodingConfig``:
  each names its ``decoding_type``), and ``QuantConfig`` (in TensorRT-LLM it lives in
  ``tensorrt_llm.models.modeling_utils``);
- ``tensorrt_llm._utils.mpi_rank``.

It is not part of the kvstore package and carries no TensorRT-LLM code.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable, ClassVar, List, Optional, Tuple

CURRENT = "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector"
LEGACY = "tensorrt_llm._torch.pyexecutor.kv_cache_connector"

_rank = {"value": 0}


def mpi_rank() -> int:
    return _rank["value"]


def set_rank(rank: int) -> None:
    _rank["value"] = rank


# -- tensorrt_llm.llmapi.llm_args ---------------------------------------------------------


@dataclass
class KvCacheConnectorConfig:
    connector_module: str
    connector_scheduler_class: str
    connector_worker_class: str
    connector: Optional[str] = None
    server_url: Optional[str] = None


@dataclass
class KvCacheConfig:
    tokens_per_block: int = 32
    dtype: str = "auto"
    enable_block_reuse: bool = True
    enable_partial_reuse: bool = True      # on by default: device matches need not be block-aligned
    max_attention_window: Optional[List[int]] = None   # per layer group; shorter than the sequence: a window


@dataclass
class QuantConfig:
    """``tensorrt_llm.models.modeling_utils.QuantConfig``: algorithms are ``QuantAlgo``
    enum members (strings here) or ``None``."""

    quant_algo: Optional[str] = None
    kv_cache_quant_algo: Optional[str] = None


@dataclass
class MTPDecodingConfig:
    decoding_type: ClassVar[str] = "MTP"
    num_nextn_predict_layers: int = 1


@dataclass
class EagleDecodingConfig:
    decoding_type: ClassVar[str] = "Eagle"
    max_draft_len: int = 3


@dataclass
class NGramDecodingConfig:
    decoding_type: ClassVar[str] = "NGram"
    max_draft_len: int = 3


@dataclass
class DraftTargetDecodingConfig:
    decoding_type: ClassVar[str] = "DraftTarget"
    max_draft_len: int = 3


@dataclass
class TorchLlmArgs:
    model: str
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    dtype: str = "auto"
    revision: Optional[str] = None
    max_seq_len: Optional[int] = None
    quant_config: QuantConfig = field(default_factory=QuantConfig)
    speculative_config: Optional[object] = None
    kv_cache_config: KvCacheConfig = field(default_factory=KvCacheConfig)
    kv_connector_config: Optional[KvCacheConnectorConfig] = None


# -- tensorrt_llm.bindings.internal.batch_manager ----------------------------------------


class LlmRequest:
    """The few members of the C++ ``LlmRequest`` binding a connector reads."""

    def __init__(self, request_id: int, tokens: List[int], cache_salt: Optional[str] = None, *,
                 lora_task_id: Optional[int] = None, prompt_embedding_table=None,
                 multimodal_hashes: Optional[List[List[int]]] = None, multimodal_positions: Optional[List[int]] = None,
                 multimodal_lengths: Optional[List[int]] = None, multimodal_embedding=None,
                 py_multimodal_data: Optional[dict] = None, py_lora_path: Optional[str] = None) -> None:
        self.request_id = request_id
        self._tokens = list(tokens)
        self.cache_salt = cache_salt
        self.is_generation_only_request = False
        # the binding's read-only properties (None when the request has none); py_* are
        # the Python-side attributes the PyTorch backend sets on the request
        self.lora_task_id = lora_task_id
        self.prompt_embedding_table = prompt_embedding_table
        self.multimodal_hashes = multimodal_hashes          # per item: 8 int32 words of its content hash
        self.multimodal_positions = multimodal_positions    # per item: its first token position
        self.multimodal_lengths = multimodal_lengths        # per item: its token count
        self.multimodal_embedding = multimodal_embedding
        self.py_multimodal_data = py_multimodal_data
        self.py_lora_path = py_lora_path

    def get_tokens(self, beam: int) -> List[int]:
        return list(self._tokens)

    def add_new_token(self, token: int, beam: int) -> None:
        self._tokens.append(token)


# -- the connector base classes and records ----------------------------------------------


@dataclass
class RequestData:
    request_id: int
    new_tokens: List[int]
    new_block_ids: List[int]
    computed_position: int
    num_scheduled_tokens: int
    block_hashes: List[int] = field(default_factory=list)
    priorities: Optional[List[int]] = None
    cache_salt: Optional[str] = None
    new_block_ids_by_layer_group: List[List[int]] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    new_requests: List[RequestData] = field(default_factory=list)
    cached_requests: List[RequestData] = field(default_factory=list)
    attention_dp_rank: Optional[int] = None


class KvCacheConnectorWorker(ABC):
    supports_attention_dp = False

    def __init__(self, llm_args: TorchLlmArgs) -> None:
        self._llm_args = llm_args
        self._metadata = None
        super().__init__()

    def bind_connector_meta(self, metadata: object) -> None:
        self._metadata = metadata

    def get_connector_meta(self) -> object:
        return self._metadata

    def _clear_connector_meta(self) -> None:
        self._metadata = None

    def register_forward_pass_callable(self) -> Optional[Callable]:
        return None

    @abstractmethod
    def register_kv_caches(self, kv_cache_tensor) -> None: ...

    def register_kv_cache_layout(self, layout) -> None:
        self.register_kv_caches(layout.groups[0].regions[0].as_tensor())

    @abstractmethod
    def start_load_kv(self, stream) -> None: ...

    @abstractmethod
    def wait_for_layer_load(self, layer_idx: int, stream) -> None: ...

    @abstractmethod
    def save_kv_layer(self, layer_idx: int, stream) -> None: ...

    @abstractmethod
    def wait_for_save(self, stream) -> None: ...

    @abstractmethod
    def get_finished(self, finished_gen_req_ids: List[int],
                     started_loading_req_ids: List[int]) -> Tuple[List[int], List[int]]: ...


class KvCacheConnectorScheduler(ABC):
    def __init__(self, llm_args: TorchLlmArgs) -> None:
        self._llm_args = llm_args
        super().__init__()

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput): ...

    @abstractmethod
    def get_num_new_matched_tokens(self, request: LlmRequest, num_computed_tokens: int) -> Tuple[int, bool]: ...

    @abstractmethod
    def request_finished(self, request: LlmRequest, cache_block_ids: List[int]) -> bool: ...

    @abstractmethod
    def update_state_after_alloc(self, request: LlmRequest, block_ids: List[int]) -> None: ...

    def request_finished_by_layer_group(self, request, cache_block_ids_by_layer_group) -> bool:
        return self.request_finished(request, cache_block_ids_by_layer_group[0])

    def update_state_after_alloc_by_layer_group(self, request, block_ids_by_layer_group) -> None:
        self.update_state_after_alloc(request, block_ids_by_layer_group[0])

    def cancel_load(self, request: LlmRequest, start: int, end: int) -> None:
        """Optional, no-op by default: the runtime will not consume the offered prompt
        tokens ``[start, end)`` (KVCacheManagerV2: it could not allocate for them, or the
        request went away before it was scheduled)."""

    def request_reset(self, request: LlmRequest) -> None:
        """Optional, no-op by default: the request's pages were released and it will run
        again from the start."""

    def wait_for_initialization(self) -> None:
        return None


# -- installing into sys.modules ----------------------------------------------------------


def _module(name: str, **attrs) -> ModuleType:
    module = ModuleType(name)
    module.__path__ = []  # a package, so submodules resolve
    module.__dict__.update(attrs)
    return module


def install(path: str = CURRENT) -> None:
    """Put the stand-in modules into ``sys.modules`` with the connector API at ``path``
    (``CURRENT`` or ``LEGACY``). Undo with :func:`uninstall`."""
    uninstall()
    api = dict(KvCacheConnectorWorker=KvCacheConnectorWorker, KvCacheConnectorScheduler=KvCacheConnectorScheduler,
               RequestData=RequestData, SchedulerOutput=SchedulerOutput)
    modules = {
        "tensorrt_llm": {},
        "tensorrt_llm._utils": dict(mpi_rank=mpi_rank),
        "tensorrt_llm.bindings": {},
        "tensorrt_llm.bindings.internal": {},
        "tensorrt_llm.bindings.internal.batch_manager": dict(LlmRequest=LlmRequest),
        "tensorrt_llm.llmapi": {},
        "tensorrt_llm.llmapi.llm_args": dict(TorchLlmArgs=TorchLlmArgs, KvCacheConfig=KvCacheConfig,
                                             KvCacheConnectorConfig=KvCacheConnectorConfig, QuantConfig=QuantConfig,
                                             MTPDecodingConfig=MTPDecodingConfig,
                                             EagleDecodingConfig=EagleDecodingConfig,
                                             NGramDecodingConfig=NGramDecodingConfig,
                                             DraftTargetDecodingConfig=DraftTargetDecodingConfig),
        "tensorrt_llm._torch": {},
        "tensorrt_llm._torch.pyexecutor": {},
    }
    if path == CURRENT:
        modules["tensorrt_llm._torch.pyexecutor.connectors"] = {}
    modules[path] = api
    for name, attrs in modules.items():
        sys.modules[name] = _module(name, **attrs)
    set_rank(0)


def uninstall() -> None:
    for name in [n for n in sys.modules if n == "tensorrt_llm" or n.startswith("tensorrt_llm.")]:
        del sys.modules[name]
    for name in ("kvstore.connectors.trtllm", "kvstore.connectors._trtllm_worker", "kvstore.connectors._trtllm_base"):
        sys.modules.pop(name, None)     # they subclass the installed API's base classes
