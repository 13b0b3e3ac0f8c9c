"""Prometheus metrics of one server: request latency and counts from the server, tier,
hint and tenant counters read from the Store at scrape time (so they can never drift
from ``stats()``).

Each server owns its own registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvstore.stats import COUNTERS, GAUGES

_TIER_COUNTERS = {
    "hits": "blocks served from this tier",
    "misses": "loads that found no tier holding the block (counted on the first tier)",
    "bytes_read": "payload bytes read from this tier",
    "bytes_written": "payload bytes written into this tier",
    "writes": "blocks written into this tier",
    "evictions": "blocks evicted from this tier",
    "spills": "evicted blocks written down into the next tier",
    "promotions": "blocks copied up into this tier on a hit below",
    "corruptions": "stored blocks that failed verification",
    "errors": "tier operations that failed",
    "rejected": "blocks refused by admission",
}
_TIER_GAUGES = {"used_bytes": "payload bytes stored", "capacity_bytes": "configured capacity",
                "blocks": "blocks stored"}
# retention hints (kvstore.store.hints): stats()["hints"], and each tier's HintTrust
# (stats()["tiers"][i]["hint_trust"], kvstore.policies.retention)
_HINT_COUNTERS = {
    "given": "hints given, per key and call",
    "hit": "hinted blocks hit before their hint expired (once per hint)",
    "expired": "hints that expired, or whose block left after expiry, without a hit",
    "discarded": "discard blocks evicted and not spilled",
}
_HINT_TRUST_PROTECT = ("kvstore_tier_hint_trust_protect_seconds",
                       "age up to which a live hint protects its blocks in this tier (+Inf: in full)")
_HINT_TRUST_REUSE = ("kvstore_tier_hint_trust_reuse_ratio",
                     "reuse rate of the blocks watched at the eviction end, per class (absent: none seen yet)")
_HINT_TRUST_WATCHED = ("kvstore_tier_hint_trust_watched", "blocks the tier's hint trust watches now")
# KV events (kvstore._events), when the config has an events section
_EVENT_COUNTERS = {
    "batches": "event batches published (the next one gets sequence number batches)",
    "events": "events published",
    "blocks_stored": "blocks reported stored in a tier",
    "blocks_removed": "blocks reported removed from a tier",
    "cleared": "AllBlocksCleared events published",
    "tokens_missing": "blocks published in BlockStored without token ids",
    "overflows": "times the event queue overflowed and was replaced by AllBlocksCleared",
    "replays": "replay requests answered",
    "errors": "publishing failures",
}
_EVENT_GAUGES = {
    "sequence": ("kvstore_events_sequence", "sequence number of the last published batch (-1: none yet)"),
    "queued": ("kvstore_events_queued", "block reports waiting to be published"),
    "lag_s": ("kvstore_events_lag_seconds", "age of the oldest report not yet published (0: none waiting)"),
    "last_lag_s": ("kvstore_events_last_lag_seconds", "report-to-publish time of the last batch"),
}
# per tenant (server.tenants): (metric, doc), per tier unless noted
_TENANT_TIER_GAUGES = {
    "used_bytes": ("kvstore_tenant_used_bytes", "payload bytes this tenant holds in this tier"),
    "blocks": ("kvstore_tenant_blocks", "blocks this tenant holds in this tier"),
    "quota_bytes": ("kvstore_tenant_quota_bytes", "this tenant's quota in this tier (absent: none)"),
}
_TENANT_TIER_COUNTERS = {
    "evictions": ("kvstore_tenant_evictions", "this tenant's blocks evicted from this tier"),
    "quota_full": ("kvstore_tenant_quota_full", "this tenant's blocks refused by this tier for its quota"),
    "walk_capped": ("kvstore_tenant_walk_capped", "this tenant's quota evictions stopped at the walk's step cap"),
}
_TENANT_COUNTERS = {
    "hits": ("kvstore_tenant_hits", "blocks served to this tenant's GETs"),
    "misses": ("kvstore_tenant_misses", "keys this tenant's GETs found no block for"),
}
_LATENCY_BUCKETS = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
                    100e-3, 250e-3, 500e-3, 1.0, 2.5, 10.0)


class _StoreCollector:
    def __init__(self, store: Any, tenants: Callable[[Any], dict] | None = None) -> None:
        self._store = store
        self._tenants = tenants   # the Store's "tenants" stats -> per tenant, with the server's counters

    def collect(self) -> Iterator[Any]:
        try:
            stats = self._store.stats()
        except Exception:  # a closed store during shutdown: export nothing rather than fail
            return
        for name, doc in _TIER_COUNTERS.items():
            fam = CounterMetricFamily(f"kvstore_tier_{name}", doc, labels=["tier", "kind"])
            for t in stats["tiers"]:
                fam.add_metric([t["name"], t["kind"]], float(t.get(name, 0)))
            yield fam
        for name, doc in _TIER_GAUGES.items():
            fam = GaugeMetricFamily(f"kvstore_tier_{name}", doc, labels=["tier", "kind"])
            for t in stats["tiers"]:
                fam.add_metric([t["name"], t["kind"]], float(t.get(name, 0)))
            yield fam
        yield from _hint_families(stats)
        for name, doc in {**COUNTERS, **GAUGES}.items():
            family = CounterMetricFamily if name in COUNTERS else GaugeMetricFamily
            fam = family(f"kvstore_connector_{name}", doc, labels=["connector"])
            for connector, values in stats.get("connectors", {}).items():
                fam.add_metric([connector], float(values.get(name, 0)))
            yield fam
        for name in ("blocks", "leases", "pins"):
            yield GaugeMetricFamily(f"kvstore_store_{name}", f"{name} held by the store", value=stats[name])
        yield CounterMetricFamily("kvstore_store_resave_size_mismatch",
                                  "saves refused: the key is held (or being saved) with another size",
                                  value=stats.get("resave_size_mismatch", 0))
        events = stats.get("events")
        if events is not None:
            for name, doc in _EVENT_COUNTERS.items():
                metric = "kvstore_events_published" if name == "events" else f"kvstore_events_{name}"
                yield CounterMetricFamily(metric, doc, value=events[name])
            for name, (metric, doc) in _EVENT_GAUGES.items():
                yield GaugeMetricFamily(metric, doc, value=events[name])
        if self._tenants is not None:
            yield from _tenant_families(self._tenants(stats.get("tenants", {})))


def _hint_families(stats: dict[str, Any]) -> Iterator[Any]:
    """``stats()["hints"]`` and each tier's ``hint_trust`` (absent from a store without hints)."""
    hints = stats.get("hints")
    if hints is not None:
        for name, doc in _HINT_COUNTERS.items():
            yield CounterMetricFamily(f"kvstore_hints_{name}", doc, value=hints.get(name, 0))
        yield GaugeMetricFamily("kvstore_hints_live", "keys with a retention hint now", value=hints.get("live", 0))
    trusted = [t for t in stats["tiers"] if t.get("hint_trust") is not None]
    if not trusted:
        return
    protect = GaugeMetricFamily(*_HINT_TRUST_PROTECT, labels=["tier", "kind"])
    reuse = GaugeMetricFamily(*_HINT_TRUST_REUSE, labels=["tier", "kind", "class"])
    watched = GaugeMetricFamily(*_HINT_TRUST_WATCHED, labels=["tier", "kind"])
    for t in trusted:
        trust, labels = t["hint_trust"], [t["name"], t["kind"]]
        protect_s = trust.get("protect_s")     # None: hints protect for as long as they live
        protect.add_metric(labels, math.inf if protect_s is None else float(protect_s))
        for cls in ("hinted", "unhinted"):
            if trust.get(f"{cls}_reuse") is not None:
                reuse.add_metric([*labels, cls], float(trust[f"{cls}_reuse"]))
        watched.add_metric(labels, float(trust.get("watched", 0)))
    yield from (protect, reuse, watched)


def _tenant_families(tenants: dict[str, Any]) -> Iterator[Any]:
    for name, (metric, doc) in _TENANT_COUNTERS.items():
        fam = CounterMetricFamily(metric, doc, labels=["tenant"])
        for tenant, entry in tenants.items():
            fam.add_metric([tenant], float(entry[name]))
        yield fam
    for table, family in ((_TENANT_TIER_GAUGES, GaugeMetricFamily), (_TENANT_TIER_COUNTERS, CounterMetricFamily)):
        for name, (metric, doc) in table.items():
            fam = family(metric, doc, labels=["tenant", "tier"])
            for tenant, entry in tenants.items():
                for tier, values in entry["tiers"].items():
                    if values[name] is not None:
                        fam.add_metric([tenant, tier], float(values[name]))
            yield fam


class ServerMetrics:
    """Thread-safe (prometheus_client locks internally). ``tenants``: with
    ``server.tenants``, maps the Store's per-tenant stats to the server's (hits, misses)."""

    def __init__(self, store: Any, tenants: Callable[[Any], dict] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.latency = Histogram("kvstore_request_seconds", "time from a request's header to its reply",
                                 ["op"], registry=self.registry, buckets=_LATENCY_BUCKETS)
        self.requests = Counter("kvstore_requests", "requests served", ["op", "status"], registry=self.registry)
        self.bytes = Counter("kvstore_server_bytes", "block bytes moved for clients",
                             ["direction", "path"], registry=self.registry)
        self.connections = Gauge("kvstore_connections", "open client connections", registry=self.registry)
        self.refused = Counter("kvstore_refused_connections", "connections closed for bad frames or auth",
                               ["reason"], registry=self.registry)
        self.registry.register(_StoreCollector(store, tenants))

    def render(self) -> bytes:
        return generate_latest(self.registry)
