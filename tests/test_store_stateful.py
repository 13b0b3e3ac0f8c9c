"""The Store against its model (kvstore.testing.store_model): two DRAM tiers with retention
hints; DRAM over lineage-evicting DRAM over NVMe with leases, pins, prefetch and
reservations; and two DRAM tiers with tenants' quotas and racing re-saves of one key at
different sizes (issue 34 item 1: per-tier ledgers are what each tier holds, never
negative)."""

from hypothesis import settings

from kvstore.testing.store_model import StoreMachine, TenantStoreMachine, TieredStoreMachine

TestStoreStateful = StoreMachine.TestCase
TestStoreStateful.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)

TestTieredStoreStateful = TieredStoreMachine.TestCase
TestTieredStoreStateful.settings = settings(max_examples=150, stateful_step_count=50, deadline=None,
                                            derandomize=True, database=None)

TestTenantStoreStateful = TenantStoreMachine.TestCase
TestTenantStoreStateful.settings = settings(max_examples=100, stateful_step_count=40, deadline=None,
                                            derandomize=True, database=None)
