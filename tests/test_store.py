import threading
import time

import numpy as np
import pytest

from kvstore import Namespace, Store
from kvstore.config import load_config
from kvstore.errors import BufferSizeError, InvalidArgumentError, StoreClosedError

BLOCK = 4096


def two_tier(top_blocks=4, bottom_blocks=16, **placement):
    return Store.from_config({
        "tiers": [{"name": "top", "kind": "dram", "capacity": top_blocks * BLOCK},
                  {"name": "bottom", "kind": "dram", "capacity": bottom_blocks * BLOCK}],
        "placement": placement or {"write": "back"},
        "io_threads": 2,
    })


def blocks(n, salt=""):
    keys = Namespace(model="t", dtype="u8", chunk_tokens=1, salt=salt).chunk_keys(np.arange(n))
    return keys, [np.full(BLOCK, i % 251, np.uint8) for i in range(n)]


def test_round_trip_and_prefix_lookup():
    with two_tier() as store:
        keys, srcs = blocks(6)
        assert store.save(keys[:4], srcs[:4]).result() == [True] * 4
        assert store.lookup(keys) == 4
        dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
        assert store.load(keys, dsts).result() == [True] * 4 + [False] * 2
        assert all(np.array_equal(d, s) for d, s in zip(dsts[:4], srcs[:4]))
        assert store.contains(keys) == [True] * 4 + [False] * 2


def test_spill_on_eviction_and_promote_on_hit():
    with two_tier(top_blocks=2) as store:
        keys, srcs = blocks(4)
        for k, s in zip(keys, srcs):
            store.save([k], [s]).result()
        st = store.stats()["tiers"]
        assert st[0]["blocks"] == 2 and st[0]["spills"] == 2 and st[1]["blocks"] == 2
        dst = np.zeros(BLOCK, np.uint8)
        assert store.load([keys[0]], [dst]).result() == [True]  # from the bottom tier
        assert np.array_equal(dst, srcs[0])
        st = store.stats()["tiers"]
        assert st[1]["hits"] == 1 and st[0]["promotions"] == 1
        assert store.tiers[0].contains([keys[0]]) == [True]


def test_write_through_and_capacity():
    with two_tier(top_blocks=2, write="through") as store:
        keys, srcs = blocks(5)
        store.save(keys, srcs).result()
        assert store.tiers[1].contains(keys) == [True] * 5
        for t in store.tiers:
            assert t.used_bytes <= t.capacity_bytes


def test_selective_write_through_after_repeated_hits():
    with two_tier(top_blocks=8, write="selective", selective_threshold=2) as store:
        keys, srcs = blocks(2)
        store.save(keys, srcs).result()
        assert store.tiers[1].contains(keys) == [False, False]
        dst = [np.zeros(BLOCK, np.uint8)]
        store.load(keys[:1], dst).result()
        assert store.tiers[1].contains(keys[:1]) == [False]
        store.load(keys[:1], dst).result()
        assert store.tiers[1].contains(keys) == [True, False]


def test_lease_blocks_eviction_until_loaded_or_expired():
    now = [1000.0]                            # an injected clock: expiry without sleeping
    config = load_config({"tiers": [{"name": "only", "kind": "dram", "capacity": 2 * BLOCK}]})
    with Store(config, clock=lambda: now[0]) as store:
        keys, srcs = blocks(4)
        store.save(keys[:2], srcs[:2]).result()
        assert store.lookup(keys[:2], lease_s=30) == 2
        assert store.save(keys[2:], srcs[2:]).result() == [False, False]  # no room: both leased
        assert store.lookup(keys[:2]) == 2
        store.load(keys[:1], [np.zeros(BLOCK, np.uint8)]).result()  # loading releases that lease
        assert store.save(keys[2:3], srcs[2:3]).result() == [True]
        assert store.contains(keys[:3]) == [False, True, True]
        now[0] += 30.1                        # keys[1]'s 30 s lease has expired
        assert store.lookup(keys[1:3], lease_s=5) == 2
        now[0] += 4.9
        assert store.save(keys[3:], srcs[3:]).result() == [False]  # both still leased
        now[0] += 0.2
        assert store.save(keys[3:], srcs[3:]).result() == [True]  # expired leases no longer protect
        assert store.contains(keys)[3] and sum(store.contains(keys)) == 2


def test_pin_and_delete():
    with Store.from_config({"tiers": [{"name": "only", "kind": "dram", "capacity": 2 * BLOCK}]}) as store:
        keys, srcs = blocks(3)
        store.save(keys[:2], srcs[:2]).result()
        store.pin(keys[:1])
        assert store.save(keys[2:], srcs[2:]).result() == [True]
        assert store.contains(keys) == [True, False, True]
        store.unpin(keys[:1])
        assert store.delete(keys) == 2
        assert store.stats()["blocks"] == 0 and store.tiers[0].used_bytes == 0


def test_prefetch_moves_up():
    with two_tier(top_blocks=2, promote_on_hit=False) as store:
        keys, srcs = blocks(4)
        for k, s in zip(keys, srcs):
            store.save([k], [s]).result()
        assert store.tiers[0].contains(keys[:1]) == [False]
        assert store.prefetch(keys[:1], "top").result() == 1
        assert store.tiers[0].contains(keys[:1]) == [True]
        with pytest.raises(InvalidArgumentError):
            store.prefetch(keys, "nowhere")


def test_bad_input_keeps_store_working():
    with two_tier() as store:
        keys, srcs = blocks(3)
        store.save(keys, srcs).result()
        with pytest.raises(BufferSizeError, match="4096"):
            store.load(keys[:1], [np.zeros(BLOCK - 1, np.uint8)])
        with pytest.raises(InvalidArgumentError, match="2 keys but 1"):
            store.save(keys[:2], srcs[:1])
        with pytest.raises(InvalidArgumentError, match="BlockKey"):
            store.save(["not-a-key"], srcs[:1])
        with pytest.raises(InvalidArgumentError, match="twice"):
            store.save([keys[0], keys[0]], srcs[:2])
        dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
        assert store.load(keys, dsts).result() == [True] * 3
        assert all(np.array_equal(d, s) for d, s in zip(dsts, srcs))
    with pytest.raises(StoreClosedError):
        store.save(keys, srcs)


def test_concurrent_callers_never_see_wrong_bytes():
    store = two_tier(top_blocks=8, bottom_blocks=24)
    keys, _ = blocks(40)
    expected = {k: np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8) for i, k in enumerate(keys)}
    errors, stop = [], time.monotonic() + 3.0

    def worker(seed):
        rng = np.random.default_rng(seed)
        dst = np.zeros(BLOCK, np.uint8)
        try:
            while time.monotonic() < stop:
                batch = [keys[i] for i in rng.choice(len(keys), 4, replace=False)]
                op = rng.integers(3)
                if op == 0:
                    store.save(batch, [expected[k] for k in batch]).result()
                elif op == 1:
                    for k in batch:
                        if store.load([k], [dst]).result()[0] and not np.array_equal(dst, expected[k]):
                            errors.append(f"wrong bytes for {k}")
                else:
                    store.lookup(batch, lease_s=0.01)
                for t in store.tiers:
                    assert t.used_bytes <= t.capacity_bytes
        except Exception as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.close()
    assert not errors, errors[:3]


def test_leases_are_counted_per_holder():
    """Two callers lease the same block: one releasing (or loading) it leaves the other's
    lease in force; the block is evictable again only when both are done."""
    from kvstore.keys import Namespace

    store = Store.from_config({"tiers": [{"name": "hot", "kind": "dram", "capacity": "64KiB"}]})
    try:
        ns = Namespace("m", "f16", 16)
        keys = ns.chunk_keys(np.arange(16 * 16, dtype=np.uint32))
        store.save(keys[:1], [np.full(16384, 1, np.uint8)]).result()
        assert store.lookup(keys[:1], lease_s=60) == 1 and store.lookup(keys[:1], lease_s=60) == 1
        dst = np.empty(16384, np.uint8)
        assert store.load(keys[:1], [dst]).result() == [True]          # consumes one lease
        store.save(keys[1:8], [np.full(16384, 2, np.uint8)] * 7).result()  # pressure: evict what it can
        assert store.contains(keys[:1]) == [True]                       # the other holder's lease held
        assert store.stats()["leases"] == 1
        store.release(keys[:1])
        assert store.stats()["leases"] == 0
    finally:
        store.close()


def test_a_failing_background_prefetch_is_logged_and_counted(caplog):
    """Work nobody waits for (a lookup's prefetch, a reservation's write-through) must not
    lose its exception with its future."""
    from kvstore.keys import Namespace

    store = Store.from_config({"tiers": [{"name": "hot", "kind": "dram", "capacity": "64KiB"},
                                         {"name": "low", "kind": "dram", "capacity": "1MiB"}],
                               "placement": {"prefetch_depth": 4}})
    try:
        keys = Namespace("m", "f16", 16).chunk_keys(np.arange(16 * 8, dtype=np.uint32))
        store.save(keys, [np.full(16384, i, np.uint8) for i in range(8)]).result()   # spills some below

        def broken(*args):
            raise OSError("disk gone")

        store._data.prefetch = broken          # the data path's prefetch (kvstore.store.datapath)
        with caplog.at_level("WARNING"):
            store.lookup(keys[4:])                                    # held by the lower tier only
            deadline = time.monotonic() + 10
            while store.stats()["background_errors"] == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
        assert store.stats()["background_errors"] >= 1 and "disk gone" in caplog.text
    finally:
        store.close()


def test_a_retried_write_never_evicts_its_own_batch_under_the_index():
    # Found by tests/test_store_stateful.py: a prefix-aware tier places a batch in its
    # policy before the write; when part of the batch did not fit, the retry's victims
    # could include blocks of the same batch just written (not yet indexed): deleted
    # from the tier, then indexed as held there.
    import tempfile
    keys = Namespace(model="m", dtype="u8", chunk_tokens=1).chunk_keys(np.arange(16))
    runs = [(0, 4)] * 4 + [(12, 4), (11, 4), (0, 4), (10, 4), (0, 4), (12, 4), (0, 4), (7, 5)]
    with tempfile.TemporaryDirectory() as d, Store.from_config({"tiers": [
            {"name": "top", "kind": "dram", "capacity": 4096},
            {"name": "middle", "kind": "dram", "capacity": 4 * 4096, "eviction": "lineage"},
            {"name": "nvme", "kind": "nvme", "path": d, "capacity": 7 * 4096, "direct_io": False,
             "file_bytes": 8 * 4096, "io_threads": 1, "index_sync": False, "readahead_bytes": 0}],
            "placement": {"write": "through"}, "io_threads": 1}) as store:
        for start, n in runs:
            idx = [(start + j) % 16 for j in range(n)]
            store.save([keys[i] for i in idx], [np.zeros(4096, np.uint8)] * n).result()
            for t, tier in enumerate(store.tiers):
                assert set(tier.keys()) == {k for k, m in store._where.items() if m >> t & 1}, (start, n, t)
