"""Retention hints through the SGLang backend (issue 22), built by SGLang's own storage
factory over its real host pool: SGLang 0.5.23's HiCache hands the backend only
``HiCacheStorageExtraInfo`` (prefix keys; no request priority, its extra key already
folded into the page hash), so a hint arrives in ``extra_info.extra_info["kvstore"]``,
where a deployment's hook sets it."""

from __future__ import annotations

import pytest

from tests import test_connector_sglang as base

torch = base.torch
make_backend, host_pool_factory = base.make_backend, base.host_pool_factory   # fixtures
HiCacheStorageExtraInfo = base.HiCacheStorageExtraInfo


def hints(backend, keys):
    space = backend._space()
    return [backend.store._hints.get(k) for k in space.keys(keys)]


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_v1_saves_carry_the_extra_info_hint(make_backend, host_pool_factory, layout):
    pool = host_pool_factory(layout, layers=2)
    base.fill(pool, 3)
    backend = make_backend(base.storage_config(store=base.SMALL_STORE, layout=layout, interface_v1=1), pool)
    P = pool.page_size
    keys = base.page_hashes(3, f"hint-{layout}")
    info = HiCacheStorageExtraInfo(extra_info={"kvstore": {"retain_s": 300, "priority": 2}})
    assert backend.batch_set_v1(keys, torch.arange(4 * P, 7 * P), info) == [True] * 3
    recs = hints(backend, keys)
    assert recs and all(r is not None and r.priority == 2 for r in recs)
    # SGLang's own call, with prefix keys only, asks for nothing
    plain = base.page_hashes(2, f"plain-{layout}")
    assert backend.batch_set_v1(plain, torch.arange(8 * P, 10 * P), HiCacheStorageExtraInfo(prefix_keys=None)) \
        == [True, True]
    assert all(r is None for r in hints(backend, plain))


def test_exists_hints_the_cached_prefix_and_bad_hints_are_ignored(make_backend, host_pool_factory, caplog):
    pool = host_pool_factory("page_first", layers=2)
    backend = make_backend(base.storage_config(store=base.SMALL_STORE, interface_v1=1), pool)
    P = pool.page_size
    keys = base.page_hashes(2, "exists-hint")
    assert backend.batch_set_v1(keys, torch.arange(0, 2 * P)) == [True, True]
    info = HiCacheStorageExtraInfo(extra_info={"kvstore": {"discard": True}})
    assert backend.batch_exists(keys + base.page_hashes(1, "absent"), info) == 2
    assert all(r is not None and r.discard for r in hints(backend, keys))
    with caplog.at_level("WARNING", logger="kvstore.connectors"):
        bad = HiCacheStorageExtraInfo(extra_info={"kvstore": {"retain": 5}})
        assert backend.batch_exists(keys, bad) == 2
    assert "unknown hint field" in caplog.text
