"""Restart persistence: pages an SGLang backend stored through an NVMe-backed
``kvstore serve`` are found by a new backend instance after the server restarts.

Runs the real server as a subprocess on a random loopback port and SGLang's real
host pool; needs the NVMe tier and the cache server client in this build."""

from __future__ import annotations

import importlib.util

import pytest

from kvstore.testing import IN_CI, free_port

if IN_CI:
    import sglang  # noqa: F401
else:
    pytest.importorskip("sglang", reason="sglang==0.5.23 not installed (scripts/deps/50-sglang.sh)")
_missing = [m for m in ("kvstore.tiers.nvme", "kvstore.client", "kvstore.server") if importlib.util.find_spec(m) is None]
if _missing:
    pytest.skip(f"restart test needs {', '.join(_missing)} (the NVMe tier and cache server)", allow_module_level=True)

import torch  # noqa: E402

from tests._sglang_env import make_mha_host_pool  # noqa: E402
from tests._serve import start_server as _start, stop_server as _stop  # noqa: E402
from tests.test_connector_sglang import DYNAMIC, page_hashes  # noqa: E402

def _config(tmp_path, port: int) -> str:
    path = tmp_path / "serve.yaml"
    path.write_text(f"""
server: {{host: 127.0.0.1, port: {port}, admin_port: null}}
placement: {{write: through}}
tiers:
  - {{name: hot, kind: dram, capacity: 32MiB}}
  - {{name: disk, kind: nvme, path: {tmp_path / 'nvme'}, capacity: 64MiB, file_bytes: 16MiB}}
""")
    return str(path)


def _backend(port: int, pool):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    cfg = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="org/restart-model",
        extra_config={**DYNAMIC, "interface_v1": 1, "server": f"127.0.0.1:{port}"})
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    backend.register_mem_pool_host(pool)
    return backend


@pytest.mark.slow
def test_pages_survive_a_server_restart(tmp_path):
    port = free_port()
    config = _config(tmp_path, port)
    log_path = tmp_path / "serve.log"
    pool = make_mha_host_pool("page_first", layers=2)
    gen = torch.Generator().manual_seed(11)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=gen).half())
    P, keys = pool.page_size, page_hashes(4, "restart")
    expect = [pool.get_data_page(i * P).clone() for i in range(4)]

    proc = _start(config, port, log_path)
    try:
        first = _backend(port, pool)
        assert first.batch_set_v1(keys, torch.arange(0, 4 * P)) == [True] * 4
        first.close()
    finally:
        _stop(proc)

    proc = _start(config, port, log_path)
    try:
        fresh_pool = make_mha_host_pool("page_first", layers=2)
        second = _backend(port, fresh_pool)
        assert second.batch_exists(keys + page_hashes(1, "never")) == 4
        assert second.batch_get_v1(keys, torch.arange(8 * P, 12 * P)) == [True] * 4
        for i in range(4):
            assert torch.equal(fresh_pool.get_data_page((8 + i) * P), expect[i])
        second.close()
    finally:
        _stop(proc)


@pytest.mark.slow
def test_corrupt_pages_on_disk_are_not_loaded(tmp_path):
    """Fail closed: after the NVMe data files are scribbled over while the server is
    down, no page is reported loaded."""
    port = free_port()
    config = _config(tmp_path, port)
    log_path = tmp_path / "serve.log"
    pool = make_mha_host_pool("page_first", layers=2)
    pool.kv_buffer.fill_(1.5)
    P, keys = pool.page_size, page_hashes(3, "corrupt")

    proc = _start(config, port, log_path)
    try:
        first = _backend(port, pool)
        assert first.batch_set_v1(keys, torch.arange(0, 3 * P)) == [True] * 3
        first.close()
    finally:
        _stop(proc)

    data_files = sorted((tmp_path / "nvme").rglob("*.kvd"))
    assert data_files, f"no NVMe data files under {tmp_path / 'nvme'}"
    for path in data_files:
        with open(path, "r+b") as f:
            raw = bytearray(f.read())
            for i in range(0, len(raw), 64):
                raw[i] ^= 0xFF
            f.seek(0)
            f.write(raw)

    proc = _start(config, port, log_path)
    try:
        fresh_pool = make_mha_host_pool("page_first", layers=2)
        second = _backend(port, fresh_pool)
        assert second.batch_get_v1(keys, torch.arange(8 * P, 11 * P)) == [False] * 3
        assert second.batch_exists(keys) == 0   # the unreadable copies are dropped
        second.close()
    finally:
        _stop(proc)


@pytest.mark.slow
def test_backend_starts_without_its_server_and_stores_once_it_is_up(tmp_path):
    """A cache is best effort (issue 35, finding 2): SGLang's backend is built while no
    server listens; every query is a miss, every save is skipped (counted), nothing is
    reported loaded, and it reconnects on its own once the server is up."""
    import time

    port = free_port()
    config = _config(tmp_path, port)
    pool = make_mha_host_pool("page_first", layers=2)
    gen = torch.Generator().manual_seed(12)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=gen).half())
    P, keys = pool.page_size, page_hashes(3, "down")
    backend = _backend(port, pool)                  # nothing listens on the port
    try:
        assert backend.batch_exists(keys) == 0
        assert backend.batch_set_v1(keys, torch.arange(0, 3 * P)) == [False] * 3
        sentinel = pool.get_data_page(8 * P).clone()
        assert backend.batch_get_v1(keys[:1], torch.arange(8 * P, 9 * P)) == [False]
        assert torch.equal(pool.get_data_page(8 * P), sentinel)
        got = backend.store.stats()["connectors"]["sglang"]
        assert got["dropped_saves"] == 3 and got["failed_loads"] == 1 and got["unreachable_lookups"] == 1

        proc = _start(config, port, tmp_path / "serve.log")
        try:
            deadline = time.monotonic() + 30
            while not backend.store.stats()["server_link"]["reachable"]:
                assert time.monotonic() < deadline, "the backend did not reconnect"
                time.sleep(0.05)
            expect = [pool.get_data_page(i * P).clone() for i in range(3)]
            assert backend.batch_set_v1(keys, torch.arange(0, 3 * P)) == [True] * 3
            assert backend.batch_exists(keys) == 3
            assert backend.batch_get_v1(keys, torch.arange(8 * P, 11 * P)) == [True] * 3
            assert all(torch.equal(pool.get_data_page((8 + i) * P), expect[i]) for i in range(3))
        finally:
            _stop(proc)
    finally:
        backend.close()
