"""Scheduler side of the vLLM connector: answers prefix lookups from the store, leases
the chunks it plans to load, and tells workers which chunks to load and save.

Never wrong KV through a save: a chunk is stored only if every block before it was
valid KV when it was computed. A request's saves are held while a synchronous load it
depends on (its own, or one whose blocks it shares through vLLM's prefix cache) has not
reported back: the workers report every load's outcome, aggregated over all ranks, in
their step output (:class:`KVStoreWorkerMetadata`); a failed load moves the request's
save point back to the first failed chunk, so only recomputed bytes are stored.

Runs in vLLM's engine-core process, on the scheduler thread only (vLLM calls these
hooks from one thread); not thread-safe by itself.
"""

from __future__ import annotations

import itertools
import logging
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvstore.connectors._hints import request_hint, with_hint_actions
from kvstore.connectors._vllm_handoff import Handoffs, without_handoff
from kvstore.connectors._metrics import ConnectorMetrics
from kvstore.connectors._store_handle import clear_namespaces
from kvstore.connectors._vllm_config import KVShape, VllmConnectorConfig, load_staging_bytes, request_salt, token_array
from kvstore.connectors._vllm_meta import ChunkTransfer, KVStoreConnectorMetadata, KVStoreWorkerMetadata
from kvstore.connectors._vllm_prefix import HeldBlocks, hold, restore
from kvstore.api import StoreAPI
from kvstore.errors import KVStoreError
from kvstore.hint import Hint
from kvstore.keys import BlockKey

log = logging.getLogger(__name__)

# Request states that end in vLLM's output loop, which never finishes a request whose
# load failed in the step it reports: its held saves are valid KV.
_NORMAL_FINISH = {"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_REPETITION"}
NULL_BLOCK = 0          # vLLM's null block: the block pool's first block, never a request's KV
_TAINT_ENTRIES = 4096   # failed loads' unwritten blocks remembered (oldest forgotten first)


@dataclass
class _Req:
    """What the scheduler side remembers about one request."""

    tokens: Any                       # prompt token ids (uint32 array)
    keys: list[list[BlockKey]]        # per key rank, one key per full prompt chunk
    hit_chunks: int = 0               # chunks found in the store at the last lookup
    offer_from: int = 0               # num_computed_tokens vLLM asked about at that lookup
    block_ids: list[int] = field(default_factory=list)
    saved_chunks: int = 0             # leading chunks already stored or being saved
    had_saves: bool = False           # a worker was told to save chunks of this request
    load: ChunkTransfer | None = None  # planned, not yet handed to the workers
    leased: list[list[BlockKey]] | None = None
    loading: ChunkTransfer | None = None  # the last load handed to the workers
    alloc: tuple[Any, int] | None = None  # the planned load's KVCacheBlocks and end block
    pending: set[int] = field(default_factory=set)  # serials of sync loads its saves wait for
    no_save_from: int | None = None   # first chunk computed over a failed load's block: never saved
    hint: Hint | None = None          # retention hint from the request (vllm_hint)
    uncached: str | None = None       # why the request is neither offered nor saved (uncacheable)
    held: HeldBlocks | None = None    # the planned sync load's blocks, out of vLLM's prefix cache


def uncacheable(request: Any) -> str | None:
    """Why a request's KV is not a function of what its keys hash, or None. Prompt
    embeddings: the embedded positions carry a placeholder token id and the real input
    is ``prompt_embeds``, so token-id keys would give two different prompts one key."""
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt embeddings"
    mask = getattr(request, "prompt_is_token_ids", None)
    if mask is not None and not all(mask):
        return "prompt embeddings"
    if getattr(request, "prompt_token_ids", None) is None:
        return "no prompt token ids"
    return None


def vllm_hint(request: Any) -> Hint | None:
    """The retention hint of a vLLM request: ``kv_transfer_params["kvstore"]`` (the
    OpenAI API's ``extra_body``) or a ``"kvstore"`` action of its ``kv_hints``, and
    vLLM's ``priority``, where a lower value is served first (default 0): a request
    ranked above the default (negative) keeps its blocks at kvstore priority
    ``-priority``."""
    params = with_hint_actions(without_handoff(getattr(request, "kv_transfer_params", None)),
                               getattr(request, "kv_hints", None))
    return request_hint(params, max(0, -int(getattr(request, "priority", 0) or 0)), request_id=request.request_id)


class SchedulerSide:
    def __init__(self, config: VllmConnectorConfig, shape: KVShape, store: StoreAPI, metrics: ConnectorMetrics, *,
                 do_load: bool, do_save: bool, producer: bool = False) -> None:
        self.config = config
        self.shape = shape
        self.store = store
        self.metrics = metrics
        self.do_load = do_load
        self.do_save = do_save
        self._reqs: dict[str, _Req] = {}
        self._planned: list[ChunkTransfer] = []
        self._final_saves: list[ChunkTransfer] = []
        # Sync loads handed out and not yet reported, by serial: the loading request and the
        # request id, position and id of its first written block, per load serial.
        self._unconfirmed: dict[int, tuple[str, int, int]] = {}
        # Blocks a failed load left unwritten, (position, block id) -> the request that
        # owns them; vLLM may keep them in its prefix cache until that request recomputes.
        self._tainted: OrderedDict[tuple[int, int], str] = OrderedDict()   # (position, block) -> owner
        self._serials = itertools.count(1)
        # vLLM's KVCacheManager (bound by vLLM's scheduler), to evict failed loads' blocks.
        self.kv_cache_manager: Any = None
        # Sync loads' blocks held out of vLLM's prefix cache until the load reports, by serial.
        self._held: dict[int, HeldBlocks] = {}
        # Every namespace digest this side made keys in since the last reset_cache, and the
        # generation mixed into every salt after one (a fresh random one per reset).
        self._namespaces: set[bytes] = set()
        self._epoch = ""
        # P/D through the store (connectors/_vllm_handoff.py): params out, handed-off loads in.
        self.handoff = Handoffs(config, shape, store, metrics, producer=producer, do_save=do_save, do_load=do_load)
        # The most chunks one load may span: a worker stages a load in one take from the
        # load half of staging_bytes, so a longer offer would fail on every attempt.
        self.max_load_chunks = load_staging_bytes(config) // max(1, shape.chunk_bytes)
        if do_load and self.max_load_chunks == 0:
            log.warning("kvstore connector: the load half of staging_bytes (%d) holds no chunk of %d bytes: "
                        "nothing is loaded (raise staging_bytes)", load_staging_bytes(config), shape.chunk_bytes)

    # -- vLLM hooks -----------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        """Hash the prompt's chunk keys once, when the request arrives."""
        self._state(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` that the store can supply. No leases,
        no plans: vLLM may ask several times. A prompt's last token is never served
        (vLLM must compute at least one token to sample), and no more chunks than one
        worker's load staging holds (``max_load_chunks``): the rest is computed, then
        saved."""
        if not self.do_load:
            return 0, False
        st = self._state(request)
        if st.uncached is not None:
            return 0, False
        usable = (len(st.tokens) - 1) // self.shape.chunk_tokens
        if usable <= 0:
            return 0, False
        handoff = self.handoff.offer(request, st.keys)
        if handoff is not None:
            # Handed off by a producer: offered before it is stored; the async load waits
            # for it (until the params' deadline) and fails closed on what never lands.
            hit = min(handoff["chunks"], usable, num_computed_tokens // self.shape.chunk_tokens + self.max_load_chunks)
            st.hit_chunks, st.offer_from = hit, num_computed_tokens
            external = hit * self.shape.chunk_tokens - num_computed_tokens
            return (external, True) if external > 0 else (0, False)
        hit = min(self._lookup(request, keys[:usable], hint=st.hint) for keys in st.keys)
        hit = min(hit, num_computed_tokens // self.shape.chunk_tokens + self.max_load_chunks)
        st.hit_chunks, st.offer_from = hit, num_computed_tokens
        external = hit * self.shape.chunk_tokens - num_computed_tokens
        if external <= 0:
            return 0, False
        return external, self.config.load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the load of exactly the tokens vLLM accepted — ``num_external_tokens``
        from the point it asked about, which the scheduler may cap below the offer —
        and lease their chunks so that they cannot be evicted before a worker loads them."""
        st = self._state(request)
        if num_external_tokens <= 0 or st.uncached is not None:
            return
        c, bs, per = self.shape.chunk_tokens, self.shape.block_size, self.shape.blocks_per_chunk
        start = st.offer_from
        end = start + num_external_tokens
        # Chunks loaded whole need no save (until a failed load moves this back); the
        # lookup is not trusted beyond what is loaded now.
        st.saved_chunks = max(st.saved_chunks, end // c)
        if end > st.hit_chunks * c:
            raise KVStoreError(f"request {request.request_id}: vLLM accepted {num_external_tokens} tokens from "
                               f"{start}, beyond the {st.hit_chunks * c} offered; its connector contract changed")
        first, last = start // c, -(-end // c)
        end_block = -(-end // bs)
        if len(blocks.blocks[0]) < end_block:
            # vLLM now counts these tokens as computed: never leave them unloaded.
            raise KVStoreError(f"request {request.request_id}: {len(blocks.blocks[0])} blocks allocated for "
                               f"{end} loaded tokens; vLLM's allocation contract changed")
        keys = [k[first:last] for k in st.keys]
        wait_until = self.handoff.planned(request)    # a handoff: the worker waits for its saves
        if not wait_until:      # (a handoff's waiting lookup leases them as they land)
            got = [self._lookup(request, k, lease_s=self.config.lease_s) for k in keys]
            if min(got) < len(keys[0]):
                # Evicted since the lookup; the worker will fail closed on the missing chunks.
                log.info("request %s: %d of %d chunks still cached at allocation", request.request_id,
                         min(got), len(keys[0]))
            st.leased = keys
        # Block ids are filled in by build_connector_meta, from the ids vLLM lists for
        # the step anyway (converting vLLM's block objects here costs more than the rest).
        st.load = ChunkTransfer(request.request_id, keys, [], skip_blocks=(start - first * c) // bs,
                                is_async=self.config.load_async or bool(wait_until), first_chunk=first, per=per,
                                wait_until=wait_until)
        st.alloc = (blocks, end_block)
        if not st.load.is_async:      # (a handoff's load is async even without load_async)
            # vLLM cached these blocks at allocation: no request may be given them before
            # the load reports (later in this schedule(), or a step ahead under async
            # scheduling); see connectors._vllm_prefix.
            st.held = hold(self.kv_cache_manager, request, blocks, start // bs)
        self.metrics.add("hit_tokens", num_external_tokens)
        self._planned.append(st.load)

    def build_connector_meta(self, scheduler_output: Any) -> KVStoreConnectorMetadata:
        """Hand this step's planned loads to the workers, and ask them to save every
        prompt chunk that this step completes and the store does not hold yet, unless
        the request waits for a load's outcome."""
        meta = KVStoreConnectorMetadata(loads=self._planned, saves=self._final_saves,
                                        handoffs=self.handoff.take_announced())
        self._planned, self._final_saves = [], []
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            st = self._reqs.get(req_id)
            if st is not None:
                st.block_ids = []               # freed; a resumed request lists its new ones
        fresh: dict[str, tuple[_Req, int]] = {}   # given their blocks in this step, computed tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is not None:
                st.block_ids = list(new.block_ids[0])
                fresh[new.req_id] = (st, new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids else []
                fresh[req_id] = (st, cached.num_computed_tokens[i])
            elif new_ids:
                st.block_ids.extend(new_ids[0])
        per = self.shape.blocks_per_chunk
        for spec in meta.loads:
            st = self._reqs[spec.req_id]          # request_finished unplans a finished request's load
            blocks, end_block = st.alloc
            lo = spec.first_chunk * per
            # The ids vLLM lists for this step where it lists the request (a sync load's
            # request is scheduled with it), else the blocks allocated for the load (an
            # async load waits unscheduled): never ids of an earlier, freed allocation.
            spec.block_ids = (st.block_ids[lo:end_block] if spec.req_id in fresh and len(st.block_ids) >= end_block
                              else [b.block_id for b in blocks.blocks[0][lo:end_block]])
            spec.serial = next(self._serials)
            st.load, st.leased, st.alloc = None, None, None   # the worker's load now releases them
            st.loading = spec
            if st.held is not None:
                self._held[spec.serial], st.held = st.held, None
            if not spec.is_async:
                # Async loads finish before the request computes anything; sync ones are
                # confirmed by the workers' report.
                st.pending.add(spec.serial)
                self._unconfirmed[spec.serial] = (spec.req_id, lo + spec.skip_blocks,
                                                  spec.block_ids[spec.skip_blocks])
        if not self.do_save:
            return meta
        for req_id, (st, computed) in fresh.items():
            self._note_shared_loads(req_id, st, computed)
        counts = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is not None:
                self._plan_save(meta, new.req_id, st, new.num_computed_tokens + counts.get(new.req_id, 0))
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is not None:
                self._plan_save(meta, req_id, st, cached.num_computed_tokens[i] + counts.get(req_id, 0))
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """Release the saves waiting on loads that reported back; where a load failed
        (on any rank), move the loading request's save point back to the first failed
        chunk (it recomputes from there), stop every request that shares the unwritten
        blocks from saving past them, and remember those blocks for requests that reach
        them through vLLM's prefix cache later."""
        bad = connector_output.invalid_block_ids or set()
        if bad:
            self._evict_from_prefix_cache(bad)
        self.handoff.settled(connector_output.finished_sending)
        worker_meta = connector_output.kv_connector_worker_meta
        outcomes = worker_meta.loads if isinstance(worker_meta, KVStoreWorkerMetadata) else {}
        self.handoff.outcomes(outcomes)
        per = self.shape.blocks_per_chunk
        failed_at: dict[int, tuple[str, int, int]] = {}    # serial -> owner, position, block
        for serial, (req_id, failed) in outcomes.items():
            self._unconfirmed.pop(serial, None)
            held = self._held.pop(serial, None)
            st = self._reqs.get(req_id)
            if st is None:
                continue
            spec = st.loading
            if held is not None:
                # Back into vLLM's prefix cache: the load's blocks, or where it failed, those
                # of the chunks before the first failed one (loaded and verified on every rank).
                good = len(held.ids)
                if failed is not None:
                    good = (max(0, (failed - spec.first_chunk) * per - spec.skip_blocks)
                            if spec is not None and spec.serial == serial else 0)
                restore(self.kv_cache_manager, held, self.shape.block_size, count=good)
            if spec is not None and spec.serial == serial:
                if failed is not None:
                    at = (failed - spec.first_chunk) * per
                    skip = spec.skip_blocks if failed == spec.first_chunk else 0
                    if at + skip < len(spec.block_ids):
                        pos, block = failed * per + skip, spec.block_ids[at + skip]
                        failed_at[serial] = (req_id, pos, block)
                        self._taint(pos, block, req_id)
                st.loading = None
            if failed is not None:
                st.saved_chunks = min(st.saved_chunks, failed)
        for req_id, st in self._reqs.items():
            if st.pending:
                for serial in st.pending & outcomes.keys():
                    owner, pos, block = failed_at.get(serial, (None, 0, 0))
                    if owner is not None and owner != req_id and pos < len(st.block_ids) and st.block_ids[pos] == block:
                        self._stop_saves(st, pos // per)
                st.pending.difference_update(outcomes)
            if bad and st.block_ids and (st.loading is not None or st.pending or st.no_save_from is not None):
                # Without worker metadata (an engine that drops it): vLLM's invalid blocks.
                for i, block in enumerate(st.block_ids):
                    if block in bad:
                        st.saved_chunks = min(st.saved_chunks, i // per)
                        break

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Forget the request. Its blocks are kept (returns True) only when saves that
        were held for a load's outcome are handed out now (the workers gather them in
        the next step and report the request in ``finished_sending``)."""
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        if st.load is not None:
            self._planned = [s for s in self._planned if s is not st.load]
        if st.loading is not None:
            self._held.pop(st.loading.serial, None)    # its blocks are freed: nothing to put back
        if st.leased:
            self._release(request.request_id, st.leased)
        final = False
        if st.pending and self.do_save:
            if getattr(request.status, "name", "") in _NORMAL_FINISH:
                st.block_ids = list(block_ids)
                st.pending.clear()
                meta = KVStoreConnectorMetadata()
                self._plan_save(meta, request.request_id, st, request.num_computed_tokens, hold=True)
                self._final_saves += meta.saves
                final = bool(meta.saves)
            else:
                held = min(request.num_computed_tokens, len(st.tokens)) // self.shape.chunk_tokens
                self.metrics.add("dropped_saves", max(0, min(held, len(st.keys[0])) - st.saved_chunks))
        # Other saves need no blocks kept: workers gather a step's chunks in that step, on
        # the engine's stream, before any later write to those blocks. A handoff keeps
        # them until its saves settled, and returns its params.
        handed, params = self.handoff.finished(request, st.keys, st.saved_chunks)
        return final or handed, params

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)`` (weight updates,
        ``pause_generation(clear_cache=True)``): KV stored so far may be of other weights.
        Drops the namespaces this side made keys in from the store and moves every later
        key to a fresh generation (a random salt suffix), so a save still in flight with
        old bytes lands where no key of this engine looks again. Requests vLLM still
        holds keep their blocks but neither load nor save from here on (their keys were
        of the old generation). ``False`` when the store could not drop them."""
        self._epoch = f"\0gen:{secrets.token_hex(8)}"
        for st in self._reqs.values():
            if st.leased:
                self._release("reset", st.leased)   # the clear must still run
                st.leased = None
            st.keys = [[] for _ in st.keys]
            st.hit_chunks = 0
        spaces, self._namespaces = self._namespaces, set()
        spaces.update(self.shape.namespace(r, "").digest for r in range(self.shape.key_ranks))
        return clear_namespaces(self.store, spaces, owner="vLLM kvstore connector")

    # -- internals ------------------------------------------------------------------------

    def _lookup(self, request: Any, keys: list[BlockKey], **kwargs: Any) -> int:
        """The store's lookup; a failure is a miss: a hook's exception would end vLLM's
        engine loop. (A server store answers an unreachable server with a miss itself,
        counted and logged at a bounded rate; this catches what else a store raises.)"""
        try:
            return self.store.lookup(keys, **kwargs)
        except KVStoreError as exc:
            log.warning("request %s: kvstore lookup failed (%s: %s); a miss", request.request_id,
                        type(exc).__name__, exc)
            return 0

    def _release(self, what: str, leased: list[list[BlockKey]]) -> None:
        """Drop leases; a failure is logged only (a lease times out by itself)."""
        for keys in leased:
            try:
                self.store.release(keys)
            except Exception as exc:   # noqa: BLE001 - a hook's exception would end vLLM's engine loop
                log.warning("%s: releasing a kvstore lease failed (%s: %s)", what, type(exc).__name__, exc)

    def _state(self, request: Any) -> _Req:
        """The request's state, its chunk keys hashed on first sight. Never raises for a
        request: one the keys cannot cover, or whose keys cannot be computed, is a miss
        that is never saved (counted once in ``uncached_requests``)."""
        st = self._reqs.get(request.request_id)
        if st is None:
            why = uncacheable(request)
            if why is None:
                try:
                    tokens = token_array(request.prompt_token_ids)
                    salt = request_salt(request) + self._epoch
                    keys = [self.shape.namespace(r, salt).chunk_keys(tokens) for r in range(self.shape.key_ranks)]
                    self._namespaces.update(k[0].namespace for k in keys if k)
                    st = _Req(tokens, keys, hint=vllm_hint(request))
                except Exception as exc:   # a hook's exception would end vLLM's engine loop
                    why = f"its keys cannot be computed ({type(exc).__name__}: {exc})"
            if why is not None:
                log.info("request %s is not cached by the kvstore connector: %s", request.request_id, why)
                self.metrics.add("uncached_requests")
                st = _Req(token_array([]), [[] for _ in range(self.shape.key_ranks)], uncached=why)
            self._reqs[request.request_id] = st
        return st

    def _note_shared_loads(self, req_id: str, st: _Req, computed: int) -> None:
        """A request that starts with ``computed`` tokens counted as computed, over blocks
        a not yet confirmed load writes (a prefix-cache hit on them), computes over that
        load: its saves wait for the outcome too; over blocks a failed load left
        unwritten, it never saves from there on. vLLM shares cached blocks only at the
        same position and as a prefix, so a request holds some of a load's blocks
        exactly when it holds the load's first written block at its position, counted
        as computed: one comparison per load."""
        ids, bs = st.block_ids, self.shape.block_size
        for serial, (owner, pos, block) in self._unconfirmed.items():
            if owner != req_id and pos < len(ids) and ids[pos] == block and computed > pos * bs:
                st.pending.add(serial)
        for pos, block in self._tainted:
            # The owner too: resumed after a preemption, it may get the block back from
            # vLLM's prefix cache; one that still computes the block itself is not flagged.
            if pos < len(ids) and ids[pos] == block and computed > pos * bs:
                self._stop_saves(st, pos // self.shape.blocks_per_chunk)

    def _evict_from_prefix_cache(self, bad: set[int]) -> None:
        """Take the blocks a failed load left unwritten, and every later block of each
        request holding one (computed over them in the same step), out of vLLM's prefix
        cache. vLLM caches a sync load's blocks at allocation and, under ``recompute``,
        evicts nothing: with chunked prefill the owner recomputes them over several steps,
        and meanwhile a new request with the same prefix would be given them as computed.
        The requests keep their blocks (and recompute them); only the hashes go, so the
        cost is lost reuse of those blocks. Async loads' blocks are not cached yet: no-op."""
        manager = self.kv_cache_manager
        if manager is None:
            return
        evict = set(bad)
        for req_id, st in self._reqs.items():
            try:
                (ids,) = manager.get_block_ids(req_id)
            except Exception:   # an engine whose manager answers otherwise: the connector's own list
                ids = []
            ids = ids or st.block_ids   # not held by the manager (any more): what the connector saw
            for i, block in enumerate(ids or ()):
                if block in bad:
                    evict.update(ids[i:])
                    break
        try:
            manager.evict_blocks(evict)
        except Exception as exc:   # a hook's exception would end vLLM's engine loop
            log.error("could not evict %d failed-load blocks from vLLM's prefix cache (%s: %s); requests with "
                      "the same prefix may reuse them", len(evict), type(exc).__name__, exc)

    def _taint(self, pos: int, block: int, owner: str) -> None:
        self._tainted[(pos, block)] = owner
        self._tainted.move_to_end((pos, block))
        while len(self._tainted) > _TAINT_ENTRIES:
            self._tainted.popitem(last=False)

    def _stop_saves(self, st: _Req, chunk: int) -> None:
        """Chunks from ``chunk`` on were computed over a failed load's blocks: never save them."""
        if st.no_save_from is None or chunk < st.no_save_from:
            st.no_save_from = chunk

    def _plan_save(self, meta: KVStoreConnectorMetadata, req_id: str, st: _Req, computed: int, *,
                   hold: bool = False) -> None:
        if st.pending or st.uncached is not None:
            return                      # computed over a load not yet confirmed, or never cached
        p = self.shape.blocks_per_chunk
        full = min(computed, len(st.tokens)) // self.shape.chunk_tokens
        full = min(full, len(st.block_ids) // p, len(st.keys[0]))
        if st.no_save_from is not None:
            full = min(full, st.no_save_from)
        if full <= st.saved_chunks:
            return
        lo = st.saved_chunks
        if NULL_BLOCK in st.block_ids[lo * p:full * p]:
            # vLLM's placeholder for a block the request does not hold: no KV of this request.
            full = st.block_ids.index(NULL_BLOCK, lo * p) // p
            self._stop_saves(st, full)
            if full <= lo:
                return
        meta.saves.append(ChunkTransfer(req_id, [k[lo:full] for k in st.keys], st.block_ids[lo * p:full * p],
                                        first_chunk=lo, hold=hold, per=p, hint=st.hint))
        st.saved_chunks = full
        st.had_saves = True


__all__ = ["SchedulerSide"]
