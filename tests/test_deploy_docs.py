"""Every complete config in docs/deploy.md validates, and the dashboard it points to is
valid JSON (its queries are checked against a running server in test_events_server)."""

import json
import re

import pytest
import yaml

from kvstore.config import load_config
from tests._servers import ROOT

DEPLOY = (ROOT / "docs" / "deploy.md").read_text()
CONFIGS = [block for block in re.findall(r"```yaml\n(.*?)```", DEPLOY, re.S) if "tiers:" in block]


def test_the_page_has_its_topologies():
    kinds = {tier["kind"] for block in CONFIGS for tier in yaml.safe_load(block)["tiers"]}
    assert {"dram", "nvme", "redis", "mooncake", "s3"} <= kinds
    assert any("events" in yaml.safe_load(block) for block in CONFIGS)


@pytest.mark.parametrize("block", CONFIGS, ids=[f"config{i}" for i in range(len(CONFIGS))])
def test_each_config_validates(block):
    config = load_config(yaml.safe_load(block), env={})
    assert config.tiers


def test_the_dashboard_is_grafana_json():
    dashboard = json.loads((ROOT / "docs" / "grafana-kvstore.json").read_text())
    assert dashboard["uid"] and dashboard["panels"]
    assert all(t["expr"] for p in dashboard["panels"] for t in p["targets"])
