"""The device copier's lanes: one stream and staging ring per direction, adjacent copies
merged, no lock held across a host wait, stream order kept.

There is no GPU here. The copier is the real one; its device calls go to a CPU stand-in
runtime that behaves like CUDA where it matters: a copy issued on a stream does not run
until an event recorded after it is waited on (as a DMA completes only later), and every
call is logged in the order the copier makes it. Host tensors play device memory."""

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from kvstore.buffers import streams as _streams
from kvstore.buffers.device import DeviceCopier


class Stream:
    def __init__(self, rt, name):
        self.rt, self.name, self.pending = rt, name, []

    def wait_event(self, event):
        self.rt.log.append(("wait_event", self, event))

    def wait_stream(self, other):
        self.rt.log.append(("wait_stream", self, other))

    def __repr__(self):
        return f"Stream({self.name})"


class Event:
    def __init__(self, rt):
        self.rt, self.stream, self.upto = rt, None, 0

    def record(self, stream):
        with self.rt.lock:
            self.stream, self.upto = stream, stream.done + len(stream.pending)
        self.rt.log.append(("record", stream, self))

    def synchronize(self):
        self.rt.log.append(("sync", self.stream, self))
        if self.stream is None:
            return
        park = self.rt.parks.get(self.stream)
        if park is not None:
            park.parked.set()
            assert park.go.wait(60), "a parked wait was never released"
        self.rt.run_until(self.stream, self.upto)


class Park:
    def __init__(self):
        self.parked, self.go = threading.Event(), threading.Event()


class StandIn:
    """Streams whose copies run only when an event recorded after them is synchronised."""

    def __init__(self):
        self.log, self.lock, self.parks, self.streams = [], threading.RLock(), {}, []
        self.current = None
        self.current = self.stream()

    def stream(self):
        s = Stream(self, f"s{len(self.streams)}")
        s.done = 0
        self.streams.append(s)
        return s

    def event(self):
        return Event(self)

    def current_stream(self):
        return self.current

    def copy(self, stream, dst, src):
        self.log.append(("copy", stream, dst.numel()))
        with self.lock:
            stream.pending.append(lambda: dst.copy_(src))

    def staging(self, nbytes):
        return torch.empty(nbytes, dtype=torch.uint8)

    def run_until(self, stream, upto):
        with self.lock:
            while stream.done < upto:
                stream.pending.pop(0)()
                stream.done += 1

    def copies(self, stream=None):
        return [e for e in self.log if e[0] == "copy" and (stream is None or e[1] is stream)]


def _rand(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


BLOCK = 4096


@pytest.fixture
def rt():
    return StandIn()


def test_adjacent_blocks_move_in_one_copy_per_direction(rt):
    c = DeviceCopier("cpu", runtime=rt)
    dev = torch.zeros(8 * BLOCK, dtype=torch.uint8)
    host = _rand(8 * BLOCK, 1)
    with c.batch() as b:                       # 8 blocks, adjacent on both sides
        for i in range(8):
            b.copy(dev[i * BLOCK:(i + 1) * BLOCK], host[i * BLOCK:(i + 1) * BLOCK])
    h2d = c.lanes["h2d"].stream
    assert [n for _, _, n in rt.copies(h2d)] == [8 * BLOCK]
    assert np.array_equal(dev.numpy(), host)

    out = np.zeros(8 * BLOCK, np.uint8)
    with c.batch() as b:
        for i in range(8):
            b.copy(out[i * BLOCK:(i + 1) * BLOCK], dev[i * BLOCK:(i + 1) * BLOCK])
    assert [n for _, _, n in rt.copies(c.lanes["d2h"].stream)] == [8 * BLOCK]
    assert np.array_equal(out, host)

    other = torch.zeros(8 * BLOCK, dtype=torch.uint8)
    with c.batch() as b:
        for i in range(8):
            b.copy(other[i * BLOCK:(i + 1) * BLOCK], dev[i * BLOCK:(i + 1) * BLOCK])
    assert [n for _, _, n in rt.copies(c.lanes["d2d"].stream)] == [8 * BLOCK]
    assert torch.equal(other, dev)
    assert c.counters["merged_copies"] == 3 * 7 and c.counters["direct_copies"] == 3


def test_runs_break_where_either_side_is_not_adjacent(rt):
    c = DeviceCopier("cpu", runtime=rt)
    dev = torch.zeros(8 * BLOCK, dtype=torch.uint8)
    host = _rand(8 * BLOCK, 2)
    blk = [slice(i * BLOCK, (i + 1) * BLOCK) for i in range(8)]
    with c.batch() as b:
        for i in (0, 1, 2, 5, 6):               # a gap: two runs
            b.copy(dev[blk[i]], host[blk[i]])
        for i in (4, 3, 7):                     # never contiguous in issue order
            b.copy(dev[blk[i]], host[blk[i]])
    assert [n for _, _, n in rt.copies()] == [3 * BLOCK, 2 * BLOCK, BLOCK, BLOCK, BLOCK]
    assert np.array_equal(dev.numpy(), host)

    rt.log.clear()
    separate = [_rand(BLOCK, 10 + i) for i in range(4)]   # destination adjacent, sources not
    with c.batch() as b:
        for i, src in enumerate(separate):
            b.copy(dev[blk[i]], src)
    assert len(rt.copies()) == 4
    assert np.array_equal(dev.numpy()[:4 * BLOCK], np.concatenate(separate))

    rt.log.clear()
    whole = np.zeros(2 * BLOCK, np.uint8)          # two arrays over adjacent memory, each its own
    first = np.frombuffer(memoryview(whole)[:BLOCK], np.uint8)      # allocation as far as the
    second = np.frombuffer(memoryview(whole)[BLOCK:], np.uint8)     # copier can tell: not merged
    assert second.ctypes.data == first.ctypes.data + BLOCK
    with c.batch() as b:
        b.copy(first, dev[blk[0]])
        b.copy(second, dev[blk[1]])
    assert len(rt.copies()) == 2
    assert np.array_equal(whole, dev.numpy()[:2 * BLOCK])


def test_merged_staged_copies_fill_the_ring_chunks(rt):
    c = DeviceCopier("cpu", runtime=rt, force_staging=True, chunk_bytes=4 * BLOCK, slots=2)
    dev = torch.zeros(8 * BLOCK, dtype=torch.uint8)
    host = _rand(8 * BLOCK, 3)
    with c.batch() as b:
        for i in range(8):
            b.copy(dev[i * BLOCK:(i + 1) * BLOCK], host[i * BLOCK:(i + 1) * BLOCK])
    assert c.counters["staged_chunks"] == 2          # 8 blocks of 4 KiB, 2 chunks of 16 KiB
    out = bytearray(8 * BLOCK)
    with c.batch() as b:
        for i in range(8):
            b.copy(memoryview(out)[i * BLOCK:(i + 1) * BLOCK], dev[i * BLOCK:(i + 1) * BLOCK])
    assert np.array_equal(np.frombuffer(out, np.uint8), host)


@pytest.mark.parametrize("force_staging", [False, True])
def test_every_copy_waits_for_the_callers_event_and_completes_before_the_batch_returns(rt, force_staging):
    c = DeviceCopier("cpu", runtime=rt, force_staging=force_staging, chunk_bytes=BLOCK, slots=2)
    caller = Event(rt)
    order = _streams.CallerOrder({torch.device("cpu"): caller})
    dev = torch.zeros(6 * BLOCK, dtype=torch.uint8)
    host = _rand(6 * BLOCK, 4)
    out = np.zeros(6 * BLOCK, np.uint8)
    back = torch.zeros(6 * BLOCK, dtype=torch.uint8)

    def call():
        with c.batch() as b:
            b.copy(dev, host)                                   # H2D (3+ chunks when staged)
        with c.batch() as b:
            b.copy(out[:3 * BLOCK], dev[:3 * BLOCK])            # D2H
            b.copy(back, dev)                                   # D2D
            b.copy(out[3 * BLOCK:], dev[3 * BLOCK:])            # D2H again, a new run
        rt.log.append(("returned",))

    with ThreadPoolExecutor(1) as pool:
        _streams.submit(pool, order, call).result()
    assert np.array_equal(dev.numpy(), host) and np.array_equal(out, host) and torch.equal(back, dev)

    log = rt.log
    copies = [i for i, e in enumerate(log) if e[0] == "copy"]
    assert len(copies) >= 3
    for i in copies:
        stream = log[i][1]
        assert ("wait_event", stream, caller) in log[:i], f"copy {i} on {stream} not after the caller's event"
        later = log[i + 1:log.index(("returned",))]
        assert any(e[0] == "record" and e[1] is stream and ("sync", stream, e[2]) in later for e in later), \
            f"copy {i} was not waited for before the batch returned"
    assert not any(e[0] == "wait_stream" for e in log)     # a Store call orders on the caller, not ours


def test_a_direct_batch_waits_for_the_threads_current_stream(rt):
    c = DeviceCopier("cpu", runtime=rt)
    with c.batch() as b:
        b.copy(torch.zeros(BLOCK, dtype=torch.uint8), _rand(BLOCK, 5))
    first_copy = next(i for i, e in enumerate(rt.log) if e[0] == "copy")
    assert ("wait_stream", c.lanes["h2d"].stream, rt.current) in rt.log[:first_copy]


@pytest.mark.parametrize("force_staging", [False, True])
def test_a_d2h_batch_completes_while_an_h2d_batch_is_parked_in_its_host_wait(rt, force_staging):
    c = DeviceCopier("cpu", runtime=rt, force_staging=force_staging, chunk_bytes=BLOCK, slots=2)
    park = rt.parks[c.lanes["h2d"].stream] = Park()
    dev_in = torch.zeros(4 * BLOCK, dtype=torch.uint8)
    host_in = _rand(4 * BLOCK, 6)
    dev_out = torch.from_numpy(_rand(4 * BLOCK, 7))
    host_out = np.zeros(4 * BLOCK, np.uint8)
    errors = []

    def batch(dst, src):
        try:
            with c.batch() as b:
                b.copy(dst, src)
        except BaseException as exc:   # surfaced by the assertions below
            errors.append(exc)

    h2d = threading.Thread(target=batch, args=(dev_in, host_in), daemon=True)
    h2d.start()
    assert park.parked.wait(30), "the H2D batch never reached its host wait"
    d2h = threading.Thread(target=batch, args=(host_out, dev_out), daemon=True)
    d2h.start()
    d2h.join(20)
    try:
        assert not d2h.is_alive(), "the D2H batch was held up by the parked H2D batch"
        assert h2d.is_alive()                                  # still parked: the two overlapped
        assert np.array_equal(host_out, dev_out.numpy())
    finally:
        park.go.set()
        h2d.join(30)
    assert not errors and np.array_equal(dev_in.numpy(), host_in)


def test_a_second_batch_of_one_direction_is_not_held_up_by_a_parked_one(rt):
    c = DeviceCopier("cpu", runtime=rt)
    lane = c.lanes["d2h"]
    park = Park()
    first_out, second_out = np.zeros(BLOCK, np.uint8), np.zeros(BLOCK, np.uint8)
    src = torch.from_numpy(_rand(BLOCK, 8))

    def first():
        rt.parks[lane.stream] = park
        with c.batch() as b:
            b.copy(first_out, src)

    t = threading.Thread(target=first, daemon=True)
    t.start()
    assert park.parked.wait(30)
    del rt.parks[lane.stream]                   # the second batch's wait is not parked

    def second():
        with c.batch() as b:
            b.copy(second_out, src)

    s = threading.Thread(target=second, daemon=True)
    s.start()
    s.join(20)
    try:
        assert not s.is_alive(), "the second D2H batch was held up by the parked one"
        assert t.is_alive() and np.array_equal(second_out, src.numpy())
    finally:
        park.go.set()
        t.join(30)
    assert np.array_equal(first_out, src.numpy())


def test_concurrent_staged_batches_share_a_small_ring_without_mixing_bytes(rt):
    """Copies run only when waited for, so a slot reused before its transfer completed,
    or a copy-out run before its DMA, would show as wrong bytes."""
    c = DeviceCopier("cpu", runtime=rt, force_staging=True, chunk_bytes=1024, slots=2)
    n = 5000

    def worker(seed):
        for r in range(6):
            src = _rand(n, seed * 100 + r)
            dev = torch.zeros(n, dtype=torch.uint8)
            out = np.zeros(n, np.uint8)
            with c.batch() as b:
                b.copy(dev, src)
            with c.batch() as b:
                b.copy(out, dev)
            assert np.array_equal(out, src), f"worker {seed} round {r}: bytes mixed"
        return True

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(worker, range(4)))
    assert sorted(c.lanes["h2d"]._free) == [0, 1] and sorted(c.lanes["d2h"]._free) == [0, 1]


def test_one_batch_staging_both_ways_drains_one_ring_before_using_the_other(rt):
    c = DeviceCopier("cpu", runtime=rt, force_staging=True, chunk_bytes=1024, slots=2)
    src, dev_src = _rand(4000, 9), torch.from_numpy(_rand(4000, 10))
    dev, out = torch.zeros(4000, dtype=torch.uint8), np.zeros(4000, np.uint8)
    with c.batch() as b:
        b.copy(out, dev_src)
        b.copy(dev, src)
        b.copy(out, dev_src)
    assert np.array_equal(out, dev_src.numpy()) and np.array_equal(dev.numpy(), src)
    assert sorted(c.lanes["h2d"]._free) == [0, 1] and sorted(c.lanes["d2h"]._free) == [0, 1]
