"""The Store drives eviction policies exactly as the policy replay's model does: a victim
is taken only when room is needed (no look-ahead that a policy would read as a skip), and
prefix-aware policies place a batch block by block."""

import pytest

from benchmarks.policy_replay import replay, replay_through_store, synthetic_trace, to_keys


@pytest.mark.parametrize("policy", ["lru", "lineage", "arc"])
def test_store_matches_the_policy_model(policy):
    trace = to_keys(synthetic_trace(seed=3, num_requests=600))
    distinct = len({key for keys in trace for key in keys})
    capacity = max(8, distinct // 20)
    model = replay(policy, trace, capacity)
    assert model > 0
    assert replay_through_store(policy, trace, capacity) == pytest.approx(model, abs=1e-9)
