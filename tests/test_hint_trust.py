"""Hints must earn their keep (issue 22): each tier compares how often hinted and unhinted
blocks at its eviction end are used again, and protects hinted blocks only as far as
hints have proven right (``policies/retention.py``, ``HintTrust``). Through a real Store
with an injected clock, for every eviction policy; deterministic, no sleeps."""

import math

import numpy as np
import pytest

from kvstore import Hint, Namespace, Store
from kvstore.policies import EVICTION_NAMES
from kvstore.policies.retention import HintTrust

BLOCK = 4096
NS = Namespace(model="trust", dtype="u8", chunk_tokens=1)
SLOTS = 16
BUF = np.zeros(BLOCK, np.uint8)
OUT = np.empty(BLOCK, np.uint8)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


TAGS = {"h": 0, "u": 1, "o": 2}


def key(tag: str, i: int):
    return NS.chunk_keys([TAGS[tag] * 10**7 + i])[0]


def store_of(policy: str, clock: Clock) -> Store:
    return Store.from_config({"tiers": [{"name": "top", "kind": "dram", "capacity": SLOTS * BLOCK,
                                         "eviction": policy}], "io_threads": 1}, clock=clock)


def read(store: Store, k, hint=None) -> bool:
    """What an engine does: look the block up, load it if cached, else compute and save it."""
    if store.lookup([k]):
        return store.load([k], [OUT]).result() == [True]
    store.save([k], [BUF], hint=hint).result()
    return False


def wrong_client(store: Store, clock: Clock, steps: int, start: int = 0, hinted: bool = True) -> list[bool]:
    """Each second: a block the client hints and never reads again, and a block it does
    not hint and reads back two seconds later (a miss saves it again). Returns the reads."""
    hits = []
    for t in range(start, start + steps):
        clock.now += 1
        store.save([key("h", t)], [BUF], hint=Hint(600) if hinted else None).result()
        store.save([key("u", t)], [BUF]).result()
        if t - start >= 2:
            hits.append(read(store, key("u", t - 2)))
    return hits


def right_client(store: Store, clock: Clock, steps: int, start: int = 0, hinted: bool = True) -> list[bool]:
    """Each second: a block the client hints and reads back five seconds later, and three
    one-off blocks it does not hint (plain recency would evict the hinted block first)."""
    hint = Hint(8) if hinted else None
    hits = []
    for t in range(start, start + steps):
        clock.now += 1
        store.save([key("h", t)], [BUF], hint=hint).result()
        store.save([key("o", 3 * t + j) for j in range(3)], [BUF] * 3).result()
        if t - start >= 5:
            hits.append(read(store, key("h", t - 5), hint))
    return hits


def trust(store: Store) -> dict:
    return store.stats()["tiers"][0]["hint_trust"]


@pytest.mark.parametrize("policy", EVICTION_NAMES)
def test_always_wrong_hints_end_in_plain_policy_order(policy):
    clock = Clock()
    with store_of(policy, clock) as store:
        early = wrong_client(store, clock, 20)          # at first hints protect in full
        late = wrong_client(store, clock, 200, start=20)[-100:]
        state = trust(store)
        assert state["hinted_reuse"] <= state["unhinted_reuse"]
        # a hint protects only up to protect_s, younger than the hinted blocks the walk
        # meets at the eviction end (16 blocks, 2 new a second: ~8 seconds' worth)
        assert state["protect_s"] < 6
    plain_clock = Clock()
    with store_of(policy, plain_clock) as plain:         # the same traffic, no hints at all
        unhinted = wrong_client(plain, plain_clock, 220, hinted=False)
    assert sum(late) == sum(unhinted[-100:])             # as many hits as without hints
    assert not all(early)                                # which full protection did not get


def test_always_wrong_hints_leave_the_lru_order_untouched():
    """Once distrusted, the victims are exactly the policy's own, hinted or not."""
    clock = Clock()
    with store_of("lru", clock) as store:
        wrong_client(store, clock, 200)
        layer = store._levels[0].policy
        assert store.stats()["hints"]["live"] > 0        # hints are still live ...
        # ... and change nothing at the eviction end (the oldest quarter of the tier)
        offered = [k for k, _ in zip(layer.victims(), range(SLOTS // 4))]
        # LRU's order: the blocks the layer parked (policies/_parking.py) head it
        lru_order = [*layer._parking.all_in_order(), *layer.inner._order]
        assert offered == lru_order[:SLOTS // 4]
        assert any(store._hints.get(k) is not None for k in offered)   # hinted blocks among them


@pytest.mark.parametrize("policy", EVICTION_NAMES)
def test_right_hints_keep_their_protection(policy):
    clock = Clock()
    with store_of(policy, clock) as store:
        hits = right_client(store, clock, 300)
        state = trust(store)
        assert state["protect_s"] is None                # hints protect in full
        assert state["hinted_reuse"] > state["unhinted_reuse"]
        assert all(hits[-100:])                          # every hinted block was still there
    plain_clock = Clock()
    with store_of(policy, plain_clock) as plain:
        unhinted = right_client(plain, plain_clock, 300, hinted=False)
    assert sum(unhinted[-100:]) < 50                     # which plain order would not keep


def test_trust_comes_back_when_hints_turn_right():
    clock = Clock()
    with store_of("lru", clock) as store:
        wrong_client(store, clock, 200)
        assert trust(store)["protect_s"] < 6
        hits = right_client(store, clock, 300, start=1000)
        assert trust(store)["protect_s"] is None
        assert all(hits[-100:])


def test_feedback_is_deterministic_and_in_stats():
    def run():
        clock = Clock()
        with store_of("s3fifo", clock) as store:
            wrong_client(store, clock, 120)
            right_client(store, clock, 120, start=500)
            return trust(store), store.stats()["tiers"][0]["evictions"]
    first = run()
    assert first == run()
    state = first[0]
    assert set(state) == {"protect_s", "hinted_reuse", "unhinted_reuse", "watched"}
    assert 0 < state["watched"] <= 4 * SLOTS


def test_no_hints_no_watching():
    clock = Clock()
    with store_of("lru", clock) as store:
        wrong_client(store, clock, 50, hinted=False)
        assert trust(store) == {"protect_s": None, "hinted_reuse": None, "unhinted_reuse": None,
                                "watched": 0}


# -- HintTrust alone ----------------------------------------------------------------------

def test_trust_shrinks_from_the_oldest_protected_age_and_regrows():
    t = HintTrust()
    window = 100
    for i in range(40):                       # hinted blocks passed at age 50 s, never reused
        t.passed(("h", i), 50.0)
        t.oldest = 50.0
        t.evicted(("u", i), False, window)    # unhinted evicted in their place, reused
        t.reused(("u", i))
    assert t.protect_s < 50.0 * 0.99 ** 10
    low = t.protect_s
    for i in range(40, 200):                  # now hinted blocks are reused, unhinted not
        t.distrusted(50.0)
        t.evicted(("h", i), True, window)     # evicted as untrusted, and read back
        t.reused(("h", i))
        t.evicted(("u", i), False, window)
    assert t.protect_s > low
    assert math.isinf(t.protect_s)


def test_equal_rates_never_earn_protection_and_doubt_takes_it_away():
    """Hinted blocks reused as often as unhinted ones are worth nothing over the policy:
    from the start they earn no protection, and protection earned before goes."""
    for start in (0.0, math.inf):
        t = HintTrust()
        t.protect_s = start
        for i in range(400):                  # both reused one time in four
            t.passed(("h", i), 30.0)
            t.oldest = 30.0
            t.evicted(("u", i), False, 1000)
            if i % 4 == 0:
                t.reused(("h", i))
            if i % 4 == 2:
                t.reused(("u", i))
        assert t.protect_s < 30.0


def test_a_large_tier_watches_a_bounded_sample():
    t = HintTrust()
    held = 1 << 20
    for i in range(300_000):
        t.evicted(i, False, held)
    assert t.stats()["watched"] <= (1 << 16) + 1


def test_a_lucky_streak_does_not_restore_full_protection():
    """Issue 39: after a client's hints proved wrong, a short run of right ones (30
    seconds, about two tiers' worth of blocks) must not swing the tier back to full
    protection: protection comes back only on sustained evidence
    (test_trust_comes_back_when_hints_turn_right)."""
    clock = Clock()
    with store_of("lru", clock) as store:
        wrong_client(store, clock, 200)
        assert trust(store)["protect_s"] < 6
        right_client(store, clock, 30, start=1000)
        assert trust(store)["protect_s"] is not None      # still bounded by the hint age


def test_hints_that_fail_their_first_verdict_protect_nothing():
    """Issue 39: the first comparison of the rates drops wrong hints to plain policy
    order at once, not 1% per event from the oldest hint age."""
    t = HintTrust()
    for i in range(24):                       # hinted passed at age 50 s, never reused
        t.passed(("h", i), 50.0)
        t.oldest = 50.0
        t.evicted(("u", i), False, 100)       # unhinted evicted in their place, reused
        t.reused(("u", i))
    assert t.protect_s == 0.0
