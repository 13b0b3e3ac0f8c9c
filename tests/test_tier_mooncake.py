"""The mooncake tier against a real Mooncake Store pool on loopback (master + one storage
node from Mooncake's wheel, started and stopped by PID)."""

from __future__ import annotations

import itertools
import os
import time

import numpy as np
import pytest

from kvstore.block import HEADER_BYTES, encode_header
from kvstore.errors import BufferSizeError, ConfigError, TierUnavailableError
from kvstore.testing import IN_CI, TierConformance, make_keys, payload

from tests import _mooncake
from tests._stray_dram import check_a_spill_keeps_drams_checksum

_MISSING = _mooncake.missing()
if _MISSING is not None and not IN_CI:
    pytest.skip(_MISSING, allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def _mooncake_installed():
    """Under CI a missing wheel fails every test here, saying why (never a silent skip);
    the rest of the suite still runs."""
    if _MISSING is not None:
        pytest.fail(_MISSING + " — CI runs the mooncake tier's conformance", pytrace=False)

from kvstore.tiers.mooncake import MooncakeTier, _object_name  # noqa: E402

_prefixes = itertools.count()


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    p = _mooncake.MooncakePool(tmp_path_factory.mktemp("mooncake"))
    yield p
    p.stop()


def _tier(pool, capacity: int, prefix: str | None = None, **kw) -> MooncakeTier:
    return MooncakeTier(capacity, master=pool.master, metadata_server=pool.metadata,
                        prefix=prefix or f"t{os.getpid()}-{next(_prefixes)}", staging_bytes=4 << 20, **kw)


class TestMooncakeConformance(TierConformance):
    CONCURRENCY_ROUNDS = 10

    @pytest.fixture
    def tier(self, pool):
        t = _tier(pool, self.CAPACITY)
        yield t
        t.close()


def _raw(pool):
    from mooncake.store import MooncakeDistributedStore

    raw = MooncakeDistributedStore()
    assert raw.setup(f"127.0.0.1:{_mooncake.free_port()}", pool.metadata, 0, 16 << 20, "tcp", "", pool.master) == 0
    return raw


def _reads_back(tier, keys, srcs) -> None:
    """Every key reads back through ``tier``'s ``read_into``, True and byte-exact."""
    dsts = [np.zeros(src.nbytes, np.uint8) for src in srcs]
    assert tier.read_into(keys, dsts) == [True] * len(keys)
    assert all(np.array_equal(src, dst) for src, dst in zip(srcs, dsts))


def test_another_node_finds_the_block(pool):
    a = _tier(pool, 1 << 20, prefix="shared-a")
    b = _tier(pool, 1 << 20, prefix="shared-a")
    try:
        keys = make_keys(3, salt="cross")
        srcs = [payload(i, 4096) for i in range(3)]
        assert a.write(keys, srcs) == [True] * 3
        assert b.contains(keys) == [True] * 3
        _reads_back(b, keys, srcs)
        assert b.used_bytes == 3 * 4096   # budgeted here too once found
    finally:
        a.close()
        b.close()


def test_find_asks_the_pool(pool):
    a = _tier(pool, 1 << 20, prefix="shared-find")
    b = _tier(pool, 2 * 4096, prefix="shared-find")
    try:
        keys = make_keys(4, salt="find")
        assert a.write(keys[:3], [payload(i, 4096) for i in range(3)]) == [True] * 3
        assert b.find(keys) == [4096, 4096, None, None]   # the third is past b's budget
        assert b.used_bytes == 2 * 4096 and b.stats()["found"] == 2
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("where", ["payload", "header", "truncated"])
def test_corrupt_object_is_a_miss_and_removed(pool, where):
    tier = _tier(pool, 1 << 20)
    raw = _raw(pool)
    try:
        key = make_keys(1, salt=where)
        src = payload(3, 8192)
        assert tier.write(key, [src]) == [True]
        block = bytearray(HEADER_BYTES + src.nbytes)
        encode_header(key[0].digest, src, block)
        block[HEADER_BYTES:] = src.tobytes()
        if where == "payload":
            block[HEADER_BYTES + 100] ^= 0x01
        elif where == "header":
            block[20] ^= 0x80
        else:
            block = block[:-1]
        name = _object_name(tier.prefix, key[0])
        assert raw.upsert(name, bytes(block)) == 0
        dst = np.zeros(src.nbytes, np.uint8)
        assert tier.read_into(key, [dst]) == [False]
        if where != "truncated":   # a shorter object is another block's size: a plain miss
            assert tier.stats()["corrupt_blocks"] == 1
            assert raw.batch_is_exist([name]) == [0]
        assert tier.contains(key) == [where == "truncated"]
    finally:
        raw.close()
        tier.close()


def _block(key, src, where: str) -> bytes:
    """The stored form of ``src`` under ``key``, damaged as ``where`` says."""
    block = bytearray(HEADER_BYTES + src.nbytes)
    encode_header(key.digest, src, block)
    block[HEADER_BYTES:] = src.tobytes()
    if where == "payload":
        block[-1] ^= 0x01
    elif where == "header":
        block[HEADER_BYTES - 1] ^= 0x01          # the header checksum
    elif where == "truncated":
        block = block[:-4096]
    elif where == "longer":
        block += b"\0"
    return bytes(block)


@pytest.mark.parametrize("how", ["upsert", "remove-put"])
@pytest.mark.parametrize("where", ["exact", "payload", "header", "truncated", "longer"])
def test_object_rewritten_by_another_node(pool, how, where):
    """An object another node overwrote (upsert) or removed and wrote again under the same
    name, after this tier wrote and read it: only the exact block reads True; a damaged,
    shorter or longer object is never served (a block this tier has read before gets no
    shortcut: its next read checks the object that is there now)."""
    tier = _tier(pool, 1 << 20)
    raw = _raw(pool)
    try:
        key = make_keys(1, salt=f"rewrite-{how}-{where}")
        src = payload(5, 3 * 4096)
        assert tier.write(key, [src]) == [True]
        dst = np.zeros(src.nbytes, np.uint8)
        assert tier.read_into(key, [dst]) == [True] and np.array_equal(dst, src)
        name = _object_name(tier.prefix, key[0])
        if how == "upsert":
            assert raw.upsert(name, _block(key[0], src, where)) == 0
        else:
            assert raw.batch_remove([name], True) == [0]
            assert raw.put(name, _block(key[0], src, where)) == 0
        dst[:] = 0
        got = tier.read_into(key, [dst])
        if where == "exact":
            assert got == [True] and np.array_equal(dst, src)
            assert tier.stats()["corrupt_blocks"] == 0
        else:
            assert got == [False]
            if where in ("payload", "header"):
                assert tier.stats()["corrupt_blocks"] == 1
                assert raw.batch_is_exist([name]) == [0]
    finally:
        raw.close()
        tier.close()


@pytest.mark.parametrize("where", ["payload", "header"])
def test_corrupt_block_another_node_wrote_is_never_served(pool, where):
    """A node that found a block in the pool (it did not write it) checks header and
    payload on its first read, and on every later one."""
    a = _tier(pool, 1 << 20, prefix=f"shared-corrupt-{where}")
    b = _tier(pool, 1 << 20, prefix=f"shared-corrupt-{where}")
    raw = _raw(pool)
    try:
        keys = make_keys(2, salt=f"found-{where}")
        srcs = [payload(i, 4096) for i in range(2)]
        assert a.write(keys, srcs) == [True, True]
        assert b.find(keys) == [4096, 4096]
        dsts = [np.zeros(4096, np.uint8) for _ in keys]
        assert b.read_into(keys[1:], dsts[1:]) == [True]   # read once: the header seen
        for key, src in zip(keys, srcs):
            assert raw.upsert(_object_name(b.prefix, key), _block(key, src, where)) == 0
        assert b.read_into(keys, dsts) == [False, False]
        assert b.stats()["corrupt_blocks"] == 2
    finally:
        raw.close()
        a.close()
        b.close()


def test_size_mismatch_raises_before_copy(pool):
    tier = _tier(pool, 1 << 20)
    try:
        key = make_keys(1, salt="size")
        tier.write(key, [payload(1, 4096)])
        with pytest.raises(BufferSizeError):
            tier.read_into(key, [np.zeros(2048, np.uint8)])
        dst = np.zeros(4096, np.uint8)
        assert tier.read_into(key, [dst]) == [True]
    finally:
        tier.close()


def test_batch_larger_than_staging_goes_in_rounds(pool):
    tier = _tier(pool, 64 << 20)
    try:
        keys = make_keys(6, salt="rounds")
        srcs = [payload(i, 1 << 20) for i in range(6)]   # 6 MiB through a 4 MiB staging buffer
        assert tier.write(keys, srcs) == [True] * 6
        _reads_back(tier, keys, srcs)
    finally:
        tier.close()


def test_a_host_block_larger_than_staging_goes_in_two_pieces(pool):
    """Staging is for blocks that fit it: a host block larger than the staging buffer
    goes as header and payload in place, in the same batch as staged ones."""
    tier = _tier(pool, 64 << 20)
    try:
        tier._store = spy = _PutPieces(tier._store)
        keys = make_keys(3, salt="huge")
        srcs = [payload(20, 6 << 20), payload(21, 4096), payload(22, 5 << 20)]   # staging is 4 MiB
        assert tier.write(keys, srcs) == [True] * 3
        assert sorted(spy.pieces) == [1, 2, 2]
        _reads_back(tier, keys, srcs)
    finally:
        tier.close()


def test_one_frame_given_for_two_keys_is_used_once(pool):
    """The same lent view under two keys in one put: the frame carries one key's header,
    the other key's object is staged, and each reads back as its own block."""
    from kvstore.tiers.dram import DramTier

    tier = _tier(pool, 4 << 20)
    try:
        with DramTier(1 << 20, pin=False, header_frames=True) as dram:
            held, keys = make_keys(1, salt="held"), make_keys(2, salt="twice")
            src = payload(30, 8192)
            assert dram.write(held, [src]) == [True]
            with dram.lend(held) as (views, sums):
                assert tier.write(keys, [views[0], views[0]], [sums[0], sums[0]]) == [True, True]
        _reads_back(tier, keys, [src, src])
        assert tier.stats()["corrupt_blocks"] == 0
    finally:
        tier.close()


def test_a_framed_view_without_the_lenders_checksum_is_staged(pool):
    """A frame carries only a header with the lender's checksum (the same bytes whoever
    writes it): a framed view handed over without one is staged and hashed instead."""
    from kvstore.tiers.dram import DramTier

    tier = _tier(pool, 4 << 20)
    try:
        with DramTier(1 << 20, pin=False, header_frames=True) as dram:
            held, keys = make_keys(1, salt="nosum-held"), make_keys(1, salt="nosum")
            src = payload(31, 8192)
            assert dram.write(held, [src]) == [True]
            tier._store = spy = _PutPieces(tier._store)
            with dram.lend(held) as (views, _):
                assert tier.write(keys, [views[0]]) == [True]
                frame_start = views[0].ctypes.data - HEADER_BYTES
        assert spy.pieces == [1] and spy.starts[0] != frame_start
        staging = tier._staging.ctypes.data
        assert staging <= spy.starts[0] < staging + tier._staging.nbytes
        _reads_back(tier, keys, [src])
    finally:
        tier.close()


def test_bad_master_is_a_config_error(pool):
    with pytest.raises(ConfigError, match="protocol"):
        MooncakeTier(1 << 20, master=pool.master, metadata_server=pool.metadata, protocol="carrier-pigeon")


def test_store_spills_to_mooncake_and_loads_exact(pool):
    from kvstore.store import Store

    store = Store.from_config({"tiers": [
        {"name": "hot", "kind": "dram", "capacity": 2 * 4096},
        {"name": "pool", "kind": "mooncake", "capacity": "1MiB", "master": pool.master,
         "metadata_server": pool.metadata, "prefix": f"store-{os.getpid()}", "staging_bytes": "4MiB"}]})
    try:
        keys = make_keys(6, salt="store")
        srcs = [payload(i, 4096) for i in range(6)]
        store.save(keys, srcs).result()
        assert store.lookup(keys) == 6
        assert store.stats()["tiers"][1]["blocks"] >= 4   # spilled past the 2-block DRAM tier
        dsts = [np.zeros(4096, np.uint8) for _ in keys]
        assert store.load(keys, dsts).result() == [True] * 6
        assert all(np.array_equal(s, d) for s, d in zip(srcs, dsts))
    finally:
        store.close()


@pytest.mark.parametrize("framed", [False, True])
def test_a_spill_keeps_drams_checksum_so_a_stray_write_after_its_check_is_a_miss(pool, framed):
    """Also from a DRAM tier with header frames (one piece per block): the header written
    into the frame carries DRAM's checksum, not one of the changed bytes."""
    prefix = f"stray-{os.getpid()}-{framed}"
    check_a_spill_keeps_drams_checksum(
        {"name": "pool", "kind": "mooncake", "capacity": "1MiB", "master": pool.master,
         "metadata_server": pool.metadata, "prefix": prefix, "staging_bytes": "4MiB"},
        _tier(pool, 1 << 20, prefix=prefix, name="pool"), block=64 << 10, header_frames=framed)


class _PutPieces:
    """Mooncake's client with the pieces of every batch put recorded (the calls go
    through to it unchanged)."""

    def __init__(self, store) -> None:
        self._store, self.pieces, self.starts = store, [], []

    def batch_put_from_multi_buffers(self, names, ptrs, lens):
        self.pieces += [len(p) for p in lens]
        self.starts += [p[0] for p in ptrs]
        return self._store.batch_put_from_multi_buffers(names, ptrs, lens)

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_a_store_over_mooncake_spills_each_block_from_drams_frame_in_one_piece(pool):
    """The build gives a DRAM tier with Mooncake next below header frames; its spills go
    one piece per block (header in the slot's frame, then the payload), and every block
    loads back byte-exact from the pool, its object a valid header plus the payload."""
    from kvstore.block import parse_block_header
    from kvstore.store import Store

    block, prefix = 64 << 10, f"framed-{os.getpid()}"
    store = Store.from_config({"tiers": [
        {"name": "hot", "kind": "dram", "capacity": 2 * block, "pin": False},
        {"name": "pool", "kind": "mooncake", "capacity": "4MiB", "master": pool.master,
         "metadata_server": pool.metadata, "prefix": prefix, "staging_bytes": "4MiB"}]})
    raw = _raw(pool)
    try:
        hot, cold = store.tiers
        assert hot.header_frames and hot.stats()["header_frames"]
        cold._store = spy = _PutPieces(cold._store)
        keys = make_keys(8, salt="framed-store")
        srcs = [payload(70 + i, block) for i in range(8)]
        for i in range(0, 8, 2):
            assert store.save(keys[i:i + 2], srcs[i:i + 2]).result() == [True, True]
        spilled = [k for k in keys if cold.contains([k]) == [True]]
        assert len(spilled) >= 6 and spy.pieces and set(spy.pieces) == {1}
        for key in spilled:
            got = np.zeros(HEADER_BYTES + block, np.uint8)
            assert raw.get_into(_object_name(prefix, key), got.ctypes.data, got.nbytes) == got.nbytes
            head = parse_block_header(got[:HEADER_BYTES], digest=key.digest)
            assert head.length == block
            assert np.array_equal(got[HEADER_BYTES:], srcs[keys.index(key)])
        assert store.tiers[0].delete(keys) >= 0
        dsts = [np.zeros(block, np.uint8) for _ in keys]
        assert store.load(spilled, dsts[:len(spilled)]).result() == [True] * len(spilled)
        assert all(np.array_equal(d, srcs[keys.index(k)]) for k, d in zip(spilled, dsts))
    finally:
        raw.close()
        store.close()


def test_one_batch_mixes_framed_and_plain_sources(pool):
    """Framed views (sent from their frames) and plain buffers (staged behind their
    headers) in one put, one piece each: each object is its own block."""
    from kvstore.tiers.dram import DramTier

    tier = _tier(pool, 4 << 20)
    try:
        with DramTier(1 << 20, pin=False, header_frames=True) as dram:
            keys = make_keys(4, salt="mixed")
            srcs = [payload(90 + i, 8192 * (i + 1)) for i in range(4)]
            assert dram.write(keys[::2], srcs[::2]) == [True, True]
            tier._store = spy = _PutPieces(tier._store)
            with dram.lend(keys[::2]) as (views, sums):
                mixed = [views[0], srcs[1], views[1], srcs[3]]
                assert tier.write(keys, mixed, [sums[0], None, sums[1], None]) == [True] * 4
                framed_starts = [v.ctypes.data - HEADER_BYTES for v in views]
            assert spy.pieces == [1, 1, 1, 1]
            staging = tier._staging.ctypes.data, tier._staging.ctypes.data + tier._staging.nbytes
            assert [spy.starts[0], spy.starts[2]] == framed_starts
            assert all(staging[0] <= spy.starts[i] < staging[1] for i in (1, 3))
        _reads_back(tier, keys, srcs)
    finally:
        tier.close()


def test_master_down_is_misses_and_the_tier_comes_back(pool):
    tier = _tier(pool, 1 << 20)
    try:
        keys = make_keys(2, salt="down")
        srcs = [payload(i, 4096) for i in range(2)]
        assert tier.write(keys[:1], srcs[:1]) == [True]
        pool.stop_master()
        dst = np.zeros(4096, np.uint8)
        with pytest.raises(TierUnavailableError):
            tier.read_into(keys[:1], [dst])
        with pytest.raises(TierUnavailableError):   # fails fast while marked down
            tier.write(keys[1:], srcs[1:])
        assert tier.stats()["healthy"] is False
        pool.start_master()
        deadline = time.monotonic() + 60
        while not tier.stats()["healthy"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert tier.stats()["healthy"] is True
        # The restarted master lost its metadata: the old block is a clean miss, not an error.
        assert tier.read_into(keys[:1], [dst]) == [False]
    finally:
        tier.close()


def test_the_clusters_benchmark_rows_put_and_get_every_block():
    """``benchmarks.cluster``'s Mooncake rows on a pool of their own: the tier against the
    raw client, and the block format priced with the raw client alone (one piece, two
    pieces); each timed call asserts its batch landed whole."""
    from benchmarks._cluster_mooncake import mooncake_rows

    rows = mooncake_rows(64 * 1024, 4, 1)
    assert [r["op"] for r in rows] == ["put", "put (spill from DRAM)", "put (spill from DRAM without header frames)",
                                       "get", "put, header + payload in one piece",
                                       "put, header and payload as two pieces"]
    for r in rows[:4]:
        assert r["kvstore_gbps"] > 0 and r["baseline_gbps"] > 0 and r["ratio"] > 0
    for r in rows[4:]:
        assert r["raw_framed_gbps"] > 0 and r["raw_gbps"] > 0 and r["ratio"] > 0


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_cache_server_over_mooncake_frames_its_shared_arena(pool, transport):
    """``kvstore serve`` with DRAM over a Mooncake pool: its shared-memory arena keeps
    header frames, a same-host client (and a TCP one) saves past DRAM into the pool and
    loads every block back byte-exact, from the arena or the pool."""
    from kvstore.client import Client
    from tests._servers import ThreadServer, config_dict

    block = 256 << 10
    server = ThreadServer(config_dict(tiers=[
        {"name": "hot", "kind": "dram", "capacity": 4 * block, "pin": False},
        {"name": "pool", "kind": "mooncake", "capacity": "16MiB", "master": pool.master,
         "metadata_server": pool.metadata, "prefix": f"serve-{os.getpid()}-{transport}", "staging_bytes": "4MiB"}]))
    try:
        hot = server.store.tiers[0]
        assert hot.header_frames and hot.shm_path
        client = Client(server.address, transport=transport)
        try:
            keys = make_keys(16, salt=f"serve-{transport}")
            srcs = [payload(100 + i, block) for i in range(16)]
            for lo in range(0, 16, 4):
                assert client.save(keys[lo:lo + 4], srcs[lo:lo + 4]).result() == [True] * 4
            assert server.store.tiers[1].stats()["blocks"] >= 12
            dsts = [np.zeros(block, np.uint8) for _ in keys]
            assert client.load(keys, dsts).result() == [True] * 16
            assert all(np.array_equal(s, d) for s, d in zip(srcs, dsts))
            assert server.store.tiers[1].stats()["corrupt_blocks"] == 0
        finally:
            client.close()
    finally:
        server.stop()
