"""The GPU tier: the conformance suite on ``cpu`` everywhere and on ``cuda`` where present,
plus device tensors through the tier and through a Store."""

import numpy as np
import pytest
import torch

from kvstore.errors import InvalidArgumentError, TierUnavailableError
from kvstore.store import Store
from kvstore.testing import CAPACITY, TierConformance, make_keys, payload
from kvstore.tiers.gpu import GpuTier

DEVICES = ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture
def tier(device):
    t = GpuTier(CAPACITY, name="gpu-test", device=device)
    yield t
    t.close()


class TestGpuConformance(TierConformance):
    pass


def test_device_tensors_round_trip(tier, device):
    keys = make_keys(3)
    srcs = [torch.from_numpy(payload(i)).to(device) for i in range(3)]
    assert tier.write(keys, srcs) == [True] * 3
    dsts = [torch.empty(len(payload(0)) // 2, dtype=torch.float16, device=device) for _ in keys]
    assert tier.read_into(keys, dsts) == [True] * 3
    for i, d in enumerate(dsts):
        assert np.array_equal(d.view(torch.uint8).cpu().numpy(), payload(i))


def test_capacity_is_byte_accurate(device):
    # 1000-byte blocks do not fill 256-byte slots exactly: usage still counts payload bytes.
    t = GpuTier(10_000, device=device)
    keys = make_keys(11)
    got = t.write(keys, [payload(i, 1000) for i in range(11)])
    assert t.used_bytes == 1000 * sum(got) <= 10_000
    assert sum(got) < 11
    t.close()


def test_view_is_on_the_device_and_survives_delete(tier, device):
    key = make_keys(1)
    tier.write(key, [payload(3)])
    with tier.view(key[0]) as v:
        assert v.device == torch.device(device) or str(v.device).startswith(device)
        tier.delete(key)
        tier.write(make_keys(1, salt="other"), [np.zeros(len(payload(3)), np.uint8)])
        assert np.array_equal(v.cpu().numpy(), payload(3))


def test_cuda_absent_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(TierUnavailableError, match="needs CUDA"):
        GpuTier(1 << 20, device="cuda:0")


def test_bad_device_name():
    with pytest.raises(TierUnavailableError, match="not a torch device"):
        GpuTier(1 << 20, device="gpu0")
    with pytest.raises(InvalidArgumentError):
        GpuTier(0, device="cpu")


def test_store_with_gpu_over_dram_spills_and_promotes(device):
    """A Store of GPU over DRAM takes tensors on the device, spills from the GPU arena
    into DRAM when full, and promotes back on a hit: bytes stay exact all the way."""
    block = 64 * 1024
    cfg = {"tiers": [{"name": "hbm", "kind": "gpu", "device": device, "capacity": 4 * block},
                     {"name": "ram", "kind": "dram", "capacity": 32 * block}]}
    keys = make_keys(10)
    srcs = [torch.from_numpy(payload(i)).to(device) for i in range(10)]
    with Store.from_config(cfg) as store:
        for k, s in zip(keys, srcs):  # one at a time, so a full GPU tier evicts and spills
            assert store.save([k], [s]).result() == [True]
        stats = store.stats()["tiers"]
        assert stats[0]["used_bytes"] <= 4 * block and stats[0]["spills"] >= 6
        dsts = [torch.empty(block, dtype=torch.uint8, device=device) for _ in keys]
        assert store.load(keys, dsts).result() == [True] * 10
        for i, d in enumerate(dsts):
            assert torch.equal(d.cpu(), torch.from_numpy(payload(i)))
        assert store.stats()["tiers"][0]["promotions"] > 0


def test_every_gpu_tier_on_a_device_shares_its_copier(device):
    """One copier (three streams, two pinned staging rings) per device, not one per tier."""
    from kvstore.buffers.device import copier_for

    a, b = GpuTier(1 << 20, name="a", device=device), GpuTier(1 << 20, name="b", device=device)
    try:
        assert a._copier is b._copier is copier_for(device)
    finally:
        a.close()
        b.close()
