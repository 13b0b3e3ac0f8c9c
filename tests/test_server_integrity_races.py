"""Issue 20, finding 6 follow-up: a block whose DRAM slot leaves the index between the
server's borrow and its checksum lookup (evicted, or dropped as corrupt by a verifying
reader) is a miss at the client on every transport, never vouched for by a hash of the
bytes the slot holds now."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.testing import make_keys, payload
from tests._servers import ThreadServer, config_dict

BLOCK = 256 * 1024
TRANSPORTS = ["tcp", "shm"] + (["nixl"] if importlib.util.find_spec("nixl") is not None else [])


@pytest.fixture(params=TRANSPORTS)
def transport(request):
    return request.param


def test_a_slot_dropped_between_borrow_and_checksum_lookup_is_a_miss(transport, monkeypatch):
    s = ThreadServer(config_dict("16MiB", transport=transport))
    try:
        keys = make_keys(2, salt=f"race-{transport}")
        srcs = [payload(50 + i, BLOCK) for i in range(2)]
        with Client(s.address, transport=transport, timeout_s=30) as c:
            assert c.save(keys, srcs).result(10) == [True, True]
            store, dram = s.server.store, s.server.store.tiers[0]
            offset, _ = dram.offset_of(keys[0])
            dram.arena[offset + 321] ^= 0x04         # corrupt in the arena
            lookup = store.checksums

            def dropped_first(ks):
                # what a verifying reader does meanwhile: drops the corrupt slot while the
                # borrow still holds it (its bytes stay until the borrow ends)
                if keys[0] in ks:
                    dram.delete([keys[0]])
                return lookup(ks)

            monkeypatch.setattr(store, "checksums", dropped_first)
            dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
            got = c.load(keys, dsts).result(30)
            assert got == [False, True]
            assert np.array_equal(dsts[1], srcs[1])
    finally:
        s.stop()
