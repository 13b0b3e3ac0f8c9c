"""Leases taken by ``batch_exists`` end when SGLang can no longer read those pages.

Driven by SGLang 0.5.23's own cache controller code: its prefetch thread function
queries (``HybridCacheController._storage_hit_query``, one ``batch_exists`` per
prefetch, as the scheduler's controller does) and its transfer function reads
(``_page_transfer``: batches of ``STORAGE_BATCH_SIZE`` pages through ``batch_get_v1``,
stopping at the first failed page or when the prefetch is terminated). Between the
two, ``schedule`` does what ``UnifiedRadixCache._drain_and_alloc_storage_hit`` does
with a queried prefetch: revoke it below ``prefetch_threshold``, or allocate host
pages (possibly fewer than the hit: host capacity) and queue the read. The Store's
lease count must return to 0.
"""

from __future__ import annotations

import queue
import threading

import pytest

from kvstore.testing import IN_CI

if IN_CI:
    import sglang  # noqa: F401
else:
    pytest.importorskip("sglang", reason="sglang==0.5.23 not installed (scripts/deps/50-sglang.sh)")

torch = pytest.importorskip("torch")

from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE, PoolName  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from tests._sglang_env import import_host_pool, make_mha_host_pool  # noqa: E402
from tests.test_connector_sglang import SMALL_STORE, fill, storage_config  # noqa: E402

THRESHOLD = 16   # tokens: SGLang's prefetch_threshold for these tests (4 pages of 4)


class Engine:
    """SGLang's controller code over a real host pool and our backend."""

    def __init__(self, layout: str = "page_first", device_tokens: int = 256, **extra) -> None:
        self.pool = make_mha_host_pool(layout, layers=2, device_tokens=device_tokens)
        import_host_pool()   # the controller modules need the torchvision placeholder too
        from sglang.srt.managers.cache_controller import HiCacheController
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (HybridCacheController,
                                                                              PrefetchOperation)
        from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        self._op, self._handle, self.hashes = PrefetchOperation, CacheRequestHandle, get_storage_hash_str
        self._transfer = HiCacheController._page_transfer   # what the hybrid controller's wraps
        fill(self.pool, 1)
        cfg = storage_config(store=SMALL_STORE, layout=layout, interface_v1=1, **extra)
        self.backend = StorageBackendFactory.create_backend("dynamic", cfg, self.pool)
        self.backend.register_mem_pool_host(self.pool)
        cc = HybridCacheController.__new__(HybridCacheController)   # its storage threads' state only
        cc.page_size = self.pool.page_size
        cc.storage_backend = self.backend
        cc.storage_host_pool = self.pool
        cc.mem_pool_host = HostPoolGroup([PoolEntry(PoolName.KV, self.pool, None, lambda i: i,
                                                    is_primary_index_anchor=True)])
        cc.page_get_func, cc.page_set_func = cc._page_get_zero_copy, cc._page_set_zero_copy
        cc.prefetch_hits_sync_groups, cc.prefetch_completion_sync_groups = [], []
        cc.prefetch_queue, cc.prefetch_hit_queue = queue.Queue(), queue.Queue()
        cc.prefetch_sync_queue = queue.Queue()
        cc.storage_stop_event = threading.Event()
        self.cc = cc
        self.P = self.pool.page_size

    @property
    def leases(self) -> int:
        return self.backend.store.stats()["leases"]

    def store_prefix(self, tokens: list[int]) -> None:
        """Back up ``tokens`` (whole pages) as SGLang's backup thread would."""
        hashes = self.hashes(tokens, None, page_size=self.P)
        host = self.pool.alloc(len(tokens))
        assert self.backend.batch_set_v1(hashes, host) == [True] * len(hashes)
        self.pool.free(host)

    def query(self, *requests: list[int]) -> list:
        """Queue prefetches and run SGLang's prefetch thread function over them."""
        ops = [self._op(self._handle(f"r{i}", 0), tokens) for i, tokens in enumerate(requests)]
        for op in ops:
            self.cc.prefetch_queue.put(op)
        self.cc.storage_stop_event.set()   # the thread function drains the queue, then returns
        self.cc.prefetch_thread_func()
        self.cc.storage_stop_event.clear()
        return [self.cc.prefetch_hit_queue.get_nowait() for _ in ops]

    def schedule(self, op, host_tokens: int | None = None) -> bool:
        """The scheduler's decision on a queried prefetch: revoke below the threshold,
        else allocate host pages (at most ``host_tokens``) and queue the read."""
        hit = op.storage_hit_count
        if op.is_terminated() or hit < THRESHOLD:
            return False
        n = hit if host_tokens is None else min(hit, host_tokens)
        op.storage_hit_count = n
        op.hash_value = op.hash_value[:n // self.P]
        op.host_indices = self.pool.alloc(n)
        return True

    def read(self, op, stop_after_batches: int | None = None) -> int:
        """SGLang's transfer function for one prefetch; with ``stop_after_batches``
        the scheduler terminates it (best_effort/timeout) after that many batches."""
        if stop_after_batches is not None:
            real, done = self.cc._page_get_zero_copy, []

            def get_then_stop(operation, *args):
                got = real(operation, *args)
                done.append(1)
                if len(done) >= stop_after_batches:
                    self.cc.terminate_prefetch(operation)
                return got
            self.cc.page_get_func = get_then_stop
        try:
            self._transfer(self.cc, op)
        finally:
            self.cc.page_get_func = self.cc._page_get_zero_copy
        acks = [self.cc.prefetch_sync_queue.get_nowait() for _ in range(self.cc.prefetch_sync_queue.qsize())]
        return max((a.completed_tokens or 0) for a in acks)

    def close(self) -> None:
        self.backend.close()


@pytest.fixture
def engine():
    made = []

    def make(**kwargs) -> Engine:
        e = Engine(**kwargs)
        made.append(e)
        return e

    try:
        import_host_pool()
    except ImportError as exc:
        if IN_CI:
            raise
        pytest.skip(f"SGLang's host pool does not import here: {exc}")
    yield make
    for e in made:
        e.close()


def tokens(n_pages: int, seed: int, page: int = 4) -> list[int]:
    return [seed * 100_000 + i for i in range(n_pages * page)]


def test_a_finished_prefetch_leaves_no_lease(engine):
    e = engine()
    e.store_prefix(tokens(10, 1))
    (op,) = e.query(tokens(10, 1))
    assert op.storage_hit_count == 40 and e.leases == 2 * 10   # K and V per page
    assert e.schedule(op)
    assert e.read(op) == 40
    assert e.leases == 0


def test_a_prefetch_skipped_below_the_threshold_is_released_by_the_next_read(engine):
    e = engine()
    e.store_prefix(tokens(2, 1))       # 8 tokens: below the threshold, revoked
    e.store_prefix(tokens(6, 2))
    short, long = e.query(tokens(2, 1), tokens(6, 2))
    assert short.storage_hit_count == 8 and long.storage_hit_count == 24
    assert not e.schedule(short)
    assert e.schedule(long)
    assert e.read(long) == 24
    assert e.leases == 0


def test_a_prefetch_truncated_by_host_capacity_releases_the_tail(engine):
    e = engine()
    e.store_prefix(tokens(10, 3))
    (op,) = e.query(tokens(10, 3))
    assert e.schedule(op, host_tokens=24)    # room for 6 of the 10 pages
    assert e.read(op) == 24
    assert e.leases == 0


def test_a_prefetch_cut_short_by_a_page_lost_after_the_query(engine):
    e = engine()
    e.store_prefix(tokens(10, 4))
    (op,) = e.query(tokens(10, 4))
    lost = e.backend._v1.keys(op.hash_value[3:4])
    e.backend.store.delete(lost)             # evicted, deleted: gone before the read
    assert e.schedule(op)
    assert e.read(op) == 12                  # SGLang keeps the 3 pages before it
    assert e.leases == 0


def test_a_prefetch_terminated_between_batches(engine):
    """best_effort / timeout stop a prefetch between batches of STORAGE_BATCH_SIZE
    pages; its unread tail is released by the next prefetch's read."""
    pages = STORAGE_BATCH_SIZE + 4
    e = engine(device_tokens=pages * 4)
    e.store_prefix(tokens(pages, 5))
    e.store_prefix(tokens(5, 6))
    big, small = e.query(tokens(pages, 5), tokens(5, 6))
    assert big.storage_hit_count == pages * 4
    assert e.schedule(big)
    assert e.read(big, stop_after_batches=1) == STORAGE_BATCH_SIZE * 4
    assert e.schedule(small)
    assert e.read(small) == 20
    assert e.leases == 0


def test_overlapping_prefetches_keep_a_shared_page_leased_until_both_are_done(engine):
    e = engine()
    e.store_prefix(tokens(8, 7))
    first, second = e.query(tokens(8, 7), tokens(8, 7))
    assert e.schedule(first, host_tokens=16)    # reads 4 pages, releases its tail
    assert e.read(first) == 16
    # the second prefetch still holds all the pages it was promised (the Store counts
    # one lease per query: the first query's loads consumed only the first's)
    assert e.leases == 2 * 8
    assert e.schedule(second)
    assert e.read(second) == 32
    assert e.leases == 0


def test_clear_and_close_release_what_no_read_followed(engine):
    e = engine()
    e.store_prefix(tokens(6, 8))
    e.query(tokens(6, 8))      # queried, never read (the engine falls idle)
    assert e.leases == 12
    e.backend.clear()
    assert e.leases == 0
    e.store_prefix(tokens(6, 8))
    e.query(tokens(6, 8))
    assert e.leases == 12
    store = e.backend.store
    e.backend.close()          # releases, then closes the store it owns
    assert store.stats()["leases"] == 0
