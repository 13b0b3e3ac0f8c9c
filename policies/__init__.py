"""Eviction, admission and placement policies. Pure bookkeeping: no I/O, no storage."""

from __future__ import annotations

import importlib
from typing import Callable

from kvstore.policies.base import AdmissionPolicy, Decision, EvictionPolicy


# The one registry of eviction names (config validation reads it: kvstore.config.tiers):
# config name -> (module, class), imported only when built.
_EVICTION_CLASSES: dict[str, tuple[str, str]] = {
    "lru": ("kvstore.policies.lru", "LruPolicy"), "fifo": ("kvstore.policies.fifo", "FifoPolicy"),
    "lfu": ("kvstore.policies.lfu", "LfuPolicy"), "s3fifo": ("kvstore.policies.s3fifo", "S3FifoPolicy"),
    "sieve": ("kvstore.policies.sieve", "SievePolicy"), "arc": ("kvstore.policies.arc", "ArcPolicy"),
    "lineage": ("kvstore.policies.lineage", "LineagePolicy"),
}

EVICTION_NAMES = tuple(_EVICTION_CLASSES)


def _eviction_classes() -> dict[str, Callable[[], EvictionPolicy]]:
    return {name: getattr(importlib.import_module(module), cls) for name, (module, cls) in _EVICTION_CLASSES.items()}


def make_eviction(name: str) -> EvictionPolicy:
    """A new eviction policy by its config name (see ``EVICTION_NAMES``)."""
    classes = _eviction_classes()
    if name not in classes:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(sorted(classes))}")
    return classes[name]()


__all__ = ["AdmissionPolicy", "Decision", "EvictionPolicy", "EVICTION_NAMES", "make_eviction"]
