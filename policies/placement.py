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
    write: WriteMode = WriteMode.BACK
    promote_on_hit: bool = True   # a hit in a lower tier copies the block up to the first tier
    prefetch_depth: int = 0       # blocks past a lookup's prefix to start promoting

    def writes_through(self) -> bool:
        return self.write is not WriteMode.BACK
