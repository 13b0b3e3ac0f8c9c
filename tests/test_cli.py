import json
import subprocess
import sys

import pytest

from kvstore.cli import main


def test_config_validate_and_show(tmp_path, capsys):
    cfg = tmp_path / "kv.yaml"
    cfg.write_text("tiers:\n  - {name: hot, kind: dram, capacity: 64MiB}\n")
    assert main(["config", "validate", str(cfg)]) == 0
    assert "hot (dram)" in capsys.readouterr().out
    assert main(["config", "show", str(cfg)]) == 0
    assert "capacity: 67108864" in capsys.readouterr().out


def test_bad_config_exits_2_naming_the_field(tmp_path, capsys):
    cfg = tmp_path / "kv.yaml"
    cfg.write_text("tiers:\n  - {name: hot, kind: dram, capacity: 64MiB, size: 3}\n")
    assert main(["config", "validate", str(cfg)]) == 2
    assert "tiers.0.size: unknown field" in capsys.readouterr().err


def test_bench_runs_end_to_end(tmp_path):
    cfg = tmp_path / "kv.yaml"
    cfg.write_text("tiers:\n  - {name: hot, kind: dram, capacity: 8MiB}\n")
    out = subprocess.run([sys.executable, "-m", "kvstore", "bench", "--config", str(cfg), "--block-size", "64KiB",
                          "--blocks", "32", "--batch", "8", "--rounds", "2", "--json"],
                         capture_output=True, text=True, check=True, timeout=120)
    result = json.loads(out.stdout)
    (row,) = result["rows"]
    assert result["hits"] == row["verified"] == 64 and row["stats"]["capacity_bytes"] == 8 << 20


def test_public_exports():
    import kvstore
    import kvstore.errors as errors

    # the exact public surface: a name added or dropped is a deliberate change made here too
    assert sorted(kvstore.__all__) == ["BlockKey", "Client", "Hint", "KVStoreError", "Namespace", "Store", "__version__"]
    for name in kvstore.__all__:
        assert getattr(kvstore, name) is not None
    assert kvstore.Store.__name__ == "Store"
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.KVStoreError)
    assert issubclass(errors.ConfigError, ValueError)
    assert issubclass(errors.TierUnavailableError, ConnectionError)
    with pytest.raises(AttributeError):
        kvstore.NoSuchThing
