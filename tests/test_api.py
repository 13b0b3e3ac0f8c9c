"""Store and Client both satisfy kvstore.api.StoreAPI: every method is there with a
compatible signature, and what a Client cannot do raises NotSupportedError naming the
method and why. The Client runs against a real cache server on loopback."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from kvstore import Client, Store
from kvstore.api import BlockReservation, StoreAPI
from kvstore.errors import KVStoreError, NotSupportedError
from kvstore.testing import make_keys, payload
from tests._servers import ThreadServer, config_dict

_KINDS = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _members(proto: type) -> list[str]:
    return sorted(n for n in dir(proto) if n in ("__enter__", "__exit__") or
                  (not n.startswith("_") and callable(getattr(proto, n))))


def _incompatible(want: inspect.Signature, have: inspect.Signature) -> str | None:
    """Why a call written against ``want`` could fail on ``have`` (None: it cannot)."""
    w = list(want.parameters.values())[1:]          # without self
    h = list(have.parameters.values())[1:]
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in w):
        return None if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in h) else "no *args"
    w_pos = [p for p in w if p.kind in _KINDS]
    h_pos = [p for p in h if p.kind in _KINDS]
    if [p.name for p in h_pos[:len(w_pos)]] != [p.name for p in w_pos]:
        return f"positional parameters {[p.name for p in h_pos]} instead of {[p.name for p in w_pos]}"
    for pw, ph in zip(w_pos, h_pos):
        if pw.default is not inspect.Parameter.empty and ph.default != pw.default:
            return f"{pw.name} defaults to {ph.default!r}, not {pw.default!r}"
    by_name = {p.name: p for p in h}
    for pw in w:
        if pw.kind is inspect.Parameter.KEYWORD_ONLY:
            ph = by_name.get(pw.name)
            if ph is None or ph.kind not in (*_KINDS, inspect.Parameter.KEYWORD_ONLY) or ph.default != pw.default:
                return f"keyword {pw.name}={pw.default!r} missing or different"
    named = {p.name for p in w}
    extra = [p.name for p in h if p.name not in named and p.default is inspect.Parameter.empty
             and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    return f"extra required parameters {extra}" if extra else None


@pytest.mark.parametrize("impl", [Store, Client])
def test_implementation_has_every_method_with_a_compatible_signature(impl):
    problems = []
    for name in _members(StoreAPI):
        if not callable(getattr(impl, name, None)):
            problems.append(f"{name}: missing")
            continue
        why = _incompatible(inspect.signature(getattr(StoreAPI, name)), inspect.signature(getattr(impl, name)))
        if why:
            problems.append(f"{name}: {why}")
    assert isinstance(getattr(impl, "lends_memory", None), bool)
    assert problems == [], f"{impl.__name__} does not satisfy StoreAPI: {problems}"


def test_the_signature_check_catches_a_mismatch():
    class Lookalike:
        def lookup(self, keys, lease=None): ...          # renamed parameter
        def load(self, keys, dsts, timeout): ...         # extra required parameter
        def reserve(self, keys, sizes): ...              # keyword-only evict missing

    def sig(cls, name):
        return inspect.signature(getattr(cls, name))

    for name in ("lookup", "load", "reserve"):
        assert _incompatible(sig(StoreAPI, name), sig(Lookalike, name)) is not None, name
    assert _incompatible(sig(StoreAPI, "lookup"), sig(Store, "lookup")) is None


def test_a_store_satisfies_the_protocol_and_lends_memory():
    keys = make_keys(2, salt="api-store")
    with Store.from_config({"tiers": [{"name": "hot", "kind": "dram", "capacity": "1MiB"}]}) as store:
        assert isinstance(store, StoreAPI) and store.lends_memory
        with store.reserve(keys, [4096, 4096]) as res:
            assert isinstance(res, BlockReservation)
            for i, view in enumerate(res.views):
                view[:] = payload(i, 4096)
        with store.borrow(keys) as views:
            assert all(np.array_equal(np.asarray(v), payload(i, 4096)) for i, v in enumerate(views))


@pytest.fixture(scope="module")
def server():
    s = ThreadServer(config_dict("16MiB"))
    yield s
    s.stop()


def test_a_client_satisfies_the_protocol(server):
    keys = make_keys(2, salt="api-client")
    with Client(server.address, transport="tcp") as client:
        assert isinstance(client, StoreAPI) and not client.lends_memory
        assert client.save(keys, [payload(i, 4096) for i in range(2)]).result() == [True, True]
        assert client.lookup(keys) == 2 and client.contains(keys) == [True, True]
        assert client.clear() >= 2 and client.contains(keys) == [False, False]


@pytest.mark.parametrize("call", [
    lambda c, k: c.pin(k), lambda c, k: c.unpin(k), lambda c, k: c.prefetch(k),
    lambda c, k: c.reserve(k, [4096]), lambda c, k: c.borrow(k), lambda c, k: c.flush(),
], ids=["pin", "unpin", "prefetch", "reserve", "borrow", "flush"])
def test_what_a_client_cannot_do_is_a_clear_error(server, call, request):
    method = request.node.callspec.id
    with Client(server.address, transport="tcp") as client:
        with pytest.raises(NotSupportedError, match=rf"Client\.{method} is not supported: \S+") as info:
            call(client, make_keys(1, salt="api-unsupported"))
    assert isinstance(info.value, KVStoreError) and isinstance(info.value, NotImplementedError)
