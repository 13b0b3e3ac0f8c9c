"""Optional tier methods and policy hooks are declared, never probed for.

Every tier's conformance suite holds it to its ``capabilities`` (``test_declares_*`` in
:mod:`kvstore.testing.tier_conformance`). Here: the base class's defaults, and that the
Store and the cache server act on what a tier declares, not on which attributes it has
(a tier that has a ``reserve`` method but does not declare it is never asked to reserve).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Sequence

import numpy as np
import pytest

from kvstore.config import load_config
from kvstore.errors import NotSupportedError
from kvstore.keys import BlockKey
from kvstore.net.server._shm import Arena
from kvstore.policies import EVICTION_NAMES, make_eviction
from kvstore.policies.base import EvictionPolicy
from kvstore.policies.lru import LruPolicy
from kvstore.store import Store
from kvstore.store import build
from kvstore.testing import make_keys, payload
from kvstore.tiers.base import HostArena, Tier, TierCapabilities
from kvstore.tiers.dram import DramTier

BLOCK = 64 * 1024


class _DictTier(Tier):
    """The least a tier implements: no optional method, nothing declared."""

    def __init__(self) -> None:
        self.name, self._capacity, self._used, self._blocks = "dict", 1 << 20, 0, {}

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        return [k in self._blocks for k in keys]

    def read_into(self, keys: Sequence[BlockKey], dsts: Sequence[Any]) -> list[bool]:
        return [False for _ in keys]

    def write(self, keys: Sequence[BlockKey], srcs: Sequence[Any]) -> list[bool]:
        return [False for _ in keys]

    def delete(self, keys: Sequence[BlockKey]) -> int:
        return 0

    def keys(self) -> Iterator[BlockKey]:
        return iter(())


class _UndeclaredDram(DramTier):
    """A DRAM tier that keeps its reserve/slots methods and arena but declares none of
    them: the Store and the server must treat it as a tier without them."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.capabilities = dataclasses.replace(self.capabilities, reserve=False, slots=False, host_arena=False)

    def reserve(self, keys, sizes):   # noqa: D102 - must never be reached
        raise AssertionError("reserve called on a tier that does not declare it")

    def slots(self, keys, *, verify=True):   # noqa: D102 - must never be reached
        raise AssertionError("slots called on a tier that does not declare it")


def _store(tiers: list[Tier]) -> Store:
    cfg = [{"name": t.name, "kind": "dram", "capacity": t.capacity_bytes, "pin": False} for t in tiers]
    return Store(load_config({"tiers": cfg}, env={}), tiers=tiers)


def test_defaults_declare_nothing_optional():
    caps = TierCapabilities()
    assert (caps.reserve, caps.slots, caps.host_arena) == (False, False, False)


@pytest.mark.parametrize("method, call", [("reserve", lambda t, k: t.reserve(k, [BLOCK])),
                                          ("slots", lambda t, k: t.slots(k))])
def test_undeclared_method_raises_not_supported(method, call):
    tier = _DictTier()
    with pytest.raises(NotSupportedError, match=rf"_DictTier\.{method} is not supported: tier 'dict' does not "
                                                rf"declare capabilities\.{method}") as info:
        call(tier, make_keys(1))
    assert isinstance(info.value, NotImplementedError)   # the stdlib class it also is
    assert not isinstance(tier, HostArena)


def test_dram_declares_what_it_implements():
    with DramTier(1 << 20, name="hot", pin=False) as tier:
        caps = tier.capabilities
        assert caps.reserve and caps.slots and caps.host_arena and isinstance(tier, HostArena)
        assert tier.shm_path is None and tier.arena.nbytes >= tier.capacity_bytes


def test_store_reserves_only_in_a_first_tier_that_declares_it():
    keys = make_keys(2, salt="undeclared")
    srcs = [payload(i, BLOCK) for i in range(2)]
    with _store([_UndeclaredDram(1 << 20, name="hot", pin=False)]) as store:
        with store.reserve(keys, [BLOCK] * 2) as res:
            assert res.views == [None, None] and res.missing == [0, 1]   # save those instead
        assert store.contains(keys) == [False, False]
        assert all(store.save(keys, srcs).result())
        with store.borrow(keys, offsets=True) as got:
            assert got == [None, None]   # no declared slots: offsets are not offered
        with store.borrow(keys) as views:   # views are a base-contract method: still lent
            assert all(np.array_equal(v, s) for v, s in zip(views, srcs))


def test_store_reserves_and_lends_slots_in_a_declaring_tier():
    keys = make_keys(2, salt="declared")
    srcs = [payload(10 + i, BLOCK) for i in range(2)]
    tier = DramTier(1 << 20, name="hot", pin=False)
    with _store([tier]) as store:
        with store.reserve(keys, [BLOCK] * 2) as res:
            for view, src in zip(res.views, srcs):
                view[:] = src
        with store.borrow(keys, offsets=True) as got:
            for (offset, nbytes), src in zip(got, srcs):
                assert np.array_equal(tier.arena[offset:offset + nbytes], src)
        dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
        assert store.load(keys, dsts).result() == [True, True]
        assert all(np.array_equal(d, s) for d, s in zip(dsts, srcs))


def test_server_maps_only_a_declared_host_arena(tmp_path):
    with DramTier(1 << 20, name="plain", pin=False) as plain:
        assert Arena.of(plain) is None                       # anonymous memory: nothing to map
    with DramTier(1 << 20, name="shared", shm_path=str(tmp_path / "a"), pin=False) as shared:
        arena = Arena.of(shared)
        assert arena is not None and arena.path == shared.shm_path
        assert arena.base_address == shared.arena.ctypes.data and arena.nbytes == shared.arena.nbytes
    with _UndeclaredDram(1 << 20, name="undeclared", shm_path=str(tmp_path / "b"), pin=False) as undeclared:
        assert Arena.of(undeclared) is None                  # has the attributes, declares no arena
    assert Arena.of(_DictTier()) is None


@pytest.mark.parametrize("name", EVICTION_NAMES)
def test_every_eviction_policy_declares_set_capacity(name):
    policy = make_eviction(name)
    assert isinstance(policy, EvictionPolicy)
    policy.set_capacity(4 * BLOCK)   # a no-op where the policy sizes nothing from it


def test_build_tells_the_policy_its_tier_capacity(monkeypatch):
    told: list[int] = []

    class _Recording(LruPolicy):
        def set_capacity(self, capacity_bytes: int) -> None:
            told.append(capacity_bytes)

    monkeypatch.setattr(build, "make_eviction", lambda name: _Recording())
    cfg = load_config({"tiers": [{"name": "hot", "kind": "dram", "capacity": "1MiB", "pin": False}]}, env={})
    assert isinstance(build.build_eviction(cfg.tiers[0]), _Recording)
    assert told == [1 << 20]
    monkeypatch.undo()
    assert isinstance(build.build_eviction(cfg.tiers[0]), LruPolicy)   # the base class's no-op suffices
