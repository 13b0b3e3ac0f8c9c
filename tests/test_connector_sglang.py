"""The SGLang connector against the real sglang==0.5.23 (installed by
scripts/deps/50-sglang.sh): SGLang's own storage factory builds the backend, and the
zero-copy tests run against SGLang's real ``MHATokenToKVPoolHost`` on CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from kvstore.errors import ConfigError, InvalidArgumentError
from kvstore.testing import IN_CI

if IN_CI:
    import sglang  # noqa: F401  (CI installs it: a missing engine is a failure there)
else:
    pytest.importorskip("sglang", reason="sglang==0.5.23 not installed (scripts/deps/50-sglang.sh)")

torch = pytest.importorskip("torch")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvstore.connectors.sglang import KVStoreHiCacheStorage  # noqa: E402
from tests._sglang_env import make_mha_host_pool  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DYNAMIC = {"backend_name": "kvstore", "module_path": "kvstore.connectors.sglang", "class_name": "KVStoreHiCacheStorage"}
SMALL_STORE = {"tiers": [{"name": "hot", "kind": "dram", "capacity": "16MiB"}]}


def storage_config(*, tp_rank=0, tp_size=1, mla=False, model="org/tiny-model", layout="page_first",
                   metrics=False, **extra) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=metrics, is_page_first_layout=layout != "layer_first",
        model_name=model, extra_config={**DYNAMIC, **extra})


def page_hashes(n: int, seed: str = "p") -> list[str]:
    import hashlib

    return [hashlib.sha256(f"{seed}{i}".encode()).hexdigest() for i in range(n)]


def flat(i: int, n: int = 256) -> "torch.Tensor":
    return torch.from_numpy(np.random.default_rng(i).standard_normal(n).astype(np.float16))


@pytest.fixture
def make_backend():
    made = []

    def make(cfg: HiCacheStorageConfig, pool=None):
        backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
        if pool is not None:
            backend.register_mem_pool_host(pool)
        made.append(backend)
        return backend

    yield make
    for b in made:
        b.close()


@pytest.fixture(scope="module")
def host_pool_factory():
    try:
        make_mha_host_pool("page_first")
    except ImportError as exc:
        if IN_CI:
            raise
        pytest.skip(f"SGLang's host pool does not import here: {exc}")
    return make_mha_host_pool


def fill(pool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=gen).to(pool.kv_buffer.dtype))


# -- construction through SGLang's factory ---------------------------------------------------


def test_factory_builds_our_class(make_backend):
    backend = make_backend(storage_config(store=SMALL_STORE))
    assert isinstance(backend, KVStoreHiCacheStorage)
    assert backend.model == "org/tiny-model"


def test_unknown_option_is_a_clear_error():
    with pytest.raises(ConfigError, match="unknown option.*stroe"):
        StorageBackendFactory.create_backend("dynamic", storage_config(stroe=SMALL_STORE), None)


def test_store_and_server_together_is_an_error():
    with pytest.raises(ConfigError, match="not both"):
        KVStoreHiCacheStorage(storage_config(store=SMALL_STORE, server="127.0.0.1:1"), {})


def test_bad_lease_is_an_error():
    with pytest.raises(ConfigError, match="lease_s"):
        KVStoreHiCacheStorage(storage_config(store=SMALL_STORE, lease_s="soon"), {})


# -- generic (v0) path -----------------------------------------------------------------------


def test_batch_round_trip(make_backend):
    backend = make_backend(storage_config(store=SMALL_STORE))
    keys = page_hashes(4)
    values = [flat(i) for i in range(4)]
    assert backend.batch_set(keys, values) is True
    dsts = [torch.zeros(256, dtype=torch.float16) for _ in keys]
    got = backend.batch_get(keys, dsts)
    for g, d, v in zip(got, dsts, values):
        assert g is d and torch.equal(d, v)
    assert backend.set("solo", flat(9)) is True
    one = torch.zeros(256, dtype=torch.float16)
    assert backend.get("solo", one) is one and torch.equal(one, flat(9))
    assert backend.get("absent", torch.zeros(256, dtype=torch.float16)) is None
    assert backend.exists("solo") and not backend.exists("absent")


def test_batch_exists_counts_leading_hits(make_backend):
    backend = make_backend(storage_config(store=SMALL_STORE))
    keys = page_hashes(5)
    backend.batch_set([keys[0], keys[1], keys[3]], [flat(0), flat(1), flat(3)])
    assert backend.batch_exists(keys) == 2          # stops at the first gap
    assert backend.batch_exists(keys[3:]) == 1
    assert backend.batch_exists(keys[2:]) == 0
    assert backend.batch_exists([]) == 0


def test_repeated_key_in_one_batch(make_backend):
    backend = make_backend(storage_config(store=SMALL_STORE))
    k = page_hashes(1)[0]
    assert backend.batch_set([k, k], [flat(1), flat(1)]) is True
    dsts = [torch.zeros(256, dtype=torch.float16) for _ in range(2)]
    got = backend.batch_get([k, k], dsts)
    assert all(g is not None for g in got) and torch.equal(dsts[0], flat(1)) and torch.equal(dsts[1], flat(1))


def test_wrong_size_block_is_a_miss_not_bytes(make_backend):
    backend = make_backend(storage_config(store=SMALL_STORE))
    keys = page_hashes(2)
    backend.batch_set(keys, [flat(0), flat(1, 128)])
    dsts = [torch.zeros(256, dtype=torch.float16) for _ in keys]
    got = backend.batch_get(keys, dsts)
    assert got[0] is dsts[0] and got[1] is None
    assert not dsts[1].any()


def test_closed_store_reads_as_misses(make_backend):
    backend = make_backend(storage_config(store=SMALL_STORE))
    keys = page_hashes(2)
    backend.batch_set(keys, [flat(0), flat(1)])
    backend.store.close()
    assert backend.batch_get(keys, [torch.zeros(256, dtype=torch.float16) for _ in keys]) == [None, None]
    assert backend.batch_set(page_hashes(1, "x"), [flat(2)]) is False
    assert backend.batch_exists(keys) == 0
    assert backend.counters["store_failures"] == 3


def test_generic_path_with_real_pool(make_backend, host_pool_factory):
    """What SGLang's controller does without interface_v1: get_data_page -> batch_set,
    batch_get into dummy flat pages -> set_from_flat_data_page."""
    for layout in ("layer_first", "page_first"):
        pool = host_pool_factory(layout)
        fill(pool, 1)
        backend = make_backend(storage_config(store=SMALL_STORE, layout=layout), pool)
        keys, starts = page_hashes(3, layout), [8, 12, 16]
        expect = [pool.get_data_page(s).clone() for s in starts]
        assert backend.batch_set(keys, [pool.get_data_page(s) for s in starts])
        pool.kv_buffer.zero_()
        got = backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
        for s, page in zip([20, 24, 28], got):
            pool.set_from_flat_data_page(s, page)
        for s, e in zip([20, 24, 28], expect):
            assert torch.equal(pool.get_data_page(s), e)


# -- zero-copy (v1) path against SGLang's real host pool ------------------------------------


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_v1_round_trip_real_pool(make_backend, host_pool_factory, layout):
    pool = host_pool_factory(layout, layers=3)
    fill(pool, 2)
    backend = make_backend(storage_config(store=SMALL_STORE, layout=layout, interface_v1=1), pool)
    P = pool.page_size
    keys = page_hashes(4, layout)
    src = torch.arange(4 * P, 8 * P)
    expect = [pool.get_data_page(int(src[i * P])).clone() for i in range(4)]
    assert backend.batch_set_v1(keys, src) == [True] * 4
    assert backend.batch_exists(keys + page_hashes(1, "other")) == 4
    pool.kv_buffer.zero_()
    dst = torch.arange(12 * P, 16 * P)
    assert backend.batch_get_v1(keys, dst) == [True] * 4
    for i in range(4):
        assert torch.equal(pool.get_data_page(int(dst[i * P])), expect[i])
    # nothing outside the destination pages was written
    assert not pool.get_data_page(4 * P).any() and not pool.get_data_page(16 * P).any()


def test_v1_page_with_a_missing_segment_is_not_loaded(make_backend, host_pool_factory):
    pool = host_pool_factory("page_first", layers=2)
    fill(pool, 3)
    backend = make_backend(storage_config(store=SMALL_STORE, interface_v1=1), pool)
    P, keys = pool.page_size, page_hashes(3, "gap")
    backend.batch_set_v1(keys, torch.arange(0, 3 * P))
    block_keys = backend._v1.keys(keys)
    per = backend._v1.segments
    assert per == 2   # K and V
    backend.store.delete([block_keys[per + 1]])   # the V segment of the second page
    assert backend.batch_exists(keys) == 1
    # only whole pages are leased: the second page's K segment is not held
    assert backend.store.stats()["leases"] == per
    got = backend.batch_get_v1(keys, torch.arange(8 * P, 11 * P))
    assert got == [True, False, True]
    assert backend.store.stats()["leases"] == 0


def test_layer_first_v1_stores_one_block_per_page(make_backend, host_pool_factory):
    """layer_first scatters a page over 2 x layers segments; it is stored as one
    block per page, and read back into the pool exactly."""
    layers = 3
    pool = host_pool_factory("layer_first", layers=layers)
    fill(pool, 4)
    backend = make_backend(storage_config(store=SMALL_STORE, layout="layer_first", interface_v1=1), pool)
    P, keys = pool.page_size, page_hashes(5, "lf")
    assert len(pool.get_page_buffer_meta(torch.arange(0, P))[0]) == 2 * layers
    src = torch.arange(4 * P, 9 * P)
    expect = [pool.get_data_page(int(s)).clone() for s in src[::P]]
    assert backend.batch_set_v1(keys, src) == [True] * 5
    stats = backend.store.stats()
    assert stats["blocks"] == 5
    assert stats["tiers"][0]["used_bytes"] >= 5 * pool.get_size_per_token() * P
    assert backend.batch_exists(keys) == 5
    pool.kv_buffer.zero_()
    assert backend.batch_get_v1(keys, torch.arange(12 * P, 17 * P)) == [True] * 5
    for i in range(5):
        assert torch.equal(pool.get_data_page((12 + i) * P), expect[i])
    assert not pool.get_data_page(11 * P).any() and not pool.get_data_page(17 * P).any()


def test_layer_first_failed_page_is_never_written_into_the_pool(make_backend, host_pool_factory):
    pool = host_pool_factory("layer_first", layers=2)
    fill(pool, 5)
    # a staging buffer of two pages: the batch is moved in several rounds
    page_bytes = pool.get_size_per_token() * pool.page_size
    backend = make_backend(storage_config(store=SMALL_STORE, layout="layer_first", interface_v1=1,
                                          staging_bytes=2 * page_bytes), pool)
    P, keys = pool.page_size, page_hashes(5, "lf-gap")
    assert backend.batch_set_v1(keys, torch.arange(0, 5 * P)) == [True] * 5
    expect = [pool.get_data_page(i * P).clone() for i in range(5)]
    backend.store.delete(backend._v1.keys(keys[2:3]))
    sentinel = torch.full_like(pool.get_data_page(0), 7)
    for i in range(5):
        pool.set_from_flat_data_page((10 + i) * P, sentinel)
    assert backend.batch_get_v1(keys, torch.arange(10 * P, 15 * P)) == [True, True, False, True, True]
    assert torch.equal(pool.get_data_page(12 * P), sentinel)       # untouched
    for i in (0, 1, 3, 4):
        assert torch.equal(pool.get_data_page((10 + i) * P), expect[i])
    assert backend.store.stats()["connectors"]["sglang"]["staging_bytes"] == 2 * page_bytes


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_v1_refuses_host_indices_that_are_not_whole_pages(make_backend, host_pool_factory, layout):
    """The pool's own metadata reads only each page's first slot; indices that are
    not whole, aligned pages would move other slots' bytes. Refused instead."""
    pool = host_pool_factory(layout)
    backend = make_backend(storage_config(store=SMALL_STORE, layout=layout, interface_v1=1), pool)
    P, keys = pool.page_size, page_hashes(2, "odd")
    for bad in (torch.arange(1, 2 * P + 1),                                    # not page aligned
                torch.cat([torch.arange(0, P), torch.arange(3 * P, 4 * P)]).flip(0),  # not consecutive
                torch.arange(pool.size, pool.size + 2 * P)):                   # outside the pool
        with pytest.raises(InvalidArgumentError, match="whole pages"):
            backend.batch_set_v1(keys, bad)
        with pytest.raises(InvalidArgumentError, match="whole pages"):
            backend.batch_get_v1(keys, bad)


def test_v1_needs_interface_flag(make_backend, host_pool_factory):
    pool = host_pool_factory("page_first")
    backend = make_backend(storage_config(store=SMALL_STORE), pool)
    with pytest.raises(InvalidArgumentError, match="interface_v1"):
        backend.batch_set_v1(page_hashes(1), torch.arange(0, pool.page_size))


def test_v1_rejects_misaligned_indices(make_backend, host_pool_factory):
    pool = host_pool_factory("page_first")
    backend = make_backend(storage_config(store=SMALL_STORE, interface_v1=1), pool)
    with pytest.raises(InvalidArgumentError, match="host_indices"):
        backend.batch_set_v1(page_hashes(2), torch.arange(0, pool.page_size))


def test_v0_and_v1_key_spaces_do_not_mix(make_backend, host_pool_factory):
    """The flat page (v0) and the pool's segments (v1) are different bytes, so the
    same page hash must give disjoint keys."""
    pool = host_pool_factory("page_first")
    v1 = make_backend(storage_config(store=SMALL_STORE, interface_v1=1), pool)
    v0 = make_backend(storage_config(store=SMALL_STORE), pool)
    keys = page_hashes(2, "mix")
    assert not set(v0._v0.keys(keys)) & set(v1._v1.keys(keys))
    assert v0._v0.ns.digest != v1._v1.ns.digest


# -- namespacing ------------------------------------------------------------------------------


def test_namespace_separates_ranks_models_and_salts(make_backend):
    backend = make_backend(storage_config(store=SMALL_STORE))
    key = page_hashes(1)[0]
    base = backend._v0.keys([key])[0]
    for cfg in (storage_config(tp_rank=1, tp_size=2, store=SMALL_STORE),
                storage_config(model="org/other", store=SMALL_STORE),
                storage_config(namespace="tenant-b", store=SMALL_STORE)):
        other = make_backend(cfg)
        assert other._v0.keys([key])[0] != base


def test_mla_shares_one_copy_across_tp_ranks(make_backend):
    rank0 = make_backend(storage_config(tp_rank=0, tp_size=4, mla=True, store=SMALL_STORE))
    rank2 = KVStoreHiCacheStorage(storage_config(tp_rank=2, tp_size=4, mla=True, store=SMALL_STORE), {})
    try:
        key = page_hashes(1)[0]
        assert rank0._v0.keys([key]) == rank2._v0.keys([key])
        assert rank2.is_writer is False and rank0.is_writer is True
        assert rank2.batch_set([key], [flat(1)]) is True     # not written: rank 0 writes
        assert rank2.store.stats()["blocks"] == 0
    finally:
        rank2.close()


def test_keys_are_stable_across_processes():
    code = ("import sys; sys.path.insert(0, %r);"
            "from connectors._sglang_pages import PageKeys, make_namespace;"
            "from types import SimpleNamespace as S;"
            "cfg = S(tp_rank=1, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False);"
            "ns = make_namespace('m', 'float16', 'L', 4, cfg, 's');"
            "print(PageKeys(ns, 3).keys(['abc', 'def'])[4].hex())") % ROOT
    outs = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                           capture_output=True, text=True, check=True).stdout.strip() for seed in ("1", "2")}
    assert len(outs) == 1 and len(outs.pop()) == 64


# -- metrics and lifecycle -------------------------------------------------------------------


def test_get_stats_drains_storage_metrics(make_backend, host_pool_factory):
    pool = host_pool_factory("page_first")
    fill(pool, 5)
    backend = make_backend(storage_config(store=SMALL_STORE, interface_v1=1, metrics=True), pool)
    keys, P = page_hashes(2, "m"), pool.page_size
    backend.batch_set_v1(keys, torch.arange(0, 2 * P))
    backend.batch_get_v1(keys, torch.arange(4 * P, 6 * P))
    metrics = backend.get_stats()
    assert metrics.backup_pgs == [2] and metrics.prefetch_pgs == [2]
    assert len(metrics.prefetch_bandwidth) == 1 and metrics.prefetch_bandwidth[0] > 0
    assert backend.get_stats().backup_pgs == []
    counters = backend.stats()
    assert counters["pages_saved"] == 2 and counters["pages_loaded"] == 2


def test_prefix_keys_do_not_change_keys(make_backend):
    backend = make_backend(storage_config(store=SMALL_STORE))
    keys = page_hashes(3)
    backend.batch_set(keys[1:], [flat(1), flat(2)])
    info = HiCacheStorageExtraInfo(prefix_keys=keys[:1])
    assert backend.batch_exists(keys[1:], info) == 2


def test_clear_and_close(make_backend):
    backend = make_backend(storage_config(store=SMALL_STORE))
    keys = page_hashes(2)
    backend.batch_set(keys, [flat(0), flat(1)])
    backend.clear()
    assert backend.batch_exists(keys) == 0
    backend.close()
    backend.close()


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "page_head"])
def test_segment_views_match_the_pools_own_metadata(host_pool_factory, layout):
    """The bulk offset computation gives exactly the segments SGLang's
    get_page_buffer_meta reports, for scattered pages; so does the per-page fallback."""
    from kvstore.connectors._sglang_pages import PoolSegments

    pool = host_pool_factory(layout, layers=3)
    P = pool.page_size
    pages = [7, 2, 11, 0]
    idx = torch.cat([torch.arange(p * P, (p + 1) * P) for p in pages])
    ptrs, sizes = pool.get_page_buffer_meta(idx)
    base = pool.kv_buffer.data_ptr()
    segs = PoolSegments(pool)
    assert segs._slope is not None            # SGLang's MHA layouts take the bulk path
    for bulk in (True, False):
        if not bulk:
            segs._slope = None
        views = segs.views(idx, len(pages))
        got = [(v.__array_interface__["data"][0] - base, v.nbytes) for v in views]
        assert got == [(p - base, s) for p, s in zip(ptrs, sizes)]


def test_prefetch_and_backup_threads_at_once(make_backend, host_pool_factory):
    """SGLang calls a backend from its prefetch and backup threads concurrently."""
    import threading

    pool = host_pool_factory("page_first", layers=2, device_tokens=256)
    fill(pool, 6)
    backend = make_backend(storage_config(store=SMALL_STORE, interface_v1=1), pool)
    P = pool.page_size
    stored = page_hashes(8, "stored")
    assert backend.batch_set_v1(stored, torch.arange(0, 8 * P)) == [True] * 8
    expect = [pool.get_data_page(i * P).clone() for i in range(8)]
    errors: list[BaseException] = []

    def backup() -> None:
        try:
            for r in range(20):
                keys = page_hashes(8, f"backup{r}")
                assert backend.batch_set_v1(keys, torch.arange(8 * P, 16 * P)) == [True] * 8
        except BaseException as exc:
            errors.append(exc)

    def prefetch() -> None:
        try:
            for _ in range(20):
                assert backend.batch_exists(stored) == 8
                assert backend.batch_get_v1(stored, torch.arange(16 * P, 24 * P)) == [True] * 8
                for i in range(8):
                    assert torch.equal(pool.get_data_page((16 + i) * P), expect[i])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=backup), threading.Thread(target=prefetch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_connector_metrics_reach_store_stats(make_backend, host_pool_factory):
    """hit_tokens, loaded_tokens, failed_loads, dropped_saves and staging_bytes are
    counted through connectors/_metrics.py and reported in store.stats()."""
    pool = host_pool_factory("page_first")
    fill(pool, 8)
    backend = make_backend(storage_config(store=SMALL_STORE, interface_v1=1), pool)
    P, keys = pool.page_size, page_hashes(4, "metrics")
    assert backend.batch_set_v1(keys, torch.arange(0, 4 * P)) == [True] * 4
    assert backend.batch_exists(keys) == 4
    backend.store.delete(backend._v1.keys(keys[3:]))
    assert backend.batch_get_v1(keys, torch.arange(8 * P, 12 * P)) == [True, True, True, False]
    backend.store.close()                       # a store that fails: the save is dropped
    assert backend.batch_set_v1(page_hashes(2, "late"), torch.arange(0, 2 * P)) == [False, False]
    got = backend.store.stats()["connectors"]["sglang"]
    assert got == {"hit_tokens": 4 * P, "loaded_tokens": 3 * P, "failed_loads": 1, "dropped_saves": 2,
                   "deleted_saves": 0, "staging_bytes": 0, "uncached_requests": 0,
                   "unreachable_lookups": 0, "handoffs_sent": 0, "handoffs_received": 0,
                   "failed_handoffs": 0}
    store = backend.store
    backend.close()
    assert "sglang" not in store.stats()["connectors"]
