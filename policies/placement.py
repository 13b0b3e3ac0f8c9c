"""Placement: where a saved block is written and when blocks move between tiers."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class WriteMode(str, enum.Enum):
    BACK = "back"            # save into the first tier; spill down on eviction
    THROUGH = "through"      # save into every tier at once
    SELECTIVE = "selective"  # write through to a lower tier only where its admission admits now


@dataclass(frozen=True)
class Placement:
    """The ``placement:`` settings (``kvstore.config.PlacementConfig`` holds their one
    definition and defaults)."""

    write: WriteMode
    promote_on_hit: bool          # a hit in a lower tier copies the block up to the first tier
    prefetch_depth: int           # blocks past a lookup's prefix to start promoting
    selective_threshold: int      # selective: a block hit this often in the first tier is written through

    def writes_through(self) -> bool:
        return self.write is not WriteMode.BACK
