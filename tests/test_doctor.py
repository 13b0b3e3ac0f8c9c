import importlib.util
import json
import os

import pytest

from kvstore import doctor
from kvstore.cli import main
from kvstore.testing import IN_CI


def _has_rdma() -> bool:
    return os.path.isdir("/sys/class/infiniband") and bool(os.listdir("/sys/class/infiniband"))


def test_doctor_runs_and_reports(capsys, tmp_path):
    cfg = tmp_path / "kv.yaml"
    data = tmp_path / "nvme0"
    data.mkdir()
    cfg.write_text(f"tiers:\n  - {{name: hot, kind: dram, capacity: 64MiB}}\n"
                   f"  - {{name: disk, kind: nvme, capacity: 1GiB, path: {data}}}\n")
    assert main(["doctor", "--config", str(cfg), "--path", str(tmp_path / "missing")]) == 0
    out = capsys.readouterr().out
    if not _has_rdma():
        assert "no RDMA devices" in out
    assert f"direct_io {data}" in out
    assert "directory does not exist" in out
    assert "transport auto:" in out
    assert "cuda" in out and "gds" in out


def test_doctor_json(capsys, tmp_path):
    assert main(["doctor", "--json", "--path", str(tmp_path)]) == 0
    checks = json.loads(capsys.readouterr().out)
    areas = {c["area"] for c in checks}
    assert {"rdma", "nixl", "cuda", "gds", "direct_io"} <= areas
    for c in checks:
        assert c["detail"], f"check {c['area']} {c['name']} gives no reason"


def test_nixl_backends_reported():
    checks = doctor.nixl_checks()
    installed = importlib.util.find_spec("nixl") is not None
    if not installed:
        if IN_CI:
            pytest.fail("nixl must be installed in CI (scripts/deps/60-nixl.sh)")
        assert not checks[0].ok and "pip install --no-deps nixl" in checks[0].detail
        return
    by_name = {c.name: c for c in checks}
    assert by_name["nixl"].ok
    assert by_name["backend UCX"].ok, by_name["backend UCX"].detail
    assert "DRAM" in by_name["backend UCX"].detail
    for c in checks:
        if not c.ok:
            assert c.detail  # each absent backend says why


def test_direct_io_probe(tmp_path):
    ok = doctor.direct_io_checks([str(tmp_path)])[0]
    assert ok.ok, ok.detail
    assert not list(tmp_path.iterdir()), "the probe must remove its file"
    not_dir = tmp_path / "file"
    not_dir.write_text("x")
    bad = doctor.direct_io_checks([str(not_dir)])[0]
    assert not bad.ok and "does not exist" in bad.detail
    none = doctor.direct_io_checks([])
    assert len(none) == 1 and not none[0].ok and "no NVMe tier" in none[0].detail


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_direct_io_unwritable(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    check = doctor.direct_io_checks([str(ro)])[0]
    assert not check.ok and "cannot create" in check.detail


def test_rdma_sysfs_fallback(tmp_path, monkeypatch):
    """Without pyverbs anywhere, devices and ports come from sysfs, with the reasons."""
    port = tmp_path / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "link_layer").write_text("Ethernet\n")
    down = tmp_path / "mlx5_1" / "ports" / "1"
    down.mkdir(parents=True)
    (down / "state").write_text("1: DOWN\n")
    (down / "link_layer").write_text("InfiniBand\n")
    monkeypatch.setattr(doctor, "SYSFS_INFINIBAND", tmp_path)
    monkeypatch.setattr(doctor, "SYSTEM_PYTHON", str(tmp_path / "no-python"))
    monkeypatch.setattr(doctor, "_pyverbs_here", lambda: {"import_error": "ModuleNotFoundError: pyverbs"})
    checks = {c.name: c for c in doctor.rdma_checks()}
    assert checks["mlx5_0"].ok and "ACTIVE Ethernet" in checks["mlx5_0"].detail
    assert not checks["mlx5_1"].ok and "no active port" in checks["mlx5_1"].detail
    assert "no-python does not exist" in checks["mlx5_0"].extra["source"]


def test_rdma_no_driver_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(doctor, "SYSFS_INFINIBAND", tmp_path / "absent")
    monkeypatch.setattr(doctor, "SYSTEM_PYTHON", str(tmp_path / "no-python"))
    monkeypatch.setattr(doctor, "_pyverbs_here", lambda: {"import_error": "ModuleNotFoundError: pyverbs"})
    (check,) = doctor.rdma_checks()
    assert not check.ok
    assert "no RDMA devices" in check.detail and "pyverbs" in check.detail
