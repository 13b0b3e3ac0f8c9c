"""An NVMe tier directory that cannot work is refused with a message naming it, and the
index of key digests is readable by its owner only (issue 20, finding 7)."""

import os
import stat

import pytest

from kvstore.config import load_config
from kvstore.errors import ConfigError
from kvstore.tiers.nvme import NvmeTier


def _tier(path, capacity=16 << 20):
    return NvmeTier(str(path), capacity_bytes=capacity, file_bytes=4 << 20)


def test_a_path_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        _tier(f)
    assert f.read_text() == "x"


def test_the_root_directory_is_refused_by_validate_and_by_the_tier():
    with pytest.raises(ConfigError, match="root directory"):
        load_config({"tiers": [{"name": "d", "kind": "nvme", "path": "/", "capacity": "1GiB"}]}, env={})


def test_a_capacity_larger_than_the_file_system_is_flagged(tmp_path, caplog):
    vfs = os.statvfs(tmp_path)
    with caplog.at_level("WARNING"):
        _tier(tmp_path / "d", capacity=vfs.f_blocks * vfs.f_frsize + (1 << 30)).close()
    assert "more than its whole file system" in caplog.text


def test_the_index_and_its_directory_are_private(tmp_path):
    tier = _tier(tmp_path / "d")
    try:
        for root, dirs, files in os.walk(tmp_path / "d" / "index"):
            for name in files:
                assert stat.S_IMODE(os.stat(os.path.join(root, name)).st_mode) & 0o077 == 0, name
        assert stat.S_IMODE(os.stat(tmp_path / "d").st_mode) & 0o077 == 0
    finally:
        tier.close()
