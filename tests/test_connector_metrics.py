"""Connector counters reach a Store's and a Client's ``stats()`` and a server's
``/metrics``; sources with one name are summed, a closed one is gone."""

import urllib.request

from kvstore.connectors._metrics import ConnectorMetrics
from kvstore.client import Client
from kvstore.store import Store
from tests._servers import ThreadServer, config_dict


def test_store_stats_sum_connectors_with_one_name_and_forget_closed_ones():
    store = Store.from_config({"tiers": [{"name": "hot", "kind": "dram", "capacity": "4MiB"}]})
    try:
        sched, worker, other = (ConnectorMetrics(store, "vllm"), ConnectorMetrics(store, "vllm"),
                                ConnectorMetrics(store, "sglang"))
        sched.add("hit_tokens", 256)
        worker.add("loaded_tokens", 192)
        worker.add("failed_loads", 2)
        worker.set("staging_bytes", 4096)
        other.add("dropped_saves", 3)
        got = store.stats()["connectors"]
        assert got["vllm"]["hit_tokens"] == 256 and got["vllm"]["loaded_tokens"] == 192
        assert got["vllm"]["failed_loads"] == 2 and got["vllm"]["staging_bytes"] == 4096
        assert got["sglang"]["dropped_saves"] == 3 and got["sglang"]["hit_tokens"] == 0
        worker.close()
        assert store.stats()["connectors"]["vllm"]["loaded_tokens"] == 0
    finally:
        store.close()


def test_client_reports_its_own_connectors_and_server_metrics_export_embedded_ones():
    server = ThreadServer(config_dict("4MiB"))
    try:
        inside = ConnectorMetrics(server.store, "vllm")      # a connector embedded in the server process
        inside.add("failed_loads", 5)
        with Client(server.address, transport="tcp") as client:
            mine = ConnectorMetrics(client, "trtllm")
            mine.add("hit_tokens", 64)
            assert client.stats()["connectors"] == {"trtllm": {**mine.snapshot()}}
        port = server.server.admin_port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        assert 'kvstore_connector_failed_loads_total{connector="vllm"} 5.0' in text
        assert 'kvstore_connector_staging_bytes{connector="vllm"} 0.0' in text
    finally:
        server.stop()
