"""Retention classes over any eviction policy: one layer that makes every policy honour
client hints, so the policies themselves stay unaware of them.

Victims come in three classes:

1. ``discard`` blocks (one-shot), oldest hint first;
2. unhinted blocks, blocks whose hint has expired (an expired hint is ignored: the
   block sits wherever the policy's own history puts it), and blocks whose hint is
   older than the tier's trust in hints (``protect_s``, below), in the wrapped
   policy's own order;
3. blocks held by a live hint, lowest priority class first; within a class by what
   the hint says about the block's next use (:mod:`kvstore.policies._ranked`: the
   hint's window and age and the tier's observed reuse of hinted blocks), lowest
   expected value first: of hints with one window the oldest first (in the order the
   tier got them), of hints of one age the longest window first, a hint with no expiry
   first of all; of the hints the tier got at one time (one request's blocks) the last
   first, so a request's deepest blocks leave before its prefix. Reads since the hint
   do not count: the hint a client gave last is its latest word on a block's future (a
   conversation that came back without hinting again has had its turn). Lineage keeps
   its own order here (leaves first, which a prefix-aware policy needs within a class).

A hint protects no block in ``unprotected`` (``None``, the default: a hint may protect
every block). The Store sets it for the cache server's tenants
(:meth:`kvstore.store.tenants.TenantLedger.hint_bound`): a tenant's hints protect its
blocks in a tier only within its quota there, so no tenant can keep more than its quota
against other tenants' blocks by hinting. It is called once per walk and returns the
keys whose hints protect nothing for that walk (a container: ``key in it``; a
:class:`TrackedKeys` that lists the keys joining it), or ``None`` when there are none;
such a block is class 2.

The wrapped policy sees every insert, access and removal, so its order is the same as
without hints; the layer only filters its walk. A class-3 block is offered only once
the walk has passed every block of classes 1 and 2. Walking past a hinted block is a
skip as far as the policy can tell (as for a leased block: S3-FIFO and SIEVE move such
keys on). Cost (LFU, S3-FIFO, SIEVE, ARC): a victim walk steps over the live-hinted
blocks ahead of the first unhinted one; class 3 then walks the hinted blocks of each
priority class present, comparing only the heads of a fixed number of buckets per
victim, with no snapshot (lineage: its own order once more per class).

Over a stamped policy (LRU, FIFO: ``EvictionPolicy.stamped``) it steps over each of them
once: every key the walk steps past in the policy's queue (held by a hint, skipped by the
Store, or a discard block) leaves the queue for :class:`~kvstore.policies._parking.Parking`,
in order. In such a policy those keys are exactly the head of its order, so the walk
offers the parked keys that no longer hold first, in order, then the queue: the same
order as stepping over them, at a cost of what it offers plus the hints that lapsed
since the last walk (heaps by expiry and by when given, O(log n) per hint). A parked key
read under LRU goes back to the queue's recent end. While a tenant's hints are bounded
in the tier by a :class:`TrackedKeys` (the Store's tenants without a quota there), the
held keys in it go loose once, when that container first comes, then those that joined
it since the last walk, and walks stay this cheap; while ``unprotected`` returns any
other container (a tenant over a lowered quota: rare) the walk checks every parked key.

A policy that can hold keys (``EvictionPolicy.holds``: lineage, whose walk changes nothing
when it passes a key over) keeps the hinted keys its walk passed out of its own walk
(``hold``) until their hint lapses (``release``: back where the policy's history puts
them), with the same bookkeeping, so it too steps over each of them once. Its order is
the same as stepping over them; class 3 (every other block passed) walks the policy's
own order with the held keys in it (``held_victims``).

**Hints must earn their keep** (:class:`HintTrust`, one per tier). A client whose hints
are wrong would otherwise fill the tier with blocks nobody reads again while the
unhinted blocks it needs go first. So each tier watches the blocks at its eviction
end: hinted blocks the walk passes over (kept by their hint) or evicts, and unhinted
blocks it evicts. A watched block counts as *reused* if it is accessed, or saved again,
within the next ``2W`` evictions (``W``: the blocks the tier holds). While hinted blocks
at the eviction end are reused significantly more often than unhinted ones, hints
protect in full; while significantly less often, the tier lowers ``protect_s``: a hint
then protects its blocks only until it is ``protect_s`` old (since it was last given),
after which they rank in the policy's own order, as if unhinted. Wrong hints thus end
in plain policy order, right ones keep their protection, and ``protect_s`` comes back
as soon as hinted blocks are reused more often again. Deterministic; its state is in
each tier's ``stats()["tiers"][i]["hint_trust"]``.

Hints are read, never written, from ``hints``: a mapping from key to a record with
``expires`` (seconds on ``clock``), ``given`` (when it was last given), ``priority`` and
``discard``, kept by the Store. The Store calls :meth:`rehint` when a held key's hint
changes. Not thread-safe: the Store calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Container, Hashable, Iterator, Mapping

from kvstore.policies._order import iter_live
from kvstore.policies._parking import Parking
from kvstore.policies._ranked import RankedHeld
from kvstore.policies._trust import HintTrust
from kvstore.policies.base import EvictionPolicy

_MAX_JOINED = 1 << 16   # TrackedKeys lists at most this many joins between two walks


class TrackedKeys:
    """A set of keys for ``unprotected`` that tells the retention layer which keys joined
    since its last walk (the Store's tenants without a quota in the tier: a key joins as
    it is indexed there, which for a policy that stages a batch, lineage, can be after the
    walk passed it). Return the same object on every walk: the layer checks the keys it
    holds against it once, then only the keys that joined. Its owner changes it with
    :meth:`add`, :meth:`discard` and :meth:`clear` only."""

    __slots__ = ("_keys", "_joined")

    def __init__(self) -> None:
        self._keys: set[Hashable] = set()
        self._joined: list[Hashable] | None = []     # None: more than _MAX_JOINED

    def add(self, key: Hashable) -> None:
        if key not in self._keys:
            self._keys.add(key)
            joined = self._joined
            if joined is not None:
                joined.append(key)
                if len(joined) > _MAX_JOINED:
                    self._joined = None

    def discard(self, key: Hashable) -> None:
        self._keys.discard(key)

    def clear(self) -> None:
        self._keys.clear()
        self._joined = []

    def take_joined(self) -> list[Hashable] | None:
        """The keys added since the last call (``None``: too many to list: check all)."""
        joined, self._joined = self._joined, []
        return joined

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class RetentionClasses(EvictionPolicy):
    """``inner`` with the victim classes above. ``clock()`` is the time base of the
    hints' ``expires`` and ``given`` (injectable, so tests never sleep)."""

    def __init__(self, inner: EvictionPolicy, hints: Mapping[Hashable, Any],
                 clock: Callable[[], float]) -> None:
        self.inner = inner
        self.name = inner.name
        self.uses_parent = inner.uses_parent
        self._hints = hints
        self._clock = clock
        self._discard: OrderedDict[Hashable, None] = OrderedDict()
        # class 3 by hint age, per priority: key -> its record, in the order the tier got
        # the hints (lineage keeps its own leaf-first order instead: see _held_walk)
        self._by_age = not inner.uses_parent
        self._held: dict[int, RankedHeld] = {}      # by priority, ranked by next use
        self._held_at: dict[Hashable, int] = {}      # key -> its priority in _held
        # stamped policies (LRU, FIFO): hinted keys the walk passed leave the policy's
        # queue while their hint holds, so a walk does not step over them again; policies
        # that hold keys (lineage) keep them out of their own walk meanwhile
        self._holding = inner.holds and not inner.stamped
        self._parking = (Parking(hints, release=inner.release) if self._holding
                         else Parking(hints) if inner.stamped else None)
        self.trust = HintTrust(parks=self._parking is not None)
        self._offered: tuple[Hashable, bool] | None = None   # the walk's last victim, hinted?
        # per walk: the keys a live hint may not protect here (the Store's tenants); None: none
        self.unprotected: Callable[[], Container[Hashable] | None] | None = None
        self._settled: TrackedKeys | None = None   # no held parked key is in it (see _settle)

    def on_insert(self, key: Hashable, nbytes: int, parent: Hashable | None = None) -> None:
        parking = self._parking
        if parking is None or self._holding or key not in parking:
            self.inner.on_insert(key, nbytes, parent)
        elif self.inner.renews:          # LRU: an insert of a key it holds renews it, as a read
            parking.remove(key)
            self.inner.on_insert(key, nbytes, parent)
        # (FIFO: a key it holds keeps its place)
        self.trust.reused(key)           # saved again after an eviction the tier watched
        self.rehint(key)

    def on_access(self, key: Hashable) -> None:
        parking = self._parking
        if parking is not None and self.inner.renews and parking.remove(key):
            self.inner.on_insert(key, 0)     # back in the policy's order, where a read puts it
        else:
            self.inner.on_access(key)
        self.trust.reused(key)

    def on_remove(self, key: Hashable) -> None:
        offered = self._offered
        self.inner.on_remove(key)
        if self._parking is not None:
            self._parking.remove(key)
        if offered is not None and offered[0] is key:
            self.trust.evicted(key, offered[1], len(self))
        else:
            self.trust.forget(key)
        self._offered = None
        self._discard.pop(key, None)
        self._unhold(key)

    def rehint(self, key: Hashable) -> None:
        """``key``'s hint changed (set, merged or dropped)."""
        hint = self._hints.get(key)
        self._unhold(key)
        if self._parking is not None:
            self._parking.rehinted(key, hint)
        if hint is not None and hint.discard and key in self:
            self._discard[key] = None
            return
        self._discard.pop(key, None)
        if hint is not None and self._by_age and key in self:
            held = self._held.get(hint.priority)
            if held is None:
                held = self._held[hint.priority] = RankedHeld()
            held.add(key, hint)
            self._held_at[key] = hint.priority

    def _unhold(self, key: Hashable) -> None:
        priority = self._held_at.pop(key, None)
        if priority is not None:
            held = self._held[priority]
            held.remove(key)
            if not len(held):
                del self._held[priority]

    def set_capacity(self, capacity_bytes: int) -> None:
        self.inner.set_capacity(capacity_bytes)

    def victims(self) -> Iterator[Hashable]:
        if not self._hints and not self._parking:   # no hints anywhere: the policy's own
            return self.inner.victims()     # walk, untouched (and nothing to learn about hints)
        return self._classed()

    def _classed(self) -> Iterator[Hashable]:
        now = self._clock()
        hints, trust, parking = self._hints, self.trust, self._parking
        unprotected = self.unprotected() if self.unprotected is not None else None
        limit = trust.protect_s
        for key in iter_live(self._discard):
            self._offered = None
            yield key
        kept: set[int] = set()
        trust.oldest = oldest = 0.0
        ahead: Iterator[Hashable] = iter(())
        settled = False                          # the walk may pass over the held parked keys
        if parking is not None:
            # the parked keys are the head of the policy's order: those that no longer
            # hold first (all of them while some tenant's hints are bounded), in order
            parking.release_due(now, limit)
            for key in trust.unwatched(parking.held):
                trust.watch(key, True)          # kept by its hint past its watch window
            given = parking.oldest_given()
            if given is not None:
                oldest = now - given
                last = hints.get(parking.last_held())
                if last is not None:
                    trust.held(now - last.given)
            settled = self._settle(unprotected)
            if self._holding:
                if not settled:     # the walk checks every hinted key: the policy offers them all
                    parking.loosen_many(list(parking.held))
            else:
                ahead = iter(parking.loose_in_order() if settled else parking.all_in_order())
        policy = self.inner
        for walk in (ahead, policy.victims()):
            # every key the walk steps past in the policy's queue is parked, in order (a
            # policy that holds keys: the hinted ones it passed; it handles the rest)
            hold = parking is not None and walk is not ahead
            step_past = hold and not self._holding
            for key in walk:
                if walk is ahead and key not in parking:
                    continue                    # evicted or read since the snapshot
                hint = hints.get(key)
                # an expired hint, or one that may not protect this key here: policy order
                if hint is None or (not hint.discard and (hint.expires <= now or
                                                          (unprotected is not None and key in unprotected))):
                    trust.oldest = oldest
                    self._offered = (key, False)
                    yield key
                    if step_past and key in policy:     # skipped (leased, pinned): keeps its place
                        policy.on_remove(key)
                        parking.park_loose(key)
                elif not hint.discard:
                    age = now - hint.given
                    if age >= limit:          # older than the tier trusts hints: policy order
                        trust.distrusted(age)
                        trust.oldest = oldest
                        self._offered = (key, True)
                        yield key
                        if step_past and key in policy:
                            policy.on_remove(key)
                            parking.park_loose(key)
                    else:
                        kept.add(hint.priority)
                        if hold:
                            if step_past:
                                policy.on_remove(key)
                            else:
                                policy.hold(key)
                            parking.park(key, hint)
                        elif parking is not None and key in parking.loose:
                            parking.repark(key, hint)
                        trust.passed(key, age)
                        if age > oldest:
                            oldest = age
                elif step_past:                 # a discard block: class 1 offers it
                    policy.on_remove(key)
                    parking.park_loose(key)
        trust.oldest = oldest
        if settled:                                       # the held keys passed too
            kept.update(rec.priority for rec in map(hints.get, parking.held) if rec is not None)
        for priority in sorted(kept):
            for key in self._held_walk(priority, now):
                hint = hints.get(key)
                if (hint is not None and not hint.discard and hint.expires > now and hint.priority == priority
                        and now - hint.given < limit and (unprotected is None or key not in unprotected)):
                    self._offered = (key, True)
                    yield key

    def _settle(self, unprotected: Container[Hashable] | None) -> bool:
        """Whether no held parked key is in ``unprotected``, so the walk need only offer
        the loose ones: always for ``None``; for a :class:`TrackedKeys`, once its held keys
        went loose (all of them the first walk it comes to in a row, O(held) once; then
        those that joined since); never for any other container."""
        if unprotected is None or not isinstance(unprotected, TrackedKeys):
            self._settled = None
            return unprotected is None
        parking = self._parking
        joined = unprotected.take_joined()
        if self._settled is not unprotected or joined is None:
            parking.loosen_many([key for key in parking.held if key in unprotected])
            self._settled = unprotected
        else:
            parking.loosen_many(list(dict.fromkeys(key for key in joined if key in parking.held)))
        return True

    def _held_walk(self, priority: int, now: float) -> Iterator[Hashable]:
        """Class 3 candidates of one priority, lowest expected value of keeping first
        (:mod:`kvstore.policies._ranked`; lineage: its own walk). The caller re-checks
        each key's hint."""
        if not self._by_age:
            yield from (self.inner.held_victims() if self._holding else self.inner.victims())
            return
        held = self._held.get(priority)
        if held is not None:
            yield from held.walk(now, self.trust.hinted_rate())

    def hint_stats(self) -> dict[str, Any]:
        """This tier's :class:`HintTrust` state (``stats()["tiers"][i]["hint_trust"]``)."""
        return self.trust.stats()

    def __len__(self) -> int:
        parked = self._parking is not None and not self._holding
        return len(self.inner) + (len(self._parking) if parked else 0)

    def __contains__(self, key: object) -> bool:
        parked = self._parking is not None and not self._holding
        return key in self.inner or (parked and key in self._parking)


__all__ = ["HintTrust", "RetentionClasses", "TrackedKeys"]
