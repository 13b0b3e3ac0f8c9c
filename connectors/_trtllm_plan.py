"""Key scheme and per-request bookkeeping of the TensorRT-LLM connector (no
TensorRT-LLM import here).

Keys come in two steps so the scheduler (rank 0) can name every rank's blocks:

- a **content key** per full block of tokens: the chained digest of the token ids in
  a namespace of model, KV dtype, tokens per block and the request's ``cache_salt``;
- a **rank key**: the content key mapped into the namespace of one TP rank (each rank
  stores its own shard of the heads).

Workers receive content keys in the metadata and derive their own rank keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from kvstore.keys import BlockKey, Namespace


@dataclass(frozen=True)
class KeyScheme:
    """What every key of one deployment shares. Immutable; safe across threads."""

    model: str
    dtype: str
    tokens_per_block: int
    world_size: int

    def content_keys(self, tokens: Sequence[int], salt: str | None) -> list[BlockKey]:
        """Content keys of every full block of ``tokens``."""
        ns = Namespace(model=self.model, dtype=self.dtype, chunk_tokens=self.tokens_per_block,
                       layout="trtllm:content", salt=salt or "")
        return ns.chunk_keys(list(tokens))

    def rank_namespace(self, rank: int) -> Namespace:
        return Namespace(model=self.model, dtype=self.dtype, chunk_tokens=self.tokens_per_block,
                         layout="trtllm:block", rank=rank, world_size=self.world_size)

    def rank_keys(self, content: Sequence[bytes], rank: int) -> list[BlockKey]:
        """The keys rank ``rank`` stores the blocks with content digests ``content``
        under; each links to the previous block for lineage-aware eviction."""
        ns = self.rank_namespace(rank)
        out: list[BlockKey] = []
        prev: BlockKey | None = None
        for digest in content:
            key = ns.key_for(digest)
            key = BlockKey(key.digest, prev.digest if prev else None, ns.digest)
            out.append(key)
            prev = key
        return out


@dataclass
class Transfer:
    """One block to move: the request it belongs to, the engine's block id, and the
    block's content digest. Picklable: it travels in the broadcast metadata."""

    request_id: int
    block_id: int
    content: bytes


@dataclass
class ConnectorMeta:
    """What the scheduler broadcasts to every worker for one forward pass."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


@dataclass
class PendingMatch:
    """The answer ``get_num_new_matched_tokens`` gave, waiting for the request to be
    scheduled: the blocks [first, stored) are loaded from the store."""

    first: int
    stored: int
    content: list[bytes]
    leased: list[list[BlockKey]]


@dataclass
class RequestState:
    """Tokens and block ids seen so far for one in-flight request."""

    salt: str | None
    tokens: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    content: list[bytes] = field(default_factory=list)
    saved_upto: int = 0        # blocks below this are stored (or being stored)
    saves_scheduled: bool = False

    def content_upto(self, scheme: KeyScheme, n_blocks: int) -> list[bytes]:
        """Content digests of the first ``n_blocks`` blocks (rehashed only when that
        number grows)."""
        if len(self.content) < n_blocks:
            keys = scheme.content_keys(self.tokens[:n_blocks * scheme.tokens_per_block], self.salt)
            self.content = [k.digest for k in keys]
        return self.content[:n_blocks]


__all__ = ["ConnectorMeta", "KeyScheme", "PendingMatch", "RequestState", "Transfer"]
