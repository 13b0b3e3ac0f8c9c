"""The Store caller's stream order reaches every thread that copies for that call
(kvstore.buffers.streams). There is no GPU here: the caller's events are stand-ins that record
who waited on them; the threads, pools and tiers are the real ones."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import kvstore.store as store_mod
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
