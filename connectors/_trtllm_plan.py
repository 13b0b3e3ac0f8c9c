"""Keys, host staging and per-request bookkeeping of the TensorRT-LLM connector (no
TensorRT-LLM import here).

Keys come in two steps so the scheduler (rank 0) can name every rank's blocks:

- a **content key** per full block of tokens: the chained digest of the token ids in
  a namespace of everything that changes a block's bytes and that the scheduler can
  read from ``llm_args`` (model and revision, model dtype, KV cache dtype and
  quantisation, tokens per block, TP/PP sizes), plus what the request adds to its KV
  (:class:`RequestKey`: ``cache_salt``, the LoRA adapter, and each multimodal item's
  hash at the block where the item starts, as TensorRT-LLM's own block keys do);
- a **rank key**: the content key mapped into the namespace of one TP rank and of the
  engine's KV pool as the worker sees it (:class:`PoolLayout`: the resolved torch
  dtype and shape of one block, never ``auto``). Under MLA (one latent per token,
  replicated on every TP rank) the rank part is rank-agnostic: one copy for all ranks.

Workers receive content keys in the metadata and derive their own rank keys; the
scheduler reads the pool layout from the worker of its own process
(:func:`local_layout`), so keys never depend on a guess about the model.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

from kvstore.hint import Hint
from kvstore.keys import BlockKey, Namespace


@dataclass(frozen=True)
class PoolLayout:
    """One block of the engine's primary pool as a worker registered it: the torch
    dtype and the per-block shape ``(layers, kv_factor, tokens*heads*head_dim)``.
    ``kv_factor == 1`` is MLA (one latent, the same on every TP rank)."""

    dtype: str
    block_shape: tuple[int, ...]
    block_nbytes: int

    @property
    def mla(self) -> bool:
        return len(self.block_shape) >= 2 and self.block_shape[1] == 1

    def describe(self) -> str:
        return f"trtllm:v1-primary-pool:{self.dtype}:{'x'.join(map(str, self.block_shape))}"


@dataclass(frozen=True)
class RequestKey:
    """What one request adds to the key of its blocks besides its tokens, stable across
    processes: ``cache_salt``, the LoRA adapter (TensorRT-LLM's ``lora_task_id`` and,
    where the request carries it, the adapter path) and the multimodal items
    (``(position, hash, length)`` each, TensorRT-LLM's ``multimodal_positions``,
    ``multimodal_hashes`` and ``multimodal_lengths``)."""

    salt: str | None = None
    lora: str | None = None
    mm_items: tuple[tuple[int, str, int], ...] = ()
    salt_id: int | None = None   # the binding's ``cache_salt_id``, where the salt text is not exposed

    def namespace_salt(self) -> str:
        """The namespace's salt: the bare ``cache_salt`` for a plain request (keys as
        before), else a JSON record no bare salt can equal (a JSON object's text
        starts with ``{``; a salt that does is encoded as a record too)."""
        plain = self.salt or ""
        if self.lora is None and self.salt_id is None and not plain.startswith("{"):
            return plain
        record = {"cache_salt": plain, "lora": self.lora}
        if self.salt_id is not None:
            record["cache_salt_id"] = self.salt_id
        return json.dumps(record, sort_keys=True, separators=(",", ":"))

    def items_in(self, start: int, end: int) -> list[tuple[int, str, int]]:
        """The multimodal items that start inside token positions ``[start, end)``;
        every later block chains from that block's key."""
        return [item for item in self.mm_items if start <= item[0] < end]


PLAIN = RequestKey()


@dataclass(frozen=True)
class KeyScheme:
    """What every key of one deployment shares. Immutable; safe across threads.

    ``fields`` are the byte-changing settings read from ``llm_args`` (see
    ``connectors.trtllm._scheme``), as ``name=value`` pairs in a fixed order.
    """

    model: str
    dtype: str                  # KV cache dtype as configured ("auto" means the model's)
    tokens_per_block: int
    world_size: int             # TP size
    fields: tuple[tuple[str, str], ...] = ()

    def _content_layout(self) -> str:
        return "trtllm:content;" + ";".join(f"{k}={v}" for k, v in self.fields)

    def content_keys(self, tokens: Sequence[int], ident: RequestKey | str | None) -> list[BlockKey]:
        """Content keys of every full block of ``tokens`` for a request of identity
        ``ident`` (a bare string or ``None``: only a ``cache_salt``). A block where a
        multimodal item starts mixes the item's hash, position and length into its key,
        and every later block chains from it; blocks before the first item keep the
        keys of the same tokens without it (they do not depend on it)."""
        if not isinstance(ident, RequestKey):
            ident = RequestKey(salt=ident)
        ns = Namespace(model=self.model, dtype=self.dtype, chunk_tokens=self.tokens_per_block,
                       layout=self._content_layout(), salt=ident.namespace_salt())
        keys = ns.chunk_keys(list(tokens))
        if not ident.mm_items:
            return keys
        bs, out, mixed = self.tokens_per_block, [], False
        for idx, key in enumerate(keys):
            items = ident.items_in(idx * bs, (idx + 1) * bs)
            if mixed or items:
                mixed = True
                block = key.digest + json.dumps(items, separators=(",", ":")).encode()
                key = ns.key_for(block, parent=out[-1] if out else None)
            out.append(key)
        return out

    def rank_namespace(self, rank: int, layout: PoolLayout) -> Namespace:
        """The namespace rank ``rank`` stores blocks of pool ``layout`` under; under MLA
        every rank shares the namespace of rank 0 (one replicated copy)."""
        rank, world = (0, 1) if layout.mla else (rank, self.world_size)
        return Namespace(model=self.model, dtype=layout.dtype, chunk_tokens=self.tokens_per_block,
                         layout=layout.describe(), rank=rank, world_size=world)

    def storing_ranks(self, layout: PoolLayout) -> range:
        """The ranks whose keys differ: all TP ranks, or only rank 0 under MLA."""
        return range(1 if layout.mla else self.world_size)

    def rank_keys(self, content: Sequence[bytes], rank: int, layout: PoolLayout) -> list[BlockKey]:
        """The keys rank ``rank`` stores the blocks with content digests ``content``
        under; each links to the previous block for lineage-aware eviction."""
        ns = self.rank_namespace(rank, layout)
        out: list[BlockKey] = []
        prev: BlockKey | None = None
        for digest in content:
            key = ns.key_for(digest)
            key = BlockKey(key.digest, prev.digest if prev else None, ns.digest)
            out.append(key)
            prev = key
        return out


# -- host staging ---------------------------------------------------------------------


class HostStaging:
    """A byte budget of reusable host buffers, pinned where CUDA is available (so
    host<->device copies can be asynchronous). ``take`` returns ``None`` rather than
    allocate past ``capacity_bytes``. Thread-safe."""

    def __init__(self, capacity_bytes: int, on_change: Any = None) -> None:
        self.capacity_bytes = int(capacity_bytes)
        self._free: dict[int, list[Any]] = {}
        self._held = 0            # bytes allocated (in use or free for reuse)
        self._lock = threading.Lock()
        self._on_change = on_change

    @property
    def held_bytes(self) -> int:
        return self._held

    def take(self, nbytes: int, count: int) -> list[Any] | None:
        """``count`` buffers of ``nbytes`` each, or ``None`` when over budget."""
        import torch

        out: list[Any] = []
        with self._lock:
            pool = self._free.setdefault(nbytes, [])
            reuse = min(len(pool), count)
            grow = count - reuse
            if self._held + grow * nbytes > self.capacity_bytes:
                self._evict_free_locked(self._held + grow * nbytes - self.capacity_bytes, keep=nbytes)
                if self._held + grow * nbytes > self.capacity_bytes:
                    return None
            for _ in range(reuse):
                out.append(pool.pop())
            self._held += grow * nbytes
        pin = torch.cuda.is_available()
        out.extend(torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(grow))
        self._changed()
        return out

    def give(self, bufs: Sequence[Any]) -> None:
        """Hand buffers back for reuse; the caller's copies from/into them are done."""
        with self._lock:
            for buf in bufs:
                self._free.setdefault(buf.numel(), []).append(buf)

    def _evict_free_locked(self, want: int, keep: int) -> None:
        for size, pool in self._free.items():
            if size == keep:
                continue
            while pool and want > 0:
                pool.pop()
                self._held -= size
                want -= size

    def clear(self) -> None:
        with self._lock:
            for size, pool in self._free.items():
                self._held -= size * len(pool)
            self._free.clear()
        self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self._held)


class LocalRegistry:
    """What the scheduler and the worker of one process share: each worker's pool
    layout, and host buffers the scheduler loaded and verified for the worker
    (``tickets``). Keyed by store URL ("" for embedded). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._layouts: dict[str, dict[int, PoolLayout]] = {}
        self._tickets: dict[int, tuple[HostStaging, list[Any]]] = {}
        self._next = 0

    def set_layout(self, url: str, rank: int, layout: PoolLayout | None) -> None:
        with self._lock:
            ranks = self._layouts.setdefault(url, {})
            if layout is None:
                ranks.pop(rank, None)
            else:
                ranks[rank] = layout

    def layout(self, url: str) -> PoolLayout | None:
        """The layout every worker of this process registered, or ``None`` when there is
        none or they disagree (then nothing is matched: keys would be a guess)."""
        with self._lock:
            seen = set(self._layouts.get(url, {}).values())
        return seen.pop() if len(seen) == 1 else None

    def has_rank(self, url: str, rank: int) -> bool:
        with self._lock:
            return rank in self._layouts.get(url, {})

    def park(self, staging: HostStaging, bufs: list[Any]) -> int:
        with self._lock:
            self._next += 1
            self._tickets[self._next] = (staging, bufs)
            return self._next

    def claim(self, ticket: int) -> tuple[HostStaging, list[Any]] | None:
        with self._lock:
            return self._tickets.pop(ticket, None)


LOCAL = LocalRegistry()


# -- metadata and per-request state --------------------------------------------------


@dataclass
class Transfer:
    """One block to move: the request it belongs to, the engine's block id, and the
    block's content digest. Picklable: it travels in the broadcast metadata."""

    request_id: int
    block_id: int
    content: bytes
    hint: Hint | None = None   # saves: from the block's retention priority (trtllm.retention_hint)


@dataclass
class LoadGroup:
    """One request's loads for a forward pass. ``ticket``: host buffers the scheduler
    already loaded and verified in this process (one per transfer, in order); ``None``
    when each worker loads its own shard. ``tokens``: tokens the engine accepted."""

    request_id: int
    transfers: list[Transfer]
    tokens: int
    ticket: int | None = None


@dataclass
class ConnectorMeta:
    """What the scheduler broadcasts to every worker for one forward pass."""

    loads: list[LoadGroup] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


@dataclass
class PendingMatch:
    """The answer ``get_num_new_matched_tokens`` gave, waiting for the request to be
    scheduled: blocks [first, stored) are to be loaded, for the tokens
    [num_computed, accepted_end) the engine takes from the connector."""

    num_computed: int
    first: int
    stored: int
    content: list[bytes]
    leased: list[list[BlockKey]]
    accepted_end: int
    ticket: int | None = None


@dataclass
class RequestState:
    """Tokens and block ids seen so far for one in-flight request."""

    ident: RequestKey | None      # None: the connector never saw the request; nothing is saved
    tokens: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    content: list[bytes] = field(default_factory=list)
    saved_upto: int = 0        # blocks below this are stored (or being stored)
    priorities: list[int | None] = field(default_factory=list)   # per block, as TensorRT-LLM reports them
    saves_scheduled: bool = False

    def content_upto(self, scheme: KeyScheme, n_blocks: int) -> list[bytes]:
        """Content digests of the first ``n_blocks`` blocks (rehashed only when that
        number grows)."""
        if len(self.content) < n_blocks:
            keys = scheme.content_keys(self.tokens[:n_blocks * scheme.tokens_per_block], self.ident)
            self.content = [k.digest for k in keys]
        return self.content[:n_blocks]


__all__ = ["LOCAL", "PLAIN", "ConnectorMeta", "HostStaging", "KeyScheme", "LoadGroup", "LocalRegistry", "PendingMatch",
           "PoolLayout", "RequestKey", "RequestState", "Transfer"]
