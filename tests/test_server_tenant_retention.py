"""Tenants and retention (issue 20 follow-up, with issue 22's hints): no tenant can use
retention hints (``priority``, ``retain_s``), leases or pins to hold more than its quota
in a tier, nor to push another tenant's blocks out beyond what its quota allows.

Leased, pinned and hinted blocks all count in a tenant's bytes (``kvstore.store.tenants``),
so with a quota they stay within it; a hint protects a block only while its tenant holds
no more than a quota in that tier, so a tenant with no quota there hints in vain against
other tenants' blocks. A real server on 127.0.0.1; a hot tier of 16 blocks, LRU."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.hint import MAX_PRIORITY, Hint
from kvstore.keys import BlockKey, Namespace
from kvstore.testing import payload
from tests._servers import ThreadServer, config_dict

BLOCK = 256 * 1024
SLOTS = 16                                  # the hot tier: 4 MiB
QUOTA = 4                                   # tenant q's quota in hot, in blocks
Q, N, B = "token-of-q", "token-of-n", "token-of-b"
TENANTS = [{"name": "q", "token": Q, "salt": "salt-of-tenant-q-0001", "quota": {"hot": QUOTA * BLOCK}},
           {"name": "n", "token": N, "salt": "salt-of-tenant-n-0001"},             # no quota anywhere
           {"name": "b", "token": B, "salt": "salt-of-tenant-b-0001"}]
TIERS = [{"name": "hot", "kind": "dram", "capacity": SLOTS * BLOCK, "pin": False, "eviction": "lru"},
         {"name": "warm", "kind": "dram", "capacity": "64MiB", "pin": False}]
FOREVER = Hint(retain_s=None, priority=MAX_PRIORITY)   # the strongest hint there is


@pytest.fixture
def server():
    s = ThreadServer(config_dict(tiers=TIERS, tenants=TENANTS, transport="tcp"))
    yield s
    s.stop()


def _keys(model: str, lo: int, n: int) -> list[BlockKey]:
    return Namespace(model=model, dtype="uint8", chunk_tokens=1).chunk_keys(np.arange(lo, lo + n))


def _hot(s, tenant: str) -> dict:
    return s.server.stats()["tenants"][tenant]["tiers"]["hot"]


def _b_fills_the_rest(s, b: Client) -> tuple[list[BlockKey], list[np.ndarray]]:
    """B saves what the hot tier holds beyond q's quota, then reads it back (its blocks
    are the most recent: plain LRU would evict q's first)."""
    keys, srcs = _keys("b", 0, SLOTS - QUOTA), [payload(100 + i, BLOCK) for i in range(SLOTS - QUOTA)]
    assert b.save(keys, srcs).result(10) == [True] * len(keys)
    _reads_back(b, keys, srcs)
    return keys, srcs


def _reads_back(c: Client, keys, srcs) -> None:
    dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
    assert c.load(keys, dsts).result(10) == [True] * len(keys)
    assert all(np.array_equal(x, d) for x, d in zip(srcs, dsts))           # the right bytes, not just True


def _b_kept_everything(s, keys) -> None:
    hot = _hot(s, "b")
    assert hot["blocks"] == len(keys) and hot["evictions"] == 0
    assert s.server.store.stats()["tiers"][0]["used_bytes"] <= SLOTS * BLOCK


# -- hints -------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["save", "hint", "lookup"])
def test_hinting_everything_holds_no_more_than_the_quota(server, path):
    """q hints every block it has, the strongest way (priority max, no expiry), by a
    save's hint, a HINT, or a lookup's hint; it holds at most its quota in hot, and B
    keeps all the rest of the tier."""
    s = server
    with Client(s.address, token=Q) as q, Client(s.address, token=B) as b:
        mine = _keys("q", 0, 3 * QUOTA)
        srcs = [payload(i, BLOCK) for i in range(len(mine))]

        def q_saves(lo: int, hi: int) -> None:
            keys = mine[lo:hi]
            assert q.save(keys, srcs[lo:hi], hint=FOREVER if path == "save" else None).result(10) == [True] * len(keys)
            if path == "hint":
                assert q.hint(keys, FOREVER) == len(keys)
            elif path == "lookup":
                assert q.lookup(keys, hint=FOREVER) == len(keys)
            assert _hot(s, "q")["used_bytes"] <= QUOTA * BLOCK

        q_saves(0, QUOTA)
        theirs, _ = _b_fills_the_rest(s, b)
        q_saves(QUOTA, 2 * QUOTA)                      # over its quota: q's own hinted blocks go
        q_saves(2 * QUOTA, 3 * QUOTA)
        _b_kept_everything(s, theirs)
        assert _hot(s, "q")["blocks"] == QUOTA and _hot(s, "q")["evictions"] == 2 * QUOTA
        assert s.server.store.stats()["hints"]["live"] >= 3 * QUOTA   # q's hints are kept, in hot and warm
        _reads_back(q, mine, srcs)                     # spilled to warm, every byte intact


def test_hints_of_a_tenant_without_a_quota_protect_nothing_against_others(server):
    """n has no quota in hot: its hints give its blocks no rank over B's. n saves half
    the tier, hinted the strongest way; B saves the other half and reads it back, then
    saves more: the victims are n's blocks, the oldest (LRU's order), not B's own more
    recent ones (which n's hints would have pushed out first)."""
    s = server
    half = SLOTS // 2
    with Client(s.address, token=N) as n, Client(s.address, token=B) as b:
        first = _keys("n", 0, half)
        assert n.save(first, [payload(i, BLOCK) for i in range(half)], hint=FOREVER).result(10) == [True] * half
        theirs, srcs = _keys("b", 0, half), [payload(100 + i, BLOCK) for i in range(half)]
        assert b.save(theirs, srcs).result(10) == [True] * half
        _reads_back(b, theirs, srcs)
        more = _keys("b", half, QUOTA)                 # the tier is full: room for these
        assert b.save(more, [payload(7, BLOCK)] * QUOTA).result(10) == [True] * QUOTA
        assert _hot(s, "n")["evictions"] == QUOTA and _hot(s, "n")["blocks"] == half - QUOTA
        _b_kept_everything(s, theirs + more)
        _reads_back(b, theirs, srcs)
        assert s.server.store.stats()["hints"]["live"] == half   # still hints (counted, kept): no protection
        store = s.server.store
        for i, tier in enumerate(store.tiers):         # the ledger's unbound keys: those of n and b (no quota), per tier
            held = {k for k in tier.keys() if store._tenants.owner(k) in ("n", "b")}
            assert set(store._tenants._unbound[i]) == held


def test_a_hint_protects_within_the_quota(server):
    """Within its quota q's hints do what they are for: q's hinted blocks outlast B's
    more recent, unhinted ones when the tier is full."""
    s = server
    with Client(s.address, token=Q) as q, Client(s.address, token=B) as b:
        mine = _keys("q", 0, QUOTA)
        assert q.save(mine, [payload(i, BLOCK) for i in range(QUOTA)], hint=FOREVER).result(10) == [True] * QUOTA
        _b_fills_the_rest(s, b)
        more = _keys("b", 100, QUOTA)                   # the tier is full: B's own oldest make room
        assert b.save(more, [payload(7, BLOCK)] * QUOTA).result(10) == [True] * QUOTA
        assert _hot(s, "q")["blocks"] == QUOTA and _hot(s, "q")["evictions"] == 0
        assert _hot(s, "b")["blocks"] == SLOTS - QUOTA and _hot(s, "b")["evictions"] == QUOTA


def test_a_tenant_over_a_lowered_quota_loses_its_hints_protection(server):
    """A quota lowered under what the tenant holds (a restart with a lower quota, before
    its next insert trims it): its hints protect nothing until it is back within it."""
    s = server
    with Client(s.address, token=Q) as q, Client(s.address, token=B) as b:
        mine = _keys("q", 0, QUOTA)
        assert q.save(mine, [payload(i, BLOCK) for i in range(QUOTA)], hint=FOREVER).result(10) == [True] * QUOTA
        with s.server.store._lock:                      # as a restart with a lower quota leaves it
            s.server.store._tenants._quota["q"][0] = (QUOTA - 1) * BLOCK
        theirs, _ = _b_fills_the_rest(s, b)
        more = _keys("b", 100, 2)                       # the tier is full: room for two
        assert b.save(more, [payload(7, BLOCK)] * 2).result(10) == [True] * 2
        # q's oldest went (LRU's order) until q was within its quota; then its hint held
        assert _hot(s, "q")["evictions"] == 1 and _hot(s, "q")["used_bytes"] == (QUOTA - 1) * BLOCK
        assert _hot(s, "b")["evictions"] == 1 and _hot(s, "b")["blocks"] == len(theirs) + 1


# -- leases and pins -----------------------------------------------------------------------------

def test_leasing_everything_holds_no_more_than_the_quota(server):
    """q leases each block it has for a day (the longest lease) and keeps saving: its
    new blocks are refused in hot (counted in quota_full; stored in warm), never
    stored past its quota, and B's blocks are evicted only for B's own saves once the
    tier is full: B always keeps the tier less q's quota."""
    s = server
    with Client(s.address, token=Q) as q, Client(s.address, token=B) as b:
        mine = _keys("q", 0, QUOTA)
        srcs = [payload(i, BLOCK) for i in range(QUOTA)]
        assert q.save(mine, srcs).result(10) == [True] * QUOTA
        assert q.lookup(mine, lease_s=86400) == QUOTA
        more = _keys("q", QUOTA, QUOTA)
        assert q.save(more, [payload(9, BLOCK)] * QUOTA).result(10) == [True] * QUOTA   # into warm
        hot = _hot(s, "q")
        assert hot["used_bytes"] == QUOTA * BLOCK and hot["quota_full"] == QUOTA and hot["evictions"] == 0
        theirs, _ = _b_fills_the_rest(s, b)
        _b_kept_everything(s, theirs)
        extra = _keys("b", 100, QUOTA)                  # the tier is full: B's own oldest make room
        assert b.save(extra, [payload(7, BLOCK)] * QUOTA).result(10) == [True] * QUOTA
        assert _hot(s, "b")["blocks"] == SLOTS - QUOTA and _hot(s, "q")["blocks"] == QUOTA
        _reads_back(q, mine, srcs)                      # and the leased blocks read back intact


def test_pinned_blocks_count_against_the_quota(server):
    """The protocol has no pin (a pin outliving its client would never end); in-process
    code that pins a tenant's blocks in the served Store pins bytes of its quota."""
    s = server
    with Client(s.address, token=Q) as q, Client(s.address, token=B) as b:
        mine = _keys("q", 0, QUOTA)
        assert q.save(mine, [payload(i, BLOCK) for i in range(QUOTA)]).result(10) == [True] * QUOTA
        held = [k for k in s.server.store.tiers[0].keys() if s.server.store._tenants.owner(k) == "q"]
        assert len(held) == QUOTA
        s.server.store.pin(held)
        try:
            assert q.save(_keys("q", QUOTA, 2), [payload(8, BLOCK)] * 2).result(10) == [True] * 2   # into warm
            assert _hot(s, "q")["used_bytes"] == QUOTA * BLOCK and _hot(s, "q")["quota_full"] == 2
            theirs, _ = _b_fills_the_rest(s, b)
            assert b.save(_keys("b", 100, 2), [payload(7, BLOCK)] * 2).result(10) == [True] * 2
            assert _hot(s, "b")["blocks"] == SLOTS - QUOTA and _hot(s, "q")["blocks"] == QUOTA
        finally:
            s.server.store.unpin(held)
