"""Pinning the DRAM tier's arena: lazy (first device copy), registered and unregistered
exactly once, a failure clears CUDA's last error, and a private arena is kept out of
forked children (MADV_DONTFORK) before it is pinned. CUDA's runtime is a stand-in that
counts calls (there is no GPU here); the mapping, madvise and fork are real."""

import os

import numpy as np
import pytest

import kvstore.tiers.dram as dram
from kvstore.keys import Namespace
from kvstore.tiers.dram import DramTier


class FakeCudart:
    def __init__(self, register_error=0):
        self.register_error = register_error
        self.registered: dict[int, int] = {}
        self.calls: list[str] = []
        self.sticky = 0

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.calls.append("register")
        if self.register_error:
            self.sticky = self.register_error
            return self.register_error
        assert ptr not in self.registered, "registered twice"
        self.registered[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr):
        self.calls.append("unregister")
        assert ptr in self.registered, "unregistered something not registered"
        del self.registered[ptr]
        return 0

    def cudaGetLastError(self):
        self.calls.append("last_error")
        err, self.sticky = self.sticky, 0
        return err


@pytest.fixture
def cudart(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(dram, "_cudart", lambda: fake)
    return fake


def _dontfork(ptr: int) -> bool:
    """Whether the mapping holding ``ptr`` carries the kernel's do-not-copy-on-fork flag."""
    current = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                current = lo <= ptr < hi
            elif head == "VmFlags:" and current:
                return "dc" in line.split()[1:]          # "dc": do not copy on fork
    raise AssertionError("mapping not found")


def test_pinning_is_lazy_and_registers_and_unregisters_exactly_once(cudart):
    tier = DramTier(1 << 20, name="lazy")
    ptr = tier.arena.ctypes.data
    keys = Namespace("m", "f16", 16).chunk_keys(np.arange(32, dtype=np.uint32))
    tier.write(keys, [np.full(4096, 1, np.uint8), np.full(4096, 2, np.uint8)])
    dst = [np.empty(4096, np.uint8) for _ in keys]
    assert tier.read_into(keys, dst) == [True, True]
    assert cudart.calls == [] and not tier.pinned        # host copies never touch CUDA
    assert tier._pin.ensure() and tier._pin.ensure()     # what the first device copy does
    assert cudart.calls == ["register"] and cudart.registered == {ptr: tier.arena.nbytes}
    assert tier.pinned and tier.stats()["pinned"]
    tier.close()
    tier.close()
    assert cudart.calls == ["register", "unregister"] and cudart.registered == {}


def test_a_reopened_arena_is_never_copied_through_a_stale_registration(cudart):
    for _ in range(3):                                   # same size: may land at the same address
        tier = DramTier(1 << 20, name="again")
        assert tier._pin.ensure()
        tier.close()
    assert cudart.calls == ["register", "unregister"] * 3 and cudart.registered == {}


def test_a_failed_pin_clears_the_last_error_and_falls_back(monkeypatch):
    fake = FakeCudart(register_error=712)
    monkeypatch.setattr(dram, "_cudart", lambda: fake)
    tier = DramTier(1 << 20, name="fails")
    assert not tier._pin.ensure() and not tier._pin.ensure()
    assert fake.calls == ["register", "last_error"] and fake.sticky == 0
    tier.close()
    assert fake.calls == ["register", "last_error"]      # nothing to unregister


def test_without_cuda_nothing_is_pinned(monkeypatch):
    monkeypatch.setattr(dram, "_cudart", lambda: None)
    tier = DramTier(1 << 20, name="nocuda")
    assert not tier._pin.ensure() and not tier.pinned
    assert not _dontfork(tier.arena.ctypes.data)
    tier.close()


def test_a_fork_after_pinning_leaves_the_parents_pinned_pages_alone(cudart):
    tier = DramTier(1 << 20, name="fork")
    assert tier._pin.ensure()
    ptr = tier.arena.ctypes.data
    assert _dontfork(ptr)                                # marked before it was registered
    keys = Namespace("m", "f16", 16).chunk_keys(np.arange(16, dtype=np.uint32))
    tier.write(keys, [np.full(8192, 7, np.uint8)])
    pid = os.fork()
    if pid == 0:                                         # the child: the arena is not mapped here
        os._exit(0 if not any(f"{ptr:x}-" in line for line in open("/proc/self/maps")) else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    tier.write(Namespace("m", "f16", 16).chunk_keys(np.arange(16, 32, dtype=np.uint32)), [np.full(8192, 9, np.uint8)])
    dst = np.empty(8192, np.uint8)
    assert tier.read_into(keys, [dst]) == [True] and (dst == 7).all()
    tier.close()


def test_a_shared_arena_is_pinned_without_dontfork(cudart, tmp_path):
    tier = DramTier(1 << 20, name="shm", shm_path=str(tmp_path / "arena"))
    assert tier._pin.ensure() and not _dontfork(tier.arena.ctypes.data)
    tier.close()
    assert cudart.registered == {}


def test_a_read_only_mapping_is_registered_read_only_and_released_once():
    import mmap

    from kvstore.buffers.pinning import CUDA_HOST_REGISTER_READ_ONLY, HostPin

    fake = FakeCudart()
    flags = []
    register = fake.cudaHostRegister
    fake.cudaHostRegister = lambda ptr, n, f: (flags.append(f), register(ptr, n, f))[1]
    mm = mmap.mmap(-1, 1 << 16)
    ptr = np.frombuffer(mm, dtype=np.uint8).ctypes.data
    pin = HostPin(mm, ptr, 1 << 16, name="client arena map", shared=True, read_only=True, cudart=lambda: fake)
    assert fake.calls == [] and pin.ensure() and flags == [CUDA_HOST_REGISTER_READ_ONLY]
    pin.release()
    pin.release()
    assert fake.calls == ["register", "unregister"] and fake.registered == {}


def test_the_clients_arena_mapping_is_registered_read_only_when_it_may_only_read(monkeypatch, tmp_path):
    """kvstore.net.client.wire.ArenaMap (the same-host client's view of the server's arena): a
    mapping opened read-only registers with cudaHostRegisterReadOnly, a writable one
    without; lazily, and released at close before the unmap."""
    from kvstore.net.client import wire as _wire
    from kvstore.buffers import pinning as _pinning

    path = tmp_path / "arena"
    path.write_bytes(bytes(1 << 16))
    st = os.stat(path)
    info = {"path": str(path), "dev": st.st_dev, "ino": st.st_ino, "nbytes": 1 << 16}
    fake = FakeCudart()
    flags = []
    register = fake.cudaHostRegister
    fake.cudaHostRegister = lambda ptr, n, f: (flags.append(f), register(ptr, n, f))[1]
    real_open = os.open

    def open_read_only(p, mode, *a):
        if mode & os.O_RDWR:
            raise PermissionError("read-only for this test")   # as for a client outside the server's group
        return real_open(p, mode, *a)

    for read_only in (False, True):
        if read_only:
            monkeypatch.setattr(os, "open", open_read_only)
        before = len(fake.calls)
        arena = _wire.ArenaMap(info)
        arena.pin._cudart = lambda: fake              # the stand-in runtime (torch's by default)
        assert arena.writable is not read_only and len(fake.calls) == before     # nothing until a device copy
        assert arena.pin.ensure()
        assert flags[-1] == (_pinning.CUDA_HOST_REGISTER_READ_ONLY if read_only else 0)
        arena.close()
        assert fake.registered == {}
        monkeypatch.setattr(os, "open", real_open)
