"""GPUDirect Storage helper: availability is a value with a reason, never a crash, and
device-buffer I/O round-trips where kvikio and CUDA are present."""

import numpy as np
import pytest
import torch

from kvstore.errors import InvalidArgumentError, TierUnavailableError
from tiers.nvme.kvikio import KvikioFile, kvikio_available


def test_availability_has_a_reason():
    ok, reason = kvikio_available()
    assert isinstance(ok, bool) and reason
    if not torch.cuda.is_available():
        assert not ok and ("not installed" in reason or "no CUDA" in reason or "failed to import" in reason)


def test_unavailable_is_a_clear_error(tmp_path):
    ok, reason = kvikio_available()
    if ok:
        pytest.skip("kvikio usable here")
    with pytest.raises(TierUnavailableError, match="kvikio|CUDA"):
        KvikioFile(tmp_path / "f.bin", "w")


def test_device_round_trip(tmp_path):
    ok, reason = kvikio_available()
    if not ok:
        pytest.skip(reason)
    path = tmp_path / "f.bin"
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    with KvikioFile(path, "w") as f:
        assert f.write_from(src, 4096) == src.numel()
    with KvikioFile(path, "r") as f:
        assert f.read_into(dst, 4096) == dst.numel()
        with pytest.raises(InvalidArgumentError, match="CUDA buffers only"):
            f.read_into(np.zeros(16, np.uint8), 0)
    assert torch.equal(src, dst)
