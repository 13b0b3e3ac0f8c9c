"""The Store caller's stream order reaches every thread that copies for that call
(kvstore.buffers.streams). There is no GPU here: the caller's events are stand-ins that record
who waited on them; the threads, pools and tiers are the real ones."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import kvstore.store.facade as store_mod
from kvstore.buffers import streams as _streams
from kvstore.keys import Namespace
from kvstore.store import Store


class RecordingOrder(_streams.CallerOrder):
    def __init__(self):
        super().__init__({"cuda:0": "event"})
        self.gated: list[tuple[object, object]] = []
        self.host_waits = 0

    def gate(self, stream, device):
        self.gated.append((stream, device))

    def wait_host(self):
        self.host_waits += 1


def test_submit_carries_the_order_into_the_pool_and_into_threads_fanned_out_from_there():
    order = RecordingOrder()
    seen = []
    with ThreadPoolExecutor(2) as outer, ThreadPoolExecutor(4) as lanes:
        def lane(i):
            seen.append((i, _streams.caller_order()))
            _streams.wait_for_caller()

        def call():
            seen.append(("call", _streams.caller_order()))
            for f in [_streams.in_context(lanes, lane, i) for i in range(4)]:
                f.result()

        _streams.submit(outer, order, call).result()
        _streams.submit(outer, None, call).result()          # a call without device buffers
    assert [o for _, o in seen[:5]] == [order] * 5
    assert [o for _, o in seen[5:]] == [None] * 5
    assert order.host_waits == 4 and _streams.caller_order() is None


@pytest.mark.parametrize("op", ["save", "load"])
def test_store_save_and_load_run_their_tier_work_under_the_callers_order(monkeypatch, op):
    orders = []

    def capture(buffers):
        orders.append(RecordingOrder())
        return orders[-1]

    monkeypatch.setattr(store_mod, "capture", capture)
    store = Store.from_config({"tiers": [{"name": "hot", "kind": "dram", "capacity": "4MiB"}]})
    try:
        tier = store.tiers[0]
        seen = []
        for name in ("write", "read_into"):
            real = getattr(tier, name)

            def wrapped(*args, _real=real, _name=name):
                seen.append((_name, _streams.caller_order()))
                return _real(*args)
            monkeypatch.setattr(tier, name, wrapped)
        keys = Namespace("m", "f16", 16).chunk_keys(np.arange(32, dtype=np.uint32))
        assert store.save(keys, [np.full(4096, 3, np.uint8)] * 2).result() == [True, True]
        dst = [np.empty(4096, np.uint8) for _ in keys]
        assert store.load(keys, dst).result() == [True, True]
        want = "write" if op == "save" else "read_into"
        index = 0 if op == "save" else 1
        assert [o for name, o in seen if name == want] == [orders[index]]
    finally:
        store.close()


def test_without_device_buffers_nothing_is_captured():
    assert _streams.capture([np.zeros(8, np.uint8), bytearray(8)]) is None


def test_copy_bytes_waits_for_the_caller_first_and_completes_a_device_copy_before_returning(monkeypatch):
    """copy_bytes (the NVMe bounce, S3, redis, client and NIXL paths): the copy is gated
    on the caller's event, and a device->device copy (which copy_ only queues) is
    complete on return, like a host<->device one. CUDA is a stand-in here."""
    import torch

    from kvstore.buffers import views as buffers   # copy_bytes and the checks it calls live here

    log = []

    class Dev:
        def __init__(self, kind, index=0):
            self.type, self.index = kind, index

        def __hash__(self):
            return hash((self.type, self.index))

        def __eq__(self, other):
            return (self.type, self.index) == (other.type, other.index)

    class FakeTensor:
        def __init__(self, kind, index=0):
            self.device = Dev(kind, index)

        def numel(self):
            return 16

        def copy_(self, src, non_blocking=False):
            log.append(("copy", self.device.type, src.device.type))

    class Stream:
        def __init__(self, dev):
            self.dev = dev

        def synchronize(self):
            log.append(("synchronize", self.dev.type, self.dev.index))

    monkeypatch.setattr(buffers, "is_device", lambda b: isinstance(b, FakeTensor) and b.device.type != "cpu")
    monkeypatch.setattr(buffers, "is_torch", lambda b: isinstance(b, FakeTensor))
    monkeypatch.setattr(buffers, "device_view", lambda b: b)
    monkeypatch.setattr(_streams, "gate_current_stream", lambda dev: log.append(("gate", dev.type)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: Stream(dev))

    buffers.copy_bytes(FakeTensor("cuda"), FakeTensor("cuda"))
    assert log == [("gate", "cuda"), ("copy", "cuda", "cuda"), ("synchronize", "cuda", 0)]
    log.clear()
    buffers.copy_bytes(FakeTensor("cuda", 1), FakeTensor("cuda", 0))     # across devices: both complete
    assert log[:2] == [("gate", "cuda"), ("copy", "cuda", "cuda")]
    assert sorted(log[2:]) == [("synchronize", "cuda", 0), ("synchronize", "cuda", 1)]
    log.clear()
    buffers.copy_bytes(FakeTensor("cuda"), FakeTensor("cpu"))            # H2D: copy_ has completed already
    assert log == [("gate", "cuda"), ("copy", "cuda", "cpu")]


def test_the_kvikio_read_waits_for_the_caller_before_any_io(monkeypatch):
    """kvikio's DMA into a device buffer runs outside stream order: the NVMe tier's device
    read waits for the caller's event on the host before it touches the file or the buffer."""
    import torch

    from kvstore.tiers.nvme import gpu as _nvme_gpu

    log = []

    class Stop(Exception):
        pass

    def wait():
        log.append("wait")
        raise Stop

    io = _nvme_gpu.DeviceIO()
    io._mode = "kvikio"
    monkeypatch.setattr(_nvme_gpu, "wait_for_caller", wait)
    monkeypatch.setattr(io, "_file", lambda path: log.append("file") or pytest.fail("I/O before the wait"))
    monkeypatch.setattr(_nvme_gpu.os, "preadv", lambda *a: log.append("preadv") or pytest.fail("I/O before the wait"))
    with pytest.raises(Stop):
        io.read(-1, "/nonexistent", 0, b"\0" * 16, 64, 0, torch.zeros(64, dtype=torch.uint8))
    assert log == ["wait"]
