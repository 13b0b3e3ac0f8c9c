"""What the scheduler-side connector tells the workers each step (picklable)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvstore.keys import BlockKey


@dataclass
class ChunkTransfer:
    """Whole chunks of one request: ``keys[rank][i]`` names chunk ``i`` as rank ``rank``
    stores it, and ``block_ids[i]`` are its vLLM blocks (``blocks_per_chunk`` each)."""

    req_id: str
    keys: list[list[BlockKey]]
    block_ids: list[list[int]]
    # Loads only: how many leading blocks of the first chunk the request already holds
    # (a local prefix-cache hit); those blocks are not overwritten.
    skip_blocks: int = 0
    is_async: bool = False

    def keys_for(self, rank: int) -> list[BlockKey]:
        return self.keys[rank] if len(self.keys) > 1 else self.keys[0]


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[ChunkTransfer] = field(default_factory=list)
    saves: list[ChunkTransfer] = field(default_factory=list)


__all__ = ["ChunkTransfer", "KVStoreConnectorMetadata"]
