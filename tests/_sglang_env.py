"""Make SGLang's host-pool modules importable on a CPU-only test machine.

``sglang.srt.mem_cache.pool_host`` imports model configs that import
``torchvision.transforms`` at module level. PyPI's torchvision does not load on the CPU
torch build here (``operator torchvision::nms does not exist``), and no test touches
an image transform, so torchvision (and only torchvision: an image library, not
the code under test) is replaced by empty placeholder modules, plus the
``dist-info`` metadata that transformers reads to learn its version.

Call :func:`import_host_pool` from a test; it returns SGLang's real host-pool
classes. Nothing here is installed into site-packages.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from types import ModuleType
from unittest import mock


_POOL_BUDGET_BYTES = 4 << 30


class _TorchvisionPlaceholder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = mock.MagicMock(name=spec.name)
        module.__spec__, module.__path__, module.__name__ = spec, [], spec.name
        module.__version__ = "0.28.0"
        return module

    def exec_module(self, module: ModuleType) -> None:
        return None


def _drop_torchvision_modules() -> None:
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]


@contextmanager
def _sglang_imports():
    """SGLang's modules import inside this block with the placeholder in place; it is
    removed again after, so later tests in the same session (other engines) see no
    torchvision."""
    try:
        import torchvision  # noqa: F401  (a working torchvision needs no placeholder)
        placeholder = None
    except Exception:
        _drop_torchvision_modules()
        placeholder = _TorchvisionPlaceholder()
    meta = None
    if placeholder is not None:
        meta = tempfile.mkdtemp(prefix="kvstore-tv-meta-")
        info = os.path.join(meta, "torchvision-0.28.0.dist-info")
        os.makedirs(info)
        with open(os.path.join(info, "METADATA"), "w") as f:
            f.write("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\n")
        sys.path.append(meta)
        sys.meta_path.insert(0, placeholder)
    try:
        yield
    finally:
        if placeholder is not None:
            sys.meta_path.remove(placeholder)
            sys.path.remove(meta)
            shutil.rmtree(meta, ignore_errors=True)
            _drop_torchvision_modules()


def import_host_pool():
    """(MHATokenToKVPoolHost, MHABufferInfo, KVBuffers, KVBufferLayout) from SGLang."""
    with _sglang_imports():
        from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    return MHATokenToKVPoolHost, MHABufferInfo, KVBuffers, KVBufferLayout


def make_mamba_host_pool(*, layers: int = 2, slots: int = 8, heads: int = 2, state_dim: int = 4,
                         conv_width: int = 3, conv_dim: int = 6, layout: str = "page_first",
                         temporal_dtype=None, conv_dtype=None):
    """A real SGLang ``MambaPoolHost`` on CPU (one state slot per page) over
    device-side Mamba state tensors of a hybrid model's geometry: a temporal (SSM)
    state ``[layers, slots, heads, state_dim, state_dim]`` and one conv state
    ``[layers, slots, conv_dim, conv_width]``, as SGLang's ``MambaStateBufferInfo``."""
    import torch

    with _sglang_imports():
        from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
        from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
        from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
    temporal = torch.zeros(layers, slots, heads, state_dim, state_dim, dtype=temporal_dtype or torch.float32)
    conv = (torch.zeros(layers, slots, conv_dim, conv_width, dtype=conv_dtype or torch.bfloat16),)
    info = MambaStateBufferInfo(temporal=temporal, conv=conv)
    with host_memory_budget_scope(_POOL_BUDGET_BYTES):
        pool = MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout=layout)
    pool._kvstore_device_state = (temporal, conv)
    return pool


def make_mha_host_pool(layout: str, *, layers: int = 2, heads: int = 2, head_dim: int = 8,
                       page_size: int = 4, device_tokens: int = 64, dtype=None):
    """A real SGLang ``MHATokenToKVPoolHost`` on CPU over freshly allocated device-side
    K/V tensors (CPU tensors stand in for the GPU pool: the host pool only reads
    their geometry and pointer tables here)."""
    import torch

    pool_cls, info_cls, buffers_cls, layout_cls = import_host_pool()
    dtype = dtype or torch.float16
    k = [torch.zeros(device_tokens, heads, head_dim, dtype=dtype) for _ in range(layers)]
    v = [torch.zeros(device_tokens, heads, head_dim, dtype=dtype) for _ in range(layers)]
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)  # noqa: E731
    info = info_cls(buffers=buffers_cls(k=tuple(k), v=tuple(v), k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v),
                                        layout=layout_cls.NHD),
                    page_size=page_size, head_num=heads, head_dim=head_dim, v_head_dim=head_dim,
                    dtype=dtype, device=torch.device("cpu"))
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    # SGLang refuses a host pool when free RAM minus a fixed reserve of several GiB is
    # short, which on a shared 24 GiB test VM depends on what else runs. Book these
    # small pools against an explicit budget instead (SGLang's own mechanism).
    with host_memory_budget_scope(_POOL_BUDGET_BYTES):
        pool = pool_cls(info, 2.0, 0, page_size, layout, pin_memory=False, device="cpu",
                        device_capacity_tokens=device_tokens, start_layer=0, end_layer=layers)
    pool._kvstore_device_kv = (k, v)  # keep the device-side tensors alive with the pool
    return pool


def make_paged_indexer_host_pool(kv_pool, *, layers: int = 2, item_bytes: int = 48):
    """A real SGLang ``DeepSeekV4PagedHostPool`` on CPU: the host pool class behind
    SGLang's sparse-attention indexer side pool (``QSAIndexerPoolHost`` is it over a
    QSA device pool), one byte row per page of ``kv_pool``'s slots, addressed by them."""
    import torch

    with _sglang_imports():
        from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool
        from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    device = [torch.zeros(kv_pool.page_num, item_bytes, dtype=torch.uint8) for _ in range(layers)]
    with host_memory_budget_scope(_POOL_BUDGET_BYTES):
        pool = DeepSeekV4PagedHostPool(pool_name="qsa_indexer", device_buffers=device, item_bytes=item_bytes,
                                       num_host_pages=kv_pool.page_num, slot_page_size=kv_pool.page_size,
                                       layout=kv_pool.layout, device="cpu", pin_memory=False,
                                       page_aligned_only=True)
    pool._kvstore_device = device
    return pool
