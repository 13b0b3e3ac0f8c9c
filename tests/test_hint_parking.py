"""Parked hinted blocks (``policies/_parking.py``): over LRU and FIFO the retention layer
takes the hinted blocks its walk passed out of the policy's queue, so a walk no longer
steps over every live-hinted block at the eviction end. The order it offers must be
exactly the walk it replaces: checked against the same layer over the same policy
marked unstamped (which walks the queue, as every other policy does), under random
inserts, reads, re-hints, dropped hints, discard hints, expiry, deletes, skipped
(leased) victims and tenants' bounds."""

import math
import random

import numpy as np
import pytest

from kvstore import Hint, Namespace, Store
from kvstore.policies.fifo import FifoPolicy
from kvstore.policies.lineage import LineagePolicy
from kvstore.policies.lru import LruPolicy
from kvstore.policies.retention import RetentionClasses, TrackedKeys
from kvstore.net.server._tenants import Tenant
from kvstore.store.hints import HintRecord
from kvstore.store.tenants import TenantLedger


class _UnstampedLru(LruPolicy):
    stamped = False


class _UnstampedFifo(FifoPolicy):
    stamped = False


class _SteppedLineage(LineagePolicy):
    holds = False


PAIRS = [(LruPolicy, _UnstampedLru), (FifoPolicy, _UnstampedFifo), (LineagePolicy, _SteppedLineage)]
IDS = ["lru", "fifo", "lineage"]


class _CountingHints(dict):
    """The Store's hint records, counting lookups (what a walk examines)."""

    lookups = 0

    def get(self, key, default=None):
        self.lookups += 1
        return super().get(key, default)


def _frozen(cls, hints, clock) -> RetentionClasses:
    """The layer over ``cls()`` with its trust in hints frozen (the test sets it), so the
    order alone is compared."""
    layer = RetentionClasses(cls(), hints, clock)
    layer.trust._adjust = lambda: None
    return layer


def _drive(seed: int, policy, reference, *, tenants: str | None, steps: int = 2500):
    """Apply one random history to both layers; return the first difference, or None.

    ``tenants``: ``"dynamic"``, bounds that change at random between walks (any container:
    the layer re-checks every parked key); ``"fixed"``, a :class:`TrackedKeys` whose
    membership is drawn per key as it enters (the Store's tenants without a quota), a key
    joining now and then while held (a batch lineage staged before the ledger counted
    it), replaced now and then by a new one (a new ledger) or, for one walk, by a
    dynamic superset (a tenant over a lowered quota) or other bounds."""
    rnd = random.Random(seed)
    now = [0.0]
    hints: dict = {}
    layers = [_frozen(cls, hints, lambda: now[0]) for cls in (policy, reference)]
    bound: set = set()
    fixed = [TrackedKeys()]            # "fixed": the held keys without a quota
    over = [0]                         # "fixed": 1, this walk's bounds are a dynamic superset; 2, others
    if tenants == "dynamic":
        unprotected = lambda: bound or None                                   # noqa: E731
    elif tenants == "fixed":
        unprotected = lambda: ((set(fixed[0]) | bound), bound or None, fixed[0])[over[0] - 1]  # noqa: E731
    for layer in layers:
        layer.unprotected = unprotected if tenants else None
    held: list[str] = []
    parent: dict = {}                  # lineage: chains of keys, as a Store's chunk keys
    gone: list[str] = []               # keys that left (deleted or evicted)
    fresh = iter(range(1 << 30))
    for step in range(steps):
        op = rnd.random()
        over[0] = rnd.choice([1, 2]) if tenants == "fixed" and rnd.random() < 0.06 else 0
        if op < 0.35 or not held:
            if gone and rnd.random() < 0.15:
                key = gone.pop(rnd.randrange(len(gone)))       # saved again after it left
            else:
                key = f"k{next(fresh)}"
                if policy.uses_parent and held and rnd.random() < 0.7:
                    parent[key] = held[-1] if rnd.random() < 0.6 else rnd.choice(held)
            if rnd.random() < 0.2:
                fixed[0].add(key)
            r = rnd.random()
            if r < 0.5:
                hints[key] = HintRecord(now[0] + rnd.choice([5, 50, 500, math.inf]), rnd.randint(0, 2), False, now[0])
            elif r < 0.55:
                hints[key] = HintRecord(math.inf, 0, True, now[0])
            for layer in layers:
                layer.on_insert(key, 1, parent.get(key))
            held.append(key)
        elif op < 0.55:
            key = rnd.choice(held)
            if rnd.random() < 0.3:
                hints[key] = HintRecord(now[0] + rnd.choice([5, 50, 500]), rnd.randint(0, 2), False, now[0])
                for layer in layers:
                    layer.rehint(key)
            reads = rnd.randint(20, 80) if rnd.random() < 0.05 else 1     # (many: heaps compact)
            for _ in range(reads):
                for layer in layers:
                    layer.on_access(key)
        elif op < 0.6:
            key = rnd.choice(held)
            if hints.pop(key, None) is not None:
                for layer in layers:
                    layer.rehint(key)
        elif op < 0.65:
            key = rnd.choice(held)
            held.remove(key)
            gone.append(key)
            fixed[0].discard(key)
            hints.pop(key, None)
            for layer in layers:
                layer.on_remove(key)
                layer.rehint(key)
        elif op < 0.67:
            now[0] += rnd.choice([1, 10, 100])
        elif op < 0.69:
            protect = rnd.choice([math.inf, 3.0, 30.0, 300.0])   # the tier's trust in hints moves
            for layer in layers:
                layer.trust.protect_s = protect
        elif op < 0.7:
            key = rnd.choice(held)                                # inserted again while held
            for layer in layers:
                layer.on_insert(key, 1, parent.get(key))
        elif op < 0.72 and tenants:
            bound.clear()
            if rnd.random() < 0.5:
                bound.update(rnd.sample(held, min(len(held), 5)))
            if tenants == "fixed" and rnd.random() < 0.2:              # a new ledger
                fixed[0] = TrackedKeys()
                for k in held:
                    if rnd.random() < 0.2:
                        fixed[0].add(k)
            elif tenants == "fixed" and rnd.random() < 0.5:            # a held key joins
                fixed[0].add(rnd.choice(held))
        else:
            want, walk_seed = rnd.randint(1, 3), rnd.random()
            seen = []
            for layer in layers:
                offered, evicted = [], []
                for key in layer.victims():
                    offered.append(key)
                    if random.Random(f"{walk_seed}{key}").random() < 0.2:
                        continue              # leased: the Store steps over it
                    layer.on_remove(key)
                    evicted.append(key)
                    if len(evicted) >= want:
                        break
                seen.append((offered, evicted))
            if seen[0] != seen[1]:
                return step, seen
            for key in seen[0][1]:
                held.remove(key)
                gone.append(key)
                fixed[0].discard(key)
                hints.pop(key, None)
                for layer in layers:
                    layer.rehint(key)
        if len(layers[0]) != len(layers[1]) or any((k in layers[0]) != (k in layers[1]) for k in held[-5:]):
            return step, "membership"
    return None


@pytest.mark.parametrize("policy,reference", PAIRS, ids=IDS)
@pytest.mark.parametrize("tenants", [None, "dynamic", "fixed"], ids=["alone", "tenants", "fixed-tenants"])
def test_parked_walk_offers_exactly_the_walk_it_replaces(policy, reference, tenants):
    for seed in range(25):
        assert _drive(seed, policy, reference, tenants=tenants) is None, f"seed {seed}"


@pytest.mark.parametrize("policy,reference", PAIRS[:2], ids=IDS[:2])
@pytest.mark.parametrize("bounded", [False, True], ids=["alone", "fixed-tenants"])
def test_a_walk_past_parked_blocks_examines_only_what_it_offers(policy, reference, bounded):
    """5,000 blocks held by live hints, then unhinted blocks each evicting one: a walk
    over a stamped policy looks at a handful of keys, the queue walk at every hinted one;
    so again after the tier stopped trusting the hints for a while and then trusted them
    again (the blocks that went loose are parked once more). ``bounded``: the tier also
    has tenants' bounds (a :class:`TrackedKeys` of the unhinted blocks, a Store whose
    tenant without a quota saves them), which the walk checks the parked keys against
    only once."""
    looked = []
    for cls in (policy, reference):
        now = [10.0]
        hints = _CountingHints()
        layer = _frozen(cls, hints, lambda: now[0])
        bounds = TrackedKeys()
        if bounded:
            layer.unprotected = lambda: bounds
        for i in range(5000):
            hints[("h", i)] = HintRecord(1e9, 0, False, 0.0)
            layer.on_insert(("h", i), 1)
        for i in range(-1, 200):
            bounds.add(("u", i))
        layer.on_insert(("u", -1), 1)
        assert next(iter(layer.victims())) == ("u", -1)   # the first walk passes them all
        layer.trust.protect_s = 5.0                         # hints 10 s old: not trusted now
        assert next(iter(layer.victims())) == ("h", 0)
        layer.trust.protect_s = math.inf                    # trusted again
        assert next(iter(layer.victims())) == ("u", -1)
        hints.lookups = 0
        for i in range(200):
            layer.on_insert(("u", i), 1)
            victim = next(iter(layer.victims()))
            assert victim == ("u", i - 1)
            layer.on_remove(victim)
        looked.append(hints.lookups / 200)
        assert len(layer) == 5001 and ("h", 0) in layer
    parked, walked = looked
    assert parked <= 4
    assert walked >= 5000


def test_a_lineage_walk_past_held_blocks_examines_only_what_it_offers():
    """Lineage holds the hinted leaves its walk passed out of its heap: with 50 hinted
    chains of 100 blocks, each unhinted save's walk looks at a handful of keys (the
    stepping walk: every hinted leaf), reads of the held leaves included, and once the
    hints expire the hinted chains leave leaf first, each prefix after its extension."""
    looked = []
    for cls in (LineagePolicy, _SteppedLineage):
        now = [10.0]
        hints = _CountingHints()
        layer = _frozen(cls, hints, lambda: now[0])
        for c in range(50):
            for i in range(100):
                hints[(c, i)] = HintRecord(1000.0, 0, False, 0.0)
                layer.on_insert((c, i), 1, (c, i - 1) if i else None)
        layer.on_insert(("u", -1), 1)
        assert next(iter(layer.victims())) == ("u", -1)
        for phase in range(2):
            hints.lookups = 0
            for i in range(100 * phase, 100 * phase + 100):
                layer.on_insert(("u", i), 1)
                if phase:
                    for c in range(50):
                        layer.on_access((c, 99))            # a held leaf read: still held
                victim = next(iter(layer.victims()))
                assert victim == ("u", i - 1)
                layer.on_remove(victim)
            looked.append(hints.lookups / 100)
        now[0] = 2000.0                                     # every hint expired
        order = []
        for _ in range(5000):
            victim = next(k for k in layer.victims() if k != ("u", 199))
            layer.on_remove(victim)
            order.append(victim)
        place = {key: n for n, key in enumerate(order)}
        assert all(place[(c, i)] < place[(c, i - 1)] for c in range(50) for i in range(1, 100))
    held, held_read, stepped, _ = looked
    assert held <= 4 and held_read <= 4
    assert stepped >= 50


def test_a_parked_block_read_under_lru_goes_back_to_the_recent_end_and_fifo_keeps_its_place():
    for cls, read_renews in ((LruPolicy, True), (FifoPolicy, False)):
        now = [0.0]
        hints: dict = {}
        layer = RetentionClasses(cls(), hints, lambda: now[0])
        hints["h"] = HintRecord(10.0, 0, False, 0.0)
        for key in ("h", "a", "b"):
            layer.on_insert(key, 1)
        victim = next(iter(layer.victims()))          # passes (parks) "h", offers "a"
        assert victim == "a"
        layer.on_access("h")
        now[0] = 20.0                                 # "h"'s hint expired: policy order
        assert list(layer.victims()) == (["a", "b", "h"] if read_renews else ["h", "a", "b"])


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_a_store_with_thousands_of_hinted_blocks_still_evicts_in_class_order(policy):
    """Through a real Store: hinted blocks outlast every unhinted one, the oldest
    unhinted leave first, and once the hints expire the hinted blocks leave in the
    policy's order before the newer unhinted ones."""
    clock = [1000.0]
    ns = Namespace(model="park", dtype="u8", chunk_tokens=1)
    keys = ns.chunk_keys(np.arange(3000))
    buf = np.zeros(4096, np.uint8)
    config = {"tiers": [{"name": "t", "kind": "dram", "capacity": 2100 * 4096, "eviction": policy}],
              "io_threads": 1}
    with Store.from_config(config, clock=lambda: clock[0]) as store:
        store.save(keys[:2000], [buf] * 2000, hint=Hint(60)).result()
        for lo in range(2000, 2500, 50):
            store.save(keys[lo:lo + 50], [buf] * 50).result()
        assert all(store.contains(keys[:2000]))              # every hinted block kept
        assert store.contains(keys[2400:2500]) == [True] * 100
        assert not any(store.contains(keys[2000:2400]))      # the oldest unhinted left
        clock[0] += 120                                      # the hints expired
        store.save(keys[2500:2600], [buf] * 100).result()
        held = store.contains(keys[:2000])
        assert held[:100] == [False] * 100 and all(held[100:])
        assert store.contains(keys[2400:2600]) == [True] * 200


def test_a_tenant_that_loses_its_quota_loses_the_protection_of_its_parked_blocks():
    """Through a real Store with tenants: a tenant's hinted blocks, parked by the walks
    while it had a quota, rank in LRU order as soon as a ledger without its quota is
    attached (they are checked once against the new ledger's no-quota keys), so the
    tier's oldest blocks, its hinted ones, leave before the newer unhinted ones."""
    tenant = Tenant("a", "token", "salt-of-tenant-a-0001")
    keys = tenant.keys(Namespace(model="park", dtype="u8", chunk_tokens=1).chunk_keys(np.arange(1600)),
                       cached=False)
    buf = np.zeros(4096, np.uint8)
    config = {"tiers": [{"name": "t", "kind": "dram", "capacity": 1000 * 4096, "eviction": "lru"}],
              "io_threads": 1}
    with Store.from_config(config) as store:
        store.set_tenants(TenantLedger({tenant.tag: "a"}, {"a": {0: 2000 * 4096}}, ["t"]))
        store.save(keys[:500], [buf] * 500, hint=Hint(1e6)).result()
        for lo in range(500, 1200, 100):                     # walks park the hinted blocks
            store.save(keys[lo:lo + 100], [buf] * 100).result()
        assert all(store.contains(keys[:500]))
        assert not any(store.contains(keys[500:700]))
        store.set_tenants(TenantLedger({tenant.tag: "a"}, {"a": {}}, ["t"]))   # no quota now
        for lo in range(1200, 1500, 100):
            store.save(keys[lo:lo + 100], [buf] * 100).result()
        assert not any(store.contains(keys[:300]))           # the oldest, hinted, go first
        assert all(store.contains(keys[300:500])) and all(store.contains(keys[700:1500]))


def test_a_lineage_leaf_made_during_a_walk_and_held_keeps_its_place():
    """A key that becomes a leaf during a walk (its child taken in the ancestors' pass)
    and is then held by its hint keeps its entry through heap compactions, and comes back
    in its place when its hint is dropped (exactly as the stepping walk)."""
    walks = []
    for cls in (LineagePolicy, _SteppedLineage):
        hints: dict = {"A": HintRecord(math.inf, 0, False, 0.0)}
        layer = _frozen(cls, hints, lambda: 0.0)
        for key, parent in (("Z", None), ("A", "Z"), ("B", "A"), ("C", "B"), ("x", None)):
            layer.on_insert(key, 1, parent)
        taken = []
        for key in layer.victims():               # C and x leased: the ancestors' pass
            if key in ("C", "x"):
                continue
            layer.on_remove(key)                  # B taken: A is a leaf now, and held
            taken.append(key)
            if len(taken) == 2:
                break
        for _ in range(200):                      # the heap compacts
            layer.on_access("x")
        del hints["A"]
        layer.rehint("A")
        walks.append((taken, list(layer.victims())))
    assert walks[0] == walks[1] == (["B", "Z"], ["C", "A", "x"])


def test_a_no_quota_tenants_hinted_chain_staged_by_lineage_protects_nothing():
    """Lineage stages a batch into the policy before the Store indexes it, so its walks
    can pass (and hold) a block before the ledger lists it among the no-quota keys; it
    joins that list afterwards and must lose its protection all the same: a tenant
    without a quota cannot keep its blocks by hinting, ahead of a tenant within its own."""
    a = Tenant("a", "token-a", "salt-of-tenant-a-0001")       # no quota
    b = Tenant("b", "token-b", "salt-of-tenant-b-0001")       # a quota: its hints protect
    ns = Namespace(model="park", dtype="u8", chunk_tokens=1)
    ka = a.keys(ns.chunk_keys(np.arange(8)), cached=False)
    kb = b.keys(ns.chunk_keys(np.arange(100, 125)), cached=False)
    buf = np.zeros(4096, np.uint8)
    config = {"tiers": [{"name": "t", "kind": "dram", "capacity": 20 * 4096, "eviction": "lineage"}],
              "io_threads": 1}
    with Store.from_config(config) as store:
        store.set_tenants(TenantLedger({a.tag: "a", b.tag: "b"}, {"a": {}, "b": {0: 10**9}}, ["t"]))
        store.save(kb[:15], [buf] * 15, hint=Hint(1e6)).result()
        store.save(ka, [buf] * 8, hint=Hint(1e6)).result()     # staged into a full tier
        for key in kb[15:25]:
            store.save([key], [buf], hint=Hint(1e6)).result()
        assert not any(store.contains(ka))                     # a's blocks went first
        assert all(store.contains(kb[:10])) and all(store.contains(kb[15:25]))
