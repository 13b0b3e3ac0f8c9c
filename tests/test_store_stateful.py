"""A two-tier Store (small and larger DRAM) against a plain dict model."""

import numpy as np
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore import Namespace, Store

BLOCK = 4096
KEYS = Namespace(model="model", dtype="u8", chunk_tokens=1).chunk_keys(np.arange(24))
key_index = st.integers(0, len(KEYS) - 1)
WRITE_MODES = ("back", "through", "selective")


class StoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.store = None
        self.model: dict[int, int] = {}   # key index -> fill byte of the last save
        self.leased: set[int] = set()

    @rule(mode=st.sampled_from(WRITE_MODES), top=st.integers(1, 4), bottom=st.integers(2, 10),
          eviction=st.sampled_from(["lru", "fifo"]))
    @precondition(lambda self: self.store is None)
    def open(self, mode, top, bottom, eviction):
        self.store = Store.from_config({
            "tiers": [{"name": "small", "kind": "dram", "capacity": top * BLOCK, "eviction": eviction},
                      {"name": "large", "kind": "dram", "capacity": bottom * BLOCK}],
            "placement": {"write": mode}, "io_threads": 2})

    @rule(idx=st.lists(key_index, min_size=1, max_size=5, unique=True), fill=st.integers(0, 255))
    @precondition(lambda self: self.store is not None)
    def save(self, idx, fill):
        srcs = [np.full(BLOCK, (fill + i) % 256, np.uint8) for i in idx]
        already = [self.store.contains([KEYS[i]])[0] for i in idx]
        ok = self.store.save([KEYS[i] for i in idx], srcs).result()
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

    @rule(idx=st.lists(key_index, min_size=1, max_size=6, unique=True))
    @precondition(lambda self: self.store is not None)
    def lookup_with_lease(self, idx):
        n = self.store.lookup([KEYS[i] for i in idx], lease_s=3600)
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
