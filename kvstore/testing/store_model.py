"""The Store against a model of what it holds, as Hypothesis state machines (the Store
model of ``kvstore.testing``; ``tests/test_store_stateful.py`` runs them):

- :class:`StoreMachine`: a two-tier Store (small and larger DRAM) against a plain dict
  model, with retention hints (any policy, a fake clock that rules advance);
- :class:`TieredStoreMachine`: DRAM over a lineage-evicting DRAM over NVMe on real
  files, with leases, pins, prefetch and reservations;
- :class:`TenantStoreMachine`: two DRAM tiers with the cache server's tenant ledger
  (quotas per tier) and racing saves of the same keys at different sizes: every tier
  holds a key at one size, and each tenant's ledger per tier is what that tier holds of
  its blocks, never negative.

Needs hypothesis (the ``testing`` extra); not imported by ``kvstore.testing`` itself."""

import hashlib
import shutil
import tempfile
import threading

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstore import Hint, Namespace, Store
from kvstore.keys import BlockKey
from kvstore.policies import EVICTION_NAMES
from kvstore.store.tenants import TAG_BYTES, TenantLedger

BLOCK = 4096
KEYS = Namespace(model="model", dtype="u8", chunk_tokens=1).chunk_keys(np.arange(24))
key_index = st.integers(0, len(KEYS) - 1)
WRITE_MODES = ("back", "through", "selective")
HINTS = st.one_of(st.none(), st.just(Hint(None, discard=True)),
                  st.builds(Hint, st.sampled_from([None, 5.0, 60.0]), st.integers(1, 3)),
                  st.builds(Hint, st.sampled_from([5.0, 60.0]), st.integers(0, 3)))


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


class StoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.store = None
        self.model: dict[int, int] = {}   # key index -> fill byte of the last save
        self.leased: set[int] = set()
        self.clock = Clock()

    @rule(mode=st.sampled_from(WRITE_MODES), top=st.integers(1, 4), bottom=st.integers(2, 10),
          eviction=st.sampled_from(EVICTION_NAMES))
    @precondition(lambda self: self.store is None)
    def open(self, mode, top, bottom, eviction):
        self.store = Store.from_config({
            "tiers": [{"name": "small", "kind": "dram", "capacity": top * BLOCK, "eviction": eviction},
                      {"name": "large", "kind": "dram", "capacity": bottom * BLOCK}],
            "placement": {"write": mode}, "io_threads": 2}, clock=self.clock)

    @rule(idx=st.lists(key_index, min_size=1, max_size=5, unique=True), fill=st.integers(0, 255), hint=HINTS)
    @precondition(lambda self: self.store is not None)
    def save(self, idx, fill, hint):
        srcs = [np.full(BLOCK, (fill + i) % 256, np.uint8) for i in idx]
        already = [self.store.contains([KEYS[i]])[0] for i in idx]
        ok = self.store.save([KEYS[i] for i in idx], srcs, hint=hint).result()
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

    @rule(seconds=st.sampled_from([1.0, 10.0, 100.0]))
    def tick(self, seconds):
        self.clock.now += seconds

    @rule(idx=st.lists(key_index, min_size=1, max_size=6, unique=True), hint=HINTS)
    @precondition(lambda self: self.store is not None)
    def lookup_with_lease(self, idx, hint):
        n = self.store.lookup([KEYS[i] for i in idx], lease_s=10**6, hint=hint)  # outlasts every tick
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
    def hints_only_for_held_blocks(self):
        if self.store:
            hinted = list(self.store._hints)
            assert all(self.store.contains(hinted))
            assert self.store.stats()["hints"]["live"] <= len(hinted)

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


# -- three tiers: DRAM over a lineage-evicting DRAM over NVMe (real files) ---------------

DEEP_KEYS = Namespace(model="deep", dtype="u8", chunk_tokens=1).chunk_keys(np.arange(16))
deep_index = st.integers(0, len(DEEP_KEYS) - 1)
deep_indices = st.lists(deep_index, min_size=1, max_size=4, unique=True)


class TieredStoreMachine(RuleBasedStateMachine):
    """A Store of three tiers (a small DRAM tier with any eviction policy, a DRAM tier
    evicting by lineage, an NVMe tier on real files) against a model of what it holds:
    save, load, lookup with and without a lease, pin/unpin, prefetch, reserve then
    commit or abort (a reservation may stay open across other steps), delete, clear,
    and closing and reopening it (what the NVMe tier held comes back, byte-exact).

    The model: ``model`` is the fill byte each key was first published with (a key
    already held keeps its bytes); ``leases`` and ``pins`` count holders; ``pinned_masks``
    is which tiers held each pinned key after the last step (a pinned block never
    leaves a tier while pinned)."""

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvstore-stateful-")
        self.cfg = None
        self.store = None
        self.model: dict[int, int] = {}
        self.leases: dict[int, int] = {}
        self.pins: dict[int, int] = {}
        self.pinned_masks: dict[int, int] = {}
        self.res = None               # (reservation, key indices, fill) of an open reserve
        self.clock = Clock()

    # -- helpers

    def _quiesce(self):
        # io_threads=1: a no-op queued behind the background work (a reservation's
        # write-through) finishes after it, so every check below sees a settled Store.
        self.store._pool.submit(lambda: None).result()

    def _mask(self, i):
        return sum(1 << t for t, tier in enumerate(self.store.tiers) if tier.contains([DEEP_KEYS[i]])[0])

    def _note_pins(self):
        self.pinned_masks = {i: self._mask(i) for i in self.pins}

    def _published(self, idx, ok, was, fills):
        for i, stored, held, fill in zip(idx, ok, was, fills):
            if stored and not held:
                self.model[i] = fill
            elif stored:
                assert i in self.model

    def _open(self):
        self.store = Store.from_config(self.cfg, clock=self.clock)

    # -- rules

    @initialize(mode=st.sampled_from(WRITE_MODES), top=st.integers(1, 3), middle=st.integers(2, 5),
                bottom=st.integers(3, 10), eviction=st.sampled_from(EVICTION_NAMES))
    def open(self, mode, top, middle, bottom, eviction):
        self.cfg = {
            "tiers": [{"name": "top", "kind": "dram", "capacity": top * BLOCK, "eviction": eviction},
                      {"name": "middle", "kind": "dram", "capacity": middle * BLOCK, "eviction": "lineage"},
                      {"name": "nvme", "kind": "nvme", "path": self.dir, "capacity": bottom * BLOCK,
                       "direct_io": False, "file_bytes": 8 * BLOCK, "io_threads": 1, "index_sync": False,
                       "readahead_bytes": 0}],
            "placement": {"write": mode}, "io_threads": 1}
        self._open()

    @rule(idx=deep_indices, fill=st.integers(0, 255))
    def save(self, idx, fill):
        self._save(idx, fill)

    @rule(start=deep_index, n=st.integers(4, 10), fill=st.integers(0, 255))
    def save_run(self, start, n, fill):
        """A run of consecutive chained keys (a request's prefix): fills the tiers."""
        self._save([(start + j) % len(DEEP_KEYS) for j in range(n)], fill)

    def _save(self, idx, fill):
        fills = [(fill + i) % 256 for i in idx]
        srcs = [np.full(BLOCK, f, np.uint8) for f in fills]
        was = self.store.contains([DEEP_KEYS[i] for i in idx])
        ok = self.store.save([DEEP_KEYS[i] for i in idx], srcs).result()
        self._published(idx, ok, was, fills)

    @rule(idx=st.lists(deep_index, min_size=1, max_size=6, unique=True))
    def load(self, idx):
        keys = [DEEP_KEYS[i] for i in idx]
        held = self.store.contains(keys)
        dsts = [np.full(BLOCK, 0xEE, np.uint8) for _ in idx]
        ok = self.store.load(keys, dsts).result()
        for i, was, hit, dst in zip(idx, held, ok, dsts):
            if hit:
                assert was, "a load hit a key the Store did not hold"
                assert i in self.model, "loaded a block that was never saved"
                assert (dst == self.model[i]).all(), f"wrong bytes for key {i}"
                if self.leases.get(i):
                    self.leases[i] -= 1
                    if not self.leases[i]:
                        del self.leases[i]
            else:
                assert not was, f"key {i} is held but did not load"

    @rule(idx=st.lists(deep_index, min_size=1, max_size=6, unique=True), lease=st.booleans())
    def lookup(self, idx, lease):
        keys = [DEEP_KEYS[i] for i in idx]
        held = self.store.contains(keys)
        expect = next((n for n, h in enumerate(held) if not h), len(held))
        n = self.store.lookup(keys, lease_s=10**6 if lease else None)   # outlasts every tick
        assert n == expect
        if lease:
            for i in idx[:n]:
                self.leases[i] = self.leases.get(i, 0) + 1

    @rule(idx=deep_indices)
    def release(self, idx):
        self.store.release([DEEP_KEYS[i] for i in idx])
        for i in idx:
            if self.leases.get(i):
                self.leases[i] -= 1
                if not self.leases[i]:
                    del self.leases[i]

    @rule(idx=deep_indices)
    def pin(self, idx):
        self.store.pin([DEEP_KEYS[i] for i in idx])
        for i in idx:
            self.pins[i] = self.pins.get(i, 0) + 1

    @rule(idx=deep_indices)
    def unpin(self, idx):
        self.store.unpin([DEEP_KEYS[i] for i in idx])
        for i in idx:
            if self.pins.get(i):
                self.pins[i] -= 1
                if not self.pins[i]:
                    del self.pins[i]

    @rule(idx=st.lists(deep_index, min_size=1, max_size=6, unique=True), tier=st.sampled_from([0, "top", 1]))
    def prefetch(self, idx, tier):
        keys = [DEEP_KEYS[i] for i in idx]
        held = sum(self.store.contains(keys))
        t = 1 if tier == 1 else 0
        already = self.store.tiers[t].contains(keys)
        n = self.store.prefetch(keys, tier).result()
        assert sum(already) <= n <= held
        if t == 0 and len(keys) == 1 and held and n:
            assert self.store.tiers[0].contains(keys) == [True]

    @rule(idx=deep_indices, fill=st.integers(0, 255), evict=st.booleans())
    @precondition(lambda self: self.res is None)
    def reserve(self, idx, fill, evict):
        keys = [DEEP_KEYS[i] for i in idx]
        was = self.store.contains(keys)
        res = self.store.reserve(keys, [BLOCK] * len(keys), evict=evict)
        assert res.present == was
        for j, view in enumerate(res.views):
            assert (view is None) == (res.present[j] or j in res.missing)
            if view is not None:
                assert view.nbytes == BLOCK
                view[:] = (fill + idx[j]) % 256
        self.res = (res, idx, fill)

    @rule(commit=st.integers(0, 3))
    @precondition(lambda self: self.res is not None)
    def end_reservation(self, commit=1):
        """Commit (three times in four) or abort the open reservation."""
        res, idx, fill = self.res
        self.res = None
        if not commit:
            res.abort()
            return
        keys = [DEEP_KEYS[i] for i in idx]
        was = self.store.contains(keys)     # saved by other steps while the reservation was open
        ok = res.commit()
        self._quiesce()
        for j, i in enumerate(idx):
            if res.present[j]:
                assert ok[j]
        self._published(idx, ok, was, [(fill + i) % 256 for i in idx])

    @rule(idx=deep_indices, everything=st.integers(0, 4))
    def delete(self, idx, everything):
        """Delete some keys, or (one time in five) clear the Store."""
        if not everything:
            expect = sum(self.store.contains(DEEP_KEYS))
            assert self.store.clear() == expect
            self.model.clear()
            self.leases.clear()
            return
        keys = [DEEP_KEYS[i] for i in idx]
        expect = sum(self.store.contains(keys))
        assert self.store.delete(keys) == expect
        for i in idx:
            self.model.pop(i, None)
            self.leases.pop(i, None)

    @rule(seconds=st.sampled_from([1.0, 100.0]))
    def tick(self, seconds):
        self.clock.now += seconds

    @rule(flush=st.booleans())
    def reopen(self, flush):
        if self.res is not None:
            self.end_reservation(1)
        if flush:
            self.store.flush()
        nvme = self.store.tiers[2]
        kept = {i for i, k in enumerate(DEEP_KEYS) if nvme.contains([k])[0]}
        self.store.close()
        self._open()
        # only the NVMe tier persists; leases and pins are the old process's
        assert {i for i, k in enumerate(DEEP_KEYS) if self.store.contains([k])[0]} == kept
        self.model = {i: b for i, b in self.model.items() if i in kept}
        self.leases.clear()
        self.pins.clear()

    # -- invariants (after every step)

    @invariant()
    def settled(self):
        if self.store:
            self._quiesce()

    @invariant()
    def capacity_respected(self):
        if self.store:
            for tier in self.store.tiers:
                assert 0 <= tier.used_bytes <= tier.capacity_bytes

    @invariant()
    def index_matches_tiers(self):
        if not self.store:
            return
        where = dict(self.store._where)
        for t, tier in enumerate(self.store.tiers):
            in_tier = set(tier.keys())
            assert in_tier == {k for k, m in where.items() if m >> t & 1}, f"tier {t} and the index disagree"
            # an open reservation's room is taken in the first tier until it ends
            reserved = sum(v is not None for v in self.res[0].views) if self.res and t == 0 else 0
            assert tier.used_bytes == BLOCK * (len(in_tier) + reserved)
        held = {i for i, k in enumerate(DEEP_KEYS) if k in where}
        assert set(where) <= set(DEEP_KEYS)
        assert held <= set(self.model), "the Store holds a key the model never saw published"

    @invariant()
    def every_held_block_reads_exact(self):
        if not self.store:
            return
        for t, tier in enumerate(self.store.tiers):
            keys = list(tier.keys())
            if not keys:
                continue
            dsts = [np.full(BLOCK, 0xEE, np.uint8) for _ in keys]
            assert tier.read_into(keys, dsts) == [True] * len(keys), f"tier {t} lost a block it lists"
            for key, dst in zip(keys, dsts):
                i = DEEP_KEYS.index(key)
                assert (dst == self.model[i]).all(), f"tier {t} holds wrong bytes for key {i}"

    @invariant()
    def leased_and_pinned_blocks_stay(self):
        if not self.store:
            return
        for i in self.leases:
            assert self.store.contains([DEEP_KEYS[i]])[0], f"leased key {i} was evicted"
        for i, before in self.pinned_masks.items():
            if i in self.pins and i in self.model:
                now = self._mask(i)
                assert before & ~now == 0, f"pinned key {i} left tiers {before & ~now:b}"
        self._note_pins()

    @invariant()
    def stats_consistent(self):
        if not self.store:
            return
        s = self.store.stats()
        for name, value in s.items():
            if isinstance(value, int):
                assert value >= 0, name
        assert s["lookup_hits"] <= s["lookups"] * len(DEEP_KEYS)
        assert s["blocks"] == len(self.store._where)
        assert s["leases"] == len(self.leases)
        assert s["pins"] == len(self.pins)
        # a prefix-aware policy places reserved blocks ahead of their commit (kvstore.store.mover
        # _Staged): until the reservation ends they count in the first tier's "blocks"
        # (a save of the same key meanwhile may take it out again: the commit puts it back)
        policy = self.store._levels[0].policy
        top_keys = set(self.store.tiers[0].keys())
        staged = (sum(k in policy and k not in top_keys for k in self.res[0]._plan.inserted)
                  if self.res and self.res[0]._plan else 0)
        for n, (t, entry) in enumerate(zip(self.store.tiers, s["tiers"])):
            for c in ("hits", "misses", "writes", "bytes_written", "bytes_read", "evictions", "spills",
                      "promotions", "rejected", "throttled", "full", "errors", "corruptions"):
                assert entry[c] >= 0, (entry["name"], c)
            assert entry["errors"] == 0 and entry["corruptions"] == 0, entry["name"]
            assert entry["blocks"] == len(set(t.keys())) + (staged if n == 0 else 0)
            policy = self.store._levels[n].policy
            assert all(k in policy for k in t.keys()), f"tier {n} holds a block its policy cannot evict"
            assert entry["used_bytes"] <= entry["capacity_bytes"]
            assert entry["bytes_written"] == BLOCK * entry["writes"]
        assert s["background_errors"] == 0

    def teardown(self):
        if self.res is not None:
            try:
                self.res[0].abort()
            except Exception:
                pass
        if self.store:
            self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


# -- tenants: quotas, and racing re-saves of one key at different sizes ---------------------

TENANTS = {b"tenant-a": "a", b"tenant-b": "b"}     # tag -> name (tags of TAG_BYTES bytes)


def _tenant_keys(tag: bytes, n: int) -> list[BlockKey]:
    """A chain of ``n`` keys in a tenant's space: digests begin with its tag (as the
    cache server maps a tenant's keys; ``kvstore.store.tenants``)."""
    assert len(tag) == TAG_BYTES
    keys, parent = [], None
    for i in range(n):
        digest = tag + hashlib.sha256(tag + i.to_bytes(4, "little")).digest()[:32 - TAG_BYTES]
        keys.append(BlockKey(digest, parent))
        parent = digest
    return keys


TENANT_KEYS = {name: _tenant_keys(tag, 8) for tag, name in TENANTS.items()}
tenant_name = st.sampled_from(sorted(TENANT_KEYS))
tenant_indices = st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True)
SIZES = st.sampled_from([BLOCK // 2, BLOCK, 2 * BLOCK])


class TenantStoreMachine(RuleBasedStateMachine):
    """Two DRAM tiers (any eviction policy, every write mode) with a tenant ledger
    attached (:meth:`Store.set_tenants`, as the cache server does): tenants a and b, each
    with or without a quota per tier, save, save the same keys twice at once at two
    sizes (two saves on the Store's worker pool), load, lease, hint, reserve and delete.

    The model: ``model`` is the version (size, fill) each held key was published with,
    learnt from what the tiers hold after each save (one of the saves that reported it
    stored, or what was held before): a key's size is fixed by its first save, so a racing
    or later save at another size is refused, never indexed. Checked after every step:
    each tier holds each key at one size, the index's; each tenant's ledger in each tier
    is the sum of the sizes that tier holds of its keys, its block count theirs, and it
    never passes the tenant's quota; nothing is left in flight; every block reads exact."""

    def __init__(self):
        super().__init__()
        self.store = None
        self.quotas: dict[str, dict[int, int]] = {}
        self.model: dict[BlockKey, tuple[int, int]] = {}
        self.leased: set[BlockKey] = set()
        self.clock = Clock()

    @initialize(mode=st.sampled_from(WRITE_MODES), eviction=st.sampled_from(EVICTION_NAMES),
                top=st.integers(3, 8), bottom=st.integers(4, 12),
                quota_a=st.sampled_from([None, 0, BLOCK, 3 * BLOCK]), quota_b=st.sampled_from([None, 4 * BLOCK]),
                warm_a=st.sampled_from([None, 2 * BLOCK]))
    def open(self, mode, eviction, top, bottom, quota_a, quota_b, warm_a):
        self.store = Store.from_config({
            "tiers": [{"name": "top", "kind": "dram", "capacity": top * BLOCK, "eviction": eviction, "pin": False},
                      {"name": "warm", "kind": "dram", "capacity": bottom * BLOCK, "pin": False}],
            "placement": {"write": mode}, "io_threads": 2}, clock=self.clock)
        self.quotas = {"a": {i: q for i, q in ((0, quota_a), (1, warm_a)) if q is not None},
                       "b": {0: quota_b} if quota_b is not None else {}}
        self.store.set_tenants(TenantLedger(TENANTS, self.quotas, ["top", "warm"]))

    # -- helpers

    def _quiesce(self):
        """Every task queued on the Store's two workers so far has finished: two tasks
        that wait for each other run only once both workers are free."""
        both = threading.Barrier(2)
        done = [self.store._pool.submit(both.wait, 10) for _ in range(2)]
        for f in done:
            f.result()

    def _srcs(self, keys, size, fill):
        return [np.full(size, (fill + n) % 256, np.uint8) for n, _ in enumerate(keys)]

    def _learn(self, keys, tries):
        """After saves of ``keys``: each held key holds one of the versions it may have
        (what it held before, or a save that reported it stored), at one size in every
        tier; the model learns which. ``tries``: per save, (sources, results)."""
        store = self.store
        for n, key in enumerate(keys):
            candidates = [(src.nbytes, int(src[0])) for srcs, ok in tries for src, good in [(srcs[n], ok[n])] if good]
            if key in self.model:
                candidates.append(self.model[key])
            held = [t for t in store.tiers if t.contains([key])[0]]
            if not held:
                continue
            sizes = {t.nbytes(key) for t in held}
            assert len(sizes) == 1, f"{key!r} is held at sizes {sizes}"
            size = sizes.pop()
            dst = np.zeros(size, np.uint8)
            assert held[0].read_into([key], [dst]) == [True]
            got = (size, int(dst[0]))
            assert (dst == dst[0]).all(), "a block of mixed bytes"
            assert got in candidates, f"{key!r} holds {got}, none of {candidates}"
            self.model[key] = got

    # -- rules

    @rule(tenant=tenant_name, idx=tenant_indices, size=SIZES, fill=st.integers(0, 255))
    def save(self, tenant, idx, size, fill):
        keys = [TENANT_KEYS[tenant][i] for i in idx]
        srcs = self._srcs(keys, size, fill)
        ok = self.store.save(keys, srcs).result()
        self._learn(keys, [(srcs, ok)])

    @rule(tenant=tenant_name, idx=tenant_indices, sizes=st.lists(SIZES, min_size=2, max_size=2, unique=True),
          fill=st.integers(0, 255))
    def race(self, tenant, idx, sizes, fill):
        """The same keys saved twice at once (on the Store's two workers) at two sizes."""
        keys = [TENANT_KEYS[tenant][i] for i in idx]
        first, second = self._srcs(keys, sizes[0], fill), self._srcs(keys, sizes[1], fill + 100)
        f1, f2 = self.store.save(keys, first), self.store.save(keys, second)
        ok1, ok2 = f1.result(), f2.result()
        self._learn(keys, [(first, ok1), (second, ok2)])

    @rule(tenant=tenant_name, idx=tenant_indices, size=SIZES, fill=st.integers(0, 255), commit=st.integers(0, 3))
    def reserve(self, tenant, idx, size, fill, commit):
        """Reserve room, fill it, then commit (three times in four) or abort."""
        keys = [TENANT_KEYS[tenant][i] for i in idx]
        srcs = self._srcs(keys, size, fill)
        res = self.store.reserve(keys, [size] * len(keys))
        for view, src in zip(res.views, srcs):
            if view is not None:
                view[:] = src
        if not commit:
            res.abort()
            return
        ok = res.commit()
        self._quiesce()
        self._learn(keys, [(srcs, ok)])

    @rule(tenant=tenant_name, idx=tenant_indices)
    def load(self, tenant, idx):
        keys = [TENANT_KEYS[tenant][i] for i in idx if TENANT_KEYS[tenant][i] in self.model]
        if not keys:
            return
        dsts = [np.zeros(self.model[k][0], np.uint8) for k in keys]
        ok = self.store.load(keys, dsts).result()
        for key, hit, dst in zip(keys, ok, dsts):
            self.leased.discard(key)
            if hit:
                assert (dst == self.model[key][1]).all(), "wrong bytes"

    @rule(tenant=tenant_name, idx=tenant_indices, lease=st.booleans(), hint=HINTS)
    def lookup(self, tenant, idx, lease, hint):
        keys = [TENANT_KEYS[tenant][i] for i in idx]
        n = self.store.lookup(keys, lease_s=10**6 if lease else None, hint=hint)
        if lease:
            self.leased.update(keys[:n])

    @rule(tenant=tenant_name, idx=tenant_indices)
    def delete(self, tenant, idx):
        keys = [TENANT_KEYS[tenant][i] for i in idx]
        self.store.delete(keys)
        for key in keys:
            self.model.pop(key, None)
            self.leased.discard(key)

    @rule(seconds=st.sampled_from([1.0, 100.0]))
    def tick(self, seconds):
        self.clock.now += seconds

    # -- invariants

    @invariant()
    def ledgers_are_what_the_tiers_hold(self):
        if not self.store:
            return
        self._quiesce()
        store = self.store
        ledger = store._tenants
        stats = store.stats()
        with store._lock:
            where = dict(store._where)
            sizes = dict(store._index.sizes)
            claims = dict(store._index.claims)
            pending = {name: list(per) for name, per in ledger._pending.items()}
        assert not claims, f"sizes still claimed with nothing in flight: {claims}"
        for t, tier in enumerate(store.tiers):
            held = {k: tier.nbytes(k) for k in tier.keys()}
            indexed = {k for k, m in where.items() if m >> t & 1}
            assert set(held) == indexed, (f"tier {t} and the index disagree: held only {set(held) - indexed}, "
                                          f"indexed only {indexed - set(held)}")
            for key, n in held.items():
                assert sizes.get(key) == n, f"tier {t} holds {key!r} at {n} bytes, the index says {sizes.get(key)}"
            assert tier.used_bytes == sum(held.values()) <= tier.capacity_bytes
            for name in ("a", "b"):
                got = stats["tenants"][name]["tiers"][tier.name]
                mine = [n for k, n in held.items() if ledger.owner(k) == name]
                assert got["used_bytes"] >= 0 and pending[name][t] == 0, (name, t, got)
                assert got["used_bytes"] == sum(mine) and got["blocks"] == len(mine), (name, t, got, mine)
                quota = self.quotas[name].get(t)
                assert quota is None or got["used_bytes"] <= quota, (name, t, got)
                assert sum(ledger.charged(name, t).values()) == got["used_bytes"]

    @invariant()
    def every_held_block_reads_exact(self):
        if not self.store:
            return
        for tier in self.store.tiers:
            for key in list(tier.keys()):
                assert key in self.model, f"{key!r} held but never published"
                size, fill = self.model[key]
                dst = np.zeros(size, np.uint8)
                assert tier.read_into([key], [dst]) == [True], f"{key!r} does not read at {size} bytes"
                assert (dst == fill).all()

    @invariant()
    def leased_blocks_stay(self):
        if self.store and self.leased:
            assert all(self.store.contains(sorted(self.leased)))

    def teardown(self):
        if self.store:
            self.store.close()


__all__ = ["StoreMachine", "TenantStoreMachine", "TieredStoreMachine"]
