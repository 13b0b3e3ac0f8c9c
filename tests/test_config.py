import os
import re

import pytest

from kvstore.config import DEFAULT_CONFIG, MASK, dump_config, load_config, parse_size, secrets_of
from kvstore.errors import ConfigError

ONE = {"tiers": [{"name": "hot", "kind": "dram", "capacity": "64MiB"}]}


@pytest.mark.parametrize("text,expected", [(4096, 4096), ("4096", 4096), ("64GiB", 64 << 30), ("1.5 GB", 1_500_000_000),
                                           ("512M", 512 << 20), ("2kib", 2048), ("0", 0)])
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["8XB", "-1GiB", -5, "lots", True, "1..5G"])
def test_bad_sizes(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_yaml_file_and_defaults(tmp_path):
    path = tmp_path / "kv.yaml"
    path.write_text("tiers:\n  - name: hot\n    kind: dram\n    capacity: 8GiB\n    eviction: arc\n"
                    "    admission: {min_hits: 2}\nplacement: {write: through, promote_on_hit: false}\n")
    cfg = load_config(path, env={})
    assert cfg.tiers[0].capacity == 8 << 30 and cfg.tiers[0].eviction == "arc"
    assert cfg.tiers[0].admission.min_hits == 2
    assert cfg.placement.write == "through" and not cfg.placement.promote_on_hit
    assert load_config(dump_config(cfg) and cfg) == cfg
    assert load_config(None, env={}).tiers[0].name == DEFAULT_CONFIG["tiers"][0]["name"]


@pytest.mark.parametrize("mutate,needle", [
    (lambda c: c["tiers"][0].update(capacity=-1), "tiers.0.capacity"),
    (lambda c: c["tiers"][0].update(capacity="12 parsecs"), "unknown size unit"),
    (lambda c: c["tiers"][0].update(colour="blue"), "tiers.0.colour: unknown field"),
    (lambda c: c.update(tierz=[]), "tierz: unknown field"),
    (lambda c: c["tiers"][0].update(eviction="random"), "tiers.0.eviction"),
    (lambda c: c["tiers"].append(dict(c["tiers"][0])), "unique"),
    (lambda c: c["tiers"][0].update(kind="floppy"), "floppy"),
    (lambda c: c.update(placement={"write": "sideways"}), "placement.write"),
])
def test_errors_name_the_field(mutate, needle):
    cfg = {"tiers": [dict(t) for t in ONE["tiers"]]}
    mutate(cfg)
    with pytest.raises(ConfigError, match=needle):
        load_config(cfg, env={})


def test_env_overrides():
    env = {"KVSTORE_TIERS__hot__CAPACITY": "2GiB", "KVSTORE_TIERS__0__EVICTION": "fifo",
           "KVSTORE_PLACEMENT__WRITE": "through", "KVSTORE_IO_THREADS": "2", "UNRELATED": "x"}
    cfg = load_config(ONE, env=env)
    assert cfg.tiers[0].capacity == 2 << 30 and cfg.tiers[0].eviction == "fifo"
    assert cfg.placement.write == "through" and cfg.io_threads == 2
    assert load_config(ONE, env={"KVSTORE_BOGUS": "1"}) == load_config(ONE, env={})   # not an override
    with pytest.raises(ConfigError, match="tiers.0.capacity"):
        load_config(ONE, env={"KVSTORE_TIERS__0__CAPACITY": "-3"})
    with pytest.raises(ConfigError, match="no list entry"):
        load_config(ONE, env={"KVSTORE_TIERS__cold__CAPACITY": "1GiB"})


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)


def test_config_is_frozen():
    cfg = load_config(ONE, env={})
    with pytest.raises(Exception):
        cfg.tiers[0].capacity = 1


# -- which KVSTORE_* variables are overrides -------------------------------------------------

# what a Service named `kvstore` makes Kubernetes inject, the CLI's token, the docs' password_env
FOREIGN = {"KVSTORE_PORT": "tcp://10.0.0.1:7480", "KVSTORE_PORT_7480_TCP": "tcp://10.0.0.1:7480",
           "KVSTORE_PORT_7480_TCP_ADDR": "10.0.0.1", "KVSTORE_SERVICE_HOST": "10.0.0.1",
           "KVSTORE_SERVICE_PORT": "7480", "KVSTORE_TOKEN": "cli-token", "KVSTORE_REDIS_PASSWORD": "pw-value",
           "KVSTORE_CONFIG": "/nonexistent.yaml", "KVSTORE_SERVER": "x", "KVSTORE_SERVER_PORT": "1"}


@pytest.mark.parametrize("var,override", [
    ("KVSTORE_SERVER__PORT", True), ("KVSTORE_TIERS__hot__CAPACITY", True), ("KVSTORE_IO_THREADS", True),
    ("KVSTORE_PLACEMENT__WRITE", True), ("KVSTORE_EVENTS__ENDPOINT", True),
    ("KVSTORE_PORT", False), ("KVSTORE_SERVICE_HOST", False), ("KVSTORE_TOKEN", False), ("KVSTORE_CONFIG", False),
    ("KVSTORE_REDIS_PASSWORD", False), ("KVSTORE_SERVER", False), ("KVSTORE_SERVER_PORT", False),
    ("KVSTORE_TIERS", False), ("KVSTORE_BOGUS__X", False), ("OTHER__SERVER__PORT", False)])
def test_which_variables_are_overrides(var, override):
    from kvstore.config import is_override

    assert is_override(var) is override


def test_foreign_kvstore_variables_are_ignored_with_one_warning(caplog):
    env = {**FOREIGN, "KVSTORE_SERVER__PORT": "9000", "KVSTORE_IO_THREADS": "2"}
    with caplog.at_level("WARNING", logger="kvstore.config"):
        cfg = load_config(ONE, env=env)
        assert cfg.server.port == 9000 and cfg.io_threads == 2
        load_config(ONE, env=env)                        # the same names: warned once per process
    warnings = [r.getMessage() for r in caplog.records if r.name == "kvstore.config"]
    assert len(warnings) == 1, warnings
    for name in ("KVSTORE_PORT", "KVSTORE_SERVICE_HOST", "KVSTORE_PORT_7480_TCP_ADDR", "KVSTORE_SERVER_PORT"):
        assert name in warnings[0]
    # read by something else (the CLI, the config file's name): not warned about; values never logged
    assert "KVSTORE_TOKEN" not in warnings[0] and "KVSTORE_CONFIG" not in warnings[0]
    assert "10.0.0.1" not in warnings[0] and "cli-token" not in warnings[0]


def test_the_docs_password_env_is_not_an_override(caplog):
    raw = {"tiers": [{"name": "shared", "kind": "redis", "url": "redis://localhost:6379", "capacity": "1GiB",
                      "password_env": "KVSTORE_REDIS_PASSWORD"}]}
    with caplog.at_level("WARNING", logger="kvstore.config"):
        cfg = load_config(raw, env={"KVSTORE_REDIS_PASSWORD": "pw-value"})
    assert cfg.tiers[0].password_env == "KVSTORE_REDIS_PASSWORD"
    assert not [r for r in caplog.records if "KVSTORE_REDIS_PASSWORD" in r.getMessage()]


def test_store_from_a_dict_under_kubernetes_variables(monkeypatch):
    from kvstore import Store

    for var, value in FOREIGN.items():
        monkeypatch.setenv(var, value)
    with Store.from_config(ONE) as store:
        assert [t.name for t in store.tiers] == ["hot"]
    with pytest.raises(ConfigError, match="nonexistent.yaml"):   # $KVSTORE_CONFIG still names the file
        load_config(None)


# -- show: lossless, every secret masked ------------------------------------------------------

SALT_A, SALT_B = "a" * 16 + "-salt-one", "b" * 16 + "-salt-two"


def _round_trip_configs(tmp_path):
    from tests._pki import make_pki

    pki = make_pki(tmp_path / "pki")
    return {
        "one": ONE,
        "server-flags": {**ONE, "server": {"port": 0, "admin_port": None, "socket_path": str(tmp_path / "s.sock")}},
        "nvme": {"tiers": [ONE["tiers"][0], {"name": "warm", "kind": "nvme", "path": [str(tmp_path / "a"),
                                                                                      str(tmp_path / "b")],
                                             "capacity": "64MiB", "file_bytes": "8MiB"}]},
        "tenants": {"tiers": ONE["tiers"], "server": {"token": "operator-token", "tenants": [
            {"name": "a", "token": "tenant-a-token", "salt": SALT_A, "quota": {"hot": "8MiB"}},
            {"name": "b", "token": "tenant-b-token", "salt": SALT_B}]}},
        "tls": {"tiers": [ONE["tiers"][0], {"name": "far", "kind": "remote", "address": "localhost:7480",
                                            "capacity": "1GiB", "token": "remote-token",
                                            "tls": pki.client_tls(cert=True)}],
                "server": {"host": "0.0.0.0", "token": "tls-token", "tls": pki.server_tls(ca=pki.ca)}},
        "redis": {"tiers": [ONE["tiers"][0], {"name": "shared", "kind": "redis", "nodes": ["r1:6379", "r2:6379"],
                                              "capacity": "1GiB", "password": "redis-pw", "ttl_s": 60,
                                              "tls": {"ca": str(tmp_path / "ca.pem")}}],
                  "trace": {"path": str(tmp_path / "trace.jsonl")}, "events": {"endpoint": "tcp://*:5557"}},
    }


def test_show_round_trips(tmp_path):
    import yaml

    for name, raw in _round_trip_configs(tmp_path).items():
        cfg = load_config(raw, env={})
        assert load_config(yaml.safe_load(dump_config(cfg, secrets=True)), env={}) == cfg, name
        if not list(secrets_of(cfg)):
            assert load_config(yaml.safe_load(dump_config(cfg)), env={}) == cfg, name


def test_show_masks_every_secret(tmp_path):
    import yaml

    configs = _round_trip_configs(tmp_path)
    for name in ("tenants", "tls", "redis"):
        cfg = load_config(configs[name], env={})
        shown = dump_config(cfg)
        values = [v for _, v in secrets_of(cfg)]
        assert values and MASK in shown
        for value in values:
            assert value not in shown, (name, value)
        with pytest.raises(ConfigError, match="is the mask"):   # a masked config is never served as it is
            load_config(yaml.safe_load(shown), env={})
        for loc, value in secrets_of(cfg):   # each secret left masked is refused, by name
            data = yaml.safe_load(dump_config(cfg, secrets=True))
            *path, field = loc.split(".")
            node = data
            for part in path:
                node = node[int(part)] if isinstance(node, list) else node[part]
            node[field] = MASK
            with pytest.raises(ConfigError, match=f"{re.escape('.'.join(path))}: {field}: .* is the mask") as err:
                load_config(data, env={})
            assert value not in str(err.value)
    found = {loc for name in configs for loc, _ in secrets_of(load_config(configs[name], env={}))}
    assert found == {"server.token", "server.tenants.0.token", "server.tenants.0.salt", "server.tenants.1.token",
                     "server.tenants.1.salt", "tiers.1.token", "tiers.1.password"}


def test_file_bytes_larger_than_any_data_file_is_refused(tmp_path):
    nvme = {"name": "warm", "kind": "nvme", "path": str(tmp_path / "d"), "capacity": "64MiB"}
    with pytest.raises(ConfigError, match="tiers.0: file_bytes .* larger than any data file"):
        load_config({"tiers": [{**nvme, "file_bytes": "128MiB"}]}, env={})
    with pytest.raises(ConfigError, match="tiers.0: file_bytes"):   # each directory gets its share
        load_config({"tiers": [{**nvme, "path": ["a", "b"], "file_bytes": "48MiB"}]}, env={})
    assert load_config({"tiers": [{**nvme, "file_bytes": "64MiB"}]}, env={}).tiers[0].file_bytes == 64 << 20
    assert load_config({"tiers": [{**nvme, "capacity": "64KiB", "file_bytes": "1MiB"}]}, env={})   # headers' room
    assert load_config({"tiers": [nvme]}, env={}).tiers[0].file_bytes == 1 << 30   # the default: capped by the tier


# -- preflight: what serve checks before it starts, validate checks too -----------------------

def test_preflight_refuses_a_public_host_without_a_token():
    from kvstore.config import preflight

    with pytest.raises(ConfigError, match="server.host '0.0.0.0'.*no server.token"):
        preflight(load_config({**ONE, "server": {"host": "0.0.0.0"}}, env={}))
    for server in ({"host": "0.0.0.0", "token": "t0ken"}, {"host": "0.0.0.0", "allow_unauthenticated": True},
                   {"host": "::1"}):
        preflight(load_config({**ONE, "server": server}, env={}))


def test_preflight_refuses_tier_paths_that_cannot_be_created_and_creates_none(tmp_path):
    from kvstore.config import preflight

    (tmp_path / "file").write_text("x")
    nvme = {"name": "warm", "kind": "nvme", "capacity": "64MiB"}
    cases = [(str(tmp_path / "file" / "data"), "tiers.warm.path: .* cannot be created: .*file is not a directory"),
             (str(tmp_path / "file"), "tiers.warm.path: .* exists and is not a directory")]
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        cases.append((str(locked / "data"), "cannot be created: .*locked is not writable"))
    for path, needle in cases:
        with pytest.raises(ConfigError, match=needle):
            preflight(load_config({"tiers": [ONE["tiers"][0], {**nvme, "path": path}]}, env={}))
    fine = tmp_path / "new" / "deeper"
    preflight(load_config({"tiers": [{**nvme, "path": str(fine)}]}, env={}))
    assert not (tmp_path / "new").exists()


def test_preflight_needs_the_password_env_variable(monkeypatch):
    from kvstore.config import preflight

    raw = {"tiers": [{"name": "shared", "kind": "redis", "url": "redis://localhost:6379", "capacity": "1GiB",
                      "password_env": "KVSTORE_REDIS_PASSWORD"}]}
    monkeypatch.delenv("KVSTORE_REDIS_PASSWORD", raising=False)
    with pytest.raises(ConfigError, match="password_env: environment variable KVSTORE_REDIS_PASSWORD is not set"):
        preflight(load_config(raw, env={}))
    monkeypatch.setenv("KVSTORE_REDIS_PASSWORD", "pw")
    preflight(load_config(raw, env={}))


# -- YAML alias bombs and long values (issue 34 item 9) ---------------------------------------

def _alias_bomb(levels: int = 9) -> str:
    """Nine anchors of nine aliases each: 9**9 values when expanded."""
    lines = ['a0: &a0 ["lol"]']
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]")
    return "{" + ", ".join(lines) + "}"


def _bomb_config(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(f"tiers:\n  - name: hot\n    kind: dram\n    capacity: {_alias_bomb()}\n")
    return path


def test_a_yaml_alias_bomb_in_a_file_is_refused_in_one_short_line(tmp_path):
    import subprocess
    import sys

    path = _bomb_config(tmp_path)
    with pytest.raises(ConfigError, match="do not expand YAML aliases") as err:
        load_config(path, env={})
    assert str(path) in str(err.value) and len(str(err.value)) < 600
    # `kvstore serve` with a flag loads the file itself first: refused there too, in one line
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--config", str(path), "--port", "0"],
                          cwd=root, env={**os.environ, "PYTHONPATH": root}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "do not expand YAML aliases" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and len(done.stderr) < 600


def test_a_yaml_alias_bomb_in_an_environment_override_is_refused_in_one_short_line():
    with pytest.raises(ConfigError, match="KVSTORE_TIERS__0__CAPACITY: kvstore configs do not expand") as err:
        load_config(ONE, env={"KVSTORE_TIERS__0__CAPACITY": _alias_bomb()})
    assert len(str(err.value)) < 400


def test_a_long_bad_value_is_cut_short_in_the_error():
    with pytest.raises(ConfigError, match="not a size") as err:
        load_config(ONE, env={"KVSTORE_TIERS__0__CAPACITY": "x" * 100_000})
    assert len(str(err.value)) < 400
    nested = [[["deep"] * 1000] * 1000] * 1000          # a billion items if walked whole
    with pytest.raises(ValueError, match="not a size") as err:
        parse_size(nested)
    assert len(str(err.value)) < 200


def test_anchors_without_aliases_still_load(tmp_path):
    path = tmp_path / "kv.yaml"
    path.write_text("tiers:\n  - &hot {name: hot, kind: dram, capacity: 64MiB}\n")
    assert load_config(path, env={}).tiers[0].capacity == 64 << 20
