"""Counters that other components (engine connectors) attach to a Store or Client, so
that one ``stats()`` call reports them beside the store's own. Public: the connectors
count exactly :data:`COUNTERS` and :data:`GAUGES`."""

from __future__ import annotations

from typing import Any, Callable, Iterable

# What every engine connector counts (connectors/_metrics.py), by name and meaning.
COUNTERS = {
    "hit_tokens": "prompt tokens the store offered to the engine",
    "loaded_tokens": "tokens loaded, verified, into the engine's KV cache",
    "failed_loads": "chunks whose load failed and were reported for recompute",
    "dropped_saves": "chunks not stored: over the staging budget, refused (the cache server unreachable "
                     "included), or computed after a failed load",
    "deleted_saves": "stored chunks deleted because they were computed over a failed load",
    "uncached_requests": "requests neither offered nor saved: inputs the keys do not cover (prompt embeddings)",
    "unreachable_lookups": "lookups answered as a miss because the cache server was unreachable",
    "handoffs_sent": "P/D producer: requests finished with kvstore handoff params (prompt KV left in the store)",
    "handoffs_received": "P/D consumer: handed-off prompts loaded, verified, from the store",
    "failed_handoffs": "P/D consumer: handed-off loads that failed (keys not stored by the params' deadline, or "
                       "not verified) and went to kv_load_failure_policy",
}
GAUGES = {"staging_bytes": "host and device staging memory held by the connector"}


def sum_stat_sources(sources: Iterable[tuple[str, Callable[[], dict[str, Any]]]]) -> dict[str, dict[str, int]]:
    """``{name: counters}``, summing the counters of sources that share a name."""
    out: dict[str, dict[str, int]] = {}
    for name, source in list(sources):
        total = out.setdefault(name, {})
        for counter, value in source().items():
            total[counter] = total.get(counter, 0) + value
    return out


__all__ = ["COUNTERS", "GAUGES", "sum_stat_sources"]
