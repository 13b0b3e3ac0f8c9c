"""``kvstore serve`` with an ``events`` section (a real subprocess on loopback): KV events
decoded by vLLM's own classes, ``POST /v1/lookup`` on the admin port, the event metrics
on ``/metrics``, and the Grafana dashboard's queries checked against what it exports."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from vllm.distributed.kv_events import BlockRemoved, BlockStored

from kvstore import Namespace
from kvstore._events import block_hash
from kvstore.client import Client
from tests._events_sub import Subscriber, flat
from tests._servers import ROOT, ProcessServer, config_dict

BLOCK = 4096
CHUNK = 16
NS = {"model": "m", "dtype": "u8", "chunk_tokens": CHUNK}
DASHBOARD = ROOT / "docs" / "grafana-kvstore.json"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("events-server")
    raw = config_dict(tiers=[{"name": "hot", "kind": "dram", "capacity": 2 * BLOCK, "pin": False},
                             {"name": "warm", "kind": "nvme", "path": str(tmp / "nvme"), "capacity": "1MiB",
                              "direct_io": False, "file_bytes": "1MiB"}])
    raw["events"] = {"endpoint": f"ipc://{tmp}/pub", "replay_endpoint": f"ipc://{tmp}/replay", "topic": "node-a"}
    server = ProcessServer(raw, tmp)
    sub = Subscriber(f"ipc://{tmp}/pub", f"ipc://{tmp}/replay", topic="node-a")
    yield server, sub
    sub.close()
    server.kill()


def prompt(n_chunks, salt=""):
    tokens = list(range(7, 7 + n_chunks * CHUNK))
    keys = Namespace(**NS, salt=salt).chunk_keys(tokens)
    return tokens, keys, [np.full(BLOCK, i + 1, np.uint8) for i in range(n_chunks)]


def post(port, body, path="/v1/lookup", headers=None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        text = exc.read()
        return exc.code, json.loads(text) if exc.headers.get_content_type() == "application/json" else {"error": text}


def metrics_text(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def test_served_store_publishes_vllm_events_and_answers_lookup(served):
    server, sub = served
    tokens, keys, srcs = prompt(3)
    with Client(server.address) as client:
        assert client.save(keys, srcs).result(10) == [True] * 3     # 3 blocks, "hot" holds 2
    # every batch so far, by replay from 0 (a router that joined now)
    events = flat(_all_batches(server, sub))
    stored = {(e.medium, h) for e in events if isinstance(e, BlockStored) for h in e.block_hashes}
    removed = {(e.medium, h) for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    hashes = [block_hash(k.digest) for k in keys]
    assert {("hot", h) for h in hashes} <= stored
    assert ("warm", hashes[0]) in stored and ("hot", hashes[0]) in removed   # spilled down
    # a client's save carries no token ids: counted, placeholder fields as vLLM's own
    assert all(e.token_ids == [] and e.block_size == 0 for e in events if isinstance(e, BlockStored))

    status, answer = post(server.admin_port, {"namespace": NS, "token_ids": tokens + [1, 2]})
    assert status == 200
    assert answer["blocks"] == 3 and answer["prefix_blocks"] == 3 and answer["prefix_tokens"] == 3 * CHUNK
    tiers = {t["name"]: t for t in answer["tiers"]}
    assert [t["name"] for t in answer["tiers"]] == ["hot", "warm"]
    assert tiers["hot"]["prefix_blocks"] == 0 and tiers["warm"]["prefix_blocks"] == 1   # keys[0] went down
    assert tiers["warm"]["prefix_tokens"] == CHUNK

    status, answer = post(server.admin_port, {"keys": [k.hex() for k in keys[1:]], "chunk_tokens": CHUNK})
    assert status == 200 and answer["prefix_blocks"] == 2 and answer["tiers"][0]["prefix_blocks"] == 2
    status, answer = post(server.admin_port, {"namespace": {**NS, "salt": "other"}, "token_ids": tokens})
    assert status == 200 and answer["prefix_blocks"] == 0 and answer["prefix_tokens"] == 0

    text = metrics_text(server.admin_port)
    sequence = float(re.search(r"^kvstore_events_sequence (\S+)$", text, re.M).group(1))
    assert sequence >= 0 and "kvstore_events_lag_seconds" in text
    assert float(re.search(r"^kvstore_events_blocks_stored_total (\S+)$", text, re.M).group(1)) >= 4


@pytest.mark.parametrize("body, status, names", [
    (b"not json", 400, "JSON"),
    ({"token_ids": [1, 2]}, 400, "namespace"),
    ({"namespace": {"model": "m"}, "token_ids": [1]}, 400, "missing chunk_tokens, dtype"),
    ({"namespace": {**NS, "chunk_tokens": 0}, "token_ids": [1]}, 400, "chunk_tokens"),
    ({"namespace": NS, "token_ids": [1, -4]}, 400, "token_ids"),
    ({"namespace": NS, "token_ids": ["a"]}, 400, "token_ids"),
    ({"keys": ["abc"]}, 400, "keys"),
    ({"keys": [], "token_ids": []}, 400, "exactly one"),
    ({"keys": ["00" * 32], "chunk_tokens": -1}, 400, "chunk_tokens"),
    ({"keys": ["00" * 32], "extra": 1}, 400, "extra"),
])
def test_lookup_refuses_bad_requests_naming_the_field(served, body, status, names):
    server, _ = served
    got, answer = post(server.admin_port, body)
    assert got == status and names in answer["error"]


def test_lookup_needs_the_server_token(tmp_path):
    server = ProcessServer(config_dict("1MiB", token="s3cret"), tmp_path)
    try:
        assert post(server.admin_port, {"keys": []})[0] == 401
        status, answer = post(server.admin_port, {"keys": []}, headers={"Authorization": "Bearer s3cret"})
        assert status == 200 and answer["prefix_blocks"] == 0 and answer["prefix_tokens"] is None
    finally:
        server.kill()


def test_every_dashboard_query_uses_metrics_the_server_exports(served):
    server, _ = served
    with Client(server.address) as client:     # make the request histogram and counters appear
        _, keys, srcs = prompt(1, salt="dash")
        client.save(keys, srcs).result(10)
        client.lookup(keys)
    exported = exported_names(metrics_text(server.admin_port))
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert exprs and all(p["datasource"]["type"] == "prometheus" for p in dashboard["panels"])
    used = set()
    for expr in exprs:
        names = set(re.findall(r"\bkvstore_[a-zA-Z0-9_:]*", expr))
        assert names, f"query uses no kvstore metric: {expr}"
        used |= names
    assert "kvstore_tier_hits_total" in exported and "kvstore_no_such_metric" not in exported
    missing = sorted(used - exported)
    assert not missing, f"dashboard queries metrics the server does not export: {missing}"
    for wanted in ("kvstore_tier_used_bytes", "kvstore_tier_hits_total", "kvstore_tier_evictions_total",
                   "kvstore_tier_errors_total", "kvstore_events_lag_seconds"):
        assert wanted in used


def exported_names(text):
    """Sample names in a /metrics page, and those its ``# TYPE`` lines declare (a labelled
    counter shows samples only once something was counted, e.g. a refused connection)."""
    names = {m.group(1) for m in re.finditer(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{| )", text, re.M)}
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        # this exposition names counters with their _total already
        names |= {name + suffix for suffix in (("_bucket", "_sum", "_count") if kind == "histogram" else ("",))}
    return names


def _all_batches(server, sub):
    """Every batch published so far, by replay from 0 once the server has sent every
    report its Store queued (a save's reports are queued before the save returns)."""
    for _ in range(200):
        with urllib.request.urlopen(f"http://127.0.0.1:{server.admin_port}/stats", timeout=10) as reply:
            if json.loads(reply.read())["events"]["queued"] == 0:
                return sub.replay(0)
        time.sleep(0.05)
    raise AssertionError("the server's event queue never drained")
