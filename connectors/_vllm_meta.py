"""What the scheduler-side connector tells the workers each step, and what the workers
tell it back (both picklable)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvstore.hint import Hint
from kvstore.keys import BlockKey


@dataclass
class ChunkTransfer:
    """Whole chunks of one request: ``keys[rank][i]`` names chunk ``first_chunk + i`` as
    rank ``rank`` stores it; ``block_ids`` are their vLLM blocks, ``per`` a chunk, one
    flat list (a load's last chunk may list fewer: only those blocks are written, the
    tokens after them are the request's to compute). A list of per-chunk lists is
    accepted too and flattened."""

    req_id: str
    keys: list[list[BlockKey]]
    block_ids: list[int]
    # Loads only: how many leading blocks of the first chunk the request already holds
    # (a local prefix-cache hit); those blocks are not overwritten.
    skip_blocks: int = 0
    is_async: bool = False
    first_chunk: int = 0          # the request's chunk index of ``keys[r][0]``
    # Saves only: the scheduler keeps this request's blocks when it finishes until the
    # workers report it in ``finished_sending`` (they are still being read).
    hold: bool = False
    per: int = 0                  # blocks per chunk (0: taken from nested block_ids)
    serial: int = 0               # loads: names this load in the workers' report
    hint: Hint | None = None      # saves: the request's retention hint (connectors/_hints.py)
    # Loads only: a P/D handoff (connectors/_vllm_handoff.py): wait for the chunks to be
    # stored until this wall-clock time before loading (0: no wait).
    wait_until: float = 0.0

    def __post_init__(self) -> None:
        if self.block_ids and isinstance(self.block_ids[0], list):
            self.per = self.per or len(self.block_ids[0])
            self.block_ids = [b for chunk in self.block_ids for b in chunk]

    @property
    def num_chunks(self) -> int:
        return len(self.keys[0])

    def chunk(self, i: int) -> list[int]:
        """The blocks of chunk ``i`` (of this transfer)."""
        return self.block_ids[i * self.per:(i + 1) * self.per]

    def keys_for(self, rank: int) -> list[BlockKey]:
        return self.keys[rank] if len(self.keys) > 1 else self.keys[0]


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[ChunkTransfer] = field(default_factory=list)
    saves: list[ChunkTransfer] = field(default_factory=list)
    # Handed-off requests whose blocks vLLM keeps until every rank's saves of them
    # settled (reported in finished_sending).
    handoffs: list[str] = field(default_factory=list)


@dataclass
class KVStoreWorkerMetadata(KVConnectorWorkerMetadata):
    """Outcome of the loads a worker finished this step, by load serial: the request
    and the first chunk (request's index) that failed, or ``None`` when every chunk
    loaded. vLLM aggregates these over all workers, so a load failed on any rank is
    failed for all."""

    loads: dict[int, tuple[str, int | None]] = field(default_factory=dict)

    def aggregate(self, other: "KVStoreWorkerMetadata") -> "KVStoreWorkerMetadata":
        merged = dict(self.loads)
        for serial, (req_id, failed) in other.loads.items():
            mine = merged.get(serial, (req_id, failed))[1]
            merged[serial] = (req_id, failed if mine is None else mine if failed is None else min(mine, failed))
        return KVStoreWorkerMetadata(merged)


__all__ = ["ChunkTransfer", "KVStoreConnectorMetadata", "KVStoreWorkerMetadata"]
