"""Replaying a prefix-hash trace through a real Store, and Belady's optimum beside it.

Shared by ``kvstore replay`` (what-if runs of a user's own trace against their config)
and ``benchmarks/policy_replay.py`` (every policy on the production trace).

A trace request is a list of ``hash_ids``; :func:`to_keys` turns it into chained
:class:`~kvstore.keys.BlockKey`\\ s of ``Namespace(model="trace", dtype="none",
chunk_tokens=1)``, one token per id, so equal ids give equal keys and the trace's prefix
tree is kept (an id always has the same parent id). Replaying a request does what an
engine does: ``lookup`` the prompt, ``load`` the cached prefix, ``save`` the rest. A
block counts as a hit only while every block before it hit (a prefix hit).

Payloads are tiny (one 4 KiB slot per block, the DRAM tier's slot size): the Store's
policies see blocks, not bytes, so a tier of ``capacity`` bytes over blocks of
``block_bytes`` replays as a DRAM tier of ``capacity // block_bytes`` slots, and bytes
written are scaled back to real ones.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

from kvstore.keys import BlockKey, Namespace

PAYLOAD_BYTES = 4096
NEVER = float("inf")

Trace = list[list[BlockKey]]


def to_keys(requests: Sequence[Sequence[int]]) -> Trace:
    """Chained BlockKeys, one per id. Equal digests share one object, so dict lookups
    take the identity fast path instead of ``BlockKey.__eq__``. Ids outside a token's
    range (recorded traces hold 63-bit ids) are first renumbered densely, in order of
    first appearance: equal ids stay equal, distinct ones distinct."""
    namespace = Namespace(model="trace", dtype="none", chunk_tokens=1)
    if any(not 0 <= i < 1 << 32 for ids in requests for i in ids):
        dense: dict[int, int] = {}
        requests = [[dense.setdefault(i, len(dense)) for i in ids] for ids in requests]
    interned: dict[bytes, BlockKey] = {}
    return [[interned.setdefault(key.digest, key) for key in namespace.chunk_keys(ids)]
            for ids in requests]


@dataclass
class ReplayResult:
    """What one replay measured. ``tier_hits[i]``: blocks loaded from tier ``i``;
    ``tier_blocks_written[i]``: blocks written into it (saves, spills, promotions)."""

    refs: int = 0
    hits: int = 0
    tier_names: list[str] = field(default_factory=list)
    tier_hits: list[int] = field(default_factory=list)
    tier_blocks_written: list[int] = field(default_factory=list)
    tier_hint_trust: list[dict] = field(default_factory=list)   # each tier's at the end

    @property
    def hit_rate(self) -> float:
        return self.hits / self.refs if self.refs else 0.0

    def tier_hit_rates(self) -> list[float]:
        return [h / self.refs if self.refs else 0.0 for h in self.tier_hits]


def replay_store(config: Any, trace: Trace, saves: Sequence[bool] | None = None,
                 on_request: Callable[[], None] | None = None, *, hints: Sequence[Any] | None = None,
                 times_s: Sequence[float] | None = None,
                 hint_blocks: Sequence[int] | None = None) -> ReplayResult:
    """Replay ``trace`` through a real :class:`~kvstore.store.Store` built from
    ``config`` (a dict or StoreConfig whose blocks are :data:`PAYLOAD_BYTES` each).
    ``saves[i]`` marks request ``i`` as a bare save (stored, not looked up, not counted).
    ``hints[i]`` (a :class:`kvstore.Hint` or ``None``) goes with request ``i``'s lookup
    and save, as a client would send it, for its first ``hint_blocks[i]`` blocks (default:
    all of them; the rest are looked up and saved unhinted); ``times_s[i]`` is its
    arrival time, which the Store's clock (lease and hint expiry) follows.
    ``on_request`` is called after each request (a progress bar)."""
    import numpy as np

    from kvstore.config import load_config
    from kvstore.store import Store

    longest = max(map(len, trace), default=1)
    srcs = [np.zeros(PAYLOAD_BYTES, np.uint8)] * longest
    dsts = [np.empty(PAYLOAD_BYTES, np.uint8) for _ in range(longest)]
    result = ReplayResult()
    now = [0.0]
    with Store(load_config(config), clock=lambda: now[0]) as store:
        for index, keys in enumerate(trace):
            hint = hints[index] if hints is not None else None
            scope = len(keys) if hint is None or hint_blocks is None else hint_blocks[index]
            if times_s is not None:
                now[0] = times_s[index]
            if saves is not None and saves[index]:
                _save(store, keys, 0, scope, srcs, hint)
            else:
                result.refs += len(keys)
                hit = store.lookup(keys, hint=hint if scope >= len(keys) else None)
                if hint is not None and 0 < scope < len(keys) and hit:
                    store.hint(keys[:min(hit, scope)], hint)
                result.hits += hit
                if hit:
                    store.load(keys[:hit], dsts[:hit]).result()
                _save(store, keys, hit, scope, srcs, hint)
            if on_request is not None:
                on_request()
        tiers = store.stats()["tiers"]
    result.tier_hint_trust = [t["hint_trust"] for t in tiers]
    result.tier_names = [t["name"] for t in tiers]
    result.tier_hits = [t["hits"] for t in tiers]
    result.tier_blocks_written = [t["bytes_written"] // PAYLOAD_BYTES for t in tiers]
    return result


def _save(store: Any, keys: list[BlockKey], start: int, scope: int, srcs: list[Any], hint: Any) -> None:
    """Save ``keys[start:]``: those before ``scope`` with ``hint``, the rest without."""
    cut = max(start, min(scope, len(keys)))
    for lo, hi, with_hint in ((start, cut, hint), (cut, len(keys), None)):
        if hi > lo:
            store.save(keys[lo:hi], srcs[:hi - lo], hint=with_hint).result()


def belady(trace: Trace, capacity_blocks: int, saves: Sequence[bool] | None = None) -> float:
    """Prefix hit rate of the offline optimum (farthest next use first, deeper first):
    on overflow it drops the held or incoming block whose next use is farthest away. A
    child is never used without its parent, so its next use is never sooner; ties go to
    the deeper block. Requests marked in ``saves`` store blocks but are not counted."""
    next_use: list[list[float]] = [[]] * len(trace)
    upcoming: dict[Hashable, float] = {}
    for index in range(len(trace) - 1, -1, -1):
        next_use[index] = [upcoming.get(key, NEVER) for key in trace[index]]
        for key in trace[index]:
            upcoming[key] = index
    held: dict[Hashable, float] = {}  # key -> its next use, the heap entry's truth
    heap: list[tuple[float, int, int, Hashable]] = []
    hits = refs = stamp = 0
    for index, keys in enumerate(trace):
        if saves is None or not saves[index]:
            refs += len(keys)
            hit = 0
            while hit < len(keys) and keys[hit] in held:
                hit += 1
            hits += hit
        for depth, key in enumerate(keys):
            use = next_use[index][depth]
            held[key] = use
            stamp += 1
            heapq.heappush(heap, (-use, -depth, stamp, key))
            while len(held) > capacity_blocks:
                negative_use, _, _, victim = heapq.heappop(heap)
                if held.get(victim) == -negative_use:
                    del held[victim]
    return hits / refs if refs else 0.0
