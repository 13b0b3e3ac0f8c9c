"""SGLang's hybrid host pools for the v2 storage methods (no SGLang import here).

A hybrid model's HiCache keeps, beside the anchor KV pool (stored through v0/v1 as
before), side pools that SGLang 0.5.23 names in each ``PoolTransfer``:

- ``mamba``: one Mamba / linear-attention state per page boundary (``MambaPoolHost``,
  one slot per page), TP-sharded even where the attention KV is MLA-replicated;
- ``swa`` and ``auxiliary_swa``: the sliding-window layers' KV (an MHA or MLA host
  pool of its own, with its own slots), only the last window of a prefix;
- ``indexer``: a sparse-attention indexer cache addressed by the KV pool's slots
  (``indices_from_pool=kv``).

Each side pool page is ONE block holding the pool's own flat page
(``get_data_page(i, flat=True)``, written back with ``set_from_flat_data_page``), in a
key space of its own: the pool's name, class, layout, dtypes, state shapes and page
bytes enter the namespace, so pages of two pool kinds, or of two geometries, never
share a key. Pools of any other name (DeepSeek V4's compressed pools, draft pools)
are refused by name: their bytes or hit rules are not certified here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore.errors import ConfigError, InvalidArgumentError

# name -> why it is stored the way it is (documentation; every entry is a flat-page pool)
SUPPORTED_POOLS = {
    "mamba": "Mamba/linear-attention state, one slot per page",
    "swa": "sliding-window KV",
    "auxiliary_swa": "second sliding-window KV",
    "indexer": "sparse-attention indexer cache on the KV pool's slots",
}
# Pools whose bytes differ per TP rank even when SGLang's KV is MLA (replicated):
# SGLang's own file backend and should_backup() treat Mamba/KDA state so.
TP_SHARDED_POOLS = {"mamba"}
# Pools that hold attention KV (their uint8 storage needs the KV cache dtype).
KV_POOLS = {"swa", "auxiliary_swa"}


def pool_name(name: Any) -> str:
    """SGLang's ``PoolName`` (a str enum) or a plain string, as its value."""
    return str(getattr(name, "value", name))


def check_pool(name: str, pool: Any) -> None:
    """Refuse a side pool this backend cannot store, naming it."""
    if name not in SUPPORTED_POOLS:
        raise ConfigError(f"sglang: the kvstore HiCache backend does not support SGLang's {name!r} host pool "
                          f"(supported side pools: {', '.join(sorted(SUPPORTED_POOLS))}); this model's "
                          "hybrid cache cannot be stored in kvstore")
    missing = [m for m in ("get_data_page", "get_dummy_flat_data_page", "set_from_flat_data_page")
               if not callable(getattr(pool, m, None))]
    if missing:
        raise ConfigError(f"sglang: the {name!r} host pool ({type(pool).__name__}) has no {', '.join(missing)}; "
                          "kvstore stores side pools as flat pages")


def _dtype(d: Any) -> str:
    return str(d).replace("torch.", "")


def side_pool_signature(name: str, pool: Any) -> tuple[str, str, int, int]:
    """(dtype, layout description, pool page size in slots, flat page bytes) of a side
    pool: everything that changes what a flat page's bytes mean."""
    page = int(getattr(pool, "page_size", 1) or 1)
    page_bytes = int(pool.get_dummy_flat_data_page().nbytes)
    parts = [f"sglang-v2:{name}", type(pool).__name__, f"layout={getattr(pool, 'layout', '?')}",
             f"page={page}", f"page_bytes={page_bytes}"]
    for attr in ("layer_num", "num_mamba_layers", "head_num", "head_dim", "v_head_dim", "kv_lora_rank",
                 "qk_rope_head_dim"):
        value = getattr(pool, attr, None)
        if isinstance(value, int):
            parts.append(f"{attr}={value}")
    if hasattr(pool, "temporal_state_shape"):   # Mamba: state shapes and both dtypes
        parts.append(f"temporal={tuple(pool.temporal_state_shape)}/{_dtype(pool.temporal_dtype)}")
        parts.append(f"conv={[tuple(s) for s in pool.conv_state_shapes]}/{_dtype(pool.conv_dtype)}")
        side = getattr(pool, "slot_state_buffers", ()) or ()
        parts.append(f"side={[(tuple(b.shape[1:]), _dtype(b.dtype)) for b in side]}")
    return _dtype(pool.dtype), ":".join(parts), page, page_bytes


def page_starts(host_indices: Any, n_pages: int, page: int, slots: int) -> np.ndarray:
    """First slot of each of ``n_pages`` pages of ``page`` consecutive slots starting
    at a page boundary inside a pool of ``slots`` slots (0: unknown), none twice.
    Anything else would move bytes of slots SGLang did not name."""
    if host_indices is None or len(host_indices) != n_pages * page:
        got = 0 if host_indices is None else len(host_indices)
        raise InvalidArgumentError(f"host_indices has {got} slots, expected {n_pages} pages x {page}")
    idx = np.asarray(host_indices.cpu() if hasattr(host_indices, "cpu") else host_indices,
                     dtype=np.int64).reshape(n_pages, page)
    starts = idx[:, 0]
    if n_pages and ((idx - starts[:, None] != np.arange(page)).any() or (starts % page).any()
                    or starts.min() < 0 or (slots and starts.max() + page > slots)
                    or len(np.unique(starts)) != n_pages):
        raise InvalidArgumentError(f"host_indices must be whole pages: {page} consecutive slots "
                                   f"from a multiple of {page}, inside the pool, none twice")
    return starts


def restorable_prefixes(kv_pages: int, present: list[bool], policy: str, trailing: int) -> set[int]:
    """The prefix lengths (in pages, 1..kv_pages) one side pool can restore, from which
    of the query's first ``kv_pages`` pages it holds (SGLang's ``PoolHitPolicy``):
    ``all_pages`` needs every page of the prefix, ``trailing_pages`` only its last
    ``trailing``. Any other policy restores nothing (a miss, never a guess)."""
    if policy == "all_pages":
        boundary = next((i for i in range(kv_pages) if not present[i]), kv_pages)
        return set(range(1, boundary + 1))
    if policy == "trailing_pages":
        trailing = max(1, trailing)
        # missing[i]: pages missing in [0, i); a window [lo, hi) is whole when none is missing
        missing = np.concatenate([[0], np.cumsum([not p for p in present[:kv_pages]])])
        return {n for n in range(1, kv_pages + 1) if missing[n] == missing[max(0, n - trailing)]}
    return set()


__all__ = ["KV_POOLS", "SUPPORTED_POOLS", "TP_SHARDED_POOLS", "check_pool", "page_starts", "pool_name",
           "restorable_prefixes", "side_pool_signature"]
