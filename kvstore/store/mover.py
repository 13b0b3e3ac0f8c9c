"""How the Store places blocks in its tiers: admission and capacity on the way in, victim
choice and spill on the way out, and the mapping of tier failures into counted misses
(:meth:`Mover.tier_io`). The copies between tiers that a spill, a prefetch and a flush
make are :mod:`kvstore.store.copies` (``Mover.copies``).

One :class:`Mover` per Store, built over the Store's index, levels, hints and KV events;
the data path (``datapath``), the reservation (``reservation``) and the tenant ledger
(``tenants``) call its public methods.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from kvstore.buffers import nbytes_of
from kvstore.errors import BufferSizeError, TierError
from kvstore.keys import BlockKey
from kvstore.policies.base import AdmissionPolicy, Decision, EvictionPolicy
from kvstore.store.copies import Copies
from kvstore.store.index import Index
from kvstore.tiers.base import Tier

if TYPE_CHECKING:
    from kvstore.store.hints import StoreHints
    from kvstore.store.tenants import TenantLedger

log = logging.getLogger("kvstore.store")

T = TypeVar("T")

_COUNTERS = ("hits", "misses", "writes", "bytes_written", "bytes_read", "evictions", "spills",
             "promotions", "rejected", "throttled", "full", "errors", "corruptions")


@dataclass
class Level:
    """One tier with its policies and counters. The policies, ``counters``,
    ``pending_free`` and ``doomed`` change under ``Index.lock`` (with the index they
    describe)."""

    tier: Tier
    policy: EvictionPolicy
    admission: AdmissionPolicy
    kind: str
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_COUNTERS, 0))
    pending_free: int = 0   # bytes of chosen victims not yet deleted from the tier
    # keys out of this level's index whose delete from the tier is under way (victims, a
    # delete): no put writes them here meanwhile, or the delete would take its bytes
    doomed: set[BlockKey] = field(default_factory=set)
    recovered: int | None = None   # persistent tiers: blocks indexed from it at start-up

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
class PutPlan:
    """What :meth:`Mover.plan_put` decided for one batch."""

    result: list[bool]                       # per key: stored (so far)
    chosen: list[int] = field(default_factory=list)    # indices to write
    inserted: set[BlockKey] = field(default_factory=set)  # already placed in the policy
    victims: list[tuple[BlockKey, int]] = field(default_factory=list)
    parents: set[bytes | None] | None = None
    charged: dict = field(default_factory=dict)  # per-tenant bytes in flight (kvstore.store.tenants)
    claimed: list[BlockKey] = field(default_factory=list)  # sizes claimed in the index (Index.claim)


class Mover:
    """Tier-to-tier block movement for one Store.

    State: ``index`` (:class:`kvstore.store.index.Index`, shared with the Store),
    ``levels`` (the Store's tiers with their policies and counters, fastest first),
    ``hints`` (:class:`kvstore.store.hints.StoreHints`), ``events`` (the KV event
    publisher, or ``None``), ``clock`` (the Store's, for lease expiry), ``tenants`` (the
    cache server's :class:`kvstore.store.tenants.TenantLedger`, or ``None``; set through
    the Store), ``ops`` (the Store's op counters: ``resave_size_mismatch``) and
    per-thread scratch buffers.

    Lock rule: ``Index.lock`` (``lock`` here; not reentrant) guards the index, each
    level's policies, counters, ``pending_free`` and ``doomed``, the hint table and the
    tenant ledger. :meth:`evictable`, :meth:`take_victim`, :meth:`drop`, :meth:`forget`,
    :meth:`touched`, :meth:`refuse_size` and ``_choose_victims`` run with the caller
    holding it; every other method takes it itself, briefly, never across tier I/O, so
    the caller must not hold it.
    """

    def __init__(self, index: Index, levels: list[Level], hints: "StoreHints", events: Any,
                 clock: Callable[[], float], ops: dict[str, int] | None = None) -> None:
        self.index = index
        self.ops = ops if ops is not None else {}
        self.ops.setdefault("resave_size_mismatch", 0)
        self.lock = index.lock
        self.levels = levels
        self.hints = hints
        self.events = events
        self.clock = clock
        self.tenants: "TenantLedger | None" = None
        self.copies = Copies(self)

    def put(self, i: int, keys: list[BlockKey], srcs: list[Any],
             checksums: list[int | None] | None = None, *, admit: bool = True,
             failed: set[BlockKey] | None = None, refused: set[BlockKey] | None = None) -> list[bool]:
        """Store blocks into level ``i``, evicting (and spilling) to make room.
        ``checksums``: the XXH3-64 each source was stored with in the tier it comes
        from, kept by a tier that takes them (``write_checksums``) instead of a re-hash.
        ``admit=False``: not an offer (a flush), the level's admission is not asked.
        ``failed``: collects the keys whose write failed in the tier (an error, not a
        lack of room); ``refused``: those refused because the Store holds (or is
        saving) the key with another size (:meth:`Index.fits`; no level will take them)."""
        lvl = self.levels[i]
        sizes = [nbytes_of(src) for src in srcs]
        plan = self.plan_put(i, keys, sizes, admit=admit, refused=refused)
        try:
            return self._put_planned(i, lvl, keys, srcs, sizes, plan, checksums, failed)
        finally:
            if plan.charged or plan.claimed:   # in flight until the put ends, stored or not
                self.settle(i, plan)

    def _put_planned(self, i: int, lvl: Level, keys: list[BlockKey], srcs: list[Any], sizes: list[int],
                     plan: "PutPlan", checksums: list[int | None] | None,
                     failed: set[BlockKey] | None) -> list[bool]:
        self.evict(i, plan.victims)
        chosen = plan.chosen
        if not chosen:
            return plan.result
        if checksums is None or not lvl.tier.capabilities.write_checksums:
            checksums = None
        ok = self._write(lvl, chosen, keys, srcs, checksums)
        if ok is None and failed is not None:
            failed.update(keys[j] for j in chosen)
        self.unstage(i, keys, plan, ok)
        if ok is not None and not all(ok):
            # Fragmentation or a racing writer: make room for the rest once more.
            retry = [j for j, good in zip(chosen, ok) if not good]
            # never this batch's blocks just written (a prefix-aware policy has them
            # already, not yet indexed): evicting one would delete it under the index
            protect = (plan.parents or set()) | {keys[j].digest for j in chosen}
            with self.lock:
                victims = self._choose_victims(i, sum(sizes[j] for j in retry), force=True,
                                               protect=protect)
            if victims:
                self.evict(i, victims)
                again = self._write(lvl, retry, keys, srcs, checksums)
                if again is None and failed is not None:
                    failed.update(keys[j] for j in retry)
                if again is not None:
                    redo = dict(zip(retry, again))
                    ok = [good or redo.get(j, False) for j, good in zip(chosen, ok)]
        self.index_put(i, keys, sizes, plan, ok)
        return plan.result

    def _write(self, lvl: Level, idx: list[int], keys: list[BlockKey], srcs: list[Any],
               checksums: list[int | None] | None) -> list[bool] | None:
        """The tier's ``write`` of the blocks at ``idx`` (with their checksums, when given)."""
        args = [[keys[j] for j in idx], [srcs[j] for j in idx]]
        if checksums is not None:
            args.append([checksums[j] for j in idx])
        return self.tier_io(lvl, lvl.tier.write, *args)

    def plan_put(self, i: int, keys: list[BlockKey], sizes: list[int], *, evict: bool = True,
                 admit: bool = True, refused: set[BlockKey] | None = None) -> "PutPlan":
        """Admission and room for new blocks in level ``i``: which to write, and the
        victims to evict first (already out of the index). ``evict=False`` takes free
        room only: blocks that do not fit are left out. ``admit=False``: every block is
        admitted without asking the level's admission (which would count an offer).
        Atomic under the lock: a key held (or being saved) with another size is refused
        (:meth:`refuse_size`; into ``refused``), each owner's quota is checked and its
        bytes charged in flight, and the size of each block chosen is claimed in the
        index (``plan.claimed``) until :meth:`index_put` or :meth:`settle`."""
        lvl = self.levels[i]
        plan = PutPlan([False] * len(keys))
        chosen = plan.chosen
        index = self.index
        with self.lock:
            for j, key in enumerate(keys):
                if not index.fits(key, sizes[j]):
                    self.refuse_size(key, refused)
                    continue
                if index.where.get(key, 0) >> i & 1:
                    self.touched(key, i)
                    plan.result[j] = True
                    continue
                if lvl.doomed and key in lvl.doomed:   # its old copy is being deleted here: as if no room
                    continue
                decision = lvl.admission.decide(key, sizes[j]) if admit else Decision.ADMIT
                if decision is Decision.ADMIT:
                    chosen.append(j)
                else:
                    lvl.counters["rejected" if decision is Decision.REJECT else "throttled"] += 1
            # The blocks being added hang under these parents: evicting one now would
            # leave its new children unreachable (a chained key needs its prefix).
            plan.parents = {keys[j].parent for j in chosen} if lvl.policy.uses_parent else None
            if self.tenants is not None and chosen:   # each tenant within its quota here
                chosen, plan.charged = self.tenants.plan(self, i, keys, sizes, chosen, plan.parents, evict,
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
            for j in plan.chosen:
                index.claim(keys[j], sizes[j])
            plan.claimed = [keys[j] for j in plan.chosen]
        return plan

    def refuse_size(self, key: BlockKey, refused: set[BlockKey] | None = None) -> None:
        """A save of ``key`` with another size than the one it is held (or being saved)
        with: refused, counted (``resave_size_mismatch``), never indexed."""
        self.ops["resave_size_mismatch"] += 1
        if refused is not None:
            refused.add(key)

    def touched(self, key: BlockKey, i: int) -> None:
        """Level ``i`` holds ``key`` and it was read or saved again: its policy (and its
        owner's victim order there) hear of it."""
        self.levels[i].policy.on_access(key)
        if self.tenants is not None:
            self.tenants.touch(key, i)

    def settle(self, i: int, plan: "PutPlan") -> None:
        """The blocks ``plan`` charged to their tenants in level ``i`` are no longer in
        flight (indexed, or not stored), and their sizes no longer claimed. Idempotent."""
        if plan.charged or plan.claimed:
            with self.lock:
                self._settle(i, plan)

    def _settle(self, i: int, plan: "PutPlan") -> None:
        if plan.charged:
            self.tenants.settle(i, plan.charged)
            plan.charged = {}
        for key in plan.claimed:
            self.index.unclaim(key)
        plan.claimed = []

    def unstage(self, i: int, keys: list[BlockKey], plan: "PutPlan", ok: list[bool] | None) -> None:
        """Take blocks placed in the policy ahead of the write but not stored out again."""
        if not plan.inserted or ok is not None and all(ok):
            return
        with self.lock:
            for j, good in zip(plan.chosen, ok or [False] * len(plan.chosen)):
                # a key another writer indexed here meanwhile keeps its place in the policy
                if not good and not self.index.where.get(keys[j], 0) >> i & 1:
                    self.levels[i].policy.on_remove(keys[j])
                    plan.inserted.discard(keys[j])

    def index_put(self, i: int, keys: list[BlockKey], sizes: list[int], plan: "PutPlan",
                   ok: list[bool] | None) -> None:
        """Index the blocks of ``plan`` that level ``i`` stored (``ok``); fills ``plan.result``."""
        lvl = self.levels[i]
        ok = ok or [False] * len(plan.chosen)
        fresh: list[BlockKey] = []   # newly indexed here: KV events
        persist: dict[int, dict[BlockKey, bytes]] = {}
        where, index_sizes, policy, result = self.index.where, self.index.sizes, lvl.policy, plan.result
        inserted, bit, uses_parent = plan.inserted, 1 << i, policy.uses_parent
        full = written = 0
        with self.lock:
            tenants = self.tenants
            for j, good in zip(plan.chosen, ok):
                key = keys[j]
                if not good:
                    full += 1
                    continue
                result[j] = True
                mask = where.get(key, 0)
                if not mask & bit:
                    # the plan claimed this size (Index.claim): no other size was indexed since
                    nbytes = sizes[j]
                    where[key] = mask | bit
                    index_sizes[key] = nbytes
                    if tenants is not None:
                        tenants.add(key, i, nbytes)
                    # a staged key another put of it took out of the policy meanwhile (by
                    # dropping it from that put's own stage) is not in it: insert it again
                    if key not in inserted or key not in policy:
                        policy.on_insert(key, nbytes, parent_of(key) if uses_parent else None)
                    written += nbytes
                    fresh.append(key)
                # else a concurrent writer indexed it first; staged keys are in the policy once.
            counters = lvl.counters
            counters["full"] += full
            counters["writes"] += len(fresh)
            counters["bytes_written"] += written
            if self.events is not None and fresh:
                self.events.stored(i, fresh)
            if fresh:
                self.index.note_landed()    # lookups waiting for these keys look again
            if self.hints.records:
                self.hints.entering(i, [keys[j] for j, good in zip(plan.chosen, ok) if good], persist)
            self._settle(i, plan)
        if persist:
            self.hints.persist(persist)

    def _choose_victims(self, i: int, need: int, *, force: bool = False,
                        protect: set[bytes | None] | None = None,
                        staged: "_Staged | None" = None) -> list[tuple[BlockKey, int]]:
        """Pick victims in level ``i`` until ``need`` bytes are free, skipping leased and
        pinned keys and keys whose digest is in ``protect``. A ``staged`` key (in the
        policy, not yet written) that comes up is dropped from the stage instead.
        Victims leave the index now; their bytes leave the tier in :meth:`evict`."""
        lvl = self.levels[i]
        free = lvl.tier.capacity_bytes - lvl.tier.used_bytes + lvl.pending_free
        if staged is not None:
            free -= staged.total
        if need <= 0 or (free >= need and not force):
            return []
        if force:
            free = min(free, 0)
        now = self.clock()
        victims = []
        if free >= need:
            return []
        staging = lvl.policy.uses_parent   # a prefix-aware policy holds blocks staged by puts
        # Stop right after the victim that makes room: pulling one more candidate would
        # tell the policy it was skipped (S3-FIFO and SIEVE move such keys on).
        for key in lvl.policy.victims():
            if not self.evictable(key, now, protect):
                continue
            if staged is not None and key in staged.sizes:
                lvl.policy.on_remove(key)
                free += staged.drop(key)
                if free >= need:
                    break
                continue
            if staging and not self.index.where.get(key, 0) >> i & 1:
                # another put's staged block (placed in the policy ahead of its write, not
                # indexed yet): not this walk's to take; deleting it from the tier could
                # land after that put's write, leaving it indexed with no bytes
                continue
            free += self.take_victim(i, key, victims)
            if free >= need:
                break
        if self.events is not None and victims:
            self.events.removed(i, [key for key, _ in victims])
        return victims

    def evictable(self, key: BlockKey, now: float, protect: set[bytes | None] | None) -> bool:
        """Not leased, not pinned, not a protected parent (the index's rule)."""
        return self.index.evictable(key, now, protect)

    def take_victim(self, i: int, key: BlockKey, victims: list[tuple[BlockKey, int]]) -> int:
        """Take ``key`` out of level ``i``'s index as a victim (appended to ``victims``;
        its bytes leave the tier in :meth:`evict`); returns its size."""
        lvl = self.levels[i]
        size = self.index.sizes.get(key, 0)
        lvl.policy.on_remove(key)
        victims.append((key, self.index.remove_level(key, i)))
        lvl.doomed.add(key)
        lvl.pending_free += size
        lvl.counters["evictions"] += 1
        if self.tenants is not None:
            self.tenants.remove(key, i, evicted=True)
        return size

    def evict(self, i: int, victims: list[tuple[BlockKey, int]]) -> None:
        """Spill victims down (write-back, in batches: one write per batch into the level
        below, not one per block) and delete them from level ``i``."""
        if not victims:
            return
        lvl = self.levels[i]
        below = i + 1 if i + 1 < len(self.levels) else None
        sizes = [self.index.sizes.get(key, 0) for key, _ in victims]
        try:
            spill = []
            for key, mask in victims:
                if self.hints.is_discard(key):
                    # one-shot: not kept past this tier
                    with self.lock:
                        self.hints.count_discarded()
                elif below is not None and not mask >> below & 1:
                    spill.append(key)
            try:
                if spill:
                    lvl.counters["spills"] += sum(self.copies.between(spill, i, below))
            finally:   # out of the index already: a failed spill must not strand their bytes here
                self.tier_io(lvl, lvl.tier.delete, [key for key, _ in victims])
        finally:
            with self.lock:
                for (key, _), size in zip(victims, sizes):
                    lvl.pending_free -= size
                    lvl.doomed.discard(key)
                    if not self.index.where.get(key):
                        self.forget(key)

    def tier_io(self, lvl: Level, call: Callable[..., T], *args: Any) -> T | None:
        """``call(*args)``, one of ``lvl.tier``'s methods; a tier failure (``TierError``,
        ``OSError``) is logged, counted in ``lvl.counters["errors"]`` and answered
        ``None`` (a miss to callers of load/save), never raised. ``BufferSizeError`` (the
        caller's buffer, not the tier) is raised. Takes the lock on failure only."""
        try:
            return call(*args)
        except BufferSizeError:
            raise
        except (TierError, OSError) as exc:
            with self.lock:
                lvl.counters["errors"] += 1
            log.warning("tier %s %s failed: %s", lvl.name, getattr(call, "__name__", "call"), exc)
            return None

    def drop(self, key: BlockKey, i: int) -> None:
        """Forget that level ``i`` holds ``key``."""
        index = self.index
        if not index.holds(key, i):
            return
        self.levels[i].policy.on_remove(key)
        if self.tenants is not None:
            self.tenants.remove(key, i)
        if self.events is not None:
            self.events.removed(i, (key,))
        if not index.remove_level(key, i):
            self.forget(key)

    def forget(self, key: BlockKey) -> None:
        """Drop per-key metadata once no tier holds the key."""
        self.index.forget(key)
        self.hints.forget(key)


def parent_of(key: BlockKey) -> BlockKey | None:
    return BlockKey(key.parent, None, key.namespace) if key.parent else None


__all__ = ["Level", "Mover", "PutPlan", "parent_of"]
