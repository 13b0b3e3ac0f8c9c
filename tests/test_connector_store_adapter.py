"""connectors/_open_store.py: the options every connector accepts for its Store."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from connectors._open_store import open_store
from kvstore.errors import ConfigError
from kvstore.testing import make_keys


def test_embedded_store_from_a_mapping():
    store = open_store({"store": {"tiers": [{"name": "hot", "kind": "dram", "capacity": "1MiB"}]}}, owner="t")
    try:
        key = make_keys(1)
        assert store.save(key, [np.ones(4096, np.uint8)]).result() == [True]
        assert store.tiers[0].capacity_bytes == 1 << 20
    finally:
        store.close()


def test_bad_store_config_names_the_field():
    with pytest.raises(ConfigError, match="capacity"):
        open_store({"store": {"tiers": [{"name": "hot", "kind": "dram", "capacity": "lots"}]}}, owner="t")


@pytest.mark.parametrize("options, match", [
    ({"store": {}, "server": "h:1"}, "not both"),
    ({"server": ""}, "host:port"),
    ({"server": 7480}, "host:port"),
    ({"server": "h:1", "token": 5}, "token"),
    ({"store": 3}, "StoreConfig mapping"),
])
def test_bad_options_are_clear_errors(options, match):
    with pytest.raises(ConfigError, match=match):
        open_store(options, owner="my connector")


@pytest.mark.skipif(importlib.util.find_spec("kvstore.client") is not None,
                    reason="this build has kvstore.client")
def test_server_without_client_module_says_so():
    with pytest.raises(ConfigError, match="kvstore.client"):
        open_store({"server": "127.0.0.1:1"}, owner="my connector")
