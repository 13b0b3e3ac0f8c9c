"""The mooncake tier against Mooncake's own Python client on the same pool (the rows
``benchmarks/cluster.py`` prints): one batch of blocks put and got, the tier through its
verified block format and staging buffer, the raw client with ``batch_put_from`` /
``batch_get_into`` on a registered buffer (no header, no verification, no copy). The
spill rows put a DRAM tier's lent views with their checksums, as the Store's spill does:
from a DRAM tier with header frames (what the Store's build makes over a Mooncake tier:
one piece per block) and, for comparison, from one without (its blocks staged behind
their headers). DRAM lends (and verifies) the views before each timed put, as the
Store's spill has them before it calls the tier.

The raw calls go through the tier's own ``MooncakeDistributedStore`` instance (its
transfer engine, its connections), not a second client: two client instances in one
process doing the identical raw get differ by 0.77-1.26x from one process to the next
(``python -m benchmarks.mooncake_clients``), so a second client measured the luck of the
instance, not the tier. The tier reads and writes its own unregistered copies of the
buffers, so the registration the raw calls need does not help it.

:func:`format_rows` prices the block format itself with the raw client alone, against
the same raw put: each object 64 bytes longer in one piece (the header in front of the
payload, contiguous), and the same object as two pieces (header, payload: what the
tier sends from a caller's buffer or a DRAM slot, as no 64 bytes precede either). The
gap between those two rows is Mooncake's cost of one more piece per object, which
the tier pays and the raw put does not.
"""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path

import numpy as np

from benchmarks._cluster_redis import _paired
from kvstore.block import HEADER_BYTES
from kvstore.testing import make_keys

_runs = itertools.count()


def mooncake_rows(block_bytes: int = 1 << 20, blocks: int = 64, repeat: int = 7) -> list[dict]:
    from tests._mooncake import MooncakePool
    from kvstore.tiers.dram import DramTier
    from kvstore.tiers.mooncake import MooncakeTier

    batch = block_bytes * blocks
    with tempfile.TemporaryDirectory() as tmp:
        pool = MooncakePool(Path(tmp), segment_mib=max(256, 4 * batch >> 20))
        try:
            tier = MooncakeTier(2 * batch * (repeat + 2), master=pool.master, metadata_server=pool.metadata,
                                staging_bytes=batch + blocks * 4096, prefix="bench")
            raw = tier._store   # Mooncake's client, the same instance (see the module docstring)
            buf = np.random.default_rng(0).integers(0, 256, batch, dtype=np.uint8)
            out = np.zeros(batch, np.uint8)
            assert raw.register_buffer(buf.ctypes.data, batch) == 0
            assert raw.register_buffer(out.ctypes.data, batch) == 0
            tier_src, tier_dst = buf.copy(), np.zeros(batch, np.uint8)   # not registered: the tier's own
            srcs = [tier_src[i * block_bytes:(i + 1) * block_bytes] for i in range(blocks)]
            dsts = [tier_dst[i * block_bytes:(i + 1) * block_bytes] for i in range(blocks)]
            ptrs = [buf.ctypes.data + i * block_bytes for i in range(blocks)]
            optrs = [out.ctypes.data + i * block_bytes for i in range(blocks)]
            sizes = [block_bytes] * blocks

            def tier_put():
                keys = make_keys(blocks, salt=f"put{next(_runs)}")
                assert tier.write(keys, srcs) == [True] * blocks
                tier.delete(keys)

            # The Store's spill: a DRAM tier's lent views with their checksums, from a
            # tier with header frames (as the build makes it over a Mooncake tier: one
            # piece per block) and, for the row before them, from one without (two)
            drams = {framed: DramTier(batch, pin=False, header_frames=framed) for framed in (True, False)}
            dram_keys = make_keys(blocks, salt="dram")
            for dram in drams.values():
                assert dram.write(dram_keys, srcs) == [True] * blocks

            def tier_spill_from(dram):
                """The tier's part of a spill: the views are lent (and verified by DRAM)
                before the clock starts and returned after it stops."""
                def setup():
                    lent = dram.lend(dram_keys)
                    return make_keys(blocks, salt=f"spill{next(_runs)}"), lent, lent.__enter__()

                def spill(state):
                    keys, _, (views, sums) = state
                    assert tier.write(keys, views, sums) == [True] * blocks

                def teardown(state):
                    keys, lent, _ = state
                    lent.__exit__(None, None, None)
                    tier.delete(keys)
                return setup, spill, teardown

            def raw_put():
                names = [f"raw{next(_runs)}:{i}" for i in range(blocks)]
                assert raw.batch_put_from(names, ptrs, sizes) == [0] * blocks
                raw.batch_remove(names, True)

            get_keys = make_keys(blocks, salt="get")
            assert tier.write(get_keys, srcs) == [True] * blocks
            names = [f"rawget:{i}" for i in range(blocks)]
            assert raw.batch_put_from(names, ptrs, sizes) == [0] * blocks

            def tier_get():
                assert tier.read_into(get_keys, dsts) == [True] * blocks

            def raw_get():
                assert raw.batch_get_into(names, optrs, sizes) == sizes

            rows = []
            for op, ours, theirs in (("put", plain(tier_put), raw_put),
                                     ("put (spill from DRAM)", tier_spill_from(drams[True]), raw_put),
                                     ("put (spill from DRAM without header frames)", tier_spill_from(drams[False]),
                                      raw_put),
                                     ("get", plain(tier_get), raw_get)):
                t_ours, t_raw, ratio = _paired(ours, plain(theirs), repeat)
                rows.append({"path": "mooncake (tcp, 1 storage node)", "op": op, "block_bytes": block_bytes,
                             "blocks": blocks, "kvstore_gbps": batch / t_ours / 1e9,
                             "baseline": "Mooncake Python client (the tier's instance), registered buffer",
                             "baseline_gbps": batch / t_raw / 1e9, "ratio": ratio})
            rows += format_rows(raw, buf, block_bytes, blocks, repeat, raw_put)
            for dram in drams.values():
                dram.close()
            raw.unregister_buffer(buf.ctypes.data)
            raw.unregister_buffer(out.ctypes.data)
            tier.close()
            return rows
        finally:
            pool.stop()


def format_rows(raw, buf: np.ndarray, block_bytes: int, blocks: int, repeat: int, raw_put) -> list[dict]:
    """The raw client's put of objects 64 bytes longer (one piece, then two pieces)
    against its plain put, from one registered buffer: the block format's cost in
    Mooncake, without any of the tier's code."""
    framed = np.zeros(blocks * (block_bytes + HEADER_BYTES), np.uint8)
    assert raw.register_buffer(framed.ctypes.data, framed.nbytes) == 0
    try:
        stride = block_bytes + HEADER_BYTES
        starts = [framed.ctypes.data + i * stride for i in range(blocks)]
        for i in range(blocks):
            framed[i * stride + HEADER_BYTES:(i + 1) * stride] = buf[i * block_bytes:(i + 1) * block_bytes]

        def one_piece():
            names = [f"one{next(_runs)}:{i}" for i in range(blocks)]
            assert raw.batch_put_from(names, starts, [stride] * blocks) == [0] * blocks
            raw.batch_remove(names, True)

        def two_pieces():
            names = [f"two{next(_runs)}:{i}" for i in range(blocks)]
            ptrs = [[p, p + HEADER_BYTES] for p in starts]
            assert raw.batch_put_from_multi_buffers(names, ptrs, [[HEADER_BYTES, block_bytes]] * blocks) == [0] * blocks
            raw.batch_remove(names, True)

        rows = []
        for op, fn in (("put, header + payload in one piece", one_piece),
                       ("put, header and payload as two pieces", two_pieces)):
            t_fmt, t_raw, ratio = _paired(plain(fn), plain(raw_put), repeat)
            rows.append({"path": "mooncake (tcp, 1 storage node)", "op": op, "block_bytes": block_bytes,
                         "blocks": blocks, "raw_framed_gbps": blocks * block_bytes / t_fmt / 1e9,
                         "raw_gbps": blocks * block_bytes / t_raw / 1e9, "ratio": ratio})
        return rows
    finally:
        raw.unregister_buffer(framed.ctypes.data)


def plain(fn):
    """``(setup, timed, teardown)`` for :func:`_paired`: nothing around the timed call."""
    return (lambda: None, lambda _: fn(), lambda _: None)


if __name__ == "__main__":
    from benchmarks._common import print_table

    rows = mooncake_rows()
    print_table(["op", "GB/s", "raw GB/s", "ratio"],
                [[r["op"], r.get("kvstore_gbps", r.get("raw_framed_gbps")), r.get("baseline_gbps", r.get("raw_gbps")),
                  r["ratio"]] for r in rows])
