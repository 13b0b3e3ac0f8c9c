"""Worker side of the vLLM connector: moves whole chunks between vLLM's paged KV
blocks and the store.

A stored chunk is ``blocks_per_chunk`` blocks of every layer, as raw page bytes laid
out ``[layer][block][page]`` (see :class:`kvstore.paged.PagedLayers`); the namespace
carries the layout, so bytes are only ever loaded into caches of the same layout.

:class:`WorkerSide` owns what loads and saves share (the caches, bounded staging, the
store, the requests whose loads failed) and hands vLLM's hooks to the load path
(:mod:`connectors._vllm_loads`, fail-closed loads) and the save path
(:mod:`connectors._vllm_saves`, no save over a failed load). Pages are gathered and
scattered on the caches' own device; device caches cross to pinned host staging, bounded
by ``staging_bytes`` (host, and as much on the device): half of it for loads, half for
saves, so queued saves never starve a load (the scheduler offers no more than the load
half holds).

Threading: vLLM calls every hook from the worker's main thread. Store futures complete
on store threads; their callbacks only return staging buffers to the pool.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvstore.connectors._metrics import ConnectorMetrics
from kvstore.connectors._staging import StagingPool
from kvstore.connectors._vllm_config import KVShape, VllmConnectorConfig, load_staging_bytes, save_staging_bytes
from kvstore.connectors._vllm_loads import LoadPath
from kvstore.connectors._vllm_meta import ChunkTransfer, KVStoreConnectorMetadata, KVStoreWorkerMetadata
from kvstore.connectors._vllm_saves import SavePath
from kvstore.api import StoreAPI
from kvstore.errors import ConfigError
from kvstore.paged import PagedLayers

log = logging.getLogger(__name__)


class WorkerSide:
    def __init__(self, config: VllmConnectorConfig, shape: KVShape, store: StoreAPI, metrics: ConnectorMetrics,
                 rank: int, *, writes: bool = True) -> None:
        self.config = config
        self.shape = shape
        self.store = store
        self.metrics = metrics
        self.rank = rank               # which stored copy this worker reads and writes
        self.writes = writes           # False: an MLA replica whose copy another rank stores
        self.pages: PagedLayers | None = None
        self.layer_index: dict[str, int] = {}
        self.pool: StagingPool | None = None          # host staging for loads
        self.dev_pool: StagingPool | None = None      # device staging for loads (device caches only)
        self.save_pool: StagingPool | None = None     # host staging for saves
        self.save_dev_pool: StagingPool | None = None  # device staging for saves (device caches only)
        self.load_parts = 1            # store loads per transfer (device caches overlap them)
        self.in_place = False          # host caches over an embedded Store: no staging copy
        self.side: Any = None          # CUDA: stream for device->host copies
        self.poisoned: dict[str, int] = {}   # request -> first chunk that failed to load here
        self.loads: LoadPath | None = None
        self.saves: SavePath | None = None

    # -- setup ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        """Index the per-layer caches in model order; layers sharing one tensor are moved
        once. Works for any layout: pages are raw bytes."""
        unique: dict[tuple, int] = {}
        tensors: list[torch.Tensor] = []
        names = [n for n in self.shape.layer_names if n in kv_caches] or sorted(kv_caches)
        for name in names:
            t = kv_caches[name]
            ident = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
            if ident not in unique:
                unique[ident] = len(tensors)
                tensors.append(t)
            self.layer_index[name] = unique[ident]
        if not tensors:
            raise ConfigError("register_kv_caches: vLLM passed no KV cache tensors")
        page_dim, ratio = _page_dim(tensors[0], num_blocks)
        self.pages = PagedLayers(tensors, blocks_per_chunk=self.shape.blocks_per_chunk,
                                 page_dim=page_dim, pages_per_block=ratio)
        device = self.pages.device
        loads, saves = load_staging_bytes(self.config), save_staging_bytes(self.config)
        host, pin = torch.device("cpu"), device.type == "cuda"
        self.pool = StagingPool(host, loads, pin=pin)
        self.save_pool = StagingPool(host, saves, pin=pin)
        if device.type != "cpu":
            self.dev_pool, self.save_dev_pool = StagingPool(device, loads), StagingPool(device, saves)
        if device.type == "cuda":
            self.side = torch.cuda.Stream(device)
        # Device caches: scatter group i on the device while the store copies group
        # i + 1 on the host. Host caches: both are CPU copies and would only compete.
        self.load_parts = 1 if device.type == "cpu" else 4
        # Host caches over an embedded Store: gather straight into the store's slots and
        # scatter straight out of them (one copy each way instead of two via staging).
        self.in_place = device.type == "cpu" and self.store.lends_memory
        self.loads = LoadPath(self)
        self.saves = SavePath(self)

    # -- vLLM's hooks ----------------------------------------------------------------------

    def start_load(self, meta: KVStoreConnectorMetadata) -> None:
        self._ready().loads.start(meta)

    def wait_for_layer(self, layer_name: str) -> None:
        self._ready().loads.wait_for_layer(layer_name)

    def finish_step_loads(self) -> None:
        if self.loads is not None:
            self.loads.finish_step()

    def finished_loads(self) -> set[str]:
        return self.loads.finished() if self.loads is not None else set()

    def take_load_errors(self) -> set[int]:
        return self.loads.take_errors() if self.loads is not None else set()

    def take_load_outcomes(self) -> KVStoreWorkerMetadata | None:
        return self.loads.take_outcomes() if self.loads is not None else None

    def save_layer(self, layer_name: str, meta: KVStoreConnectorMetadata) -> None:
        self._ready().saves.layer(layer_name, meta)

    def wait_for_save(self, meta: KVStoreConnectorMetadata) -> None:
        self._ready().saves.flush(meta)

    def note_holds(self, meta: KVStoreConnectorMetadata) -> None:
        self._ready().saves.note_holds(meta)

    def finished_saves(self, finished_req_ids: set[str]) -> set[str]:
        return self.saves.finished(finished_req_ids) if self.saves is not None else set()

    def close(self, timeout_s: float) -> None:
        if self.saves is not None:
            self.saves.close(timeout_s)

    # -- shared by the load and save paths ------------------------------------------------

    def block_tensors(self, spec: ChunkTransfer) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[n, blocks_per_chunk]`` block ids of the chunks (a short last chunk padded
        with its own last block) and which blocks to write (``None``: all): not the
        leading ``skip_blocks``, not the padding."""
        per, n = self.shape.blocks_per_chunk, spec.num_chunks
        if spec.per != per:
            raise ConfigError(f"request {spec.req_id}: {spec.per} blocks per chunk planned, the caches hold {per}")
        ids = spec.block_ids
        short = n * per - len(ids)
        if short:
            ids = ids + [ids[-1]] * short
        tensor = torch.tensor(ids, dtype=torch.long).view(n, per)
        if not spec.skip_blocks and not short:
            return tensor, None
        keep = torch.ones(n, per, dtype=torch.bool)
        keep[0, :spec.skip_blocks] = False
        if short:
            keep[-1, per - short:] = False
        return tensor, keep

    def copied(self) -> Any:
        """Device caches: an event on the engine's stream after the host->device copies
        enqueued so far, so a host staging buffer is reused only once they have read it."""
        if self.side is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.side.device))
        return event

    def gauge(self) -> None:
        pools = (self.pool, self.dev_pool, self.save_pool, self.save_dev_pool)
        self.metrics.set("staging_bytes", sum(p.allocated_bytes for p in pools if p is not None))

    def paged(self) -> PagedLayers:
        if self.pages is None:
            raise ConfigError("the kvstore connector got KV transfers before register_kv_caches")
        return self.pages

    def _ready(self) -> "WorkerSide":
        self.paged()
        return self


def _page_dim(t: torch.Tensor, num_blocks: int) -> tuple[int, int]:
    """The dim indexing blocks (vLLM 0.33: dim 0 of ``[B, H, N, C]``) and how many
    kernel pages make one block."""
    for d, size in enumerate(t.shape):
        if num_blocks and size >= num_blocks and size % num_blocks == 0:
            return d, size // num_blocks
    raise ConfigError(f"cannot find the block dim of a KV cache of shape {tuple(t.shape)} "
                      f"for {num_blocks} blocks")


__all__ = ["WorkerSide"]
