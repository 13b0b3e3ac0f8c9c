"""How the Store's index learns of blocks it did not write in this process: recovery
from persistent tiers at start-up (:func:`recover`), and discovery of blocks other nodes
wrote into shared tiers (:class:`Discovery`).

Both write the Store's index (:class:`kvstore.store.index.Index`) and its levels'
policies, so they follow the index's lock rule (see each one's docstring).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from kvstore.config.base import format_size
from kvstore.keys import BlockKey
from kvstore.store.index import Index
from kvstore.store.mover import Level, Mover, parent_of

if TYPE_CHECKING:
    from kvstore.store.hints import StoreHints

log = logging.getLogger("kvstore.store")


def recover(index: Index, levels: list[Level], hints: "StoreHints", events: Any) -> None:
    """Rebuild the index from persistent tiers, oldest access first, so usage and
    eviction order continue where the last process left off; each recovered block is
    reported stored to ``events`` (the KV event publisher, or ``None``). Each persistent
    level's count goes to ``Level.recovered`` and into an INFO line. Runs while the
    Store is built, before any other thread can see it: it takes no lock."""
    where, sizes = index.where, index.sizes
    for i, lvl in enumerate(levels):
        if not lvl.tier.capabilities.persistent:
            continue
        started, count, nbytes = time.monotonic(), 0, 0
        strays = []
        for block in lvl.tier.recover():
            if not index.fits(block.key, block.nbytes):
                # a faster persistent tier holds the key with another size (kept before
                # sizes were fixed): one size per key, so this copy goes
                strays.append(block.key)
                continue
            if block.hint is not None:
                hints.restore(block.key, block.hint)
            where[block.key] = where.get(block.key, 0) | 1 << i
            sizes[block.key] = block.nbytes
            lvl.policy.on_insert(block.key, block.nbytes,
                                 parent_of(block.key) if lvl.policy.uses_parent else None)
            count += 1
            nbytes += block.nbytes
        if strays:
            log.warning("tier %s (%s): %d blocks held with another size than a faster tier's copy; deleted",
                        lvl.name, lvl.kind, len(strays))
            lvl.tier.delete(strays)
        lvl.recovered = count
        log.info("tier %s (%s): %d blocks (%s) recovered in %.2f s", lvl.name, lvl.kind, count, format_size(nbytes),
                 time.monotonic() - started)
    if events is not None:
        for i in range(len(levels)):
            events.stored(i, [k for k, mask in where.items() if mask >> i & 1])


class Discovery:
    """Blocks that other nodes wrote into the Store's shared tiers (those whose
    capabilities say ``shared``), indexed when a lookup or load misses them.

    State: ``shared`` (the indices of the shared levels, fastest first; empty: no
    discovery) and what it writes: the Store's ``index``, the levels' policies, the
    Store's op counters (``ops["shared_found"]``) and KV ``events``.

    Lock rule: :meth:`find` asks the tiers without the lock and takes the index's lock
    (``Index.lock``) to index what they found; call it without holding the lock.
    """

    def __init__(self, index: Index, levels: list[Level], mover: Mover, ops: dict[str, int], events: Any) -> None:
        self.index = index
        self.levels = levels
        self.mover = mover
        self.ops = ops
        self.events = events
        self.shared = [i for i, lvl in enumerate(levels) if lvl.tier.capabilities.shared]

    def find(self, keys: list[BlockKey]) -> None:
        """Index the blocks of ``keys`` that other nodes wrote into shared tiers. Keys (a
        prompt's missing tail, in order) are asked of each shared tier in turn, fastest
        first (:meth:`Tier.find`); those one tier does not find go to the next. A block
        found is indexed at that level (its tier has budgeted it) and reported stored.
        A tier that fails is counted and its keys stay missing."""
        index = self.index
        where, sizes = index.where, index.sizes
        pending = keys
        for i in self.shared:
            if not pending:
                break
            lvl = self.levels[i]
            found = self.mover.tier_io(lvl, lvl.tier.find, pending)
            if found is None:
                continue
            fresh: list[BlockKey] = []
            with index.lock:
                for key, n in zip(pending, found):
                    if n is None:
                        continue
                    mask = where.get(key, 0)
                    if mask >> i & 1 or not index.fits(key, n) or key in lvl.doomed:
                        continue   # indexed meanwhile, or another size than this node's copy
                    where[key] = mask | 1 << i
                    sizes[key] = n
                    lvl.policy.on_insert(key, n, parent_of(key) if lvl.policy.uses_parent else None)
                    if self.mover.tenants is not None:   # counted as every indexed block is
                        self.mover.tenants.add(key, i, n)
                    fresh.append(key)
                self.ops["shared_found"] += len(fresh)
                if self.events is not None and fresh:
                    self.events.stored(i, fresh)
            pending = [k for k, n in zip(pending, found) if n is None]


__all__ = ["Discovery", "recover"]
