"""The Store: the one object connectors and the server talk to.

It owns the index (:class:`kvstore.store.index.Index`: which tier holds which key, byte
accounting, leases and pins), runs each tier's eviction and admission policy, and moves
blocks between tiers (``mover``): a full tier spills its victims into the next one
(write-back), hits in a lower tier are promoted.

Thread-safety: every public method may be called from any thread. Metadata changes run
under one lock, the index's (``Index.lock``, ``self._lock``: see its lock rule); copies
and tier I/O run outside it. ``save``/``load``/``prefetch`` run on
a worker pool and return futures; call ``.result()`` for a synchronous answer.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Mapping, Sequence

from kvstore._events import open_events
from kvstore._stats import sum_stat_sources
from kvstore.block import checksum
from kvstore.buffers import host_view, nbytes_of
from kvstore.buffers.streams import capture, submit
from kvstore.config import StoreConfig, load_config
from kvstore.errors import BufferSizeError, InvalidArgumentError, StoreClosedError
from kvstore.hint import Hint, check_hint
from kvstore.keys import BlockKey
from kvstore.store.build import build_admission, build_eviction, build_tier
from kvstore.store.hints import HintIndex, StoreHints
from kvstore.store.index import Index
from kvstore.store.mover import Level, TierMovement, parent_of
from kvstore.store.reservation import Reservation, reserve
from kvstore.store.tenants import TenantLedger
from kvstore.trace import TraceRecorder
from kvstore.policies.placement import Placement, WriteMode
from kvstore.policies.retention import RetentionClasses
from kvstore.tiers.base import Tier

log = logging.getLogger("kvstore.store")
class Store(TierMovement, StoreHints):
    """A hierarchy of tiers, fastest first. Build it with :meth:`from_config`.

    ``clock`` (seconds, monotonic) times lease and retention-hint expiry; tests inject
    their own."""

    lends_memory = True    # StoreAPI: borrow/reserve hand out views of the first tier's memory

    def __init__(self, config: StoreConfig, *, tiers: Sequence[Tier] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        p = config.placement
        self.placement = Placement(WriteMode(p.write), p.promote_on_hit, p.prefetch_depth, p.selective_threshold)
        self._trace = TraceRecorder(config.trace) if config.trace is not None else None
        built: list[Tier] = []
        try:
            for i, tcfg in enumerate(config.tiers):
                built.append(tiers[i] if tiers is not None else build_tier(tcfg))
        except BaseException:
            for t in built:
                t.close()
            raise
        # per-key retention hints; every tier's policy ranks its victims by them
        self._hint_index = HintIndex(clock)
        self._hints = self._hint_index.records
        self._levels = [Level(t, RetentionClasses(build_eviction(c), self._hints, clock),
                              build_admission(c.admission), c.kind)
                        for t, c in zip(built, config.tiers)]
        # where/sizes/leases/pins and their lock (kvstore.store.index: its lock rule); the
        # names below are the index's own dicts and lock, not copies
        self._index = index = Index()
        self._where, self._sizes, self._leases = index.where, index.sizes, index.leases
        self._pins, self._hit_counts, self._lock = index.pins, index.hit_counts, index.lock
        self._tenants: TenantLedger | None = None   # the cache server's tenants (set_tenants)
        self._stat_sources: list[tuple[str, Any]] = []  # (name, callable) from attach_stats
        self._ops = dict.fromkeys(("saves", "loads", "lookups", "lookup_hits", "prefetches", "background_errors",
                                   "refused_checksum", "shared_found"), 0)
        # levels other nodes write into too: keys missing from the index are asked of them
        self._shared = [i for i, lvl in enumerate(self._levels) if lvl.tier.capabilities.shared]
        try:    # KV events for routers: None (and no cost) unless configured
            self._events = open_events(config.events, [c.name for c in config.tiers])
        except BaseException:
            for t in built:
                t.close()
            raise
        self._local = threading.local()
        self._closed = False
        self._pool = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kvstore-io")
        self._recover()

    @classmethod
    def from_config(cls, source: str | Mapping[str, Any] | StoreConfig | None = None, *,
                    clock: Callable[[], float] = time.monotonic) -> "Store":
        """A Store from a YAML path, a dict, a :class:`StoreConfig`, or ``None`` for the
        built-in default (DRAM). ``KVSTORE_…`` environment overrides apply."""
        return cls(load_config(source), clock=clock)

    # -- public API ---------------------------------------------------------------------

    def save(self, keys: Sequence[BlockKey], srcs: Sequence[Any], *,
             checksums: Sequence[int] | None = None,
             token_ids: Sequence[Sequence[int]] | None = None, hint: Hint | None = None) -> "Future[list[bool]]":
        """Store a copy of each buffer under its key. The future resolves to whether each
        block is stored (``False``: rejected by admission or no room). Callers must not
        modify ``srcs`` until the future is done; nothing keeps them after that.
        ``hint`` (:class:`kvstore.Hint`): applies to every key, stored now or already.
        ``checksums``: the writer's XXH3-64 (:func:`kvstore.block.checksum`) of each
        host buffer, computed before the bytes travelled (the cache server passes its
        clients'); a buffer that does not match is not stored (``False``, counted in
        ``refused_checksum``). ``token_ids``: each key's chunk tokens, published with
        its ``BlockStored`` KV events (unused without an ``events`` config)."""
        self._check_open()
        self._check_pairs(keys, srcs)
        if token_ids is not None and self._events is not None:
            self._events.note_tokens(keys, token_ids)
        if check_hint(hint) is not None:
            # given before the blocks enter a tier, so each tier ranks them by it from
            # the start (and a discard block is never written through)
            with self._lock:
                persist = self._give_hint(list(keys), hint)
            self._persist_hints(persist)
        if self._trace is not None:
            self._trace.save(keys, nbytes_of(srcs[0]) if len(srcs) else None)
        if checksums is not None and len(checksums) != len(keys):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(checksums)} checksums")
        if checksums is not None:
            return submit(self._pool, capture(srcs), self._save_checked, list(keys), list(srcs), list(checksums))
        return submit(self._pool, capture(srcs), self._save, list(keys), list(srcs))

    def checksums(self, keys: Sequence[BlockKey]) -> list[int | None]:
        """The first tier's stored checksum of each key's block (``None`` where it holds
        none, or keeps no checksums): what the cache server sends with a borrowed view.
        Same key, same content: a block re-stored under a key has the same checksum."""
        return self._levels[0].tier.checksums(keys)

    def reserve(self, keys: Sequence[BlockKey], sizes: Sequence[int], *, evict: bool = True) -> Reservation:
        """Save by filling the first tier's memory in place: room for each block is
        taken now (admission and eviction as in :meth:`save`), the caller writes
        ``reservation.views[i]`` and then commits (see :class:`kvstore.store.reservation.Reservation`).
        Saves a copy when the caller can produce the bytes straight into the slots (a
        gather of KV pages). Where the first tier cannot lend memory, or has no room,
        ``views[i]`` is ``None``: use :meth:`save` for those. ``evict=False`` takes only
        free room (no spill on the caller's thread)."""
        self._check_open()
        if self._trace is not None:
            self._trace.save(keys, int(sizes[0]) if len(sizes) else None)
        keys, sizes = list(keys), [int(n) for n in sizes]
        self._check_pairs(keys, sizes)
        for n in sizes:
            if n <= 0:
                raise InvalidArgumentError(f"block size must be positive, got {n}")
        with self._lock:
            self._ops["saves"] += len(keys)
            present = self._index.touch_held(keys, [lvl.policy for lvl in self._levels])
        return reserve(self, keys, sizes, present, evict, self._reserved_published)

    def _reserved_published(self, written: list[BlockKey]) -> None:
        """A reservation's commit stored ``written`` in the first tier: write-through
        copies them below."""
        if self.placement.write is WriteMode.THROUGH and len(self._levels) > 1 and written:
            self._background(self._write_below, written)

    def load(self, keys: Sequence[BlockKey], dsts: Sequence[Any]) -> "Future[list[bool]]":
        """Copy blocks into caller-owned buffers. Fail-closed: ``True`` only where the
        bytes in ``dst`` are verified. A size mismatch with a stored block raises
        :class:`BufferSizeError` here, before anything is copied."""
        self._check_open()
        self._check_pairs(keys, dsts)
        with self._lock:
            for key, dst in zip(keys, dsts):
                size = self._sizes.get(key)
                if size is not None and nbytes_of(dst) != size:
                    raise BufferSizeError(f"buffer for {key!r} has {nbytes_of(dst)} bytes, block has {size}")
        return submit(self._pool, capture(dsts), self._load, list(keys), list(dsts))

    def lookup(self, keys: Sequence[BlockKey], lease_s: float | None = None, *,
               hint: Hint | None = None) -> int:
        """Length of the prefix of ``keys`` cached in any tier. With ``lease_s``, those
        blocks cannot be evicted until loaded or until the lease expires. ``hint``
        (:class:`kvstore.Hint`) applies to the blocks of that prefix."""
        self._check_open()
        check_hint(hint)
        where = self._where
        persist = None
        if self._shared:
            with self._lock:
                n = self._index.held_prefix(keys)
            if n < len(keys):
                self._discover(list(keys[n:]))
        with self._lock:
            self._ops["lookups"] += 1
            n = self._index.held_prefix(keys)
            self._ops["lookup_hits"] += n
            if lease_s and n:
                self._index.lease(keys[:n], self._clock() + lease_s)
            if n and self._hints:
                self._hint_hits(keys[:n])
            if hint is not None and n:
                persist = self._give_hint(list(keys[:n]), hint)
            depth = self.placement.prefetch_depth
            lower = [k for k in keys[:n][:depth] if not where[k] & 1] if depth else []
        if persist:
            self._persist_hints(persist)
        if lower:
            self._background(self._prefetch, lower, 0)
        if self._trace is not None:
            self._trace.lookup(keys, self._sizes.get(keys[0]) if n else None)
        return n

    @property
    def discovers(self) -> bool:
        """Whether :meth:`lookup` and :meth:`load` may ask shared tiers over the network
        about keys missing from the index (the cache server then runs lookups off its
        event loop)."""
        return bool(self._shared)

    def _discover(self, keys: list[BlockKey]) -> None:
        """Index the blocks of ``keys`` that other nodes wrote into shared tiers. Keys (a
        prompt's missing tail, in order) are asked of each shared tier in turn, fastest
        first (:meth:`Tier.find`); those one tier does not find go to the next. A block
        found is indexed at that level (its tier has budgeted it) and reported stored.
        A tier that fails is counted and its keys stay missing."""
        pending = keys
        for i in self._shared:
            if not pending:
                break
            lvl = self._levels[i]
            sizes = self._tier_call(lvl, "find", pending)
            if sizes is None:
                continue
            fresh: list[BlockKey] = []
            with self._lock:
                for key, n in zip(pending, sizes):
                    if n is None:
                        continue
                    mask = self._where.get(key, 0)
                    if mask >> i & 1 or self._sizes.get(key, n) != n:
                        continue   # indexed meanwhile, or another size than this node's copy
                    self._where[key] = mask | 1 << i
                    self._sizes[key] = n
                    lvl.policy.on_insert(key, n, parent_of(key) if lvl.policy.uses_parent else None)
                    fresh.append(key)
                self._ops["shared_found"] += len(fresh)
                if self._events is not None and fresh:
                    self._events.stored(i, fresh)
            pending = [k for k, n in zip(pending, sizes) if n is None]

    def release(self, keys: Sequence[BlockKey]) -> None:
        """Drop one lease taken by :meth:`lookup` on each key without loading (e.g. a
        cancelled request). Leases are counted: a key leased by two callers stays
        protected until both released (or loaded) it, or the lease expired."""
        with self._lock:
            for key in keys:
                self._drop_lease(key)

    def _drop_lease(self, key: BlockKey) -> None:
        """One holder of ``key``'s lease is done with it. Caller holds the lock."""
        self._index.drop_lease(key)

    @contextmanager
    def borrow(self, keys: Sequence[BlockKey], *, offsets: bool = False,
               verify: bool = True) -> Iterator[list[Any]]:
        """Zero-copy, read-only views of blocks held in the first tier, for the cache
        server's send and shared-memory paths. Yields one entry per key: a view, or
        ``None`` where the first tier does not hold the key or cannot expose its memory
        (use :meth:`load` for those). With ``offsets``, entries are ``(offset, nbytes)``
        inside the first tier's arena instead of views (``None`` too where the tier has
        no arena), for a peer that maps the arena itself. Views are hits like a load
        (counted, recency updated, leases dropped); each stays valid, its slot never
        reused, until the ``with`` block exits. Each block is verified against its
        checksum first: one that fails is ``None`` (a miss) and dropped. ``verify=False``
        only for a caller that sends :meth:`checksums` to a reader that verifies the bytes
        it receives (the cache server). Thread-safe; exit the block from any thread."""
        self._check_open()
        lvl = self._levels[0]
        where = self._where
        held = [k if where.get(k, 0) & 1 else None for k in keys]
        present = [k for k in held if k is not None]
        if offsets:
            slots = lvl.tier.slots if lvl.tier.capabilities.slots else None
            cm = slots(present, verify=verify) if slots is not None else nullcontext([None] * len(present))
        else:
            cm = lvl.tier.views(present, verify=verify)
        with cm as got:
            it = iter(got)
            views = [next(it) if k is not None else None for k in held]
            # indexed here but refused by the tier: dropped there as corrupt, or just evicted
            gone = [k for k, v in zip(held, views) if k is not None and v is None]
            gone = [k for k, there in zip(gone, lvl.tier.contains(gone)) if not there] if gone else gone
            with self._lock:
                self._ops["loads"] += len(keys)
                for key in gone:
                    self._drop(key, 0)
                counters, policy = lvl.counters, lvl.policy
                for key, view in zip(keys, views):
                    if view is None:
                        continue
                    counters["hits"] += 1
                    counters["bytes_read"] += view[1] if offsets else view.nbytes
                    self._drop_lease(key)
                    if self._hints:
                        self._hint_hits((key,))
                    if where.get(key, 0) & 1:
                        policy.on_access(key)
            yield views

    def flush(self) -> int:
        """Write blocks held only in volatile tiers down into the first persistent tier,
        so they survive a restart (the server calls this on shutdown). Returns how many
        blocks were written. Blocks that tier refuses stay volatile."""
        self._check_open()
        target = next((i for i, lvl in enumerate(self._levels) if lvl.tier.capabilities.persistent), None)
        if target is None:
            return 0
        volatile = 0
        for i, lvl in enumerate(self._levels):
            if not lvl.tier.capabilities.persistent:
                volatile |= 1 << i
        with self._lock:
            todo = [(k, m) for k, m in self._where.items() if not m & ~volatile]
        written = 0
        for key, mask in todo:
            src = next(i for i in range(len(self._levels)) if mask >> i & 1)
            tier = self._levels[src].tier
            with tier.view(key) as view:
                if view is not None:
                    written += bool(self._put(target, [key], [view], tier.checksums([key]))[0])
                    continue
            size = self._sizes.get(key)
            if size is None:
                continue
            with self._scratch(size) as buf:
                ok = self._tier_call(self._levels[src], "read_into", [key], [buf])
                if ok and ok[0]:
                    written += bool(self._put(target, [key], [buf])[0])
        return written

    def hint(self, keys: Sequence[BlockKey], hint: Hint) -> int:
        """Give ``hint`` (:class:`kvstore.Hint`) to the blocks of ``keys`` cached in any
        tier, as ``save``/``lookup`` do for theirs; returns how many were cached. For a
        caller that learns the hint after the fact (the cache server's HINT request, a
        block saved through a reservation)."""
        self._check_open()
        if check_hint(hint) is None:
            raise InvalidArgumentError("hint must be a kvstore.Hint, got None")
        with self._lock:
            held = [k for k in keys if self._where.get(k)]
            persist = self._give_hint(held, hint) if held else {}
        self._persist_hints(persist)
        return len(held)

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key is cached in any tier (may be stale on return)."""
        where = self._where
        return [bool(where.get(k)) for k in keys]

    def prefetch(self, keys: Sequence[BlockKey], tier: int | str = 0) -> "Future[int]":
        """Copy blocks held only in slower tiers up into ``tier`` (index or name).
        Resolves to the number of blocks now there."""
        self._check_open()
        return self._pool.submit(self._prefetch, list(keys), self._level_index(tier))

    def pin(self, keys: Sequence[BlockKey]) -> None:
        """Protect keys from eviction until a matching :meth:`unpin` (counted)."""
        with self._lock:
            self._index.pin(keys)

    def unpin(self, keys: Sequence[BlockKey]) -> None:
        with self._lock:
            self._index.unpin(keys)

    def delete(self, keys: Sequence[BlockKey]) -> int:
        """Remove keys from every tier; returns how many were cached."""
        return self._delete(keys, cleared=False)

    def _delete(self, keys: Sequence[BlockKey], *, cleared: bool) -> int:
        self._check_open()
        with self._lock:
            plan = []
            for key in keys:
                mask = self._where.pop(key, 0)
                if mask:
                    plan.append((key, mask))
                    for i, lvl in enumerate(self._levels):
                        if mask >> i & 1:
                            lvl.policy.on_remove(key)
                            if self._tenants is not None:
                                self._tenants.remove(key, i, self._sizes.get(key, 0))
                self._forget(key)
            if self._events is not None and cleared:
                self._events.cleared()
            elif self._events is not None:
                self._events.removed_masks(plan)
        for i, lvl in enumerate(self._levels):
            doomed = [k for k, m in plan if m >> i & 1]
            if doomed:
                self._tier_call(lvl, "delete", doomed)
        return len(plan)

    def clear(self) -> int:
        """Remove every block from every tier (one ``AllBlocksCleared`` KV event)."""
        return self._delete(list(self._where), cleared=True)

    def stats(self) -> dict[str, Any]:
        """Counters per tier and for the Store; a consistent snapshot of each tier."""
        with self._lock:
            tiers = []
            for lvl in self._levels:
                entry = {"name": lvl.name, "kind": lvl.kind, "capacity_bytes": lvl.tier.capacity_bytes,
                         "used_bytes": lvl.tier.used_bytes, "blocks": len(lvl.policy),
                         "eviction": lvl.policy.name, **lvl.counters, "hint_trust": lvl.policy.hint_stats()}
                tiers.append(entry)
            out = {**self._ops, "blocks": len(self._where), "leases": len(self._leases),
                   "pins": len(self._pins), "hints": self._hint_index.stats(), "tiers": tiers}
        for entry, lvl in zip(tiers, self._levels):
            extra = lvl.tier.stats()
            entry.update(extra)
            entry["corruptions"] += int(extra.get("corrupt_blocks", 0))

        out["connectors"] = sum_stat_sources(self._stat_sources)
        if self._tenants is not None:
            with self._lock:
                out["tenants"] = self._tenants.stats()
        if self._events is not None:
            out["events"] = self._events.stats()
        return out

    def _background(self, fn: Any, *args: Any) -> None:
        """Run ``fn`` on the pool with nobody waiting for it: its failure is logged and
        counted (``background_errors``), never lost with its future."""
        def report(future: Future) -> None:
            exc = future.exception()
            if exc is not None:
                with self._lock:
                    self._ops["background_errors"] += 1
                log.warning("background %s failed: %s", getattr(fn, "__name__", fn), exc)

        try:
            self._pool.submit(fn, *args).add_done_callback(report)
        except RuntimeError:       # the pool is shut down: the Store is closing
            pass

    def set_tenants(self, ledger: TenantLedger | None) -> None:
        """Account bytes per tenant and enforce each tenant's quota per tier (the cache
        server's ``server.tenants``; see :mod:`kvstore.store.tenants`). Blocks already held
        (recovered from a persistent tier) are counted now; a hint protects a tenant's
        block only within its quota (:meth:`TenantLedger.hint_bound`). ``None``: stop."""
        with self._lock:
            if ledger is not None:
                ledger.recount(self._where, self._sizes)
            self._tenants = ledger
            for i, lvl in enumerate(self._levels):
                lvl.policy.unprotected = ledger.hint_bound(i) if ledger is not None else None

    def attach_stats(self, name: str, source: Any) -> None:
        """Report ``source()`` (a dict of counters) in :meth:`stats` under
        ``"connectors"[name]``; sources with the same name are summed (an engine
        connector's scheduler and worker sides, several engines in one process)."""
        self._stat_sources.append((name, source))

    def detach_stats(self, name: str, source: Any) -> None:
        self._stat_sources = [s for s in self._stat_sources if s != (name, source)]

    @property
    def tiers(self) -> list[Tier]:
        return [lvl.tier for lvl in self._levels]

    def close(self) -> None:
        """Finish queued operations, then close every tier. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        if self._events is not None:
            self._events.close()
        if self._trace is not None:
            self._trace.close()
        for lvl in self._levels:
            try:
                lvl.tier.close()
            except Exception:
                log.exception("closing tier %s failed", lvl.name)

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- data path ----------------------------------------------------------------------

    def _save(self, keys: list[BlockKey], srcs: list[Any], sums: list[int] | None = None) -> list[bool]:
        # Same key, same content: a key cached in any tier is only touched, never
        # rewritten, so a save can never change what a later load returns.
        with self._lock:
            self._ops["saves"] += len(keys)
            held = self._index.touch_held(keys, [lvl.policy for lvl in self._levels])
            fresh = [j for j, h in enumerate(held) if not h]
        if len(fresh) < len(keys):
            stored = [True] * len(keys)
            if fresh:
                for j, ok in zip(fresh, self._save_new([keys[j] for j in fresh], [srcs[j] for j in fresh],
                                                       None if sums is None else [sums[j] for j in fresh])):
                    stored[j] = ok
            return stored
        return self._save_new(keys, srcs, sums)

    def _save_checked(self, keys: list[BlockKey], srcs: list[Any], sums: list[int]) -> list[bool]:
        # Checked here, and handed down: a tier that takes checksums (DRAM) checks the
        # bytes again as they landed in it, so a source changed by another writer (a
        # shared staging region) between this check and the tier's copy is refused.
        good = [j for j, (src, csum) in enumerate(zip(srcs, sums)) if checksum(host_view(src)) == csum]
        if len(good) == len(keys):
            return self._save(keys, srcs, sums)
        with self._lock:
            self._ops["refused_checksum"] += len(keys) - len(good)
        log.warning("save: %d of %d blocks did not match their writer's checksum; not stored",
                    len(keys) - len(good), len(keys))
        out = [False] * len(keys)
        for j, ok in zip(good, self._save([keys[j] for j in good], [srcs[j] for j in good],
                                          [sums[j] for j in good]) if good else []):
            out[j] = ok
        return out

    def _save_new(self, keys: list[BlockKey], srcs: list[Any], sums: list[int] | None = None) -> list[bool]:
        stored = self._put(0, keys, srcs, sums)
        if self.placement.write is WriteMode.THROUGH:
            # a discard block is not kept past the tier that took it
            through = [j for j, k in enumerate(keys) if not (stored[j] and self._hint_index.is_discard(k))]
            for i in range(1, len(self._levels)):
                below = self._put(i, [keys[j] for j in through], [srcs[j] for j in through],
                                  None if sums is None else [sums[j] for j in through])
                for j, ok in zip(through, below):
                    stored[j] = stored[j] or ok
        elif len(self._levels) > 1:
            # A block the first tier refused still goes to the next one that admits it.
            missed = [j for j, ok in enumerate(stored) if not ok]
            for i in range(1, len(self._levels)):
                if not missed:
                    break
                got = self._put(i, [keys[j] for j in missed], [srcs[j] for j in missed],
                                None if sums is None else [sums[j] for j in missed])
                for j, ok in zip(missed, got):
                    stored[j] = ok
                missed = [j for j, ok in zip(missed, got) if not ok]
        if self._hints and not all(stored):
            with self._lock:    # hints of blocks no tier took go with them
                for key, ok in zip(keys, stored):
                    if not ok and not self._where.get(key):
                        self._hint_index.forget(key)
        return stored

    def _load(self, keys: list[BlockKey], dsts: list[Any]) -> list[bool]:
        n = len(keys)
        done = [False] * n
        source = [-1] * n
        with self._lock:
            self._ops["loads"] += n
            masks = [self._where.get(k, 0) for k in keys]
        unknown = [j for j in range(n) if not masks[j]] if self._shared else []
        if unknown:
            self._discover([keys[j] for j in unknown])
            with self._lock:
                for j in unknown:
                    # a block found with another size than the caller's buffer is a miss
                    if self._sizes.get(keys[j]) == nbytes_of(dsts[j]):
                        masks[j] = self._where.get(keys[j], 0)
        for i, lvl in enumerate(self._levels):
            todo = [j for j in range(n) if not done[j] and masks[j] >> i & 1]
            if not todo:
                continue
            ok = self._tier_call(lvl, "read_into", [keys[j] for j in todo], [dsts[j] for j in todo])
            if ok is None:
                # The tier failed (endpoint down, I/O error): misses now, but its blocks
                # stay indexed so they load again once the tier is back.
                continue
            with self._lock:
                for j, hit in zip(todo, ok):
                    key = keys[j]
                    if hit:
                        done[j], source[j] = True, i
                        if self._hints:
                            self._hint_hits((key,))
                        lvl.counters["hits"] += 1
                        lvl.counters["bytes_read"] += self._sizes.get(key, 0)
                        if self._where.get(key, 0) >> i & 1:
                            lvl.policy.on_access(key)
                    else:
                        if self._where.get(key, 0) >> i & 1:
                            # Indexed but unreadable (corrupt, lost): drop it here.
                            self._drop(key, i)
                        # Try the tiers that hold it now: a block evicted from this tier
                        # while we read it has been spilled into the next one.
                        masks[j] = self._where.get(key, 0)
        with self._lock:
            for j, key in enumerate(keys):
                if done[j]:
                    self._drop_lease(key)
                else:
                    self._levels[0].counters["misses"] += 1
            promote = [j for j in range(n) if source[j] > 0] if self.placement.promote_on_hit else []
            selective = self._selective_candidates(keys, done, source)
        if promote:
            got = self._put(0, [keys[j] for j in promote], [dsts[j] for j in promote])
            with self._lock:
                self._levels[0].counters["promotions"] += sum(got)
        for i, idx in selective:
            self._put(i, [keys[j] for j in idx], [dsts[j] for j in idx])
        return done

    def _selective_candidates(self, keys, done, source) -> list[tuple[int, list[int]]]:
        """Selective write-through: a block hit ``selective_threshold`` times in the first
        tier is written through to the tiers below. Caller holds the lock."""
        if self.placement.write is not WriteMode.SELECTIVE or len(self._levels) < 2:
            return []
        hot = []
        for j, key in enumerate(keys):
            if done[j] and source[j] == 0 and not self._hint_index.is_discard(key):
                count = self._hit_counts.get(key, 0) + 1
                self._hit_counts[key] = count
                if count == self.placement.selective_threshold:
                    hot.append(j)
        return [(i, hot) for i in range(1, len(self._levels))] if hot else []

    def _write_below(self, keys: list[BlockKey]) -> None:
        """Write-through for blocks committed into the first tier by a reservation: one
        batch per lower tier, straight from the first tier's slots (held meanwhile,
        verified: a corrupt one is dropped, never written down), each with the checksum
        it was stored with."""
        first = self._levels[0].tier
        with first.views(keys) as views:
            held = [(k, v) for k, v in zip(keys, views) if v is not None]
            sums = first.checksums([k for k, _ in held])
            for i in range(1, len(self._levels)):
                self._put(i, [k for k, _ in held], [v for _, v in held], sums)

    def _prefetch(self, keys: list[BlockKey], target: int) -> int:
        with self._lock:
            self._ops["prefetches"] += len(keys)
            plan = [(k, self._where.get(k, 0)) for k in keys]
        count = 0
        for key, mask in plan:
            if mask >> target & 1:
                count += 1
                continue
            src = next((i for i in range(target + 1, len(self._levels)) if mask >> i & 1), None)
            if src is not None and self._copy_between(key, src, target):
                count += 1
        return count

    # -- start-up and checks -------------------------------------------------------------

    def _recover(self) -> None:
        """Rebuild the index from persistent tiers, oldest access first, so usage and
        eviction order continue where the last process left off."""
        for i, lvl in enumerate(self._levels):
            if not lvl.tier.capabilities.persistent:
                continue
            for block in lvl.tier.recover():
                if block.hint is not None and block.key not in self._hints:
                    self._hint_index.restore(block.key, block.hint)
                self._where[block.key] = self._where.get(block.key, 0) | 1 << i
                self._sizes[block.key] = block.nbytes
                lvl.policy.on_insert(block.key, block.nbytes,
                                     parent_of(block.key) if lvl.policy.uses_parent else None)
        if self._events is not None:
            for i in range(len(self._levels)):
                self._events.stored(i, [k for k, mask in self._where.items() if mask >> i & 1])

    def _level_index(self, tier: int | str) -> int:
        if isinstance(tier, int) and 0 <= tier < len(self._levels):
            return tier
        for i, lvl in enumerate(self._levels):
            if lvl.name == tier:
                return i
        raise InvalidArgumentError(f"no tier {tier!r}; tiers are {[lvl.name for lvl in self._levels]}")

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the Store is closed")

    @staticmethod
    def _check_pairs(keys: Sequence[BlockKey], bufs: Sequence[Any]) -> None:
        if len(keys) != len(bufs):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(bufs)} buffers")
        for key in keys:
            if not isinstance(key, BlockKey):
                raise InvalidArgumentError(f"keys must be BlockKey, got {type(key).__name__}")
        seen = set()
        for key in keys:
            if key in seen:
                raise InvalidArgumentError(f"key {key!r} appears twice in one batch")
            seen.add(key)


__all__ = ["Store"]
