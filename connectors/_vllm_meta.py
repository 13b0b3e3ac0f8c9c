"""What the scheduler-side connector tells the workers each step, and what the workers
tell it back (both picklable)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvstore.keys import BlockKey


@dataclass
class ChunkTransfer:
    """Whole chunks of one request: ``keys[rank][i]`` names chunk ``first_chunk + i`` as
    rank ``rank`` stores it, and ``block_ids[i]`` are its vLLM blocks
    (``blocks_per_chunk`` each; a load's last chunk may list fewer: only those blocks
    are written, the tokens after them are the request's to compute)."""

    req_id: str
    keys: list[list[BlockKey]]
    block_ids: list[list[int]]
    # Loads only: how many leading blocks of the first chunk the request already holds
    # (a local prefix-cache hit); those blocks are not overwritten.
    skip_blocks: int = 0
    is_async: bool = False
    first_chunk: int = 0          # the request's chunk index of ``keys[r][0]``
    # Saves only: the scheduler keeps this request's blocks when it finishes until the
    # workers report it in ``finished_sending`` (they are still being read).
    hold: bool = False

    def keys_for(self, rank: int) -> list[BlockKey]:
        return self.keys[rank] if len(self.keys) > 1 else self.keys[0]


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[ChunkTransfer] = field(default_factory=list)
    saves: list[ChunkTransfer] = field(default_factory=list)


@dataclass
class KVStoreWorkerMetadata(KVConnectorWorkerMetadata):
    """Outcome of the loads a worker finished this step: request id -> the first chunk
    (request's index) that failed, or ``None`` when every chunk loaded. vLLM aggregates
    these over all workers, so a load failed on any rank is failed for all."""

    loads: dict[str, int | None] = field(default_factory=dict)

    def aggregate(self, other: "KVStoreWorkerMetadata") -> "KVStoreWorkerMetadata":
        merged = dict(self.loads)
        for req_id, failed in other.loads.items():
            mine = merged.get(req_id, failed)
            merged[req_id] = failed if mine is None else mine if failed is None else min(mine, failed)
        return KVStoreWorkerMetadata(merged)


__all__ = ["ChunkTransfer", "KVStoreConnectorMetadata", "KVStoreWorkerMetadata"]
