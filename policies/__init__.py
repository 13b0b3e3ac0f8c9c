"""Eviction, admission and placement policies. Pure bookkeeping: no I/O, no storage."""

from __future__ import annotations

from typing import Callable

from policies.base import AdmissionPolicy, Decision, EvictionPolicy


def _eviction_classes() -> dict[str, Callable[[], EvictionPolicy]]:
    from policies.arc import ArcPolicy
    from policies.fifo import FifoPolicy
    from policies.lfu import LfuPolicy
    from policies.lineage import LineagePolicy
    from policies.lru import LruPolicy
    from policies.s3fifo import S3FifoPolicy
    from policies.sieve import SievePolicy

    classes: dict[str, Callable[[], EvictionPolicy]] = {
        "lru": LruPolicy, "fifo": FifoPolicy, "lfu": LfuPolicy, "s3fifo": S3FifoPolicy,
        "sieve": SievePolicy, "arc": ArcPolicy, "lineage": LineagePolicy,
    }
    return classes


EVICTION_NAMES = ("lru", "fifo", "lfu", "s3fifo", "sieve", "arc", "lineage")


def make_eviction(name: str) -> EvictionPolicy:
    """A new eviction policy by its config name (see ``EVICTION_NAMES``)."""
    classes = _eviction_classes()
    if name not in classes:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(sorted(classes))}")
    return classes[name]()


__all__ = ["AdmissionPolicy", "Decision", "EvictionPolicy", "EVICTION_NAMES", "make_eviction"]
