"""TensorRT-LLM KV cache connector backed by kvstore (PyTorch backend).

Use it through ``kv_connector_config`` (see docs/trtllm.md)::

    kv_connector_config:
      connector_module: connectors.trtllm
      connector_scheduler_class: KVStoreConnectorScheduler
      connector_worker_class: KVStoreConnectorWorker
      server_url: 127.0.0.1:7480        # a kvstore serve; omit for an embedded Store

TensorRT-LLM runs the scheduler on rank 0 and a worker on every rank. A block is one
entry of the engine's primary pool (``kv_cache_tensor[block_id]``: all layers, K and
V of one rank's heads) and is saved and loaded whole, in place. Keys chain the token
ids of full blocks with the request's ``cache_salt``, LoRA adapter and multimodal items
(see ``_trtllm_plan.RequestKey``; a request whose input cannot be keyed is a miss), then
add the TP rank, so equal prefixes meet across processes and restarts.

Without ``server_url`` the scheduler and the worker of one process share one
embedded Store (``$KVSTORE_CONFIG`` or the default); that only fits TP=1, where both
live in the same process, and is refused otherwise.

Failed loads fail closed *before the promise*: TensorRT-LLM's connector API has no way
to report a failed load or fail one request once ``get_num_new_matched_tokens`` has
answered (``get_finished`` carries only finished ids). So where the scheduler shares
its process with the only worker (TP=1), it loads and verifies the blocks into host
staging *before* it answers, and offers only the verified prefix; the worker's part
is a host-to-device copy on the runtime's stream. With TP>1 every rank's blocks are
leased at lookup; a rank that still cannot load raises from ``start_load_kv``, before
the forward pass (never inside it). See docs/trtllm.md, "Failure behaviour".

Thread-safety: TensorRT-LLM calls each object from one executor thread; saves run on
a saver thread and the Store's pool and are tracked with futures.
"""

from __future__ import annotations

import logging
import math
from typing import Any, List, Tuple

from kvstore.connectors._metrics import ConnectorMetrics
from kvstore.connectors._trtllm_base import (LEASE_S, STAGING_BYTES, STORE_FAILURES, KvCacheConnectorScheduler, acquire_store,
                                     check_store_reach, leading, load_staging_bytes, release_store, request_key,
                                     scheme_of, windowed_pool)
from kvstore.connectors._trtllm_plan import (LOCAL, ConnectorMeta, HostStaging, LoadGroup, PendingMatch, PoolLayout,
                                     RequestKey, RequestState, Transfer)
from kvstore.connectors._trtllm_worker import KVStoreConnectorWorker
from kvstore.errors import BufferSizeError
from kvstore.hint import Hint

log = logging.getLogger(__name__)


class KVStoreConnectorScheduler(KvCacheConnectorScheduler):
    """Rank-0 side: finds stored prefixes and plans loads and saves per forward pass.

    ``staging_bytes`` bounds the host memory holding blocks loaded and verified before
    they are offered (TP=1); an offer is cut to what fits. With TP>1 an offer spans no
    more blocks than one worker's load staging (the load half of the same
    ``staging_bytes``) holds, so every rank loads it in one take."""

    def __init__(self, llm_args: Any, *, staging_bytes: int = STAGING_BYTES) -> None:
        super().__init__(llm_args)
        self.scheme = scheme_of(llm_args)
        self._url = check_store_reach(llm_args, self.scheme)
        self.store = acquire_store(self._url)
        self.metrics = ConnectorMetrics(self.store, "trtllm")
        self.staging = HostStaging(staging_bytes, on_change=lambda n: self.metrics.set("staging_bytes", n))
        self.worker_load_bytes = load_staging_bytes(staging_bytes)
        self._pending: dict[int, PendingMatch] = {}
        self._requests: dict[int, RequestState] = {}
        self._allocated: dict[int, list[int]] = {}
        self._idents: dict[int, RequestKey | None] = {}   # per request, read from its LlmRequest
        self.windowed = windowed_pool(llm_args)
        if self.windowed:
            log.warning("trtllm: the KV pool holds an attention window (kv_cache_config.max_attention_window); "
                        "the connector offers nothing and saves nothing")

    # -- matching ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[int, bool]:
        """Tokens after the ``num_computed_tokens`` the engine holds (block-aligned or
        not: partial block reuse) that every rank has stored: ``stored * block_size -
        num_computed_tokens``. With TP=1 the blocks are loaded and verified into host
        staging first and only the verified prefix is offered. At least one prompt
        token is always left for the engine to compute. A repeated query for the same
        request replaces (and releases) the previous answer."""
        rid = request.request_id
        self._drop_pending(rid)
        try:
            ident = request_key(request)
        except Exception as exc:   # a hook's exception would stop the executor loop: a miss
            log.warning("request %s is not cached: its key cannot be computed (%s: %s)", rid, type(exc).__name__, exc)
            ident = None
        self._idents[rid] = ident
        if ident is None or self.windowed:   # input it cannot key on (prompt table, unhashed multimodal); a window
            return 0, False
        layout = LOCAL.layout(self._url or "")
        if layout is None:             # no worker of this process has registered its pool yet
            return 0, False
        bs = self.scheme.tokens_per_block
        tokens = list(request.get_tokens(0))
        limit = max(len(tokens) - 1, 0) // bs
        if limit * bs <= num_computed_tokens:
            return 0, False
        first = num_computed_tokens // bs
        content = [k.digest for k in self.scheme.content_keys(tokens[:limit * bs], ident)]
        stored, leased = limit, []
        if not self._stages_here():
            # Each rank stages its shard of the load from its load half of staging_bytes.
            stored = min(stored, first + self.worker_load_bytes // max(1, layout.block_nbytes))
        try:
            for rank in self.scheme.storing_ranks(layout):
                keys = self.scheme.rank_keys(content[:stored], rank, layout)
                found = self.store.lookup(keys, lease_s=LEASE_S)
                leased.append(keys[:found])
                stored = min(stored, found)
        except STORE_FAILURES as exc:
            log.warning("trtllm: kvstore lookup failed (%s); no tokens matched", exc)
            stored = 0
        ticket = None
        if stored * bs > num_computed_tokens and self._stages_here():
            stored, ticket = self._stage(leased[0][first:stored], layout, first)
            self._release(leased)      # verified bytes are in hand: no lease needed
            leased = []
        if stored * bs <= num_computed_tokens:
            self._release(leased)
            return 0, False
        self._release([keys[stored:] for keys in leased])
        leased = [keys[:stored] for keys in leased]
        matched = stored * bs - num_computed_tokens
        self._pending[rid] = PendingMatch(num_computed_tokens, first, stored, content[:stored], leased,
                                          accepted_end=stored * bs, ticket=ticket)
        self.metrics.add("hit_tokens", matched)
        return matched, False

    def _stages_here(self) -> bool:
        """Whether the only worker lives in this process (TP=1), so blocks loaded here
        are the ones it copies in."""
        return self.scheme.world_size == 1 and LOCAL.has_rank(self._url or "", 0)

    def _stage(self, keys: list, layout: PoolLayout, first: int) -> tuple[int, int | None]:
        """Load ``keys`` (blocks ``first``...) into host staging and verify them; the
        leading verified blocks, parked for the worker under a ticket."""
        count = len(keys)
        bufs = self.staging.take(layout.block_nbytes, count)
        while bufs is None and count > 1:
            count //= 2
            bufs = self.staging.take(layout.block_nbytes, count)
        if bufs is None:
            return first, None
        try:
            ok = list(self.store.load(keys[:count], bufs).result())
        except BufferSizeError as exc:
            log.error("trtllm: stored blocks do not match this engine's pool layout (%s); not offered", exc)
            ok = [False] * count
        except STORE_FAILURES as exc:
            log.warning("trtllm: loading %d blocks failed (%s); they are recomputed", count, exc)
            ok = [False] * count
        good = leading(ok)
        self.metrics.add("failed_loads", ok.count(False))
        self.staging.give(bufs[good:])
        if good == 0:
            return first, None
        return first + good, LOCAL.park(self.staging, bufs[:good])

    # -- what the runtime accepted ----------------------------------------------------

    def cancel_load(self, request: Any, start: int, end: int) -> None:
        """The runtime will not consume the offered tokens ``[start, end)`` (absolute
        prompt positions): it could not allocate for them, or the request went away."""
        pending = self._pending.get(request.request_id)
        if pending is None or end <= start:
            return
        if start <= pending.num_computed:
            self._drop_pending(request.request_id)
            return
        pending.accepted_end = min(pending.accepted_end, start)

    def update_state_after_alloc(self, request: Any, block_ids: List[int]) -> None:
        self._allocated[request.request_id] = list(block_ids)
        accepted = getattr(request, "py_num_connector_matched_tokens", None)
        pending = self._pending.get(request.request_id)
        if pending is not None and isinstance(accepted, int) and not isinstance(accepted, bool):
            pending.accepted_end = min(pending.accepted_end, pending.num_computed + max(accepted, 0))

    def request_reset(self, request: Any) -> None:
        """The request's pages were released and it will run again from the start."""
        self._drop_pending(request.request_id)
        self._requests.pop(request.request_id, None)
        self._allocated.pop(request.request_id, None)
        self._idents.pop(request.request_id, None)

    # -- planning -----------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> ConnectorMeta:
        meta = ConnectorMeta()
        for data in scheduler_output.new_requests:
            rid = data.request_id
            pending = self._pending.pop(rid, None)
            state = self._requests[rid] = RequestState(ident=self._idents.get(rid))
            state.tokens = list(data.new_tokens)
            state.block_ids = list(data.new_block_ids) or self._allocated.get(rid, [])
            self._note_window(state.block_ids)
            state.priorities = _priorities(data, len(state.block_ids))
            external = 0
            if pending is not None:
                external = self._plan_load(meta, rid, state, pending)
            self._plan_saves(meta, rid, state, data.computed_position + external + data.num_scheduled_tokens)
        for data in scheduler_output.cached_requests:
            state = self._requests.get(data.request_id)
            if state is None:
                continue
            state.tokens.extend(data.new_tokens)
            state.block_ids.extend(data.new_block_ids)
            self._note_window(data.new_block_ids)
            state.priorities.extend(_priorities(data, len(data.new_block_ids)))
            self._plan_saves(meta, data.request_id, state, data.computed_position + data.num_scheduled_tokens)
        return meta

    def _note_window(self, block_ids: List[int]) -> None:
        """A block id of ``-1`` (a page an attention window has passed) marks the pool
        windowed: from then on nothing is offered or saved."""
        if not self.windowed and any(b < 0 for b in block_ids):
            self.windowed = True
            log.warning("trtllm: the engine reported a block with no page (-1: an attention window); the "
                        "connector offers nothing and saves nothing from now on")

    def _plan_load(self, meta: ConnectorMeta, rid: int, state: RequestState, pending: PendingMatch) -> int:
        """Loads for the accepted part of ``pending``, into every block of the range
        that has a page (a ``-1``, a block an attention window has passed, is never a
        target and needs no KV); returns the tokens it covers."""
        bs = self.scheme.tokens_per_block
        last = max(min(math.ceil(pending.accepted_end / bs), pending.stored, len(state.block_ids)), pending.first)
        ids = state.block_ids
        self._release([keys[last:] for keys in pending.leased])
        keep = [i - pending.first for i in range(pending.first, last) if ids[i] >= 0]
        ticket = self._trim_ticket(pending.ticket, last - pending.first, keep)
        if last == pending.first:
            return 0
        transfers = [Transfer(rid, ids[i], pending.content[i]) for i in range(pending.first, last) if ids[i] >= 0]
        tokens = min(pending.accepted_end, last * bs) - pending.num_computed
        if transfers:
            meta.loads.append(LoadGroup(rid, transfers, tokens, ticket))
        state.content = list(pending.content[:last])
        state.saved_upto = last
        return tokens

    def _trim_ticket(self, ticket: int | None, count: int, keep: list[int] | None = None) -> int | None:
        """Keep the staged buffers ``keep`` (indexes; by default the first ``count``)
        under a new ticket and hand the rest back."""
        if ticket is None:
            return None
        claimed = LOCAL.claim(ticket)
        if claimed is None:
            return None
        staging, bufs = claimed
        wanted = set(range(min(count, len(bufs))) if keep is None else keep)
        staging.give([b for i, b in enumerate(bufs) if i not in wanted])
        kept = [b for i, b in enumerate(bufs) if i in wanted]
        return LOCAL.park(staging, kept) if kept else None

    def _plan_saves(self, meta: ConnectorMeta, request_id: int, state: RequestState, valid_tokens: int) -> None:
        """Save each block that is full once this forward pass has run."""
        if state.ident is None or self.windowed:   # a request it cannot key on, or a windowed pool
            return
        bs = self.scheme.tokens_per_block
        full = min(valid_tokens, len(state.tokens), len(state.block_ids) * bs) // bs
        if full <= state.saved_upto:
            return
        content = state.content_upto(self.scheme, full)
        for idx in range(state.saved_upto, full):
            if state.block_ids[idx] >= 0:
                priority = state.priorities[idx] if idx < len(state.priorities) else None
                meta.saves.append(Transfer(request_id, state.block_ids[idx], content[idx],
                                           retention_hint(priority)))
        state.saved_upto = full
        state.saves_scheduled = True

    # -- finishing ----------------------------------------------------------------------

    def request_finished(self, request: Any, cache_block_ids: List[int]) -> bool:
        """True when saves were scheduled: the blocks stay allocated until every worker
        reports the request in ``get_finished``."""
        self._allocated.pop(request.request_id, None)
        self._idents.pop(request.request_id, None)
        self._drop_pending(request.request_id)
        state = self._requests.pop(request.request_id, None)
        return bool(state and state.saves_scheduled)

    def _drop_pending(self, rid: int) -> None:
        pending = self._pending.pop(rid, None)
        if pending is not None:
            self._release(pending.leased)
            self._trim_ticket(pending.ticket, 0)

    def _release(self, leased: list) -> None:
        for keys in leased:
            if not keys:
                continue
            try:
                self.store.release(keys)
            except STORE_FAILURES:
                pass

    def close(self) -> None:
        """Release what pending answers hold; drop this scheduler's reference to the
        shared Store/Client."""
        if self.store is None:
            return
        for rid in list(self._pending):
            self._drop_pending(rid)
        self.staging.clear()
        self.metrics.close()
        store, self.store = self.store, None
        release_store(store)

    shutdown = close


# TensorRT-LLM's retention priorities run 0..100; a block without a retention config
# has 35 (KvCacheRetentionConfig's default). Higher is evicted later, as in kvstore.
DEFAULT_RETENTION_PRIORITY = 35


def retention_hint(priority: int | None) -> Hint | None:
    """kvstore's hint for a block of TensorRT-LLM retention ``priority``: above the
    default, a hint of priority ``priority - 35`` without expiry (the connector API
    reports priorities per block, not the config's ``duration_ms``); at or below it,
    none (kvstore has no class between unhinted and one-shot ``discard``)."""
    if priority is None or priority <= DEFAULT_RETENTION_PRIORITY:
        return None
    return Hint(None, int(priority) - DEFAULT_RETENTION_PRIORITY)


def _priorities(data: Any, count: int) -> list[int | None]:
    """The retention priority of each of ``data``'s new blocks: ``RequestData.priorities``
    (TensorRT-LLM fills it from the request's ``KvCacheRetentionConfig`` on KV cache
    manager V1; ``None`` without one, or on V2)."""
    given = getattr(data, "priorities", None) or []
    return [int(p) if p is not None else None for p in given[:count]] + [None] * (count - len(given))


__all__ = ["ConnectorMeta", "DEFAULT_RETENTION_PRIORITY", "KVStoreConnectorScheduler", "KVStoreConnectorWorker",
           "STAGING_BYTES", "acquire_store", "release_store", "retention_hint"]
