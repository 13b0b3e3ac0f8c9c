"""A DRAM tier whose spill views see one stray write land right after their check: the
moment between DRAM's verification and a lower tier's write (tests of the checksum a
spill hands down)."""

from __future__ import annotations

from contextlib import contextmanager

from kvstore.tiers.dram import DramTier


class StrayWriteDram(DramTier):
    @contextmanager
    def view(self, key):
        with super().view(key) as got:
            if got is not None:
                offset, _ = self.offset_of(key)
                self.arena[offset + 5] ^= 0x01
            yield got
