"""The eviction-policy conformance suite: behaviour every eviction policy must have.
A policy's tests subclass :class:`PolicyConformance` and provide a ``make_policy``
fixture, a callable that returns a fresh, empty policy — see ``tests/test_policies.py``,
which runs it on every registered policy. Shipped in the package so third-party policies
can run it too. :func:`fill`, :func:`evict` and :func:`drain` drive a policy the way a
Store does (every key ``NBYTES`` bytes).
"""

from __future__ import annotations

from itertools import islice

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.policies.base import EvictionPolicy

NBYTES = 1


def fill(policy: EvictionPolicy, keys, parents=None) -> EvictionPolicy:
    for key in keys:
        policy.on_insert(key, NBYTES, (parents or {}).get(key))
    return policy


def evict(policy: EvictionPolicy, count: int, skip: frozenset = frozenset()) -> list:
    """What a Store would evict: the first ``count`` offered keys not in ``skip``."""
    evicted = []
    for _ in range(count):
        for key in policy.victims():
            if key not in skip:
                policy.on_remove(key)
                evicted.append(key)
                break
        else:
            break
    return evicted


def drain(policy: EvictionPolicy) -> list:
    return evict(policy, len(policy) + 1)


ops = st.lists(st.tuples(st.sampled_from(["insert", "access", "remove", "evict"]),
                         st.integers(0, 11), st.integers(-1, 11)), max_size=80)


class PolicyConformance:
    """Behaviour every eviction policy must have. Subclasses provide ``make_policy``."""

    @pytest.fixture
    def policy(self, make_policy) -> EvictionPolicy:
        return make_policy()

    def test_insert_len_contains(self, policy):
        fill(policy, "abcde")
        assert len(policy) == 5
        assert all(key in policy for key in "abcde")
        assert "z" not in policy
        policy.on_insert("c", NBYTES)  # saved again: no duplicate
        assert len(policy) == 5

    def test_remove_and_unknown_keys_are_ignored(self, policy):
        fill(policy, "abc")
        policy.on_remove("b")
        policy.on_remove("b")
        policy.on_remove("zz")
        policy.on_access("zz")
        assert len(policy) == 2 and "b" not in policy
        assert set(islice(policy.victims(), 10)) <= {"a", "c"}

    def test_empty_policy_offers_nothing(self, policy):
        assert list(policy.victims()) == []
        fill(policy, "a")
        policy.on_remove("a")
        assert list(policy.victims()) == []

    @pytest.mark.parametrize("capacity", [None, 4 * NBYTES])
    def test_draining_evicts_every_key_exactly_once(self, policy, capacity):
        if capacity is not None:
            policy.set_capacity(capacity)
        parents = {"b": "a", "c": "b", "e": "d"}
        fill(policy, "abcdefgh", parents)
        for key in "acdg":
            policy.on_access(key)
        evicted = drain(policy)
        assert sorted(evicted) == list("abcdefgh")
        assert len(policy) == 0

    def test_skipped_candidate_is_not_evicted_and_walk_continues(self, policy):
        fill(policy, "abcdef")
        first = next(iter(policy.victims()))
        evicted = evict(policy, 2, skip=frozenset({first}))
        assert len(evicted) == 2 and first not in evicted
        assert first in policy and len(policy) == 4

    def test_walk_ends_when_everything_is_skipped(self, policy):
        fill(policy, "abcd")
        offered = list(islice(policy.victims(), 1000))
        assert set(offered) <= set("abcd")
        assert len(offered) < 1000  # a finite walk, not an endless loop
        assert len(policy) == 4

    def test_removal_during_walk_is_tolerated(self, policy):
        fill(policy, "abcdefgh")
        walk = policy.victims()
        removed = set()
        for key in walk:
            assert key in policy and key not in removed
            if len(removed) < 4:
                policy.on_remove(key)
                removed.add(key)
        assert len(policy) == 4

    # make_policy is a factory, not state: each example builds its own policy
    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(ops=ops, capacity=st.sampled_from([None, 6]))
    def test_matches_a_plain_set_model(self, make_policy, ops, capacity):
        policy = make_policy()
        if capacity is not None:
            policy.set_capacity(capacity * NBYTES)
        model: set[int] = set()
        for op, key, other in ops:
            if op == "insert":
                policy.on_insert(key, NBYTES, other if other >= 0 and other != key else None)
                model.add(key)
            elif op == "access":
                policy.on_access(key)
            elif op == "remove":
                policy.on_remove(key)
                model.discard(key)
            else:
                skip = frozenset({other}) if other in model else frozenset()
                evicted = evict(policy, 1, skip)
                assert len(evicted) == (1 if model - skip else 0)
                model.difference_update(evicted)
            assert len(policy) == len(model)
            assert all(k in policy for k in model)
            offered = list(islice(policy.victims(), 200))
            assert set(offered) <= model
            assert len(policy) == len(model)
