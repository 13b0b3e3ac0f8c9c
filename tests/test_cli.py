import json
import re
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


def test_show_prints_a_config_validate_accepts(tmp_path, capsys):
    cfg = tmp_path / "kv.yaml"
    cfg.write_text("tiers:\n  - {name: hot, kind: dram, capacity: 64MiB}\nserver: {admin_port: null, port: 0}\n")
    assert main(["config", "show", str(cfg)]) == 0
    shown = tmp_path / "shown.yaml"
    shown.write_text(capsys.readouterr().out)
    assert main(["config", "validate", str(shown)]) == 0, capsys.readouterr().err
    assert "admin_port: null" in shown.read_text() and not re.search(r"^\s*token:", shown.read_text(), re.M)


def test_show_masks_secrets_unless_asked(tmp_path, capsys):
    cfg = tmp_path / "kv.yaml"
    cfg.write_text("tiers:\n  - {name: hot, kind: dram, capacity: 64MiB}\nserver:\n  token: op-secret-token\n"
                   "  tenants: [{name: a, token: tenant-secret, salt: salt-secret-0123456789}]\n")
    assert main(["config", "show", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "secret" not in out and "**********" in out
    assert main(["config", "show", "--secrets", str(cfg)]) == 0
    clear = tmp_path / "clear.yaml"
    clear.write_text(capsys.readouterr().out)
    assert "op-secret-token" in clear.read_text()
    assert main(["config", "validate", str(clear)]) == 0


@pytest.mark.parametrize("text,needle", [
    ("server: {host: 0.0.0.0}\n", "server.host '0.0.0.0' serves beyond this machine"),
    ("  - {name: warm, kind: nvme, path: FILE/data, capacity: 64MiB}\n", "tiers.warm.path: .* cannot be created"),
    ("  - {name: warm, kind: nvme, path: DIR, capacity: 64MiB, file_bytes: 1GiB + 1}\n", "file_bytes"),
])
def test_validate_refuses_what_serve_refuses(tmp_path, capsys, text, needle):
    (tmp_path / "file").write_text("x")
    text = text.replace("FILE", str(tmp_path / "file")).replace("DIR", str(tmp_path / "d"))
    text = text.replace("1GiB + 1", str((1 << 30) + 1))
    cfg = tmp_path / "kv.yaml"
    cfg.write_text("tiers:\n  - {name: hot, kind: dram, capacity: 64MiB}\n" + text)
    assert main(["config", "validate", str(cfg)]) == 2
    assert re.search(needle, capsys.readouterr().err)
    assert not (tmp_path / "d").exists()
