"""A block is never indexed in a tier that does not hold it, whatever runs between a
delete's (or an eviction's) index update and its delete from the tier, or between a
put's write and its index update (found by the tenant Store model in
tests/test_store_stateful.py, issue 34: the tenant ledgers charge what the index says a
tier holds, so each such block was charged in a tier without being there).

Real DRAM tiers, whose ``delete`` or ``write`` waits at a gate the test opens, so the
interleaving is forced, not timed."""

from __future__ import annotations

import threading

import numpy as np

from kvstore.config import load_config
from kvstore.store import Store
from kvstore.testing import make_keys, payload
from kvstore.tiers.dram import DramTier

BLOCK = 4096


class GatedDram(DramTier):
    """A real DRAM tier; ``gate(kind, keys)`` makes the next ``delete`` (or ``write``,
    after it stored the bytes) of any of ``keys`` wait until :meth:`open`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._kind, self._keys = None, set()
        self.reached = threading.Event()
        self._open = threading.Event()

    def gate(self, kind: str, keys) -> None:
        self._kind, self._keys = kind, set(keys)

    def open(self) -> None:
        self._open.set()

    def _wait(self, kind: str, keys) -> None:
        if self._kind == kind and self._keys & set(keys):
            self._kind = None
            self.reached.set()
            assert self._open.wait(10)

    def delete(self, keys):
        self._wait("delete", keys)
        return super().delete(keys)

    def write(self, keys, srcs, checksums=None):
        out = super().write(keys, srcs, checksums)
        self._wait("write", keys)
        return out


def _store(blocks: list[int], eviction: str = "lru") -> tuple[Store, list[GatedDram]]:
    names = ["hot", "warm"][:len(blocks)]
    cfg = load_config({"tiers": [{"name": n, "kind": "dram", "capacity": b * BLOCK, "pin": False,
                                  **({"eviction": eviction} if n == "hot" else {})}
                                 for n, b in zip(names, blocks)], "io_threads": 2}, env={})
    tiers = [GatedDram(b * BLOCK, name=n, pin=False) for n, b in zip(names, blocks)]
    return Store(cfg, tiers=tiers), tiers


def _index_matches_tiers(store: Store, keys) -> None:
    with store._lock:
        where = {k: store._where.get(k, 0) for k in keys}
    for i, tier in enumerate(store.tiers):
        for key, held in zip(keys, tier.contains(keys)):
            assert bool(where[key] >> i & 1) == held, f"tier {tier.name}: indexed {bool(where[key] >> i & 1)}, held {held}"


def _reads(store: Store, key, src) -> bool:
    dst = np.zeros(src.nbytes, np.uint8)
    hit = store.load([key], [dst]).result(10) == [True]
    assert not hit or np.array_equal(dst, src)
    return hit


def test_a_save_racing_a_delete_of_the_same_key_is_not_lost():
    """delete(A) is out of the index, its delete from hot not yet done; a save of A
    then reports stored: it must load afterwards (it lands where no delete of it is
    under way), never be indexed in hot and then deleted there."""
    store, (hot, _) = _store([4, 16])
    with store:
        key, src = make_keys(1, salt="race-delete"), payload(1, BLOCK)
        assert store.save(key, [src]).result(10) == [True]
        hot.gate("delete", key)
        deleting = store._pool.submit(store.delete, key)
        assert hot.reached.wait(10)
        saved = store.save(key, [src]).result(10)
        hot.open()
        assert deleting.result(10) == 1
        _index_matches_tiers(store, key)
        assert saved == [True] and _reads(store, key[0], src)


def test_a_save_racing_the_eviction_of_the_same_key_is_never_indexed_without_bytes():
    """A is a victim of a save of C, out of the index, its delete from the (only) tier
    not yet done; a save of A meanwhile must not be indexed there with the delete
    still to come."""
    store, (hot,) = _store([2])
    with store:
        a, b, c = make_keys(3, salt="race-evict")
        assert store.save([a, b], [payload(1, BLOCK), payload(2, BLOCK)]).result(10) == [True, True]
        hot.gate("delete", [a])
        evicting = store.save([c], [payload(3, BLOCK)])            # A is LRU's victim
        assert hot.reached.wait(10)
        saved = store.save([a], [payload(1, BLOCK)]).result(10)
        hot.open()
        assert evicting.result(10) == [True]
        _index_matches_tiers(store, [a, b, c])
        assert saved == [False] or _reads(store, a, payload(1, BLOCK))


def test_a_block_staged_by_one_put_is_not_another_puts_victim():
    """Under a prefix-aware policy (lineage) a put places its blocks in the policy before
    writing them; while one put's block is written and not yet indexed, another put's
    victim walk must not take it (its delete from the tier would leave it indexed with
    no bytes once the first put indexes it)."""
    store, (hot, _) = _store([3, 16], eviction="lineage")
    with store:
        mine = make_keys(1, salt="staged")
        theirs = make_keys(3, salt="walker")
        hot.gate("write", mine)
        first = store.save(mine, [payload(7, BLOCK)])
        assert hot.reached.wait(10)                       # written into hot, not indexed yet
        second = store.save(theirs, [payload(10 + i, BLOCK) for i in range(3)]).result(10)
        hot.open()
        assert first.result(10) == [True]
        assert all(second)
        _index_matches_tiers(store, mine + theirs)
        assert _reads(store, mine[0], payload(7, BLOCK))
