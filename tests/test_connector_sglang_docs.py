"""docs/sglang.md's launch command is what SGLang 0.5.23 accepts: parsed with SGLang's
own argument parser and extra-config parser, it builds our backend."""

from __future__ import annotations

import os
import re
import shlex

import pytest

from kvstore.testing import IN_CI

if IN_CI:
    import sglang  # noqa: F401
else:
    pytest.importorskip("sglang", reason="sglang==0.5.23 not installed (scripts/deps/50-sglang.sh)")

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "sglang.md")


def launch_args() -> list[str]:
    text = open(DOC).read()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    command = next(b for b in blocks if "sglang.launch_server" in b)
    argv = shlex.split(command.replace("\\\n", " "))
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    return argv[3:]


def test_documented_launch_flags_build_our_backend():
    import argparse

    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.server_args import ServerArgs

    from kvstore.connectors.sglang import KVStoreHiCacheStorage
    from tests._sglang_env import import_host_pool

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(launch_args())
    assert args.enable_hierarchical_cache and args.hicache_storage_backend == "dynamic"

    import_host_pool()   # SGLang's cache-controller modules need the torchvision placeholder
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    extra = HybridCacheController.parse_storage_backend_extra_config(args.hicache_storage_backend_extra_config)[0]
    assert extra["server"] and extra["interface_v1"] == 1
    extra = {k: v for k, v in extra.items() if k != "server"}   # no server runs here: embedded Store
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False,
                               is_page_first_layout=args.hicache_mem_layout == "page_first",
                               model_name=args.model_path, extra_config=extra)
    backend = StorageBackendFactory.create_backend(args.hicache_storage_backend, cfg, None)
    try:
        assert isinstance(backend, KVStoreHiCacheStorage) and backend.interface_v1
    finally:
        backend.close()
