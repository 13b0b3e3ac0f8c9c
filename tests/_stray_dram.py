"""A DRAM tier whose spill views see one stray write land right after their check: the
moment between DRAM's verification and a lower tier's write (tests of the checksum a
spill hands down)."""

from __future__ import annotations

from contextlib import contextmanager

from kvstore.tiers.dram import DramTier


class StrayWriteDram(DramTier):
    @contextmanager
    def lend(self, keys):   # how the Store borrows the blocks it spills
        with super().lend(keys) as (views, sums):
            for key, view in zip(keys, views):
                if view is not None:
                    offset, _ = self.offset_of(key)
                    self.arena[offset + 5] ^= 0x01
            yield views, sums


def check_a_spill_keeps_drams_checksum(lower_cfg: dict, lower, block: int = 8192, *, refused: bool = False,
                                       header_frames: bool = False) -> None:
    """Four blocks saved into a two-block StrayWriteDram over ``lower`` (its config
    ``lower_cfg``): the two that spill were changed after DRAM verified them, so they must
    load as misses, the other two byte-exact. The lower tier either stores them under
    DRAM's checksum and finds them corrupt on the read, or (``refused``: a cache server
    checks the bytes it receives against it) refuses them at the write. ``header_frames``:
    the DRAM tier lends framed views (as the build makes it over a Mooncake tier)."""
    import numpy as np

    from kvstore.config import load_config
    from kvstore.store import Store
    from kvstore.testing import make_keys, payload

    cfg = load_config({"tiers": [{"name": "hot", "kind": "dram", "capacity": 2 * block, "pin": False}, lower_cfg]})
    keys = make_keys(4, salt=f"stray-{lower_cfg['kind']}")
    srcs = [payload(60 + i, block) for i in range(4)]
    hot = StrayWriteDram(2 * block, name="hot", pin=False, header_frames=header_frames)
    with Store(cfg, tiers=[hot, lower]) as store:
        assert store.save(keys[:2], srcs[:2]).result() == [True] * 2
        assert store.save(keys[2:], srcs[2:]).result() == [True] * 2   # the first two spill down
        assert store.tiers[1].contains(keys[:2]) == [not refused] * 2
        dsts = [np.zeros(block, np.uint8) for _ in keys]
        assert store.load(keys, dsts).result() == [False, False, True, True], \
            "bytes changed in DRAM after its check were served from the tier below"
        assert all(np.array_equal(dsts[i], srcs[i]) for i in (2, 3))
        if not refused:
            assert store.tiers[1].stats()["corrupt_blocks"] == 2
