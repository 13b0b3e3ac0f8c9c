"""The device copier: every copy path, including the chunked staging ring, which
``force_staging`` exercises on CPU-only machines (the same code CUDA runs)."""

import numpy as np
import pytest
import torch

from kvstore.buffers.device import DeviceCopier, copier_for, resolve_device
from kvstore.errors import BufferSizeError, InvalidArgumentError

DEVICES = ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else [])


def _rand(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("nbytes", [1, 1000, 4096, 10_000, 65_536 + 17])
def test_round_trip_through_ring(device, force, nbytes):
    # 3 slots of 4 KiB: a 64 KiB buffer wraps the ring several times within one batch.
    c = DeviceCopier(device, chunk_bytes=4096, slots=3, force_staging=force)
    srcs = [_rand(nbytes, i) for i in range(3)]
    devs = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in srcs]
    with c.batch() as b:
        for d, s in zip(devs, srcs):
            b.copy(d, s)
    outs = [bytearray(nbytes) for _ in srcs]
    with c.batch() as b:
        for o, d in zip(outs, devs):
            b.copy(o, d)
    for o, s in zip(outs, srcs):
        assert np.array_equal(np.frombuffer(o, np.uint8), s)
    if force:
        assert c.counters["staged_chunks"] >= 2 * 3 * -(-nbytes // 4096)


def test_read_only_source_and_size_mismatch():
    c = DeviceCopier("cpu", chunk_bytes=1024, slots=2, force_staging=True)
    dst = torch.empty(3000, dtype=torch.uint8)
    with c.batch() as b:
        b.copy(dst, bytes(range(256)) * 11 + bytes(184))
    assert dst[:256].tolist() == list(range(256))
    with pytest.raises(BufferSizeError):
        with c.batch() as b:
            b.copy(dst, bytes(10))


def test_staged_copies_are_complete_even_when_the_batch_fails():
    c = DeviceCopier("cpu", chunk_bytes=1024, slots=2, force_staging=True)
    src = torch.from_numpy(_rand(5000, 1))
    out = np.zeros(5000, np.uint8)
    with pytest.raises(RuntimeError, match="boom"):
        with c.batch() as b:
            b.copy(out, src)
            raise RuntimeError("boom")
    assert np.array_equal(out, src.numpy())


def test_devices_are_checked():
    with pytest.raises(InvalidArgumentError, match="not a torch device"):
        resolve_device("hbm")
    with pytest.raises(InvalidArgumentError, match="at least 2 slots"):
        DeviceCopier("cpu", slots=1)
    if not torch.cuda.is_available():
        with pytest.raises(InvalidArgumentError, match="needs CUDA"):
            resolve_device("cuda:0")
    assert copier_for("cpu") is copier_for("cpu")


def test_a_failed_finish_never_runs_its_copy_outs_into_a_later_batch(monkeypatch):
    """The copy-out of a batch whose finish failed must not land in its caller's buffer
    during the next caller's batch."""
    import kvstore.buffers.device as transfer

    c = DeviceCopier("cpu", chunk_bytes=1024, slots=4, force_staging=True)
    first = np.zeros(3000, np.uint8)
    real = transfer.np.copyto
    calls = [0]

    def failing_once(dst, src, **kw):
        calls[0] += 1
        if calls[0] == 1:
            raise OSError("copy-out failed")
        return real(dst, src, **kw)

    monkeypatch.setattr(transfer.np, "copyto", failing_once)
    with pytest.raises(OSError):
        with c.batch() as b:
            b.copy(first, torch.from_numpy(_rand(3000, 5)))     # staged out in 3 chunks
    monkeypatch.setattr(transfer.np, "copyto", real)
    before = first.copy()
    second = np.zeros(4096, np.uint8)
    with c.batch() as b:
        b.copy(second, torch.from_numpy(_rand(4096, 6)))
    assert np.array_equal(first, before)                       # nothing landed afterwards
    assert np.array_equal(second, _rand(4096, 6))
