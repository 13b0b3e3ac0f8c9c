"""Retention hints (issue 22): validation, and their semantics through a real Store for
every eviction policy in the registry — class order, expiry, discard, restart, stats."""

import numpy as np
import pytest

from kvstore import Hint, Namespace, Store
from kvstore.errors import InvalidArgumentError
from kvstore.policies import EVICTION_NAMES

BLOCK = 4096
NS = Namespace(model="hints", dtype="u8", chunk_tokens=1)
# unchained keys (one-chunk prompts): no parent links, so class order is all there is
KEYS = [NS.chunk_keys([i])[0] for i in range(64)]


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def block(i: int) -> np.ndarray:
    return np.full(BLOCK, i % 251, np.uint8)


def dram_store(policy: str, blocks: int, clock: FakeClock, *, lower: int = 0, write: str = "back") -> Store:
    tiers = [{"name": "top", "kind": "dram", "capacity": blocks * BLOCK, "eviction": policy}]
    if lower:
        tiers.append({"name": "low", "kind": "dram", "capacity": lower * BLOCK})
    return Store.from_config({"tiers": tiers, "placement": {"write": write}, "io_threads": 1}, clock=clock)


def save(store: Store, idx, hint=None) -> list[bool]:
    return store.save([KEYS[i] for i in idx], [block(i) for i in idx], hint=hint).result()


def held(store: Store, idx, tier: int = 0) -> list[bool]:
    return store.tiers[tier].contains([KEYS[i] for i in idx])


# -- the Hint value ---------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, words", [
    ({"retain_s": 0}, "retain_s"), ({"retain_s": -1}, "retain_s"), ({"retain_s": float("inf")}, "retain_s"),
    ({"retain_s": "60"}, "retain_s"), ({"retain_s": True}, "retain_s"),
    ({"retain_s": 60, "priority": -1}, "priority"), ({"retain_s": 60, "priority": 1.5}, "priority"),
    ({"retain_s": 60, "priority": 2**31}, "priority"),
    ({"retain_s": None, "discard": 1}, "discard"), ({"retain_s": 60, "discard": True}, "discard"),
    ({"retain_s": None}, "empty"),
])
def test_bad_hints_are_refused_naming_the_field(kwargs, words):
    with pytest.raises(InvalidArgumentError, match=words):
        Hint(**kwargs)


def test_hint_from_dict_round_trips_and_names_unknown_fields():
    hint = Hint.from_dict({"retain_s": 600, "priority": 1})
    assert hint == Hint(600.0, 1) and Hint.from_dict(hint.to_dict()) == hint
    assert Hint.from_dict({"discard": True}) == Hint(None, discard=True)
    with pytest.raises(InvalidArgumentError, match="retain"):
        Hint.from_dict({"retain": 600})
    with pytest.raises(InvalidArgumentError, match="mapping"):
        Hint.from_dict([600])


def test_store_refuses_a_hint_that_is_not_a_hint():
    with dram_store("lru", 4, FakeClock()) as store:
        with pytest.raises(InvalidArgumentError, match="kvstore.Hint"):
            store.save([KEYS[0]], [block(0)], hint={"retain_s": 5})
        with pytest.raises(InvalidArgumentError, match="kvstore.Hint"):
            store.lookup([KEYS[0]], hint=600)


# -- semantics, for every policy ---------------------------------------------------------

@pytest.mark.parametrize("policy", EVICTION_NAMES)
def test_classes_evict_discard_then_unhinted_then_hinted_by_priority(policy):
    clock = FakeClock()
    with dram_store(policy, 4, clock) as store:
        save(store, [0], Hint(600, priority=2))
        save(store, [1], Hint(600, priority=1))
        save(store, [2])
        save(store, [3], Hint(None, discard=True))
        gone = []
        for filler in range(10, 14):          # fillers outrank everything already there
            save(store, [filler], Hint(600, priority=9))
            gone += [i for i, h in zip(range(4), held(store, range(4))) if not h and i not in gone]
        assert gone == [3, 2, 1, 0]


@pytest.mark.parametrize("policy", EVICTION_NAMES)
def test_live_hint_outlasts_unhinted_blocks(policy):
    clock = FakeClock()
    with dram_store(policy, 4, clock) as store:
        save(store, [0], Hint(60))
        for i in range(1, 12):                # 11 unhinted blocks stream through 3 free slots
            save(store, [i])
            clock.now += 1
        assert held(store, [0]) == [True]
        assert store.stats()["tiers"][0]["evictions"] == 8


@pytest.mark.parametrize("policy", EVICTION_NAMES)
def test_expired_hint_is_ignored(policy):
    """After expiry the store evicts exactly what the same policy evicts unhinted."""
    def run(hint):
        clock = FakeClock()
        with dram_store(policy, 4, clock) as store:
            save(store, [0], hint)
            for i in range(1, 4):
                save(store, [i])
            clock.now += 61
            store.load([KEYS[2]], [np.empty(BLOCK, np.uint8)]).result()
            for i in range(4, 9):
                save(store, [i])
            return held(store, range(9)), store.stats()["hints"]

    hinted, stats = run(Hint(60))
    assert hinted == run(None)[0]
    assert stats["given"] == 1 and stats["expired"] == 1 and stats["hit"] == 0 and stats["live"] == 0


@pytest.mark.parametrize("policy", EVICTION_NAMES)
def test_discard_blocks_are_not_spilled(policy):
    clock = FakeClock()
    with dram_store(policy, 2, clock, lower=8) as store:
        save(store, [0, 1], Hint(None, discard=True))
        save(store, [2, 3])
        save(store, [4, 5])                   # evicts 2, 3 (spilled) after 0, 1 (dropped)
        assert held(store, [0, 1, 2, 3], tier=0) == [False] * 4
        assert held(store, [0, 1], tier=1) == [False, False]
        assert held(store, [2, 3], tier=1) == [True, True]
        stats = store.stats()
        assert stats["hints"]["discarded"] == 2 and stats["tiers"][0]["spills"] == 2
        out = np.empty(BLOCK, np.uint8)
        assert store.load([KEYS[0]], [out]).result() == [False]


@pytest.mark.parametrize("policy", EVICTION_NAMES)
def test_restart_keeps_hints_with_nvme_blocks(policy, tmp_path):
    config = {"tiers": [{"name": "disk", "kind": "nvme", "path": str(tmp_path), "capacity": 4 * BLOCK,
                         "eviction": policy, "direct_io": False, "index_sync": False}], "io_threads": 1}
    clock = FakeClock()
    with Store.from_config(config, clock=clock) as store:
        save(store, [0], Hint(600, priority=3))
        save(store, [1], Hint(None, discard=True))
        save(store, [2, 3])
    clock = FakeClock(50.0)                     # a new process: its own clock origin
    with Store.from_config(config, clock=clock) as store:
        assert store.stats()["hints"]["live"] == 2
        save(store, [4])                         # the discard block goes first
        assert held(store, [0, 1]) == [True, False]
        save(store, [5, 6])                      # then the unhinted ones; the hinted stays
        assert held(store, [0, 2, 3]) == [True, False, False]
        clock.now += 700                         # past its expiry: an ordinary block again,
        for i in range(7, 11):                   # so it leaves before hinted newcomers
            save(store, [i], Hint(600, priority=1))
        assert held(store, [0]) == [False]


def test_merging_keeps_the_stronger_hint_and_discard_never_undoes_retain():
    clock = FakeClock()
    with dram_store("lru", 3, clock) as store:
        save(store, [0], Hint(100, priority=1))
        save(store, [0], Hint(None, discard=True))       # another request: one-shot for it
        save(store, [0], Hint(10, priority=0))           # shorter, lower: the stronger kept
        save(store, [1, 2])
        clock.now += 50                                  # 0's hint (100 s) still live
        save(store, [3, 4])
        assert held(store, [0, 1, 2]) == [True, False, False]
        stats = store.stats()["hints"]
        assert stats["given"] == 3 and stats["live"] == 1


def test_hits_before_expiry_are_counted_once_per_hint():
    clock = FakeClock()
    with dram_store("lru", 8, clock) as store:
        save(store, [0, 1], Hint(60))
        out = [np.empty(BLOCK, np.uint8) for _ in range(2)]
        assert store.lookup([KEYS[0], KEYS[1]]) == 2
        assert store.load([KEYS[0], KEYS[1]], out).result() == [True, True]
        assert store.stats()["hints"]["hit"] == 2
        clock.now += 61
        assert store.load([KEYS[0]], out[:1]).result() == [True]
        stats = store.stats()["hints"]
        assert stats["hit"] == 2 and stats["expired"] == 0 and stats["live"] == 0


def test_lookup_hint_applies_to_the_cached_prefix_only():
    clock = FakeClock()
    chain = NS.chunk_keys(np.arange(5))
    with dram_store("lru", 8, clock) as store:
        store.save(chain[:3], [block(i) for i in range(3)]).result()
        assert store.lookup(chain, hint=Hint(60)) == 3
        assert store.stats()["hints"] == {"given": 3, "hit": 0, "expired": 0, "discarded": 0, "live": 3}


def test_write_through_skips_discard_blocks():
    clock = FakeClock()
    with dram_store("lru", 4, clock, lower=4, write="through") as store:
        assert save(store, [0], Hint(None, discard=True)) == [True]
        save(store, [1])
        assert held(store, [0, 1], tier=1) == [False, True]


def test_hints_of_blocks_no_tier_took_are_dropped():
    clock = FakeClock()
    with dram_store("lru", 1, clock) as store:
        big = np.zeros(4 * BLOCK, np.uint8)
        assert store.save([KEYS[0]], [big], hint=Hint(None, discard=True)).result() == [False]
        assert store.stats()["hints"]["live"] == 0


# -- within the hinted class: the oldest hint first --------------------------------------

@pytest.mark.parametrize("policy", [p for p in EVICTION_NAMES if p != "lineage"])
def test_hinted_blocks_leave_oldest_hint_first_whatever_was_read_since(policy):
    """A block read after its hint (the conversation came back without asking again)
    leaves before one whose hint is fresher; the hint last given is the client's
    latest word. Of one request's blocks, the deepest leave first."""
    clock = FakeClock()
    out = np.empty(BLOCK, np.uint8)
    with dram_store(policy, 6, clock) as store:
        save(store, [0], Hint(600))
        clock.now += 1
        save(store, [1], Hint(600))
        clock.now += 1
        save(store, [2, 3, 4], Hint(600))             # one request: 4 is its deepest block
        clock.now += 1
        save(store, [5], Hint(600))
        for _ in range(3):                            # 0 read again and again, unhinted
            assert store.load([KEYS[0]], [out]).result() == [True]
        clock.now += 1
        store.hint([KEYS[1]], Hint(600))              # 1's hint given again: the freshest
        gone = []
        for filler in range(10, 16):
            clock.now += 1
            save(store, [filler], Hint(600))
            gone += [i for i, h in zip(range(6), held(store, range(6))) if not h and i not in gone]
        assert gone == [0, 4, 3, 2, 5, 1]


@pytest.mark.parametrize("policy", [p for p in EVICTION_NAMES if p != "lineage"])
def test_of_hints_of_one_age_the_longest_window_leaves_first(policy):
    """Issue 39: hinted blocks rank by their expected next use, not by hint age alone.
    "Back within a minute" is kept over "back within the hour" until it expires, even
    when it is the older hint; hints of one window still leave oldest first."""
    clock = FakeClock()
    with dram_store(policy, 4, clock) as store:
        save(store, [0], Hint(3600))
        clock.now += 1
        save(store, [1], Hint(60))                    # older than 2 and 3, but due soon
        clock.now += 1
        save(store, [2], Hint(3600))
        clock.now += 1
        save(store, [3], Hint(3600))
        gone = []
        for filler in range(10, 13):
            clock.now += 1
            save(store, [filler], Hint(3600))
            gone += [i for i, h in zip(range(4), held(store, range(4))) if not h and i not in gone]
        assert gone == [0, 2, 3]
        assert held(store, [1]) == [True]
        clock.now = 1000 + 1 + 60                     # 1's hint expired: policy order, first out
        save(store, [20], Hint(3600))
        assert held(store, [1]) == [False]


@pytest.mark.parametrize("policy", [p for p in EVICTION_NAMES if p != "lineage"])
def test_a_priority_only_hint_leaves_first_of_its_priority(policy):
    """A hint with no expiry says nothing about when the block comes back: of one
    priority it ranks below every hint with a window, older or not."""
    clock = FakeClock()
    with dram_store(policy, 2, clock) as store:
        save(store, [0], Hint(600, priority=1))
        clock.now += 1
        save(store, [1], Hint(None, priority=1))
        clock.now += 1
        save(store, [2], Hint(600, priority=2))
        assert held(store, [0, 1, 2]) == [True, False, True]


def test_lineage_keeps_its_leaf_first_order_among_hinted_blocks():
    clock = FakeClock()
    chain = NS.chunk_keys(np.arange(100, 104))
    with dram_store("lineage", 4, clock) as store:
        store.save(chain, [block(i) for i in range(4)], hint=Hint(600)).result()
        clock.now += 1
        other = NS.chunk_keys(np.arange(200, 201))
        store.save(other, [block(0)], hint=Hint(600)).result()
        assert store.tiers[0].contains(chain) == [True, True, True, False]   # the leaf went
