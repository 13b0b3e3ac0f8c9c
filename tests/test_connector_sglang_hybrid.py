"""The SGLang connector's v2 storage methods (``batch_exists_v2`` / ``batch_get_v2`` /
``batch_set_v2``) through SGLang 0.5.23's own hybrid host pool classes on CPU: the KV
anchor (``MHATokenToKVPoolHost``), a sliding-window KV pool (another MHA host pool with
its own slots), a Mamba state pool (``MambaPoolHost``, one slot per page) and a sparse
indexer pool (``DeepSeekV4PagedHostPool`` on the KV pool's slots), called the way
SGLang's HybridCacheController calls them (``PoolTransfer`` with its hit policies,
``HiCacheStorageExtraInfo`` prefix chains)."""

from __future__ import annotations

import pytest

from kvstore.errors import ConfigError
from kvstore.testing import IN_CI
from tests.test_connector_sglang import DYNAMIC, SMALL_STORE, page_hashes, storage_config  # noqa: F401

if IN_CI:
    import sglang  # noqa: F401
else:
    pytest.importorskip("sglang", reason="sglang==0.5.23 not installed (scripts/deps/50-sglang.sh)")
torch = pytest.importorskip("torch")

from sglang.srt.mem_cache.hicache_storage import (HiCacheStorageExtraInfo, PoolHitPolicy, PoolName,  # noqa: E402
                                                  PoolTransfer)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from tests._servers import ThreadServer, config_dict  # noqa: E402
from tests._sglang_env import make_mamba_host_pool, make_mha_host_pool, make_paged_indexer_host_pool  # noqa: E402

P = 4            # tokens per page
N = 4            # pages per prompt
WINDOW = 2       # SWA pages a prefix needs (its last window)


def _fill(t: "torch.Tensor", seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    if t.dtype == torch.uint8:
        t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
    else:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))


class Pools:
    """One hybrid model's host pools: KV anchor, SWA, Mamba, indexer."""

    def __init__(self, mamba_kw=None):
        self.kv = make_mha_host_pool("page_first")
        self.swa = make_mha_host_pool("page_first")   # the KV pool's geometry
        self.mamba = make_mamba_host_pool(**(mamba_kw or {}))
        self.indexer = make_paged_indexer_host_pool(self.kv)

    def buffers(self):
        return [self.kv.kv_buffer, self.swa.kv_buffer, self.mamba.temporal_buffer, *self.mamba.conv_buffer,
                self.indexer.kv_buffer]

    def fill(self, seed: int) -> None:
        for i, b in enumerate(self.buffers()):
            _fill(b, seed + i)

    def zero(self) -> None:
        for b in self.buffers():
            b.zero_()


@pytest.fixture(scope="module")
def pools_ok():
    try:
        Pools()
    except ImportError as exc:
        if IN_CI:
            raise
        pytest.skip(f"SGLang's host pools do not import here: {exc}")


@pytest.fixture
def hybrid(pools_ok):
    made = []

    def make(pools=None, *, register=("kv", "swa", "mamba", "indexer"), mla=False, tp=(0, 1), **extra):
        pools = pools or Pools()
        cfg = storage_config(mla=mla, tp_rank=tp[0], tp_size=tp[1], interface_v1=1,
                             **({"store": SMALL_STORE} | extra))
        backend = StorageBackendFactory.create_backend("dynamic", cfg, pools.kv)
        made.append(backend)
        backend.register_mem_pool_host(pools.kv)
        for name in register:
            backend.register_mem_host_pool_v2(getattr(pools, name), PoolName(name))
        backend.on_host_pools_registered()
        return backend, pools

    yield make
    for b in made:
        b.close()


def slots(start_page: int, pages: int, page: int = P) -> "torch.Tensor":
    return torch.arange(start_page * page, (start_page + pages) * page, dtype=torch.int64)


def save_prompt(backend, keys, *, kv_at=0, swa_at=0, mamba_slot=0, mamba_pages=(N,)) -> None:
    """What SGLang's backup does for one prompt: the KV pages (v1), the indexer pages on
    the KV slots, the SWA window of its last pages, and a Mamba state at each node end
    (``mamba_pages``: the prefix lengths whose state is stored), each with the prefix
    chain ``prefix_keys + keys``."""
    kv_idx = slots(kv_at, len(keys))
    assert all(backend.batch_set_v1(keys, kv_idx, HiCacheStorageExtraInfo(prefix_keys=None)))
    got = backend.batch_set_v2([PoolTransfer(name=PoolName.INDEXER, host_indices=kv_idx, keys=keys)],
                               HiCacheStorageExtraInfo(prefix_keys=None))
    assert got[PoolName.INDEXER] == [True] * len(keys)
    w = keys[-WINDOW:]
    got = backend.batch_set_v2([PoolTransfer(name=PoolName.SWA, host_indices=slots(swa_at, WINDOW), keys=w,
                                             hit_policy=PoolHitPolicy.TRAILING_PAGES)],
                               HiCacheStorageExtraInfo(prefix_keys=keys[:-WINDOW]))
    assert got[PoolName.SWA] == [True] * WINDOW
    for i, n in enumerate(mamba_pages):
        got = backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([mamba_slot + i]),
                                                 keys=[keys[n - 1]], hit_policy=PoolHitPolicy.TRAILING_PAGES)],
                                   HiCacheStorageExtraInfo(prefix_keys=keys[:n - 1]))
        assert got[PoolName.MAMBA] == [True]


def query(backend, keys):
    """SGLang's prefetch query for a hybrid model: placeholder trailing keys (only their
    count matters), the indexer on the KV slots."""
    transfers = [PoolTransfer(name=PoolName.SWA, keys=["__placeholder__"] * WINDOW,
                              hit_policy=PoolHitPolicy.TRAILING_PAGES),
                 PoolTransfer(name=PoolName.MAMBA, keys=["__placeholder__"], hit_policy=PoolHitPolicy.TRAILING_PAGES),
                 PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.KV)]
    return backend.batch_exists_v2(keys, transfers, HiCacheStorageExtraInfo(prefix_keys=None))


def test_round_trip_is_byte_exact_for_every_pool_kind(hybrid):
    backend, pools = hybrid()
    pools.fill(1)
    keys = page_hashes(N, "hyb")
    save_prompt(backend, keys, kv_at=0, swa_at=0, mamba_slot=0)
    want_kv = [pools.kv.get_data_page(p * P).clone() for p in range(N)]
    want_ix = [pools.indexer.get_data_page(p * P).clone() for p in range(N)]
    want_swa = [pools.swa.get_data_page(p * P).clone() for p in range(WINDOW)]
    want_mamba = pools.mamba.get_data_page(0).clone()
    pools.zero()

    res = query(backend, keys)
    assert res.kv_hit_pages == N and N in res.restorable_prefix_pages
    assert res.extra_pool_hit_pages[PoolName.MAMBA] == N and res.extra_pool_hit_pages[PoolName.SWA] == N
    # Load into other slots than the ones saved from, as a prefetch does.
    kv_idx = slots(10, N)
    assert backend.batch_get_v1(keys, kv_idx) == [True] * N
    got = backend.batch_get_v2([PoolTransfer(name=PoolName.INDEXER, host_indices=kv_idx, keys=keys)])
    assert got[PoolName.INDEXER] == [True] * N
    got = backend.batch_get_v2([PoolTransfer(name=PoolName.SWA, host_indices=slots(5, WINDOW), keys=keys[-WINDOW:],
                                             hit_policy=PoolHitPolicy.TRAILING_PAGES),
                                PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([7]), keys=keys[-1:],
                                             hit_policy=PoolHitPolicy.TRAILING_PAGES)],
                               HiCacheStorageExtraInfo(prefix_keys=keys[:-WINDOW]))
    assert got == {PoolName.SWA: [True] * WINDOW, PoolName.MAMBA: [True]}
    assert all(torch.equal(pools.kv.get_data_page((10 + p) * P), want_kv[p]) for p in range(N))
    assert all(torch.equal(pools.indexer.get_data_page((10 + p) * P), want_ix[p]) for p in range(N))
    assert all(torch.equal(pools.swa.get_data_page((5 + p) * P), want_swa[p]) for p in range(WINDOW))
    assert torch.equal(pools.mamba.get_data_page(7), want_mamba)
    assert backend.counters["side_pages_loaded"] == N + WINDOW + 1


def test_a_prefix_hit_is_only_what_every_pool_can_serve(hybrid):
    backend, pools = hybrid()
    pools.fill(2)
    keys = page_hashes(N, "part")
    # Mamba states at the ends of pages 2 and 4 (node boundaries), SWA only for the last window.
    save_prompt(backend, keys, mamba_pages=(2, N))
    res = query(backend, keys)
    # SWA's window (pages 3-4) exists only for the full prefix; Mamba for 2 and 4.
    assert res.kv_hit_pages == N and res.restorable_prefix_pages == [N]
    longer = keys + page_hashes(2, "more")    # two pages nothing stored: the KV pool stops at N
    assert query(backend, longer).kv_hit_pages == N

    # Drop the Mamba state at page 4: no prefix has both SWA's window and a Mamba state.
    backend.store.delete(backend._side["mamba"][1].keys([keys[N - 1]], keys[:N - 1]))
    res = query(backend, keys)
    assert res.kv_hit_pages == 0 and res.restorable_prefix_pages == []
    assert res.extra_pool_hit_pages[PoolName.MAMBA] == 2      # each pool's own verdict is still reported

    # Without the SWA pool in the query, the Mamba state at page 2 serves a 2-page prefix.
    res = backend.batch_exists_v2(keys, [PoolTransfer(name=PoolName.MAMBA, keys=["x"],
                                                      hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert res.kv_hit_pages == 2 and res.restorable_prefix_pages == [2]


def test_an_indexer_gap_cuts_the_prefix(hybrid):
    backend, pools = hybrid()
    pools.fill(3)
    keys = page_hashes(N, "gap")
    save_prompt(backend, keys, mamba_pages=(1, 2, 3, N))
    backend.store.delete(backend._side["indexer"][1].keys([keys[2]], keys[:2]))
    res = backend.batch_exists_v2(keys, [PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.KV)])
    assert res.kv_hit_pages == 2 and res.extra_pool_hit_pages[PoolName.INDEXER] == 2


def test_a_corrupted_side_page_is_a_miss_not_bytes(hybrid):
    backend, pools = hybrid()
    pools.fill(4)
    keys = page_hashes(N, "bad")
    save_prompt(backend, keys)
    pools.zero()
    (key,) = backend._side["mamba"][1].keys(keys[-1:], keys[:-1])
    tier = backend.store.tiers[0]
    offset, _ = tier.offset_of(key)
    tier.arena[offset + 3] ^= 0x40                           # one bit of the stored state
    got = backend.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([3]), keys=keys[-1:],
                                             hit_policy=PoolHitPolicy.TRAILING_PAGES)],
                               HiCacheStorageExtraInfo(prefix_keys=keys[:-1]))
    assert got == {PoolName.MAMBA: [False]}
    assert not pools.mamba.get_data_page(3).any()           # nothing written into the pool
    assert backend.counters["side_pages_missed"] == 1


def test_pool_kinds_and_geometries_never_share_a_key(hybrid):
    backend, pools = hybrid()
    other, _ = hybrid(Pools(mamba_kw={"state_dim": 8}))        # another Mamba geometry
    page = page_hashes(1, "same")
    keys = [backend._v0.keys(page)[0], *backend._v1.keys(page)]
    keys += [backend._side[n][1].keys(page)[0] for n in ("swa", "mamba", "indexer")]
    keys.append(other._side["mamba"][1].keys(page)[0])
    assert len({k.digest for k in keys}) == len(keys)
    assert len({k.namespace for k in keys}) == len(keys) - 1          # v1's K and V segments share one
    # SWA and KV pools of one geometry hold bytes of the same size: a page stored as
    # SWA is not a KV hit, and one stored as KV is not an SWA hit.
    pools.fill(7)
    assert backend.batch_set_v2([PoolTransfer(name=PoolName.SWA, host_indices=slots(0, 1), keys=page)]) == \
        {PoolName.SWA: [True]}
    assert backend.batch_exists(page) == 0
    kv_only = page_hashes(1, "kv-only")
    assert all(backend.batch_set_v1(kv_only, slots(0, 1)))
    res = backend.batch_exists_v2(kv_only, [PoolTransfer(name=PoolName.SWA, keys=["x"],
                                                         hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert res.kv_hit_pages == 0


def test_mamba_state_is_per_tp_rank_even_for_mla(hybrid):
    a, _ = hybrid(mla=True, tp=(0, 2), register=("kv", "mamba"))
    b, _ = hybrid(mla=True, tp=(1, 2), register=("kv", "mamba"))
    page = page_hashes(1, "mla")
    assert a._v1.keys(page)[0].digest == b._v1.keys(page)[0].digest         # MLA KV: one shared copy
    assert a._side["mamba"][1].keys(page)[0].digest != b._side["mamba"][1].keys(page)[0].digest
    # A non-writer rank still stores its own Mamba shard (SGLang's should_backup does too).
    assert not b.is_writer
    t = PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([0]), keys=page)
    assert b.batch_set_v2([t]) == {PoolName.MAMBA: [True]}
    assert b.store.contains(b._side["mamba"][1].keys(page)) == [True]


def test_an_unknown_pool_kind_is_refused_by_name(hybrid, pools_ok):
    pools = Pools()
    cfg = storage_config(interface_v1=1, store=SMALL_STORE)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pools.kv)
    try:
        backend.register_mem_pool_host(pools.kv)
        with pytest.raises(ConfigError, match="deepseek_v4_c4"):
            backend.register_mem_host_pool_v2(pools.swa, PoolName.DEEPSEEK_V4_C4)
        backend.on_host_pools_registered()
        # A dynamic sidecar after start-up is logged and reads as a miss (never raises into the scheduler).
        backend.register_mem_host_pool_v2(pools.swa, PoolName.DRAFT_SWA)
        t = PoolTransfer(name=PoolName.DRAFT_SWA, host_indices=slots(0, 1), keys=page_hashes(1))
        assert backend.batch_set_v2([t]) == {PoolName.DRAFT_SWA: [False]}
        assert backend.batch_get_v2([t]) == {PoolName.DRAFT_SWA: [False]}
        keys = page_hashes(1)
        assert all(backend.batch_set_v1(keys, slots(0, 1)))
        assert backend.batch_exists_v2(keys, [t]).kv_hit_pages == 0
    finally:
        backend.close()


def test_slots_that_are_not_whole_pages_are_refused(hybrid):
    backend, pools = hybrid()
    pools.fill(5)
    keys = page_hashes(2, "odd")
    t = PoolTransfer(name=PoolName.SWA, host_indices=torch.tensor([1, 2, 3, 4, 8, 9, 10, 11]), keys=keys)
    assert backend.batch_set_v2([t]) == {PoolName.SWA: [False, False]}
    t = PoolTransfer(name=PoolName.SWA, host_indices=slots(0, 1), keys=keys)         # one page for two keys
    assert backend.batch_set_v2([t]) == {PoolName.SWA: [False, False]}
    assert backend.counters["side_pages_saved"] == 0


def test_server_mode_round_trip():
    server = ThreadServer(config_dict("32MiB"))
    try:
        made = []
        for _ in range(2):      # two engines (processes) sharing the server
            pools = Pools()
            cfg = storage_config(interface_v1=1, server=server.address)
            backend = StorageBackendFactory.create_backend("dynamic", cfg, pools.kv)
            backend.register_mem_pool_host(pools.kv)
            for name in ("kv", "swa", "mamba", "indexer"):
                backend.register_mem_host_pool_v2(getattr(pools, name), PoolName(name))
            backend.on_host_pools_registered()
            made.append((backend, pools))
        (a, pa), (b, pb) = made
        pa.fill(6)
        keys = page_hashes(N, "srv")
        save_prompt(a, keys)
        assert query(b, keys).kv_hit_pages == N
        got = b.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([2]), keys=keys[-1:]),
                              PoolTransfer(name=PoolName.SWA, host_indices=slots(1, WINDOW), keys=keys[-WINDOW:])],
                             HiCacheStorageExtraInfo(prefix_keys=keys[:-WINDOW]))
        assert got == {PoolName.MAMBA: [True], PoolName.SWA: [True] * WINDOW}
        assert torch.equal(pb.mamba.get_data_page(2), pa.mamba.get_data_page(0))
        assert all(torch.equal(pb.swa.get_data_page((1 + p) * P), pa.swa.get_data_page(p * P)) for p in range(WINDOW))
        a.clear()
        assert query(b, keys).kv_hit_pages == 0
        for backend, _ in made:
            backend.close()
    finally:
        server.stop()
