"""The Store's data path: what a save, a load, a prefetch, a write-through and a flush do
once the facade has checked their arguments (:class:`DataPath`).

Same key, same content: a key cached in any tier is only touched, never rewritten, so a
save can never change what a later load returns. Loads fail closed: a block counts as
loaded only where its tier verified the bytes in the caller's buffer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

from kvstore.block import checksum
from kvstore.buffers import host_view, nbytes_of
from kvstore.keys import BlockKey
from kvstore.policies.placement import Placement, WriteMode
from kvstore.store.hints import StoreHints
from kvstore.store.index import Index
from kvstore.store.mover import Level, Mover
from kvstore.store.recovery import Discovery

log = logging.getLogger("kvstore.store")


@dataclass(frozen=True)
class FlushReport:
    """What a flush did: of ``blocks`` held only in volatile tiers, ``kept`` are now in
    ``tier`` (the first persistent one, of kind ``kind``; ``None``: there is none) and
    the rest were dropped: ``no_room`` (the tier had no room for them, or later blocks
    of the same flush took it) or ``failed`` (unreadable, failing their checksum, or a
    tier error). Blocks deleted while the flush ran are in neither."""

    tier: str | None
    kind: str | None
    blocks: int
    kept: int
    no_room: int
    failed: int

    @property
    def dropped(self) -> int:
        return self.no_room + self.failed

    def describe(self) -> str:
        """One log line."""
        if self.tier is None:
            return f"flush: no persistent tier; {self.blocks} blocks held only in volatile tiers are not kept"
        line = (f"flush: {self.kept} of {self.blocks} blocks held only in volatile tiers written to "
                f"{self.tier} ({self.kind}); {self.dropped} dropped")
        return line + (f" ({self.no_room} no room, {self.failed} failed)" if self.dropped else "")


class DataPath:
    """Saves, loads and copies between tiers for one Store, over its ``index``, ``levels``
    (fastest first), ``mover`` (admission, eviction, writes into a level), ``hints``,
    ``placement`` (write mode, promote-on-hit, selective threshold), ``discovery`` (blocks
    in shared tiers) and ``ops`` (the Store's op counters, ``stats()``'s top level).

    Thread-safety: every public method may run on any thread (the Store runs them on its
    worker pool). Lock rule: the index's lock (``Index.lock``, ``lock`` here) guards the
    index, ``ops``, the levels' policies and counters and the hint table; each method
    takes it itself, briefly and never across tier I/O, so call them without it
    (``_selective_candidates`` alone runs with the caller holding it).
    """

    def __init__(self, index: Index, levels: list[Level], mover: Mover, hints: StoreHints,
                 placement: Placement, discovery: Discovery, ops: dict[str, int]) -> None:
        self.index = index
        self.lock = index.lock
        self.levels = levels
        self.mover = mover
        self.hints = hints
        self.placement = placement
        self.discovery = discovery
        self.ops = ops

    # -- saves ----------------------------------------------------------------------------

    def held(self, keys: list[BlockKey], sizes: list[int]) -> list[bool | None]:
        """Count a save of ``keys`` (of ``sizes`` bytes) and, per key, whether any level
        holds it already (``True``), not (``False``), or the save is refused (``None``):
        the key is held with another size (a key's size is fixed by its first save:
        :meth:`Index.fits`; counted in ``resave_size_mismatch``). Same key,
        same content: a held key is not written again, only touched in every level that
        holds it. Every save path (``save``, a reservation) starts here; the puts that
        follow check the size again, atomically with their quota check and room."""
        index, mover = self.index, self.mover
        out: list[bool | None] = []
        with self.lock:
            self.ops["saves"] += len(keys)
            where = index.where
            for key, nbytes in zip(keys, sizes):
                mask = where.get(key, 0)
                # (a key no level holds: its puts check the size, with any claim in flight)
                if mask and not index.fits(key, nbytes):
                    mover.refuse_size(key)
                    out.append(None)
                    continue
                out.append(bool(mask))
                if mask:
                    for i in range(len(self.levels)):
                        if mask >> i & 1:
                            mover.touched(key, i)
        return out

    def save(self, keys: list[BlockKey], srcs: list[Any], sums: list[int] | None = None) -> list[bool]:
        """Store what no level holds yet (see :meth:`held`); per key, whether it is stored."""
        held = self.held(keys, [nbytes_of(src) for src in srcs])
        fresh = [j for j, h in enumerate(held) if h is False]
        if len(fresh) < len(keys):
            stored = [bool(h) for h in held]
            if fresh:
                for j, ok in zip(fresh, self._save_new([keys[j] for j in fresh], [srcs[j] for j in fresh],
                                                       None if sums is None else [sums[j] for j in fresh])):
                    stored[j] = ok
            return stored
        return self._save_new(keys, srcs, sums)

    def save_checked(self, keys: list[BlockKey], srcs: list[Any], sums: list[int | None]) -> list[bool]:
        """:meth:`save` of the sources that match their writer's checksum (``sums``;
        ``None``: none given, hashed as it is stored); the others are not stored
        (``False``, counted in ``refused_checksum``)."""
        # Checked here, and handed down: a tier that takes checksums (DRAM) checks the
        # bytes again as they landed in it, so a source changed by another writer (a
        # shared staging region) between this check and the tier's copy is refused.
        good = [j for j, (src, csum) in enumerate(zip(srcs, sums)) if csum is None or checksum(host_view(src)) == csum]
        if len(good) == len(keys):
            return self.save(keys, srcs, sums)
        with self.lock:
            self.ops["refused_checksum"] += len(keys) - len(good)
        log.warning("save: %d of %d blocks did not match their writer's checksum; not stored",
                    len(keys) - len(good), len(keys))
        out = [False] * len(keys)
        for j, ok in zip(good, self.save([keys[j] for j in good], [srcs[j] for j in good],
                                         [sums[j] for j in good]) if good else []):
            out[j] = ok
        return out

    def _save_new(self, keys: list[BlockKey], srcs: list[Any], sums: list[int] | None = None) -> list[bool]:
        refused: set[BlockKey] = set()   # a racing save of the key with another size came first

        def put(i: int, keys: list[BlockKey], srcs: list[Any], sums: list[int] | None) -> list[bool]:
            return self.mover.put(i, keys, srcs, sums, refused=refused)

        stored = put(0, keys, srcs, sums)
        if self.placement.write is WriteMode.THROUGH:
            # a discard block is not kept past the tier that took it
            through = [j for j, k in enumerate(keys) if not (stored[j] and self.hints.is_discard(k))
                       and k not in refused]
            for i in range(1, len(self.levels)):
                below = put(i, [keys[j] for j in through], [srcs[j] for j in through],
                            None if sums is None else [sums[j] for j in through])
                for j, ok in zip(through, below):
                    stored[j] = stored[j] or ok
        elif len(self.levels) > 1:
            # A block the first tier refused still goes to the next one that admits it.
            missed = [j for j, ok in enumerate(stored) if not ok and keys[j] not in refused]
            for i in range(1, len(self.levels)):
                if not missed:
                    break
                got = put(i, [keys[j] for j in missed], [srcs[j] for j in missed],
                          None if sums is None else [sums[j] for j in missed])
                for j, ok in zip(missed, got):
                    stored[j] = ok
                missed = [j for j, ok in zip(missed, got) if not ok and keys[j] not in refused]
        if self.hints.records and not all(stored):
            with self.lock:    # hints of blocks no tier took go with them
                where = self.index.where
                for key, ok in zip(keys, stored):
                    if not ok and not where.get(key):
                        self.hints.forget(key)
        return stored

    def write_below(self, keys: list[BlockKey]) -> None:
        """Write-through for blocks committed into the first tier by a reservation: one
        batch per lower tier, straight from the first tier's slots (held meanwhile,
        verified: a corrupt one is dropped, never written down), each with the checksum
        it was stored with."""
        first = self.levels[0].tier
        with first.views(keys) as views:
            held = [(k, v) for k, v in zip(keys, views) if v is not None]
            sums = first.checksums([k for k, _ in held])
            for i in range(1, len(self.levels)):
                self.mover.put(i, [k for k, _ in held], [v for _, v in held], sums)

    # -- loads ----------------------------------------------------------------------------

    def load(self, keys: list[BlockKey], dsts: list[Any]) -> list[bool]:
        """Copy blocks into the caller's ``dsts``, fastest level first; per key, whether
        its verified bytes are there. Hits drop a lease and may be promoted (or written
        through, selective mode); an indexed block its tier cannot read is dropped there
        and tried in the levels that hold it now."""
        index, lock, levels, mover = self.index, self.lock, self.levels, self.mover
        where, sizes, hints = index.where, index.sizes, self.hints
        n = len(keys)
        done = [False] * n
        source = [-1] * n
        with lock:
            self.ops["loads"] += n
            masks = [where.get(k, 0) for k in keys]
        unknown = [j for j in range(n) if not masks[j]] if self.discovery.shared else []
        if unknown:
            self.discovery.find([keys[j] for j in unknown])
            with lock:
                for j in unknown:
                    # a block found with another size than the caller's buffer is a miss
                    if sizes.get(keys[j]) == nbytes_of(dsts[j]):
                        masks[j] = where.get(keys[j], 0)
        for i, lvl in enumerate(levels):
            todo = [j for j in range(n) if not done[j] and masks[j] >> i & 1]
            if not todo:
                continue
            ok = mover.tier_io(lvl, lvl.tier.read_into, [keys[j] for j in todo], [dsts[j] for j in todo])
            if ok is None:
                # The tier failed (endpoint down, I/O error): misses now, but its blocks
                # stay indexed so they load again once the tier is back.
                continue
            bit = 1 << i
            hits = nbytes = 0
            with lock:
                for j, hit in zip(todo, ok):
                    key = keys[j]
                    if hit:
                        done[j], source[j] = True, i
                        hits += 1
                        nbytes += sizes.get(key, 0)
                        if where.get(key, 0) & bit:
                            mover.touched(key, i)
                    else:
                        if where.get(key, 0) & bit:
                            # Indexed but unreadable (corrupt, lost): drop it here.
                            mover.drop(key, i)
                        # Try the tiers that hold it now: a block evicted from this tier
                        # while we read it has been spilled into the next one.
                        masks[j] = where.get(key, 0)
                lvl.counters["hits"] += hits
                lvl.counters["bytes_read"] += nbytes
                if hints.records:
                    hints.hits([keys[j] for j, hit in zip(todo, ok) if hit])
        with lock:
            if index.leases:
                for j, key in enumerate(keys):
                    if done[j]:
                        index.drop_lease(key)
            levels[0].counters["misses"] += n - sum(done)
            promote = [j for j in range(n) if source[j] > 0] if self.placement.promote_on_hit else []
            selective = self._selective_candidates(keys, done, source)
        if promote:
            got = mover.put(0, [keys[j] for j in promote], [dsts[j] for j in promote])
            with lock:
                levels[0].counters["promotions"] += sum(got)
        for i, idx in selective:
            mover.put(i, [keys[j] for j in idx], [dsts[j] for j in idx])
        return done

    def _selective_candidates(self, keys: list[BlockKey], done: list[bool],
                              source: list[int]) -> list[tuple[int, list[int]]]:
        """Selective write-through: a block hit ``selective_threshold`` times in the first
        tier is written through to the tiers below (runs with the caller holding the lock)."""
        if self.placement.write is not WriteMode.SELECTIVE or len(self.levels) < 2:
            return []
        hot = []
        hit_counts = self.index.hit_counts
        for j, key in enumerate(keys):
            if done[j] and source[j] == 0 and not self.hints.is_discard(key):
                count = hit_counts.get(key, 0) + 1
                hit_counts[key] = count
                if count == self.placement.selective_threshold:
                    hot.append(j)
        return [(i, hot) for i in range(1, len(self.levels))] if hot else []

    def delete(self, keys: Sequence[BlockKey], *, cleared: bool = False) -> int:
        """Remove ``keys`` from the index and every level; returns how many were held.
        KV events: one ``cleared`` (``cleared``: the Store empties) or the removals."""
        mover, levels = self.mover, self.levels
        where = self.index.where
        events = mover.events
        with self.lock:
            tenants = mover.tenants
            plan = []
            for key in keys:
                mask = where.pop(key, 0)
                if mask:
                    plan.append((key, mask))
                    for i, lvl in enumerate(levels):
                        if mask >> i & 1:
                            lvl.policy.on_remove(key)
                            lvl.doomed.add(key)   # no put writes it here until it is deleted
                            if tenants is not None:
                                tenants.remove(key, i)
                mover.forget(key)
            if events is not None and cleared:
                events.cleared()
            elif events is not None:
                events.removed_masks(plan)
        for i, lvl in enumerate(levels):
            doomed = [k for k, m in plan if m >> i & 1]
            if doomed:
                try:
                    mover.tier_io(lvl, lvl.tier.delete, doomed)
                finally:
                    with self.lock:
                        lvl.doomed.difference_update(doomed)
        return len(plan)

    # -- copies between levels ------------------------------------------------------------

    def prefetch(self, keys: list[BlockKey], target: int) -> int:
        """Copy blocks held only in slower levels up into level ``target``; returns how
        many are there now."""
        with self.lock:
            self.ops["prefetches"] += len(keys)
            where = self.index.where
            plan = [(k, where.get(k, 0)) for k in keys]
        count, moves = 0, []
        for key, mask in plan:
            if mask >> target & 1:
                count += 1
                continue
            src = next((i for i in range(target + 1, len(self.levels)) if mask >> i & 1), None)
            if src is not None:
                moves.append((key, src))
        return count + self._copy_into(moves, target)

    def flush(self) -> FlushReport:
        """Write blocks held only in volatile levels down into the first persistent one
        (see :meth:`kvstore.store.Store.flush`). Not an offer: that level's admission is
        not asked (a ``min_hits: 2`` NVMe tier would refuse every block); its capacity
        and the blocks' checksums are kept to as by any write."""
        levels = self.levels
        target = next((i for i, lvl in enumerate(levels) if lvl.tier.capabilities.persistent), None)
        volatile = 0
        for i, lvl in enumerate(levels):
            if not lvl.tier.capabilities.persistent:
                volatile |= 1 << i
        with self.lock:
            todo = [(k, m) for k, m in self.index.where.items() if not m & ~volatile]
        if target is None:
            return FlushReport(None, None, len(todo), 0, 0, 0)
        failed: set[BlockKey] = set()
        self._copy_into([(key, next(i for i in range(len(levels)) if mask >> i & 1)) for key, mask in todo],
                        target, admit=False, failed=failed)
        # Counted at the end: a later batch of the flush may have evicted an earlier one.
        kept = no_room = lost = 0
        with self.lock:
            where = self.index.where
            for key, _ in todo:
                mask = where.get(key, 0)
                if mask >> target & 1:
                    kept += 1
                elif key in failed:
                    lost += 1
                elif mask:
                    no_room += 1
        lvl = levels[target]
        return FlushReport(lvl.name, lvl.kind, len(todo), kept, no_room, lost)

    def _copy_into(self, moves: list[tuple[BlockKey, int]], target: int, *, admit: bool = True,
                   failed: set[BlockKey] | None = None) -> int:
        """Copy each ``(key, source level)`` into level ``target``, one batch per source
        level; returns how many were written (``admit``, ``failed``: see
        :meth:`kvstore.store.copies.Copies.between`)."""
        by_src: dict[int, list[BlockKey]] = {}
        for key, src in moves:
            by_src.setdefault(src, []).append(key)
        return sum(sum(self.mover.copies.between(keys, src, target, admit=admit, failed=failed))
                   for src, keys in by_src.items())


__all__ = ["DataPath", "FlushReport"]
