"""Retention hints on the server's Prometheus ``/metrics`` (issue 22): the Store's hint
counters (``stats()["hints"]``) and each tier's hint trust
(``stats()["tiers"][i]["hint_trust"]``), read from a real server's admin port and
compared with what the Store it serves reports."""

from __future__ import annotations

import math
import urllib.request

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvstore import Hint, Namespace, Store
from kvstore.client import Client
from tests._servers import ThreadServer, config_dict

BLOCK = 4096
SLOTS = 16
NS = Namespace(model="metrics-hints", dtype="u8", chunk_tokens=1)
BUF = np.zeros(BLOCK, np.uint8)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _key(tag: int, i: int):
    return NS.chunk_keys([tag * 10**7 + i])[0]


def _scrape(server: ThreadServer) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.server.admin_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _tier(name: str, **labels: str) -> tuple:
    return tuple(sorted({"tier": name, "kind": "dram", **labels}.items()))


def test_hint_trust_and_counters_on_metrics_are_the_stores():
    """A client whose hints are never right (each second a hinted block nobody reads
    again, and an unhinted one read back two seconds later) lowers the tier's
    ``protect_s`` below infinity: /metrics shows that very value, the two reuse rates,
    and the hint counters."""
    clock = Clock()
    store = Store.from_config({"tiers": [{"name": "top", "kind": "dram", "capacity": SLOTS * BLOCK}],
                               "io_threads": 1}, clock=clock)
    out = np.empty(BLOCK, np.uint8)
    for t in range(200):
        clock.now += 1
        store.save([_key(0, t)], [BUF], hint=Hint(600)).result()
        store.save([_key(1, t)], [BUF]).result()
        if t >= 2 and store.lookup([_key(1, t - 2)]):
            assert store.load([_key(1, t - 2)], [out]).result() == [True]
        elif t >= 2:
            store.save([_key(1, t - 2)], [BUF]).result()
    server = ThreadServer(config_dict(), store=store)
    try:
        got = _scrape(server)
        stats = store.stats()
        trust, hints = stats["tiers"][0]["hint_trust"], stats["hints"]
        assert trust["protect_s"] is not None and trust["protect_s"] < 6     # hints distrusted
        assert got[("kvstore_tier_hint_trust_protect_seconds", _tier("top"))] == trust["protect_s"]
        assert got[("kvstore_tier_hint_trust_reuse_ratio", _tier("top", **{"class": "hinted"}))] \
            == trust["hinted_reuse"]
        assert got[("kvstore_tier_hint_trust_reuse_ratio", _tier("top", **{"class": "unhinted"}))] \
            == trust["unhinted_reuse"]
        assert got[("kvstore_tier_hint_trust_watched", _tier("top"))] == trust["watched"] > 0
        assert hints["given"] == 200
        for name in ("given", "hit", "expired", "discarded"):
            assert got[(f"kvstore_hints_{name}_total", ())] == hints[name]
        assert got[("kvstore_hints_live", ())] == hints["live"] > 0
    finally:
        server.stop()
        store.close()


def test_a_fresh_server_exports_full_trust_and_counts_hints_given_over_the_wire():
    """Before any evidence a tier trusts hints in full (``protect_s`` null in stats,
    +Inf on /metrics, no reuse rate yet); a client's HINTs are counted."""
    server = ThreadServer(config_dict("1MiB", tiers=[{"name": "hot", "kind": "dram", "capacity": "1MiB", "pin": False},
                                                     {"name": "warm", "kind": "dram", "capacity": "4MiB",
                                                      "pin": False}]))
    try:
        keys = NS.chunk_keys(list(range(3)))
        with Client(server.address, transport="tcp") as c:
            assert c.save(keys, [BUF] * 3, hint=Hint(retain_s=60, priority=2)).result(10) == [True] * 3
            assert c.lookup(keys) == 3
        got = _scrape(server)
        stats = server.store.stats()
        for tier in ("hot", "warm"):
            assert stats["tiers"][["hot", "warm"].index(tier)]["hint_trust"]["protect_s"] is None
            assert math.isinf(got[("kvstore_tier_hint_trust_protect_seconds", _tier(tier))])
            assert ("kvstore_tier_hint_trust_reuse_ratio", _tier(tier, **{"class": "hinted"})) not in got
        assert stats["hints"]["given"] == 3 and stats["hints"]["hit"] == 3
        assert got[("kvstore_hints_given_total", ())] == 3 and got[("kvstore_hints_hit_total", ())] == 3
        assert got[("kvstore_hints_live", ())] == 3
    finally:
        server.stop()
