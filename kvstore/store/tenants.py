"""Per-tenant bytes and quotas in the Store's tiers, for the cache server's
``server.tenants`` (``docs/server.md``, Tenants).

A companion of :class:`kvstore.store.Store` (as ``reservation`` and ``kvstore._prefix`` are): the
server attaches one with :meth:`Store.set_tenants` (it is held by the Store's
:class:`kvstore.store.mover.Mover`, which calls it); a Store without one (every embedded
Store) runs none of this. Not thread-safe: every method runs with the caller holding the
index's lock (``Index.lock``); :meth:`TenantLedger.plan` calls the mover's
lock-held methods (``evictable``, ``take_victim``, ``clock``, ``hints``).

Ownership is read off the key. The server maps each tenant's keys into the tenant's own
space, whose digests begin with the tenant's :data:`TAG_BYTES`-byte tag
(:mod:`kvstore.net.server._tenants`), so a block's owner needs no table, is the same in every
tier, and survives a restart from a persistent tier. A key without a tenant's tag (one
stored before tenants were configured) is nobody's: counted against no quota.

Ledgers: a tenant's bytes in level ``i`` are exactly what level ``i`` holds of its blocks.
Each block is charged in a level when it enters that level's index (:meth:`TenantLedger.add`)
and uncharged, by what was charged, when it leaves it (:meth:`TenantLedger.remove`), so no
ledger can go negative (asserted where it changes, as are the bytes in flight); the Store
keeps one size per key, fixed by its first save (:meth:`kvstore.store.index.Index.fits`: a
re-save with another size is refused), so every level holding a key charges the same.

Quotas: before blocks enter level ``i`` (a save, a spill from the level above, a
promotion, a reservation), a tenant whose bytes there plus the incoming ones pass its
quota for that level first evicts its *own* blocks there (victims spill down as any
eviction does); blocks that still do not fit are refused in that level as by a full
tier (counted in ``quota_full``; a save then tries the next level). The check, the
charge of the blocks in flight and the victims are one step under the lock
(:meth:`kvstore.store.mover.Mover.plan_put`), so concurrent saves never pass a quota
together. A quota is a cap, not a reservation: a full tier still evicts in its policy's
order across tenants. A tenant's own victims come from its own order in the level (one
per tenant and level, the keys :meth:`TenantLedger.add` charged): least recently saved or
read first (:meth:`TenantLedger.touch`), those a live retention hint holds after all its
others (as the level's retention layer ranks them, while the tenant is within its quota).
So the walk never steps over another tenant's block, however many lie ahead in the
level's policy, and pulls nothing from that policy (a pull has side effects: S3-FIFO and
SIEVE move skipped keys on). It is bounded: a tenant that holds no bytes in the level
has nothing to evict and is refused at once (no walk), and a walk looks at no more than
:data:`WALK_STEPS` of the tenant's own keys (all of them leased, say: what is still over
the quota is refused; counted in ``walk_capped``). Cost: one ordered-dict entry per
tenant-owned block per level.

Retention within the quota: every block a tenant holds in a level counts in its bytes
there, leased, pinned or hinted alike, so leases and pins never let it hold more than
its quota. A retention hint (``priority``, ``retain_s``) ranks a block after every
unhinted one of the level, other tenants' included; so a hint protects a tenant's block
only while the tenant has a quota in that level and holds no more than it
(:meth:`TenantLedger.hint_bound`, read by the level's retention layer,
:class:`kvstore.policies.retention.RetentionClasses`). Elsewhere (no quota there, a
tenant over a quota lowered since its blocks came in, a key that is nobody's) its hinted
blocks rank in the policy's own order, as if unhinted. Hints thus let a tenant keep at
most its quota against other tenants' blocks. Cost: a set of the keys of tenants with
no quota in each level (one entry per such key held there), and a look-up in it per
hinted key a victim walk steps over (over LRU and FIFO, which park the hinted keys they
passed, once per parked key when the ledger is attached, not on every walk).
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import islice
from typing import TYPE_CHECKING, Any, Callable, Container, Mapping, Sequence

from kvstore.keys import BlockKey
from kvstore.policies.retention import TrackedKeys

if TYPE_CHECKING:
    from kvstore.store.mover import Mover

TAG_BYTES = 8   # a tenant's keys all begin with its tag (see kvstore.net.server._tenants)
WALK_STEPS = 1024   # of a tenant's own keys, one quota eviction walk looks at most


class TenantLedger:
    """``tags``: tag -> tenant name; ``quotas``: tenant name -> {level index: bytes};
    ``levels``: the Store's tier names, fastest first. Not thread-safe: every method runs
    with the caller holding the index's lock (``Index.lock``; see the module docstring)."""

    def __init__(self, tags: Mapping[bytes, str], quotas: Mapping[str, Mapping[int, int]],
                 levels: Sequence[str]) -> None:
        self._tags = dict(tags)
        self.levels = list(levels)
        n = len(self.levels)
        names = list(self._tags.values())
        self._quota: dict[str, list[int | None]] = {name: [None] * n for name in names}
        for name, per_level in quotas.items():
            for i, nbytes in per_level.items():
                self._quota[name][i] = int(nbytes)
        self._used = {name: [0] * n for name in names}       # indexed bytes per level
        # per tenant and level, its keys held there -> the bytes charged for each (what
        # remove uncharges), least recently saved or read first: its own victim order
        self._held: dict[str, list[OrderedDict[BlockKey, int]]] = {
            name: [OrderedDict() for _ in range(n)] for name in names}
        self._pending = {name: [0] * n for name in names}    # admitted, not yet indexed
        self._evictions = {name: [0] * n for name in names}
        self._quota_full = {name: [0] * n for name in names}
        self._walk_capped = {name: [0] * n for name in names}   # walks stopped at WALK_STEPS
        # per level, the keys held there whose hints protect nothing there as a rule: nobody's
        # keys, and the keys of tenants with no quota in the level (hint_bound)
        self._unbound: list[TrackedKeys] = [TrackedKeys() for _ in range(n)]

    def owner(self, key: BlockKey) -> str | None:
        return self._tags.get(key.digest[:TAG_BYTES])

    # -- the index -------------------------------------------------------------------------

    def recount(self, where: Mapping[BlockKey, int], sizes: Mapping[BlockKey, int]) -> None:
        """Usage from the whole index (blocks recovered before the ledger was attached)."""
        for name in self._used:
            self._used[name] = [0] * len(self.levels)
            self._held[name] = [OrderedDict() for _ in self.levels]
        for unbound in self._unbound:
            unbound.clear()
        for key, mask in where.items():
            for i in range(len(self.levels)):
                if mask >> i & 1:
                    self.add(key, i, sizes.get(key, 0))

    def _unbounded(self, name: str | None, i: int) -> bool:
        """Hints of ``name``'s blocks protect nothing in level ``i``: nobody's blocks, or a
        tenant with no quota there."""
        return name is None or self._quota[name][i] is None

    def add(self, key: BlockKey, i: int, nbytes: int) -> None:
        """``key`` entered level ``i``'s index: its owner is charged ``nbytes`` there
        (once: a key is indexed in a level at most once)."""
        name = self.owner(key)
        if self._unbounded(name, i):
            self._unbound[i].add(key)
        if name is not None:
            held = self._held[name][i]
            assert key not in held, f"tenant {name}: {key!r} charged twice in level {i}"
            held[key] = nbytes
            self._used[name][i] += nbytes

    def remove(self, key: BlockKey, i: int, *, evicted: bool = False) -> None:
        """``key`` left level ``i``'s index (``evicted``: as a victim): its owner is
        uncharged what :meth:`add` charged there (nothing for a key it did not)."""
        name = self.owner(key)
        if self._unbounded(name, i):
            self._unbound[i].discard(key)
        if name is not None:
            nbytes = self._held[name][i].pop(key, None)
            if nbytes is None:
                return
            used = self._used[name][i] - nbytes
            assert used >= 0, f"tenant {name}: level {i} ledger went negative ({used} bytes)"
            self._used[name][i] = used
            if evicted:
                self._evictions[name][i] += 1

    def touch(self, key: BlockKey, i: int) -> None:
        """``key`` was read or saved again in level ``i``: last in its owner's victim
        order there."""
        name = self.owner(key)
        if name is not None:
            held = self._held[name][i]
            if key in held:
                held.move_to_end(key)

    def charged(self, name: str, i: int) -> Mapping[BlockKey, int]:
        """``name``'s keys in level ``i``'s index and the bytes charged for each (its
        ledger there is their sum)."""
        return self._held[name][i]

    # -- admission under quota ---------------------------------------------------------------

    def plan(self, mover: "Mover", i: int, keys: Sequence[BlockKey], sizes: Sequence[int], chosen: list[int],
             protect: set[bytes | None] | None, evict: bool,
             victims: list[tuple[BlockKey, int]]) -> tuple[list[int], dict[BlockKey, tuple[str, int]]]:
        """The blocks ``chosen`` (indices into ``keys``) for level ``i`` that fit their
        owners' quotas there, after evicting (into ``victims``; ``evict=False``: none)
        each owner's own blocks to make room; and what they are charged while in flight
        (settled by :meth:`settle` once indexed or dropped)."""
        groups: dict[str, list[int]] = {}
        for j in chosen:
            name = self.owner(keys[j])
            if name is not None and self._quota[name][i] is not None:
                groups.setdefault(name, []).append(j)
        if not groups:
            return chosen, {}
        dropped: set[int] = set()
        charged: dict[BlockKey, tuple[str, int]] = {}
        for name, idx in groups.items():
            incoming = sum(sizes[j] for j in idx)
            # nothing of its own indexed here: nothing to evict, no walk (the batch is refused)
            if evict and self._used[name][i] > 0 and self._over(name, i, incoming) > 0:
                self._evict_own(mover, i, name, incoming, protect, victims)
            over = self._over(name, i, incoming)
            while over > 0 and idx:   # the tail of the batch goes: its prefix stays useful
                j = idx.pop()
                dropped.add(j)
                over -= sizes[j]
                self._quota_full[name][i] += 1
            for j in idx:
                charged[keys[j]] = (name, sizes[j])
                self._pending[name][i] += sizes[j]
        return [j for j in chosen if j not in dropped], charged

    def settle(self, i: int, charged: Mapping[BlockKey, tuple[str, int]]) -> None:
        """Blocks admitted by :meth:`plan` were indexed (then :meth:`add` counted them)
        or dropped: no longer in flight."""
        for name, nbytes in charged.values():
            pending = self._pending[name][i] - nbytes
            assert pending >= 0, f"tenant {name}: level {i} bytes in flight went negative ({pending})"
            self._pending[name][i] = pending

    def _over(self, name: str, i: int, incoming: int) -> int:
        return self._used[name][i] + self._pending[name][i] + incoming - self._quota[name][i]

    def _evict_own(self, mover: "Mover", i: int, name: str, incoming: int, protect: set[bytes | None] | None,
                   victims: list[tuple[BlockKey, int]]) -> None:
        """Take ``name``'s own blocks out of level ``i`` until its bytes there plus
        ``incoming`` fit its quota or none is left to take: least recently saved or read
        first, those a live hint holds last (see :meth:`_own_victims`). Walks the
        tenant's own blocks only, never another tenant's, and at most
        :data:`WALK_STEPS` of them (a walk that stopped there: ``walk_capped``)."""
        now = mover.clock()
        taken = len(victims)
        for key in self._own_victims(mover, i, name, now):
            if not mover.evictable(key, now, protect):
                continue
            mover.take_victim(i, key, victims)
            if self._over(name, i, incoming) <= 0 or self._used[name][i] <= 0:
                break   # stop at the victim that makes room
        else:
            if len(self._held[name][i]) + len(victims) - taken > WALK_STEPS:
                self._walk_capped[name][i] += 1
        if mover.events is not None and len(victims) > taken:
            mover.events.removed(i, [key for key, _ in victims[taken:]])

    def _own_victims(self, mover: "Mover", i: int, name: str, now: float) -> list[BlockKey]:
        """The first :data:`WALK_STEPS` of ``name``'s keys in level ``i`` (a snapshot: the
        walk takes keys out as it goes), least recently saved or read first, those a live
        hint holds there after the others (as the level's retention layer ranks them;
        while the tenant holds more than its quota there, hints hold none of them)."""
        keys = list(islice(self._held[name][i], WALK_STEPS))
        records = mover.hints.records
        cap = self._quota[name][i]
        if not records or (cap is not None and self._used[name][i] > cap):
            return keys
        limit = mover.levels[i].policy.trust.protect_s   # the level's retention layer's trust in hints
        first, held = [], []
        for key in keys:
            rec = records.get(key)
            live = rec is not None and not rec.discard and rec.expires > now and now - rec.given < limit
            (held if live else first).append(key)
        return first + held

    # -- retention -----------------------------------------------------------------------------

    def hint_bound(self, i: int) -> Callable[[], Container[BlockKey] | None]:
        """For level ``i``'s retention layer (its ``unprotected``), called at the start
        of each victim walk: the keys there whose live hints protect nothing, i.e. whose
        owner has no quota in the level or holds more than it (the module docstring): the
        same :class:`~kvstore.policies.retention.TrackedKeys` of the keys with no quota there
        on every walk, or, while some tenant is over its quota, a container answering
        from the ledger as it is then. A walk only takes blocks out, so a tenant within
        its quota at the start stays so to the end. Runs under the Store's lock, as the
        walk does; the answer is for that walk only."""
        # the same object on every walk, listing the keys that joined it, so the layer
        # checks its parked keys against it once and then only those
        unbound = self._unbound[i]

        def walk() -> Container[BlockKey] | None:
            for name, cap in self._quota.items():
                if cap[i] is not None and self._used[name][i] > cap[i]:
                    return _OverQuota(self, i)    # rare: a quota lowered under what it holds
            return unbound

        return walk

    # -- stats -----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Per tenant and tier: bytes and blocks held, quota (None: none), evictions and
        blocks refused for the quota."""
        out = {}
        for name in self._used:
            tiers = {tier: {"used_bytes": self._used[name][i], "blocks": len(self._held[name][i]),
                            "quota_bytes": self._quota[name][i], "evictions": self._evictions[name][i],
                            "quota_full": self._quota_full[name][i],
                            "walk_capped": self._walk_capped[name][i]}
                     for i, tier in enumerate(self.levels)}
            out[name] = {"tiers": tiers}
        return out


class _OverQuota:
    """Level ``i``'s keys whose hints protect nothing while some tenant there is over
    its quota: answered per key from the ledger as it is now (a tenant the walk brings
    back within its quota is protected again for the rest of the walk)."""

    def __init__(self, ledger: TenantLedger, i: int) -> None:
        self._ledger, self._i = ledger, i

    def __contains__(self, key: object) -> bool:
        ledger, i = self._ledger, self._i
        name = ledger.owner(key)
        if name is None:
            return True
        cap = ledger._quota[name][i]
        return cap is None or ledger._used[name][i] > cap


__all__ = ["TAG_BYTES", "TenantLedger", "WALK_STEPS"]
