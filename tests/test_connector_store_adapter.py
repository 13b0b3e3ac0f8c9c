"""connectors/_store_handle.py: the one way every connector opens its store (options,
environment, sharing of embedded Stores inside a process)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from kvstore.connectors._store_handle import open_store, release_store
from kvstore.api import StoreAPI
from kvstore.errors import ConfigError, StoreClosedError
from kvstore.store import Store
from kvstore.testing import make_keys

ONE_MIB = {"tiers": [{"name": "hot", "kind": "dram", "capacity": "1MiB"}]}


def test_embedded_store_from_a_mapping():
    store = open_store({"store": ONE_MIB}, owner="t")
    try:
        assert isinstance(store, StoreAPI)
        key = make_keys(1)
        assert store.save(key, [np.ones(4096, np.uint8)]).result() == [True]
        assert store.tiers[0].capacity_bytes == 1 << 20
    finally:
        release_store(store)


def test_one_embedded_store_per_config_in_a_process_closed_by_its_last_user():
    a = open_store({"store": ONE_MIB}, owner="scheduler")
    b = open_store({"store": dict(ONE_MIB)}, owner="worker")
    other = open_store({"store": {"tiers": [{"name": "hot", "kind": "dram", "capacity": "2MiB"}]}}, owner="t")
    try:
        assert a is b and other is not a
        key = make_keys(1, salt="shared")
        assert a.save(key, [np.ones(4096, np.uint8)]).result() == [True]
        assert b.contains(key) == [True] and other.contains(key) == [False]
        release_store(a)
        assert b.contains(key) == [True]                 # still open for its other user
    finally:
        release_store(b)
        release_store(other)
    with pytest.raises(StoreClosedError):
        b.save(key, [np.ones(4096, np.uint8)])
    fresh = open_store({"store": ONE_MIB}, owner="t")   # a later open builds a new one
    try:
        assert fresh is not a and fresh.contains(key) == [False]
    finally:
        release_store(fresh)


def test_an_explicit_store_ignores_environment_overrides(monkeypatch):
    monkeypatch.setenv("KVSTORE_TIERS__0__CAPACITY", "2MiB")
    store = open_store({"store": ONE_MIB}, owner="t")
    try:
        assert store.tiers[0].capacity_bytes == 1 << 20
    finally:
        release_store(store)


def test_neither_store_nor_server_uses_the_environment(monkeypatch, tmp_path):
    path = tmp_path / "kvstore.yaml"
    path.write_text("tiers:\n  - {name: env, kind: dram, capacity: 3MiB}\n")
    monkeypatch.setenv("KVSTORE_CONFIG", str(path))
    store = open_store({}, owner="t")
    try:
        assert isinstance(store, Store) and store.tiers[0].capacity_bytes == 3 << 20
        monkeypatch.setenv("KVSTORE_TIERS__env__CAPACITY", "4MiB")   # overrides apply here
        again = open_store({}, owner="t")
        try:
            assert again is not store and again.tiers[0].capacity_bytes == 4 << 20
        finally:
            release_store(again)
    finally:
        release_store(store)


def test_bad_store_config_names_the_field():
    with pytest.raises(ConfigError, match="capacity"):
        open_store({"store": {"tiers": [{"name": "hot", "kind": "dram", "capacity": "lots"}]}}, owner="t")


@pytest.mark.parametrize("options, match", [
    ({"store": {}, "server": "h:1"}, "my connector: .*not both"),
    ({"server": ""}, "host:port"),
    ({"server": 7480}, "host:port"),
    ({"server": "h:1", "token": 5}, "token"),
    ({"server": "h:1", "timeout_s": 0}, "timeout_s"),
    ({"server": "h:1", "timeout_s": "soon"}, "timeout_s"),
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
