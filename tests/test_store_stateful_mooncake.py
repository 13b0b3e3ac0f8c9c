"""The Store against its model (kvstore.testing.store_model) with a Mooncake pool under a
DRAM tier: the build gives that DRAM tier header frames, so every spill writes a block
header into the page before a DRAM slot and sends it from there. Random saves (hinted or
not, every write mode), loads, leases, deletes and clock ticks: a load is a miss or the
exact bytes of the key's last save, never another block's."""

from __future__ import annotations

import itertools
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kvstore.store import Store
from kvstore.testing import IN_CI
from kvstore.testing.store_model import BLOCK, WRITE_MODES, StoreMachine

from tests import _mooncake

_MISSING = _mooncake.missing()
if _MISSING is not None and not IN_CI:
    pytest.skip(_MISSING, allow_module_level=True)

_pool: _mooncake.MooncakePool | None = None
_prefixes = itertools.count()


@pytest.fixture(scope="module", autouse=True)
def _pool_for_the_module():
    """One pool for every example (each example a prefix of its own); under CI a missing
    wheel fails the test, saying why."""
    global _pool
    if _MISSING is not None:
        pytest.fail(_MISSING + " — CI runs the Store over a Mooncake pool", pytrace=False)
    with tempfile.TemporaryDirectory() as tmp:
        _pool = _mooncake.MooncakePool(Path(tmp))
        try:
            yield
        finally:
            _pool.stop()
            _pool = None


class MooncakeStoreMachine(StoreMachine):
    @rule(mode=st.sampled_from(WRITE_MODES), top=st.integers(1, 4), bottom=st.integers(2, 10),
          eviction=st.sampled_from(["lru", "lineage", "s3fifo"]))
    @precondition(lambda self: self.store is None)
    def open(self, mode, top, bottom, eviction):
        self.store = Store.from_config({
            "tiers": [{"name": "small", "kind": "dram", "capacity": top * BLOCK, "eviction": eviction, "pin": False},
                      {"name": "pool", "kind": "mooncake", "capacity": bottom * BLOCK, "master": _pool.master,
                       "metadata_server": _pool.metadata, "prefix": f"model-{os.getpid()}-{next(_prefixes)}",
                       "staging_bytes": "1MiB"}],
            "placement": {"write": mode}, "io_threads": 2}, clock=self.clock)
        assert self.store.tiers[0].header_frames

    def teardown(self):
        if self.store:
            pool = self.store.tiers[1].stats()
            assert pool["corrupt_blocks"] == 0, "a spill from a header frame stored a bad object"
        super().teardown()


TestMooncakeStoreStateful = MooncakeStoreMachine.TestCase
TestMooncakeStoreStateful.settings = settings(max_examples=25, stateful_step_count=30, deadline=None,
                                              derandomize=True, database=None)
