"""A tenant's quota eviction never walks the shared policy under the Store's lock
(issue 20, review F5; issue 34 item 2). A tenant holding no bytes in a tier (quota 0, or
nothing there yet) is refused there at once; a tenant over its quota walks its own
blocks only (its own order per tier, least recently saved or read first, hinted ones
last), so other tenants' blocks ahead of its own, however many, neither stop it nor
are pulled from the tier's policy (a pull has side effects: S3-FIFO and SIEVE move
skipped keys on). The walk over its own blocks stops after ``WALK_STEPS`` of them,
counted in ``walk_capped``. Real server on 127.0.0.1; keys pulled are counted, never
timed."""

from __future__ import annotations

import numpy as np
import pytest

import kvstore.store.tenants as ledger
from kvstore.client import Client
from kvstore.hint import Hint
from kvstore.keys import Namespace
from tests._servers import ThreadServer, config_dict

BLK = 4096
A, B = "token-of-a", "token-of-b"
TIERS = [{"name": "hot", "kind": "dram", "capacity": "4MiB", "pin": False, "eviction": "lru"},
         {"name": "warm", "kind": "dram", "capacity": "4MiB", "pin": False}]


def _keys(model: str, lo: int, n: int):
    return Namespace(model=model, dtype="uint8", chunk_tokens=1).chunk_keys(np.arange(lo, lo + n))


def _server(quota_b: dict) -> ThreadServer:
    tenants = [{"name": "a", "token": A, "salt": "salt-of-tenant-a-0001"},
               {"name": "b", "token": B, "salt": "salt-of-tenant-b-0001", "quota": quota_b}]
    return ThreadServer(config_dict(tiers=TIERS, tenants=tenants, transport="tcp"))


def _count_pulls(monkeypatch, policy) -> list[int]:
    pulled = [0]
    real = policy.victims

    def victims():
        for key in real():
            pulled[0] += 1
            yield key

    monkeypatch.setattr(policy, "victims", victims)
    return pulled


def _hot(s, tenant: str) -> dict:
    return s.server.stats()["tenants"][tenant]["tiers"]["hot"]


def test_a_tenant_with_nothing_in_a_tier_is_refused_without_a_walk(monkeypatch):
    s = _server({"hot": 0})
    try:
        buf = np.ones(BLK, np.uint8)
        with Client(s.address, token=A) as a, Client(s.address, token=B) as b:
            assert a.save(_keys("a", 0, 200), [buf] * 200).result(10) == [True] * 200
            pulled = _count_pulls(monkeypatch, s.server.store._levels[0].policy)
            for i in range(5):
                assert b.save(_keys("b", i, 1), [buf]).result(10) == [True]   # stored in warm
            assert pulled[0] == 0
            hot = _hot(s, "b")
            assert hot["quota_full"] == 5 and hot["used_bytes"] == 0 and hot["walk_capped"] == 0
            assert s.server.stats()["tenants"]["b"]["tiers"]["warm"]["blocks"] == 5
            assert _hot(s, "a")["blocks"] == 200 and _hot(s, "a")["evictions"] == 0
    finally:
        s.stop()


def _in_hot(s, tenant: str, keys) -> list[bool]:
    """Whether the hot tier holds each of ``tenant``'s ``keys`` (as the server maps them)."""
    named = next(t for t in s.server.tenants.all if t.name == tenant)
    return s.server.store.tiers[0].contains(named.keys(keys, cached=False))


def test_other_tenants_blocks_ahead_never_stop_a_tenants_walk(monkeypatch):
    """Issue 34 item 2: tenant a stores 1,100 small blocks (within its quota) ahead of
    b's; b, at its quota, keeps saving: each new block enters hot, b's own oldest going
    down to warm, and not one key of the tier's policy is pulled for it (the walk was
    over the shared order and stopped at 1,024 keys: none of b's saves entered hot)."""
    tiers = [{"name": "hot", "kind": "dram", "capacity": "8MiB", "pin": False, "eviction": "lru"},
             {"name": "warm", "kind": "dram", "capacity": "8MiB", "pin": False}]
    tenants = [{"name": "a", "token": A, "salt": "salt-of-tenant-a-0001", "quota": {"hot": "6MiB"}},
               {"name": "b", "token": B, "salt": "salt-of-tenant-b-0001", "quota": {"hot": str(4 * BLK)}}]
    s = ThreadServer(config_dict(tiers=tiers, tenants=tenants, transport="tcp"))
    try:
        buf = np.ones(BLK, np.uint8)
        with Client(s.address, token=A) as a, Client(s.address, token=B) as b:
            theirs = _keys("a", 0, 1100)
            for lo in range(0, 1100, 100):
                assert a.save(theirs[lo:lo + 100], [buf] * 100).result(10) == [True] * 100
            mine = _keys("b", 0, 12)
            assert b.save(mine[:4], [buf] * 4).result(10) == [True] * 4       # b at its quota in hot
            pulled = _count_pulls(monkeypatch, s.server.store._levels[0].policy)
            for j in range(4, 12):
                assert b.save(mine[j:j + 1], [buf]).result(10) == [True]
                assert _in_hot(s, "b", mine[j:j + 1]) == [True], f"b's block {j} did not enter hot"
            assert pulled[0] == 0
            hot = _hot(s, "b")
            assert hot["blocks"] == 4 and hot["used_bytes"] == 4 * BLK
            assert hot["evictions"] == 8 and hot["quota_full"] == 0 and hot["walk_capped"] == 0
            assert _in_hot(s, "b", mine) == [False] * 8 + [True] * 4                # b's oldest went first
            assert s.server.stats()["tenants"]["b"]["tiers"]["warm"]["blocks"] == 8   # spilled, not lost
            assert _hot(s, "a")["blocks"] == 1100 and _hot(s, "a")["evictions"] == 0
    finally:
        s.stop()


def test_a_tenants_own_order_puts_its_recent_and_hinted_blocks_last():
    """b's own victims: least recently saved or read first, blocks a live hint holds
    after every other one of its blocks."""
    s = _server({"hot": str(4 * BLK)})
    try:
        buf = np.ones(BLK, np.uint8)
        with Client(s.address, token=B) as b:
            mine = _keys("b", 0, 7)
            assert b.save(mine[:1], [buf], hint=Hint(retain_s=None, priority=3)).result(10) == [True]
            assert b.save(mine[1:4], [buf] * 3).result(10) == [True] * 3      # at its quota
            assert b.load(mine[1:2], [np.zeros(BLK, np.uint8)]).result(10) == [True]   # 1: read last
            assert b.save(mine[4:6], [buf] * 2).result(10) == [True] * 2      # 2 and 3 go
            assert _in_hot(s, "b", mine[:6]) == [True, True, False, False, True, True]
            assert b.save(mine[6:7], [buf]).result(10) == [True]              # then 1, hinted 0 stays
            assert _in_hot(s, "b", mine) == [True, False, False, False, True, True, True]
            assert _hot(s, "b")["evictions"] == 3
    finally:
        s.stop()


def test_a_quota_walk_stops_at_its_step_cap(monkeypatch):
    """The walk over a tenant's own blocks is bounded too: b's blocks all leased, b
    over its quota looks at ``WALK_STEPS`` of them, then refuses the block in hot
    (stored in warm; counted in ``walk_capped``); no other tenant's block is touched."""
    monkeypatch.setattr(ledger, "WALK_STEPS", 16)
    s = _server({"hot": str(20 * BLK)})
    try:
        buf = np.ones(BLK, np.uint8)
        with Client(s.address, token=A) as a, Client(s.address, token=B) as b:
            mine = _keys("b", 0, 20)
            assert b.save(mine, [buf] * 20).result(10) == [True] * 20         # B at its quota in hot
            assert b.lookup(mine, lease_s=3600) == 20                          # none of them evictable
            assert a.save(_keys("a", 0, 64), [buf] * 64).result(10) == [True] * 64
            pulled = _count_pulls(monkeypatch, s.server.store._levels[0].policy)
            assert b.save(_keys("b", 20, 1), [buf]).result(10) == [True]     # refused in hot, into warm
            assert pulled[0] == 0
            hot = _hot(s, "b")
            assert hot["walk_capped"] == 1 and hot["quota_full"] == 1 and hot["blocks"] == 20
            assert _in_hot(s, "b", _keys("b", 20, 1)) == [False]
            assert _hot(s, "a")["evictions"] == 0
            metrics = s.server.metrics.registry.get_sample_value(
                "kvstore_tenant_walk_capped_total", {"tenant": "b", "tier": "hot"})
            assert metrics == 1
    finally:
        s.stop()
