"""The SGLang backend against a real ``kvstore serve`` on loopback (in-process
thread): ``clear()`` in server mode, the ``CLEAR`` protocol op and ``Client.clear``,
leases and connector metrics through a Client."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.errors import ProtocolError
from kvstore.keys import Namespace
from kvstore.net import protocol as P
from kvstore.testing import IN_CI
from tests._servers import ThreadServer, config_dict

if IN_CI:
    import sglang  # noqa: F401
else:
    pytest.importorskip("sglang", reason="sglang==0.5.23 not installed (scripts/deps/50-sglang.sh)")
torch = pytest.importorskip("torch")

from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from tests.test_connector_sglang import flat, page_hashes, storage_config  # noqa: E402

TOKEN = "s3cret-token"


@pytest.fixture
def server():
    s = ThreadServer(config_dict("32MiB", token=TOKEN))
    yield s
    s.stop()


def _keys(ns: Namespace, n: int, seed: str):
    return [ns.key_for(f"{seed}{i}") for i in range(n)]


def _ns(model: str) -> Namespace:
    return Namespace(model=model, dtype="float16", chunk_tokens=4, layout="x", rank=0, world_size=1, salt="")


def test_client_clear_all_and_by_namespace(server):
    a, b = _ns("model-a"), _ns("model-b")
    with Client(server.address, token=TOKEN, transport="tcp") as client:
        ka, kb = _keys(a, 3, "a"), _keys(b, 2, "b")
        src = [np.full(64, i, np.uint8) for i in range(5)]
        assert client.save(ka + kb, src).result() == [True] * 5
        assert client.clear(namespaces=[b.digest]) == 2
        assert client.contains(ka + kb) == [True] * 3 + [False] * 2
        assert client.clear(namespaces=[]) == 0            # an empty selection removes nothing
        assert client.contains(ka) == [True] * 3
        assert client.clear() == 3
        assert server.store.stats()["blocks"] == 0


def test_clear_needs_the_server_token(server):
    from kvstore.errors import AuthError

    with pytest.raises(AuthError):
        Client(server.address, token="wrong", transport="tcp")


def test_clear_body_is_checked():
    limits = P.Limits(max_batch=4)
    header = P.Header(P.Op.CLEAR, 1, 0, 0, 0)
    assert P.decode_request(header, P.encode_namespaces([b"\1" * 32]), limits) == [b"\1" * 32]
    for bad in (b"", P.encode_namespaces([b"\1" * 32])[:-1], P.encode_namespaces([b"\2" * 32] * 5)):
        with pytest.raises(ProtocolError):
            P.decode_request(P.Header(P.Op.CLEAR, 1, 0, len(bad), 0), bad, limits)


def _backend(server, model: str):
    cfg = storage_config(model=model, server=server.address, token=TOKEN)
    return StorageBackendFactory.create_backend("dynamic", cfg, None)


def test_sglang_clear_in_server_mode_removes_only_its_own_pages(server):
    """SGLang calls clear() on /flush_cache (e.g. after loading new weights, when
    stored KV is stale): the backend's pages go; another model's stay."""
    mine, other = _backend(server, "org/mine"), _backend(server, "org/other")
    try:
        keys = page_hashes(3, "flush")
        assert mine.batch_set(keys, [flat(i) for i in range(3)])
        assert other.batch_set(keys, [flat(i) for i in range(3)])
        assert mine.batch_exists(keys) == 3 and other.batch_exists(keys) == 3
        mine.clear()
        assert mine.batch_exists(keys) == 0
        assert other.batch_exists(keys) == 3
        assert server.store.stats()["blocks"] == 3
    finally:
        mine.close()
        other.close()


def test_sglang_server_mode_leases_and_metrics(server):
    backend = _backend(server, "org/metrics")
    try:
        keys = page_hashes(4, "srv")
        assert backend.batch_set(keys, [flat(i) for i in range(4)])
        assert backend.batch_exists(keys) == 4
        assert server.store.stats()["leases"] == 4
        dsts = [torch.zeros(256, dtype=torch.float16) for _ in range(2)]
        # a prefetch that reads the first 2 pages and stops (a short, last batch)
        assert all(g is not None for g in backend.batch_get(keys[:2], dsts))
        assert server.store.stats()["leases"] == 0
        counted = backend.store.stats()["connectors"]["sglang"]
        assert counted["hit_tokens"] == 4 and counted["loaded_tokens"] == 2 and counted["failed_loads"] == 0
    finally:
        backend.close()
