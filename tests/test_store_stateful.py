"""The Store against its model (kvstore.testing.store_model): two DRAM tiers with retention
hints, and DRAM over lineage-evicting DRAM over NVMe with leases, pins, prefetch and
reservations."""

from hypothesis import settings

from kvstore.testing.store_model import StoreMachine, TieredStoreMachine

TestStoreStateful = StoreMachine.TestCase
TestStoreStateful.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)

TestTieredStoreStateful = TieredStoreMachine.TestCase
TestTieredStoreStateful.settings = settings(max_examples=150, stateful_step_count=50, deadline=None,
                                            derandomize=True, database=None)
