"""Admission policies: always, seen at least N times, and a write-byte budget."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable, Hashable

from kvstore.policies.base import AdmissionPolicy, Decision


class AlwaysAdmit(AdmissionPolicy):
    def decide(self, key: Hashable, nbytes: int) -> Decision:
        return Decision.ADMIT


class MinHitsAdmission(AdmissionPolicy):
    """Admit a key on its ``min_hits``-th offer. Sightings are remembered for the most
    recent ``history`` keys only, so memory stays bounded."""

    def __init__(self, min_hits: int, history: int = 1 << 20) -> None:
        if min_hits < 1:
            raise ValueError(f"min_hits must be >= 1, got {min_hits}")
        self.min_hits = min_hits
        self.history = history
        self._seen: OrderedDict[Hashable, int] = OrderedDict()
        self._lock = threading.Lock()

    def decide(self, key: Hashable, nbytes: int) -> Decision:
        if self.min_hits == 1:
            return Decision.ADMIT
        with self._lock:
            count = self._seen.pop(key, 0) + 1
            if count >= self.min_hits:
                return Decision.ADMIT
            self._seen[key] = count
            if len(self._seen) > self.history:
                self._seen.popitem(last=False)
        return Decision.REJECT


class ByteBudgetAdmission(AdmissionPolicy):
    """Admit at most ``bytes_per_interval`` bytes each ``interval_s`` (a token bucket),
    to bound the write rate into a wear-sensitive tier; over budget is THROTTLE."""

    def __init__(self, bytes_per_interval: int, interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if bytes_per_interval <= 0 or interval_s <= 0:
            raise ValueError("bytes_per_interval and interval_s must be positive")
        self.rate = bytes_per_interval / interval_s
        self.burst = bytes_per_interval
        self._clock = clock
        self._tokens = float(bytes_per_interval)
        self._stamp = clock()
        self._lock = threading.Lock()

    def decide(self, key: Hashable, nbytes: int) -> Decision:
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            if nbytes <= self._tokens:
                self._tokens -= nbytes
                return Decision.ADMIT
        return Decision.THROTTLE


class AllOf(AdmissionPolicy):
    """Admit only when every policy admits (e.g. seen twice *and* within budget)."""

    def __init__(self, *policies: AdmissionPolicy) -> None:
        self.policies = policies

    def decide(self, key: Hashable, nbytes: int) -> Decision:
        for policy in self.policies:
            decision = policy.decide(key, nbytes)
            if decision is not Decision.ADMIT:
                return decision
        return Decision.ADMIT
