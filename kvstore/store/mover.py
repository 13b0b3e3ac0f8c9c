"""How the Store moves blocks between its tiers: admission and capacity on the way in,
victim choice and spill on the way out, copies between tiers, and the mapping of tier
failures into counted misses. A mixin of :class:`kvstore.store.Store`, which owns the
state these methods use: ``_index`` (:class:`kvstore.store.index.Index`: where, sizes,
leases, pins and the lock; ``_where``, ``_sizes`` and ``_lock`` name its dict and lock),
``_levels``, ``_hint_index``, ``_tenants``, ``_events``, ``_local``, ``_clock``; kept
apart so each module holds one job.

Locking (the index's lock rule): methods documented "caller holds the lock" run under
``Index.lock`` (``Store._lock``); the others take it briefly and never hold it across
tier I/O.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from kvstore.buffers import nbytes_of
from kvstore.errors import BufferSizeError, TierError
from kvstore.keys import BlockKey
from kvstore.policies.base import AdmissionPolicy, Decision, EvictionPolicy
from kvstore.tiers.base import Tier

log = logging.getLogger("kvstore.store")

_COUNTERS = ("hits", "misses", "writes", "bytes_written", "bytes_read", "evictions", "spills",
             "promotions", "rejected", "throttled", "full", "errors", "corruptions")


@dataclass
class Level:
    """One tier with its policies and counters."""

    tier: Tier
    policy: EvictionPolicy
    admission: AdmissionPolicy
    kind: str
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_COUNTERS, 0))
    pending_free: int = 0   # bytes of chosen victims not yet deleted from the tier

    @property
    def name(self) -> str:
        return self.tier.name



class _Staged:
    """Blocks of one batch placed in the eviction policy before they are written."""

    def __init__(self) -> None:
        self.sizes: dict[BlockKey, int] = {}
        self.total = 0

    def add(self, key: BlockKey, nbytes: int) -> None:
        self.sizes[key] = nbytes
        self.total += nbytes

    def drop(self, key: BlockKey) -> int:
        nbytes = self.sizes.pop(key)
        self.total -= nbytes
        return nbytes


@dataclass
class _PutPlan:
    """What :meth:`TierMovement._plan_put` decided for one batch."""

    result: list[bool]                       # per key: stored (so far)
    chosen: list[int] = field(default_factory=list)    # indices to write
    inserted: set[BlockKey] = field(default_factory=set)  # already placed in the policy
    victims: list[tuple[BlockKey, int]] = field(default_factory=list)
    parents: set[bytes | None] | None = None
    charged: dict = field(default_factory=dict)  # per-tenant bytes in flight (kvstore.store.tenants)


class TierMovement:
    """Tier-to-tier block movement for the Store (see the module docstring)."""

    def _put(self, i: int, keys: list[BlockKey], srcs: list[Any],
             checksums: list[int | None] | None = None) -> list[bool]:
        """Store blocks into level ``i``, evicting (and spilling) to make room.
        ``checksums``: the XXH3-64 each source was stored with in the tier it comes
        from, kept by a tier that takes them (``write_checksums``) instead of a re-hash."""
        lvl = self._levels[i]
        sizes = [nbytes_of(src) for src in srcs]
        plan = self._plan_put(i, keys, sizes)
        try:
            return self._put_planned(i, lvl, keys, srcs, sizes, plan, checksums)
        finally:
            if plan.charged:   # a tenant's bytes in flight end with the put, stored or not
                self._settle(i, plan)

    def _put_planned(self, i: int, lvl: Level, keys: list[BlockKey], srcs: list[Any], sizes: list[int],
                     plan: "_PutPlan", checksums: list[int | None] | None) -> list[bool]:
        self._evict(i, plan.victims)
        chosen = plan.chosen
        if not chosen:
            return plan.result
        if checksums is None or not lvl.tier.capabilities.write_checksums:
            checksums = None
        ok = self._write(lvl, chosen, keys, srcs, checksums)
        self._unstage(i, keys, plan, ok)
        if ok is not None and not all(ok):
            # Fragmentation or a racing writer: make room for the rest once more.
            retry = [j for j, good in zip(chosen, ok) if not good]
            # never this batch's blocks just written (a prefix-aware policy has them
            # already, not yet indexed): evicting one would delete it under the index
            protect = (plan.parents or set()) | {keys[j].digest for j in chosen}
            with self._lock:
                victims = self._choose_victims(i, sum(sizes[j] for j in retry), force=True,
                                               protect=protect)
            if victims:
                self._evict(i, victims)
                again = self._write(lvl, retry, keys, srcs, checksums)
                if again is not None:
                    redo = dict(zip(retry, again))
                    ok = [good or redo.get(j, False) for j, good in zip(chosen, ok)]
        self._index_put(i, keys, sizes, plan, ok)
        return plan.result

    def _write(self, lvl: Level, idx: list[int], keys: list[BlockKey], srcs: list[Any],
               checksums: list[int | None] | None) -> list[bool] | None:
        """The tier's ``write`` of the blocks at ``idx`` (with their checksums, when given)."""
        args = [[keys[j] for j in idx], [srcs[j] for j in idx]]
        if checksums is not None:
            args.append([checksums[j] for j in idx])
        return self._tier_call(lvl, "write", *args)

    def _plan_put(self, i: int, keys: list[BlockKey], sizes: list[int], *, evict: bool = True) -> "_PutPlan":
        """Admission and room for new blocks in level ``i``: which to write, and the
        victims to evict first (already out of the index). ``evict=False`` takes free
        room only: blocks that do not fit are left out. Takes the lock."""
        lvl = self._levels[i]
        plan = _PutPlan([False] * len(keys))
        chosen = plan.chosen
        with self._lock:
            for j, key in enumerate(keys):
                if self._where.get(key, 0) >> i & 1:
                    lvl.policy.on_access(key)
                    plan.result[j] = True
                    continue
                decision = lvl.admission.decide(key, sizes[j])
                if decision is Decision.ADMIT:
                    chosen.append(j)
                else:
                    lvl.counters["rejected" if decision is Decision.REJECT else "throttled"] += 1
            # The blocks being added hang under these parents: evicting one now would
            # leave its new children unreachable (a chained key needs its prefix).
            plan.parents = {keys[j].parent for j in chosen} if lvl.policy.uses_parent else None
            if self._tenants is not None and chosen:   # each tenant within its quota here
                chosen, plan.charged = self._tenants.plan(self, i, keys, sizes, chosen, plan.parents, evict,
                                                          plan.victims)
                plan.chosen = chosen
            if not evict:
                free = lvl.tier.capacity_bytes - lvl.tier.used_bytes
                plan.chosen = []
                for j in chosen:
                    if sizes[j] <= free:
                        plan.chosen.append(j)
                        free -= sizes[j]
            elif lvl.policy.uses_parent and chosen:
                # Prefix-aware policies rank new blocks against old ones: place the batch
                # block by block as if each were inserted before the next one needs room,
                # so a new block the policy values least (a one-off request's tail) is
                # dropped on arrival rather than evicting something worth more.
                staged = _Staged()
                for j in chosen:
                    plan.victims += self._choose_victims(i, sizes[j], protect=plan.parents, staged=staged)
                    lvl.policy.on_insert(keys[j], sizes[j], parent_of(keys[j]))
                    staged.add(keys[j], sizes[j])
                lvl.counters["rejected"] += sum(1 for j in chosen if keys[j] not in staged.sizes)
                plan.chosen = [j for j in chosen if keys[j] in staged.sizes]
                plan.inserted = set(staged.sizes)
            else:
                plan.victims += self._choose_victims(i, sum(sizes[j] for j in chosen), protect=plan.parents)
        return plan

    def _settle(self, i: int, plan: "_PutPlan") -> None:
        """The blocks ``plan`` charged to their tenants in level ``i`` are no longer in
        flight (indexed, or not stored). Idempotent."""
        if plan.charged:
            with self._lock:
                self._tenants.settle(i, plan.charged)
            plan.charged = {}

    def _unstage(self, i: int, keys: list[BlockKey], plan: "_PutPlan", ok: list[bool] | None) -> None:
        """Take blocks placed in the policy ahead of the write but not stored out again."""
        if not plan.inserted or ok is not None and all(ok):
            return
        with self._lock:
            for j, good in zip(plan.chosen, ok or [False] * len(plan.chosen)):
                # a key another writer indexed here meanwhile keeps its place in the policy
                if not good and not self._where.get(keys[j], 0) >> i & 1:
                    self._levels[i].policy.on_remove(keys[j])
                    plan.inserted.discard(keys[j])

    def _index_put(self, i: int, keys: list[BlockKey], sizes: list[int], plan: "_PutPlan",
                   ok: list[bool] | None) -> None:
        """Index the blocks of ``plan`` that level ``i`` stored (``ok``); fills ``plan.result``."""
        lvl = self._levels[i]
        ok = ok or [False] * len(plan.chosen)
        fresh: list[BlockKey] = []   # newly indexed here: KV events
        persist: dict[int, dict[BlockKey, bytes]] = {}
        with self._lock:
            for j, good in zip(plan.chosen, ok):
                key = keys[j]
                if not good:
                    lvl.counters["full"] += 1
                    continue
                plan.result[j] = True
                mask = self._where.get(key, 0)
                if not mask >> i & 1:
                    self._where[key] = mask | 1 << i
                    self._sizes[key] = sizes[j]
                    if self._tenants is not None:
                        self._tenants.add(key, i, sizes[j])
                    # a staged key another put chose as a victim meanwhile (it freed
                    # nothing: never written) is no longer in the policy: insert it again
                    if key not in plan.inserted or key not in lvl.policy:
                        lvl.policy.on_insert(key, sizes[j], parent_of(key) if lvl.policy.uses_parent else None)
                    lvl.counters["writes"] += 1
                    lvl.counters["bytes_written"] += sizes[j]
                    fresh.append(key)
                # else a concurrent writer indexed it first; staged keys are in the policy once.
            if self._events is not None and fresh:
                self._events.stored(i, fresh)
            self._hints_entering(i, [keys[j] for j, good in zip(plan.chosen, ok) if good], persist)
            if plan.charged:
                self._tenants.settle(i, plan.charged)
                plan.charged = {}
        if persist:
            self._persist_hints(persist)

    def _choose_victims(self, i: int, need: int, *, force: bool = False,
                        protect: set[bytes | None] | None = None,
                        staged: "_Staged | None" = None) -> list[tuple[BlockKey, int]]:
        """Pick victims in level ``i`` until ``need`` bytes are free, skipping leased and
        pinned keys and keys whose digest is in ``protect``. A ``staged`` key (in the
        policy, not yet written) that comes up is dropped from the stage instead. Caller
        holds the lock. Victims leave the index now; their bytes leave the tier in
        :meth:`_evict`."""
        lvl = self._levels[i]
        free = lvl.tier.capacity_bytes - lvl.tier.used_bytes + lvl.pending_free
        if staged is not None:
            free -= staged.total
        if need <= 0 or (free >= need and not force):
            return []
        if force:
            free = min(free, 0)
        now = self._clock()
        victims = []
        if free >= need:
            return []
        # Stop right after the victim that makes room: pulling one more candidate would
        # tell the policy it was skipped (S3-FIFO and SIEVE move such keys on).
        for key in lvl.policy.victims():
            if not self._evictable(key, now, protect):
                continue
            if staged is not None and key in staged.sizes:
                lvl.policy.on_remove(key)
                free += staged.drop(key)
                if free >= need:
                    break
                continue
            free += self._take_victim(i, key, victims)
            if free >= need:
                break
        if self._events is not None and victims:
            self._events.removed(i, [key for key, _ in victims])
        return victims

    def _evictable(self, key: BlockKey, now: float, protect: set[bytes | None] | None) -> bool:
        """Not leased, not pinned, not a protected parent. Caller holds the lock."""
        return self._index.evictable(key, now, protect)

    def _take_victim(self, i: int, key: BlockKey, victims: list[tuple[BlockKey, int]]) -> int:
        """Take ``key`` out of level ``i``'s index as a victim (appended to ``victims``;
        its bytes leave the tier in :meth:`_evict`); returns its size. Caller holds the lock."""
        lvl = self._levels[i]
        size = self._sizes.get(key, 0)
        lvl.policy.on_remove(key)
        victims.append((key, self._index.remove_level(key, i)))
        lvl.pending_free += size
        lvl.counters["evictions"] += 1
        if self._tenants is not None:
            self._tenants.remove(key, i, size, evicted=True)
        return size

    def _evict(self, i: int, victims: list[tuple[BlockKey, int]]) -> None:
        """Spill victims down (write-back) and delete them from level ``i``."""
        if not victims:
            return
        lvl = self._levels[i]
        below = i + 1 if i + 1 < len(self._levels) else None
        for key, mask in victims:
            size = self._sizes.get(key, 0)
            try:
                if self._hint_index.is_discard(key):
                    # one-shot: not kept past this tier
                    with self._lock:
                        self._hint_index.counters["discarded"] += 1
                elif below is not None and not mask >> below & 1 and self._copy_between(key, i, below):
                    lvl.counters["spills"] += 1
                self._tier_call(lvl, "delete", [key])
            finally:
                with self._lock:
                    lvl.pending_free -= size
                    if not self._where.get(key):
                        self._forget(key)

    def _copy_between(self, key: BlockKey, src: int, dst: int) -> bool:
        """Copy one block from level ``src`` into level ``dst`` (the source keeps it):
        zero-copy from a tier that can lend a view, else through a staging buffer. A
        block that cannot be read is forgotten in ``src``."""
        size = self._sizes.get(key)
        if size is None:
            return False
        tier = self._levels[src].tier
        with tier.view(key) as view:   # verified by a tier that keeps checksums
            if view is not None:
                return self._put(dst, [key], [view], tier.checksums([key]))[0]
        with self._scratch(size) as buf:
            ok = self._tier_call(self._levels[src], "read_into", [key], [buf])
            if not ok or not ok[0]:
                with self._lock:
                    self._drop(key, src)
                return False
            return self._put(dst, [key], [buf])[0]

    @contextmanager
    def _scratch(self, nbytes: int) -> Iterator[np.ndarray]:
        """A per-thread scratch buffer, grown on demand and reused (no per-block alloc).
        Nested uses get a buffer each: a put through a scratch buffer may evict from a
        full tier and spill the victim through a scratch buffer of its own (one per
        level down), so the block being moved is never overwritten before it is written."""
        local = self._local
        bufs = getattr(local, "scratch", None)
        if bufs is None:
            bufs = local.scratch = []
            local.depth = 0
        depth = local.depth
        if depth == len(bufs):
            bufs.append(None)
        buf = bufs[depth]
        if buf is None or buf.nbytes < nbytes:
            buf = bufs[depth] = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
        local.depth = depth + 1
        try:
            yield buf[:nbytes]
        finally:
            local.depth = depth

    def _tier_call(self, lvl: Level, method: str, *args: Any) -> Any:
        """Call a tier; a tier failure is logged and counted, never raised to callers
        of load/save (they see misses)."""
        try:
            return getattr(lvl.tier, method)(*args)
        except BufferSizeError:
            raise
        except TierError as exc:
            with self._lock:
                lvl.counters["errors"] += 1
            log.warning("tier %s %s failed: %s", lvl.name, method, exc)
            return None
        except OSError as exc:
            with self._lock:
                lvl.counters["errors"] += 1
            log.warning("tier %s %s failed: %s", lvl.name, method, exc)
            return None

    def _drop(self, key: BlockKey, i: int) -> None:
        """Forget that level ``i`` holds ``key``. Caller holds the lock."""
        index = self._index
        if not index.holds(key, i):
            return
        self._levels[i].policy.on_remove(key)
        if self._tenants is not None:
            self._tenants.remove(key, i, index.sizes.get(key, 0))
        if self._events is not None:
            self._events.removed(i, (key,))
        if not index.remove_level(key, i):
            self._forget(key)

    def _forget(self, key: BlockKey) -> None:
        """Drop per-key metadata once no tier holds the key. Caller holds the lock."""
        self._index.forget(key)
        self._hint_index.forget(key)


def parent_of(key: BlockKey) -> BlockKey | None:
    return BlockKey(key.parent, None, key.namespace) if key.parent else None
