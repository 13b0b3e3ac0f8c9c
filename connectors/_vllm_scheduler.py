"""Scheduler side of the vLLM connector: answers prefix lookups from the store, leases
the chunks it plans to load, and tells workers which chunks to load and save.

Runs in vLLM's engine-core process, on the scheduler thread only (vLLM calls these
hooks from one thread); not thread-safe by itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from connectors._vllm_config import KVShape, VllmConnectorConfig, request_salt, token_array
from connectors._vllm_meta import ChunkTransfer, KVStoreConnectorMetadata
from kvstore.errors import KVStoreError
from kvstore.keys import BlockKey

log = logging.getLogger(__name__)


@dataclass
class _Req:
    """What the scheduler side remembers about one request."""

    tokens: Any                       # prompt token ids (uint32 array)
    keys: list[list[BlockKey]]        # per rank, one key per full prompt chunk
    hit_chunks: int = 0               # chunks found in the store at the last lookup
    block_ids: list[int] = field(default_factory=list)
    saved_chunks: int = 0             # leading chunks already stored or being saved
    had_saves: bool = False           # a worker was told to save chunks of this request
    load: ChunkTransfer | None = None  # planned, not yet handed to the workers
    leased: list[list[BlockKey]] | None = None
    loading: tuple[int, list[list[int]]] | None = None  # last planned load: first chunk, block ids


class SchedulerSide:
    def __init__(self, config: VllmConnectorConfig, shape: KVShape, store: Any, *,
                 do_load: bool, do_save: bool) -> None:
        self.config = config
        self.shape = shape
        self.store = store
        self.do_load = do_load
        self.do_save = do_save
        self._reqs: dict[str, _Req] = {}
        self._planned: list[ChunkTransfer] = []

    # -- vLLM hooks -----------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        """Hash the prompt's chunk keys once, when the request arrives."""
        self._state(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` that the store can supply. No leases,
        no plans: vLLM may ask several times. A prompt's last token is never served
        (vLLM must compute at least one token to sample)."""
        if not self.do_load:
            return 0, False
        st = self._state(request)
        usable = (len(st.tokens) - 1) // self.shape.chunk_tokens
        if usable <= 0:
            return 0, False
        hit = min(self.store.lookup(keys[:usable]) for keys in st.keys)
        st.hit_chunks = hit
        external = hit * self.shape.chunk_tokens - num_computed_tokens
        if external <= 0:
            return 0, False
        return external, self.config.load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the load of the tokens vLLM accepted and lease their chunks, so that
        they cannot be evicted before a worker loads them."""
        st = self._state(request)
        st.saved_chunks = max(st.saved_chunks, st.hit_chunks)
        if num_external_tokens <= 0:
            return
        c, bs = self.shape.chunk_tokens, self.shape.block_size
        end = st.hit_chunks * c
        start = end - num_external_tokens
        first, last = start // c, end // c
        ids = blocks.get_block_ids()[0]
        if len(ids) < end // bs:
            # vLLM now counts these tokens as computed: never leave them unloaded.
            raise KVStoreError(f"request {request.request_id}: {len(ids)} blocks allocated for "
                               f"{end} loaded tokens; vLLM's allocation contract changed")
        keys = [k[first:last] for k in st.keys]
        got = [self.store.lookup(k, lease_s=self.config.lease_s) for k in keys]
        if min(got) < len(keys[0]):
            # Evicted since the lookup; the worker will fail closed on the missing chunks.
            log.info("request %s: %d of %d chunks still cached at allocation", request.request_id,
                     min(got), len(keys[0]))
        st.leased = keys
        p = self.shape.blocks_per_chunk
        st.load = ChunkTransfer(request.request_id, keys,
                                [ids[i * p:(i + 1) * p] for i in range(first, last)],
                                skip_blocks=(start - first * c) // bs,
                                is_async=self.config.load_async)
        st.loading = (first, st.load.block_ids)
        self._planned.append(st.load)

    def build_connector_meta(self, scheduler_output: Any) -> KVStoreConnectorMetadata:
        """Hand this step's planned loads to the workers, and ask them to save every
        prompt chunk that this step completes and the store does not hold yet."""
        meta = KVStoreConnectorMetadata(loads=self._planned)
        self._planned = []
        for spec in meta.loads:
            st = self._reqs.get(spec.req_id)
            if st is not None:
                st.load, st.leased = None, None   # the worker's load now releases them
        if not self.do_save:
            return meta
        counts = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is not None:
                st.block_ids = list(new.block_ids[0])
                self._plan_save(meta, new.req_id, st, new.num_computed_tokens + counts.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                st.block_ids.extend(new_ids[0])
            self._plan_save(meta, req_id, st, cached.num_computed_tokens[i] + counts.get(req_id, 0))
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """Chunks that failed to load are recomputed by vLLM; save them again."""
        bad = connector_output.invalid_block_ids
        if not bad:
            return
        for st in self._reqs.values():
            if st.loading is None:
                continue
            first, blocks = st.loading
            for i, ids in enumerate(blocks):
                if not bad.isdisjoint(ids):
                    st.saved_chunks = min(st.saved_chunks, first + i)
                    break

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Forget the request. With async saves, keep its blocks until the workers
        report its saves done (``finished_sending``)."""
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        if st.load is not None:
            self._planned = [s for s in self._planned if s is not st.load]
        if st.leased:
            for keys in st.leased:
                self.store.release(keys)
        return bool(st.had_saves and self.config.save_async), None

    # -- internals ------------------------------------------------------------------------

    def _state(self, request: Any) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None:
            tokens = token_array(request.prompt_token_ids)
            salt = request_salt(request)
            keys = [self.shape.namespace(r, salt).chunk_keys(tokens) for r in range(self.shape.world_size)]
            st = self._reqs[request.request_id] = _Req(tokens, keys)
        return st

    def _plan_save(self, meta: KVStoreConnectorMetadata, req_id: str, st: _Req, computed: int) -> None:
        p = self.shape.blocks_per_chunk
        full = min(computed, len(st.tokens)) // self.shape.chunk_tokens
        full = min(full, len(st.block_ids) // p, len(st.keys[0]))
        if full <= st.saved_chunks:
            return
        lo = st.saved_chunks
        meta.saves.append(ChunkTransfer(req_id, [k[lo:full] for k in st.keys],
                                        [st.block_ids[i * p:(i + 1) * p] for i in range(lo, full)]))
        st.saved_chunks = full
        st.had_saves = True


__all__ = ["SchedulerSide"]
