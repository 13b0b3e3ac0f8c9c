"""GPUDirect Storage helper: availability is a value with a reason, never a crash, and
device-buffer I/O round-trips where kvikio and CUDA are present."""

import numpy as np
import pytest
import torch

from kvstore.errors import InvalidArgumentError, TierUnavailableError
from kvstore.tiers.nvme.kvikio import KvikioFile, kvikio_available


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


# -- gds_mode and the I/O thread pool, against stand-ins of kvikio's two defaults APIs ----
# kvikio >= 25.04: defaults.get / defaults.set / is_compat_mode_preferred; 24.x:
# defaults.compat_mode() and num_threads_reset(). kvikio is not installed here.

class _Mode:
    def __init__(self, name):
        self.name = name


def _fake_kvikio(monkeypatch, defaults):
    import sys
    import types

    pkg = types.ModuleType("kvikio")
    pkg.defaults = defaults
    monkeypatch.setitem(sys.modules, "kvikio", pkg)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", defaults)


def _current(compat, preferred=None, calls=None):
    import types

    d = types.ModuleType("kvikio.defaults")
    d.get = lambda name: {"compat_mode": compat}[name]
    d.set = lambda name, value: calls.append((name, value)) if calls is not None else None
    if preferred is not None:
        d.is_compat_mode_preferred = lambda: preferred
    return d


@pytest.mark.parametrize("compat, preferred, want", [
    (_Mode("AUTO"), True, "compat"),     # AUTO where cuFile cannot run (no libcufile, no /run/udev)
    (_Mode("AUTO"), False, "gds"),       # AUTO where kvikio will use cuFile
    (_Mode("ON"), False, "compat"),
    (_Mode("OFF"), True, "gds"),
])
def test_gds_mode_reports_what_kvikio_will_do(monkeypatch, compat, preferred, want):
    from kvstore.tiers.nvme import kvikio as _kvikio

    _fake_kvikio(monkeypatch, _current(compat, preferred))
    assert _kvikio.gds_mode() == want


def test_gds_mode_under_auto_never_claims_gds_when_kvikio_cannot_say(monkeypatch):
    import types

    from kvstore.tiers.nvme import kvikio as _kvikio

    legacy = types.ModuleType("kvikio.defaults")       # 24.x: compat_mode() only
    legacy.compat_mode = lambda: _Mode("AUTO")
    _fake_kvikio(monkeypatch, legacy)
    assert _kvikio.gds_mode() == "auto"
    legacy.compat_mode = lambda: True                  # older still: a bool
    assert _kvikio.gds_mode() == "compat"


def test_kvikio_gets_eight_io_threads_unless_the_user_chose(monkeypatch):
    import types

    from kvstore.tiers.nvme import kvikio as _kvikio

    monkeypatch.delenv("KVIKIO_NTHREADS", raising=False)
    calls = []
    _fake_kvikio(monkeypatch, _current(_Mode("AUTO"), False, calls))
    _kvikio._use_io_threads()
    assert calls == [("num_threads", _kvikio.IO_THREADS)] and _kvikio.IO_THREADS == 8
    legacy = types.ModuleType("kvikio.defaults")       # 24.x
    legacy.num_threads_reset = lambda n: calls.append(("reset", n))
    _fake_kvikio(monkeypatch, legacy)
    _kvikio._use_io_threads()
    assert calls[-1] == ("reset", 8)
    monkeypatch.setenv("KVIKIO_NTHREADS", "3")          # the user's number stands
    calls.clear()
    _fake_kvikio(monkeypatch, _current(_Mode("AUTO"), False, calls))
    _kvikio._use_io_threads()
    assert calls == []
