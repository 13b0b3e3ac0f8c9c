"""A synchronous load's blocks held out of vLLM's prefix cache until the load reports.

vLLM puts a sync load's blocks in its prefix cache when it allocates them, before any
worker has written them. A request scheduled before the load reports — later in the
same ``schedule()`` call, or in the next step under async scheduling, which schedules
step N+1 before it processes step N's output — is then given them as computed, and if
the load fails it computes over blocks that were never written (vLLM's own recovery
assumes the loading request recomputes them first, which chunked prefill breaks).
So the scheduler side takes them out of the prefix cache right after allocation and
puts them back, under the same hashes, once every worker reported the load done.

Runs on vLLM's scheduler thread (see :mod:`connectors._vllm_scheduler`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class HeldBlocks:
    """A request's blocks ``ids`` at positions ``first``... taken out of the prefix cache."""

    request: Any          # vLLM's Request (its block hashes re-cache the blocks)
    first: int
    ids: list[int]


def hold(manager: Any, request: Any, blocks: Any, first: int) -> HeldBlocks | None:
    """Evict the request's cached blocks from position ``first`` on (the load's blocks
    and the ones computed after them in the same step) from vLLM's prefix cache; the
    request keeps them. None where nothing was cached (an async load) or no manager."""
    if manager is None:
        return None
    try:
        run = []
        for block in blocks.blocks[0][first:]:
            if block.block_hash is None:
                break
            run.append(block.block_id)
        if not run:
            return None
        manager.evict_blocks(set(run))
    except Exception as exc:   # a hook's exception would end vLLM's engine loop
        log.error("could not hold a sync load's blocks out of vLLM's prefix cache (%s: %s); requests with the "
                  "same prefix scheduled before the load reports may reuse them", type(exc).__name__, exc)
        return None
    return HeldBlocks(request, first, run)


def restore(manager: Any, held: HeldBlocks, block_size: int, *, count: int | None = None) -> bool:
    """Put the first ``count`` held blocks (default: all) back in vLLM's prefix cache,
    the ones the load wrote: only while the request still holds exactly them, none
    cached since. False where it does not (or there is nothing to put back)."""
    ids = held.ids if count is None else held.ids[:max(0, count)]
    if not ids:
        return False
    try:
        blocks = manager.get_blocks(held.request.request_id).blocks[0]
        now = blocks[held.first:held.first + len(ids)]
        if [b.block_id for b in now] != ids or any(b.block_hash is not None for b in now):
            return False     # freed, preempted or re-cached meanwhile: never cache other bytes
        manager.block_pool.cache_full_blocks(held.request, blocks, held.first, held.first + len(ids),
                                             block_size, 0)
    except Exception as exc:   # lost reuse only; the blocks stay uncached
        log.warning("could not put a loaded prefix back in vLLM's prefix cache (%s: %s)", type(exc).__name__, exc)
        return False
    return True


__all__ = ["HeldBlocks", "hold", "restore"]
