"""Saving blocks by filling the first tier's memory in place (:meth:`Store.reserve`).

A connector that gathers KV pages into a buffer and then saves that buffer copies every
byte twice. A reservation hands it the destination instead: room in the first tier's
arena, taken with the same admission and eviction as :meth:`Store.save`, which the
caller fills (one gather straight into the slots) and then publishes.

Boundaries: a reservation works through the Store's mover (:class:`kvstore.store.mover.Mover`:
its public ``plan_put``, ``evict``, ``unstage``, ``index_put``, ``settle`` and ``tier_io``,
which take the index's lock themselves) and reads the index it shares
(:class:`kvstore.store.index.Index`, under its lock); the facade checks the arguments,
counts the save, finds the blocks held already and hands in what runs on commit
(``published``: write-through). This module imports neither the facade nor the package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from kvstore.errors import InvalidArgumentError
from kvstore.keys import BlockKey

if TYPE_CHECKING:
    from kvstore.store.mover import Mover, PutPlan


class Reservation:
    """Room for ``keys`` in the Store's first tier, filled by the caller.

    ``views[i]`` is a writable, flat ``uint8`` array of ``sizes[i]`` bytes for
    ``keys[i]``, or ``None`` when the block needs no write (``present[i]``: the Store
    holds it already) or got no room (listed in ``missing``: save those with
    :meth:`Store.save` instead).
    Nothing is visible to readers until :meth:`commit`. End a reservation with exactly
    one of :meth:`commit` or :meth:`abort`; used as a context manager, leaving the block
    commits and an exception aborts. Not thread-safe: one owner fills and ends it.
    Locks: the index's lock (``Index.lock``) guards what a commit or abort changes; they
    take it themselves (through the mover, and in ``_drop_raced``), so end a reservation
    without holding it.
    """

    def __init__(self, mover: "Mover", keys: list[BlockKey], present: list[bool],
                 fresh: list[int], sizes: list[int], plan: "PutPlan | None", tier_res: Any,
                 published: Callable[[list[BlockKey]], None] | None = None) -> None:
        self._mover, self._keys, self.present = mover, keys, present
        self._published = published
        self._fresh, self._sizes, self._plan, self._tier_res = fresh, sizes, plan, tier_res
        self.views: list[np.ndarray | None] = [None] * len(keys)
        if tier_res is not None:
            for c, view in zip(plan.chosen, tier_res.views):
                self.views[fresh[c]] = view
        self.missing = [i for i, (p, v) in enumerate(zip(present, self.views)) if not p and v is None]
        self.stored: list[bool] | None = None
        self._done = False

    def commit(self, checksums: Sequence[int | None] | None = None) -> list[bool]:
        """Publish the filled views. Per key: True when the Store holds it now.
        ``checksums`` (one per key, the writer's XXH3-64 of what it wrote): a view whose
        bytes differ is not published (False). Needs a first tier that checks them
        (the DRAM tier does); others ignore them."""
        self._finish()
        mover, plan = self._mover, self._plan
        stored = list(self.present)
        if plan is None:
            self.stored = stored
            return stored
        fkeys = [self._keys[j] for j in self._fresh]
        if self._tier_res is None:
            ok = [False] * len(plan.chosen)
        elif checksums is not None:
            ok = self._tier_res.commit([checksums[self._fresh[c]] for c in plan.chosen])
        else:
            ok = self._tier_res.commit()
        raced = self._drop_raced(fkeys, ok)
        mover.unstage(0, fkeys, plan, ok)
        if raced:   # held already: stored, not a block the first tier had no room for
            for c in raced:
                plan.result[plan.chosen[c]] = True
            keep = [c for c in range(len(ok)) if c not in raced]
            plan.chosen, ok = [plan.chosen[c] for c in keep], [ok[c] for c in keep]
        mover.index_put(0, fkeys, self._sizes, plan, ok)
        for j, good in zip(self._fresh, plan.result):
            stored[j] = good
        if self._published is not None:
            self._published([k for k, good in zip(fkeys, plan.result) if good])
        self.stored = stored
        return stored

    def _drop_raced(self, fkeys: list[BlockKey], ok: list[bool]) -> set[int]:
        """Same key, same content: a key the Store came to hold while the reservation
        was open (a save of it, stored in a lower tier because the reservation held this
        tier's room) keeps the bytes it was saved with. Its just-committed first-tier
        copy is deleted unpublished (``ok`` set False); returns those indices of
        ``plan.chosen``."""
        mover, chosen = self._mover, self._plan.chosen
        index = mover.index
        with index.lock:
            raced = {c for c, good in enumerate(ok)
                     if good and index.mask(fkeys[chosen[c]]) and not index.holds(fkeys[chosen[c]], 0)}
            if raced:   # never indexed in the first tier, so no reader can hold it
                mover.levels[0].tier.delete([fkeys[chosen[c]] for c in raced])
        for c in raced:
            ok[c] = False
        return raced

    def abort(self) -> None:
        """Free the room; nothing is stored."""
        self._finish()
        if self._plan is None:
            return
        if self._tier_res is not None:
            self._tier_res.abort()
        fkeys = [self._keys[j] for j in self._fresh]
        self._mover.unstage(0, fkeys, self._plan, [False] * len(self._plan.chosen))
        self._mover.settle(0, self._plan)

    def _finish(self) -> None:
        if self._done:
            raise InvalidArgumentError("reservation already ended")
        self._done = True
        self.views = [None] * len(self._keys)

    def __enter__(self) -> "Reservation":
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if self._done:
            return
        self.abort() if exc_type is not None else self.commit()


def reserve(mover: "Mover", keys: list[BlockKey], sizes: list[int], held: list[bool | None], evict: bool,
            published: Callable[[list[BlockKey]], None] | None = None) -> Reservation:
    """See :meth:`Store.reserve`: room in the first level for the keys not ``held``
    (``True``: held already, the facade checked the arguments and touched those;
    ``None``: refused, held or being saved with another size: no room, in ``missing``);
    ``published`` gets the keys a commit stored."""
    lvl = mover.levels[0]
    present = [h is True for h in held]
    fresh = [j for j, h in enumerate(held) if h is False]
    if not fresh or not lvl.tier.capabilities.reserve:
        return Reservation(mover, keys, present, fresh, [], None, None, published)
    fkeys, fsizes = [keys[j] for j in fresh], [sizes[j] for j in fresh]
    plan = mover.plan_put(0, fkeys, fsizes, evict=evict)
    mover.evict(0, plan.victims)
    tier_res = None
    if plan.chosen:
        tier_res = mover.tier_io(lvl, lvl.tier.reserve, [fkeys[c] for c in plan.chosen],
                                 [fsizes[c] for c in plan.chosen])
        if tier_res is None:
            mover.unstage(0, fkeys, plan, [False] * len(plan.chosen))
            plan.chosen = []
    if not plan.chosen:
        mover.settle(0, plan)   # nothing in flight for a tenant (kvstore.store.tenants)
    return Reservation(mover, keys, present, fresh, fsizes, plan, tier_res, published)


__all__ = ["Reservation", "reserve"]
