import pytest

from kvstore.config import DEFAULT_CONFIG, dump_config, load_config, parse_size
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
    with pytest.raises(ConfigError, match="KVSTORE_BOGUS"):
        load_config(ONE, env={"KVSTORE_BOGUS": "1"})
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
