"""A two-tier Store (small and larger DRAM) against a plain dict model, with retention
hints (any policy, a fake clock that rules advance)."""

import numpy as np
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore import Hint, Namespace, Store
from policies import EVICTION_NAMES

BLOCK = 4096
KEYS = Namespace(model="model", dtype="u8", chunk_tokens=1).chunk_keys(np.arange(24))
key_index = st.integers(0, len(KEYS) - 1)
WRITE_MODES = ("back", "through", "selective")
HINTS = st.one_of(st.none(), st.just(Hint(None, discard=True)),
                  st.builds(Hint, st.sampled_from([None, 5.0, 60.0]), st.integers(1, 3)),
                  st.builds(Hint, st.sampled_from([5.0, 60.0]), st.integers(0, 3)))


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


class StoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.store = None
        self.model: dict[int, int] = {}   # key index -> fill byte of the last save
        self.leased: set[int] = set()
        self.clock = Clock()

    @rule(mode=st.sampled_from(WRITE_MODES), top=st.integers(1, 4), bottom=st.integers(2, 10),
          eviction=st.sampled_from(EVICTION_NAMES))
    @precondition(lambda self: self.store is None)
    def open(self, mode, top, bottom, eviction):
        self.store = Store.from_config({
            "tiers": [{"name": "small", "kind": "dram", "capacity": top * BLOCK, "eviction": eviction},
                      {"name": "large", "kind": "dram", "capacity": bottom * BLOCK}],
            "placement": {"write": mode}, "io_threads": 2}, clock=self.clock)

    @rule(idx=st.lists(key_index, min_size=1, max_size=5, unique=True), fill=st.integers(0, 255), hint=HINTS)
    @precondition(lambda self: self.store is not None)
    def save(self, idx, fill, hint):
        srcs = [np.full(BLOCK, (fill + i) % 256, np.uint8) for i in idx]
        already = [self.store.contains([KEYS[i]])[0] for i in idx]
        ok = self.store.save([KEYS[i] for i in idx], srcs, hint=hint).result()
        for i, stored, was, src in zip(idx, ok, already, srcs):
            if stored and not was:
                self.model[i] = int(src[0])  # a key already stored keeps its first bytes

    @rule(idx=st.lists(key_index, min_size=1, max_size=6, unique=True))
    @precondition(lambda self: self.store is not None)
    def load(self, idx):
        dsts = [np.zeros(BLOCK, np.uint8) for _ in idx]
        ok = self.store.load([KEYS[i] for i in idx], dsts).result()
        for i, hit, dst in zip(idx, ok, dsts):
            self.leased.discard(i)
            if hit:
                assert i in self.model, "loaded a block that was never saved"
                assert (dst == self.model[i]).all(), "wrong bytes"

    @rule(seconds=st.sampled_from([1.0, 10.0, 100.0]))
    def tick(self, seconds):
        self.clock.now += seconds

    @rule(idx=st.lists(key_index, min_size=1, max_size=6, unique=True), hint=HINTS)
    @precondition(lambda self: self.store is not None)
    def lookup_with_lease(self, idx, hint):
        n = self.store.lookup([KEYS[i] for i in idx], lease_s=10**6, hint=hint)  # outlasts every tick
        self.leased.update(idx[:n])

    @rule(idx=st.lists(key_index, min_size=1, max_size=3, unique=True))
    @precondition(lambda self: self.store is not None)
    def delete(self, idx):
        self.store.delete([KEYS[i] for i in idx])
        for i in idx:
            self.model.pop(i, None)
            self.leased.discard(i)

    @invariant()
    def capacity_respected(self):
        if self.store:
            for tier in self.store.tiers:
                assert tier.used_bytes <= tier.capacity_bytes

    @invariant()
    def leased_blocks_stay(self):
        if self.store and self.leased:
            assert all(self.store.contains([KEYS[i] for i in sorted(self.leased)]))

    @invariant()
    def hints_only_for_held_blocks(self):
        if self.store:
            hinted = list(self.store._hints)
            assert all(self.store.contains(hinted))
            assert self.store.stats()["hints"]["live"] <= len(hinted)

    @invariant()
    def index_matches_tiers(self):
        if self.store:
            for i, key in enumerate(KEYS):
                cached = self.store.contains([key])[0]
                assert cached == any(t.contains([key])[0] for t in self.store.tiers)
                if cached:
                    assert i in self.model

    def teardown(self):
        if self.store:
            self.store.close()


TestStoreStateful = StoreMachine.TestCase
TestStoreStateful.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
