"""The Store: the one object connectors and the server talk to.

A thin facade: it checks arguments, runs the public API on its worker pool and owns the
lifecycle (build, recover, close). The work is done by the objects it composes, each
in its own module: the index (:class:`kvstore.store.index.Index`: which tier holds which
key, sizes, leases, pins, and the lock), the hints (:class:`kvstore.store.hints.StoreHints`),
the mover (:class:`kvstore.store.mover.Mover`: admission, eviction and spill, copies
between tiers, tier failures as counted misses), the data path
(:class:`kvstore.store.datapath.DataPath`: save, load, prefetch, write-through, flush),
discovery and recovery (``recovery``) and reservations (``reservation``).

Thread-safety: every public method may be called from any thread. Metadata changes run
under one lock, the index's (``Index.lock``, ``self._lock``: see its lock rule); copies
and tier I/O run outside it. ``save``/``load``/``prefetch`` run on
a worker pool and return futures; call ``.result()`` for a synchronous answer.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Mapping, Sequence

from kvstore._extras import install_hint
from kvstore.stats import sum_stat_sources
from kvstore.buffers import nbytes_of
from kvstore.buffers.streams import capture, submit
from kvstore.config import EventsConfig, StoreConfig, load_config
from kvstore.errors import BufferSizeError, ConfigError, InvalidArgumentError, StoreClosedError
from kvstore._wait import check_wait
from kvstore.hint import Hint, check_hint
from kvstore.keys import BlockKey
from kvstore.store.build import build_admission, build_eviction, build_tiers
from kvstore.store.datapath import DataPath
from kvstore.store.hints import HintIndex, StoreHints
from kvstore.store.index import Index
from kvstore.store.mover import Level, Mover
from kvstore.store.recovery import Discovery, recover
from kvstore.store.reservation import Reservation, reserve
from kvstore.store.tenants import TenantLedger
from kvstore.trace import TraceRecorder
from kvstore.policies.placement import Placement, WriteMode
from kvstore.policies.retention import RetentionClasses
from kvstore.tiers.base import Tier


def _open_events(config: EventsConfig | None, tier_names: Sequence[str]) -> Any:
    """The KV-event publisher, or ``None`` when ``events`` is not configured. Its module
    (msgspec, pyzmq: the ``events`` extra) is imported only here, so a Store without events
    needs neither."""
    if config is None:
        return None
    try:
        from kvstore._events import open_events
    except ModuleNotFoundError as exc:
        raise ConfigError(f"events: publishing KV events needs {exc.name} ({install_hint('events')})") from exc
    return open_events(config, tier_names)


log = logging.getLogger("kvstore.store")


class Store:
    """A hierarchy of tiers, fastest first. Build it with :meth:`from_config`.

    ``clock`` (seconds, monotonic) times lease and retention-hint expiry; tests inject
    their own.

    Composed of (built here, in this order): ``_levels``, ``_index`` (``_where`` and
    ``_lock`` are its dict and lock, not copies), ``_store_hints`` (``_hints``: its
    records), ``_events``, ``_mover``, ``_discovery`` and ``_data``. Lock rule: the
    index's lock guards the index, ``_ops`` and every level's policies and counters; the
    facade holds it only around index reads, counter updates and the mover's lock-held
    methods (see :class:`kvstore.store.mover.Mover`), never while calling the data path
    or a method that takes it itself."""

    lends_memory = True    # StoreAPI: borrow/reserve hand out views of the first tier's memory

    def __init__(self, config: StoreConfig, *, tiers: Sequence[Tier] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        p = config.placement
        self.placement = Placement(WriteMode(p.write), p.promote_on_hit, p.prefetch_depth, p.selective_threshold)
        self._trace = TraceRecorder(config.trace) if config.trace is not None else None
        built: list[Tier] = ([tiers[i] for i in range(len(config.tiers))] if tiers is not None
                             else build_tiers(config.tiers))
        # per-key retention hints; every tier's policy ranks its victims by them
        hint_table = HintIndex(clock)
        self._hints = hint_table.records
        self._levels = [Level(t, RetentionClasses(build_eviction(c), self._hints, clock),
                              build_admission(c.admission), c.kind)
                        for t, c in zip(built, config.tiers)]
        # where/sizes/leases/pins and their lock (kvstore.store.index: its lock rule); the
        # names below are the index's own dict and lock, not copies
        self._index = index = Index()
        self._where, self._lock = index.where, index.lock
        self._store_hints = StoreHints(hint_table, index, self._levels)
        self._stat_sources: list[tuple[str, Any]] = []  # (name, callable) from attach_stats
        self._ops = dict.fromkeys(("saves", "loads", "lookups", "lookup_hits", "prefetches", "background_errors",
                                   "refused_checksum", "shared_found", "resave_size_mismatch"), 0)
        try:    # KV events for routers: None (and no cost) unless configured
            self._events = _open_events(config.events, [c.name for c in config.tiers])
        except BaseException:
            for t in built:
                t.close()
            raise
        self._mover = Mover(index, self._levels, self._store_hints, self._events, clock, self._ops)
        # levels other nodes write into too: keys missing from the index are asked of them
        self._discovery = Discovery(index, self._levels, self._mover, self._ops, self._events)
        self._data = DataPath(index, self._levels, self._mover, self._store_hints, self.placement,
                              self._discovery, self._ops)
        self._closed = False
        self._pool = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kvstore-io")
        recover(index, self._levels, self._store_hints, self._events)

    @classmethod
    def from_config(cls, source: str | Mapping[str, Any] | StoreConfig | None = None, *,
                    clock: Callable[[], float] = time.monotonic) -> "Store":
        """A Store from a YAML path, a dict, a :class:`StoreConfig`, or ``None`` for the
        built-in default (DRAM). ``KVSTORE_…`` environment overrides apply."""
        return cls(load_config(source), clock=clock)

    # -- public API ---------------------------------------------------------------------

    def save(self, keys: Sequence[BlockKey], srcs: Sequence[Any], *,
             checksums: Sequence[int | None] | None = None,
             token_ids: Sequence[Sequence[int]] | None = None, hint: Hint | None = None) -> "Future[list[bool]]":
        """Store a copy of each buffer under its key. The future resolves to whether each
        block is stored (``False``: rejected by admission or no room, or the key is held,
        or being saved, with another size: a key's size is fixed by its first save, and a
        re-save with another size is refused, counted in ``resave_size_mismatch``; one of
        the same size keeps the bytes first stored). Callers must not
        modify ``srcs`` until the future is done; nothing keeps them after that.
        ``hint`` (:class:`kvstore.Hint`): applies to every key, stored now or already.
        ``checksums``: the writer's XXH3-64 (:func:`kvstore.block.checksum`) of each
        host buffer, computed before the bytes travelled (the cache server passes its
        clients'; ``None`` entries: none given); a buffer that does not match is not
        stored (``False``, counted in ``refused_checksum``). ``token_ids``: each key's chunk tokens, published with
        its ``BlockStored`` KV events (unused without an ``events`` config)."""
        self._check_open()
        self._check_pairs(keys, srcs)
        if token_ids is not None and self._events is not None:
            self._events.note_tokens(keys, token_ids)
        if check_hint(hint) is not None:
            # given before the blocks enter a tier, so each tier ranks them by it from
            # the start (and a discard block is never written through)
            with self._lock:
                persist = self._store_hints.give(list(keys), hint)
            self._store_hints.persist(persist)
        if self._trace is not None:
            self._trace.save(keys, nbytes_of(srcs[0]) if len(srcs) else None)
        if checksums is not None and len(checksums) != len(keys):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(checksums)} checksums")
        if checksums is not None:
            return submit(self._pool, capture(srcs), self._data.save_checked, list(keys), list(srcs), list(checksums))
        return submit(self._pool, capture(srcs), self._data.save, list(keys), list(srcs))

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
        held = self._data.held(keys, sizes)
        return reserve(self._mover, keys, sizes, held, evict, self._reserved_published)

    def _reserved_published(self, written: list[BlockKey]) -> None:
        """A reservation's commit stored ``written`` in the first tier: write-through
        copies them below."""
        if self.placement.write is WriteMode.THROUGH and len(self._levels) > 1 and written:
            self._background(self._data.write_below, written)

    def load(self, keys: Sequence[BlockKey], dsts: Sequence[Any]) -> "Future[list[bool]]":
        """Copy blocks into caller-owned buffers. Fail-closed: ``True`` only where the
        bytes in ``dst`` are verified. A size mismatch with a stored block raises
        :class:`BufferSizeError` here, before anything is copied."""
        self._check_open()
        self._check_pairs(keys, dsts)
        with self._lock:
            sizes = self._index.sizes
            for key, dst in zip(keys, dsts):
                size = sizes.get(key)
                if size is not None and nbytes_of(dst) != size:
                    raise BufferSizeError(f"buffer for {key!r} has {nbytes_of(dst)} bytes, block has {size}")
        return submit(self._pool, capture(dsts), self._data.load, list(keys), list(dsts))

    def lookup(self, keys: Sequence[BlockKey], lease_s: float | None = None, *,
               hint: Hint | None = None, wait_s: float | None = None) -> int:
        """Length of the prefix of ``keys`` cached in any tier. With ``lease_s``, those
        blocks cannot be evicted until loaded or until the lease expires. ``hint``
        (:class:`kvstore.Hint`) applies to the blocks of that prefix. ``wait_s``: wait
        up to that long (real time) for every key to be stored, woken by the saves that
        land them (a disaggregated prefill's consumer asking before the producer's
        saves arrived); the answer is then the prefix held when they all landed or the
        time was up."""
        self._check_open()
        check_hint(hint)
        wait_s = check_wait(wait_s)
        where = self._where
        persist = None
        if wait_s:
            with self._lock:
                self._index.wait_for_prefix(keys, wait_s)
        if self._discovery.shared:
            with self._lock:
                n = self._index.held_prefix(keys)
            if n < len(keys):
                self._discovery.find(list(keys[n:]))
        with self._lock:
            self._ops["lookups"] += 1
            n = self._index.held_prefix(keys)
            self._ops["lookup_hits"] += n
            if lease_s and n:
                self._index.lease(keys[:n], self._clock() + lease_s)
            if n and self._hints:
                self._store_hints.hits(keys[:n])
            if hint is not None and n:
                persist = self._store_hints.give(list(keys[:n]), hint)
            depth = self.placement.prefetch_depth
            lower = [k for k in keys[:n][:depth] if not where[k] & 1] if depth else []
        if persist:
            self._store_hints.persist(persist)
        if lower:
            self._background(self._data.prefetch, lower, 0)
        if self._trace is not None:
            self._trace.lookup(keys, self._index.sizes.get(keys[0]) if n else None)
        return n

    def add_landed_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` whenever blocks enter the index (under the index lock:
        it must only schedule work). The cache server wakes its waiting lookups so."""
        with self._lock:
            self._index.listeners.append(listener)

    def remove_landed_listener(self, listener: Callable[[], None]) -> None:
        with self._lock:
            if listener in self._index.listeners:
                self._index.listeners.remove(listener)

    def held_prefix(self, keys: Sequence[BlockKey]) -> int:
        """Length of the prefix of ``keys`` some tier holds: no counters, no lease."""
        with self._lock:
            return self._index.held_prefix(keys)

    @property
    def discovers(self) -> bool:
        """Whether :meth:`lookup` and :meth:`load` may ask shared tiers over the network
        about keys missing from the index (the cache server then runs lookups off its
        event loop)."""
        return bool(self._discovery.shared)

    def release(self, keys: Sequence[BlockKey]) -> None:
        """Drop one lease taken by :meth:`lookup` on each key without loading (e.g. a
        cancelled request). Leases are counted: a key leased by two callers stays
        protected until both released (or loaded) it, or the lease expired."""
        with self._lock:
            for key in keys:
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
                    self._mover.drop(key, 0)
                counters = lvl.counters
                for key, view in zip(keys, views):
                    if view is None:
                        continue
                    counters["hits"] += 1
                    counters["bytes_read"] += view[1] if offsets else view.nbytes
                    self._index.drop_lease(key)
                    if self._hints:
                        self._store_hints.hits((key,))
                    if where.get(key, 0) & 1:
                        self._mover.touched(key, 0)
            yield views

    def flush(self) -> int:
        """Write blocks held only in volatile tiers down into the first persistent tier,
        so they survive a restart (the server calls this on shutdown). Not an offer: the
        tier's admission (``min_hits``, ``bytes_per_s``) is not asked; its capacity is
        kept to (a full tier evicts as for any write), and a block that fails its
        checksum is not written. Returns how many of those blocks the tier now holds and
        logs one line saying so, with how many were dropped and why (WARNING when any
        were). Blocks not written stay volatile."""
        self._check_open()
        report = self._data.flush()
        log.log(logging.WARNING if report.dropped else logging.INFO, "%s", report.describe())
        return report.kept

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
            persist = self._store_hints.give(held, hint) if held else {}
        self._store_hints.persist(persist)
        return len(held)

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key is cached in any tier (may be stale on return)."""
        where = self._where
        return [bool(where.get(k)) for k in keys]

    def prefetch(self, keys: Sequence[BlockKey], tier: int | str = 0) -> "Future[int]":
        """Copy blocks held only in slower tiers up into ``tier`` (index or name).
        Resolves to the number of blocks now there."""
        self._check_open()
        return self._pool.submit(self._data.prefetch, list(keys), self._level_index(tier))

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
        return self._data.delete(keys, cleared=cleared)

    def clear(self, namespaces: Sequence[bytes] | None = None) -> int:
        """Remove every block from every tier (one ``AllBlocksCleared`` KV event), or,
        with ``namespaces`` (namespace digests, ``Namespace.digest``), only the blocks
        whose keys carry one of them, as :meth:`kvstore.client.Client.clear`. Returns
        how many blocks were removed."""
        self._check_open()
        with self._lock:     # a snapshot of the index under its lock (see its lock rule)
            keys = list(self._where)
        if namespaces is None:
            return self._delete(keys, cleared=True)
        wanted = {bytes(n) for n in namespaces}
        doomed = [key for key in keys if key.namespace in wanted] if wanted else []
        return self._delete(doomed, cleared=False) if doomed else 0

    def stats(self) -> dict[str, Any]:
        """Counters per tier and for the Store; a consistent snapshot of each tier."""
        with self._lock:
            tiers = []
            for lvl in self._levels:
                entry = {"name": lvl.name, "kind": lvl.kind, "capacity_bytes": lvl.tier.capacity_bytes,
                         "used_bytes": lvl.tier.used_bytes, "blocks": len(lvl.policy),
                         "eviction": lvl.policy.name, "recovered_at_start": lvl.recovered, **lvl.counters,
                         "hint_trust": lvl.policy.hint_stats()}
                tiers.append(entry)
            out = {**self._ops, "blocks": len(self._where), "leases": len(self._index.leases),
                   "pins": len(self._index.pins), "hints": self._store_hints.stats(), "tiers": tiers}
        for entry, lvl in zip(tiers, self._levels):
            extra = lvl.tier.stats()
            entry.update(extra)
            entry["corruptions"] += int(extra.get("corrupt_blocks", 0))

        out["connectors"] = sum_stat_sources(self._stat_sources)
        tenants = self._mover.tenants
        if tenants is not None:
            with self._lock:
                out["tenants"] = tenants.stats()
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
                ledger.recount(self._where, self._index.sizes)
            self._mover.tenants = ledger
            for i, lvl in enumerate(self._levels):
                lvl.policy.unprotected = ledger.hint_bound(i) if ledger is not None else None

    @property
    def _tenants(self) -> TenantLedger | None:
        """The ledger :meth:`set_tenants` attached (held by the mover), or ``None``."""
        return self._mover.tenants

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

    # -- checks ----------------------------------------------------------------------------

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
