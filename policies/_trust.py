"""One tier's trust in retention hints (:class:`HintTrust`): the evidence from the blocks
at its eviction end on whether hints are right, and the age up to which it lets a hint
protect. The retention layer (``policies/retention.py``, which describes the behaviour)
reports to it and reads ``protect_s``; it is re-exported there."""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Hashable, Mapping

# HintTrust's constants (see its docstring). W: the blocks the tier holds.
_WINDOW = 2            # a watched block counts as reused if reused within 2W evictions
_MEMORY = 4            # reuse rates: decayed counts over the last 4W blocks watched
_MIN_MEMORY = 64       # ... at least 64
_MIN_SAMPLES = 16      # per class (decayed) before protect_s moves at all
_Z_GROW = 3.0          # protect_s grows only while hinted beats unhinted by 3 standard errors
_STEP = 0.01           # ... by 1% per event (and shrinks by as much)
_MAX_WATCH = 1 << 16   # a larger tier watches every k-th block, so at most ~64K are watched


class HintTrust:
    """One tier's evidence on whether live hints are right, and the age up to which it
    lets a hint protect: ``protect_s`` (``inf``, the start: for as long as hints live;
    ``0.0``: not at all).

    The walk reports the blocks at the eviction end (:meth:`passed`, :meth:`distrusted`,
    :meth:`evicted`), the layer their reuse (:meth:`reused`). A watched block
    counts once as seen when first watched, and once as reused if reused within ``2W``
    evictions of that (``W``: the blocks the tier holds; a tier of more than 32K blocks
    watches every k-th candidate, so at most ~64K are watched). The reuse rate of each
    class (hinted, unhinted) is decayed counts over the last ``4W`` blocks watched.

    On each event, with at least 16 blocks of each class seen, the rates are compared
    as Beta posteriors (a uniform prior on each class's reuse rate): ``d`` is the
    difference of the observed rates (hinted minus unhinted), ``se`` the standard
    deviation of the difference of the posteriors.

    - ``d > 3 se`` (the lower confidence bound of ``d`` above zero: hints are clearly
      worth more than the blocks they displace): ``protect_s`` grows 1% (from below the
      hint ages at the eviction end, where it protects nothing, straight to half of
      them), and goes to ``inf`` once it is four times the hint age at the eviction end;
    - ``d < 0`` (hinted blocks are reused no more often than unhinted): it shrinks 1%,
      starting from the oldest hint age the walk protected;
    - in between it stays;
    - the first comparison is a verdict: hints that are not ahead there (``d < 0``)
      drop straight to ``protect_s = 0`` (plain policy order) rather than 1% at a time.

    So before evidence hints protect in full (a tier with a handful of hinted blocks
    keeps them), the early phase of a wrong client costs only the blocks watched
    until the first verdict (16 of each class), protection is earned back only on
    strong evidence and lost on mere doubt: a short lucky streak of a wrong client moves the decayed posteriors
    too little to clear three standard errors for the ~200 events it takes to climb
    from half the eviction-end age back to ``inf``.

    Pure bookkeeping, O(1) amortised per event. Not thread-safe (the Store's lock).
    """

    def __init__(self, parks: bool = False) -> None:
        self.protect_s = math.inf
        self._judged = False         # the rates were compared once (the first verdict)
        self._watch: OrderedDict[Hashable, list] = OrderedDict()  # key -> [hinted, stamp, reused]
        self._evictions = 0
        self._memory = 1.0 - 1.0 / _MIN_MEMORY
        self._sample = 1             # watch every k-th candidate
        self._ticks = 0
        self._seen = [0.0, 0.0]      # decayed blocks watched: [unhinted, hinted]
        self._reused = [0.0, 0.0]    # ... and reused within their window
        self.oldest = 0.0            # oldest hint age the current walk protected
        self._tail_age = 0.0         # hint age of the last hinted block at the eviction end
        self._floor = 0.0
        # hinted keys whose watch window ended, for a layer that parks them (see unwatched)
        self._lapsed: list[Hashable] | None = [] if parks else None

    def watch(self, key: Hashable, hinted: bool) -> None:
        if key in self._watch:
            return
        self._ticks += 1
        if self._ticks % self._sample:
            return
        self._watch[key] = [hinted, self._evictions, False]
        seen, got, memory = self._seen, self._reused, self._memory
        for c in (0, 1):
            seen[c] *= memory
            got[c] *= memory
        seen[hinted] += 1
        self._adjust()

    def passed(self, key: Hashable, age: float) -> None:
        """The walk passed over ``key``, kept by a hint ``age`` seconds old."""
        self._tail_age = age
        if key not in self._watch:
            self.watch(key, True)

    def distrusted(self, age: float) -> None:
        """The walk offers a block whose hint (``age`` seconds old) it no longer trusts."""
        self._tail_age = age
        self._floor = age / 2

    def reused(self, key: Hashable) -> None:
        entry = self._watch.get(key)
        if entry is not None and not entry[2]:
            entry[2] = True
            self._reused[entry[0]] += 1
            self._adjust()

    def forget(self, key: Hashable) -> None:
        """``key`` left without being evicted (deleted): no evidence either way."""
        self._watch.pop(key, None)

    def evicted(self, key: Hashable, hinted: bool, window: int) -> None:
        """The walk's victim ``key`` left the tier, which holds ``window`` blocks now."""
        self._evictions += 1
        self._sample = _WINDOW * window // _MAX_WATCH + 1
        self._memory = 1.0 - 1.0 / max(_MEMORY * window // self._sample, _MIN_MEMORY)
        self.watch(key, hinted)
        watch, limit = self._watch, self._evictions - max(_WINDOW * window, 1)
        while watch:
            entry = watch[next(iter(watch))]
            if entry[1] > limit:
                break
            key, _ = watch.popitem(last=False)
            if entry[0] and self._lapsed is not None:
                self._lapsed.append(key)

    def unwatched(self, held: Mapping[Hashable, int]) -> list[Hashable]:
        """The keys of ``held`` (parked: key -> place) whose watch window ended since the
        last call, in their order: a walk that stepped over them would watch them again."""
        lapsed, self._lapsed = self._lapsed or [], []
        watch = self._watch
        keys = [k for k in lapsed if k in held and k not in watch]
        keys.sort(key=held.__getitem__)
        return keys

    def held(self, age: float) -> None:
        """The walk's parked blocks end with one kept by a hint ``age`` seconds old."""
        self._tail_age = age

    def _adjust(self) -> None:
        seen, got = self._seen, self._reused
        if seen[0] < _MIN_SAMPLES or seen[1] < _MIN_SAMPLES:
            return
        # the observed rates, and the spread of their Beta(1 + reused, 1 + not reused)
        # posteriors (never zero, so that no streak of a few is certain)
        lead = got[1] / seen[1] - got[0] / seen[0]
        hinted, unhinted = (got[1] + 1) / (seen[1] + 2), (got[0] + 1) / (seen[0] + 2)
        spread = math.sqrt(hinted * (1 - hinted) / (seen[1] + 3) + unhinted * (1 - unhinted) / (seen[0] + 3))
        if not self._judged:
            self._judged = True
            if lead < 0:           # unproven hints that fail their first test protect nothing
                self.protect_s = 0.0
                return
        if lead > _Z_GROW * spread:
            if math.isfinite(self.protect_s):
                # from below the ages at the eviction end (where it protects nothing),
                # straight back to half of them
                grown = max(self.protect_s * (1 + _STEP), self._floor)
                self.protect_s = math.inf if grown > 4 * self._tail_age else grown
        elif lead < 0:
            base = min(self.protect_s, self.oldest) if self.oldest > 0 else self.protect_s
            if math.isfinite(base):
                shrunk = base * (1 - _STEP)
                self.protect_s = shrunk if shrunk >= 1e-3 else 0.0

    def hinted_rate(self) -> float:
        """The posterior mean of the hinted blocks' reuse rate (uniform prior: 0.5
        before any evidence), which ranks hinted blocks by next use."""
        return (self._reused[1] + 1.0) / (self._seen[1] + 2.0)

    def stats(self) -> dict[str, Any]:
        seen, got = self._seen, self._reused
        return {"protect_s": None if math.isinf(self.protect_s) else round(self.protect_s, 3),
                "hinted_reuse": round(got[1] / seen[1], 4) if seen[1] else None,
                "unhinted_reuse": round(got[0] / seen[0], 4) if seen[0] else None,
                "watched": len(self._watch)}


__all__ = ["HintTrust"]
