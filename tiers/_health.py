"""Availability of a remote endpoint: fail fast while it is down, probe it in the
background with exponential backoff and jitter, come back by itself when it answers.

Thread-safe. The probe runs on one daemon thread that exists only while the endpoint is
marked down, so a healthy tier costs nothing.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Callable

from kvstore.errors import TierUnavailableError

log = logging.getLogger(__name__)


class Health:
    """``probe()`` must raise while the endpoint is unusable and return once it works;
    it should use short timeouts and no retries of its own."""

    def __init__(self, name: str, probe: Callable[[], None], *, base_delay_s: float = 0.2,
                 max_delay_s: float = 5.0) -> None:
        self.name = name
        self._probe = probe
        self._base, self._max = base_delay_s, max_delay_s
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.healthy = True
        self.errors = 0          # requests that failed against the endpoint
        self.outages = 0         # times the tier went from healthy to unavailable
        self.probes = 0          # probes sent while unavailable
        self.down_since: float | None = None
        self.last_error = ""
        self._thread: threading.Thread | None = None

    def check(self) -> None:
        """Raise :class:`TierUnavailableError` at once while the endpoint is marked down."""
        if not self.healthy:
            raise TierUnavailableError(
                f"endpoint unavailable for {time.time() - (self.down_since or time.time()):.1f} s "
                f"(last error: {self.last_error}); probing in the background", tier=self.name)

    def count(self, exc: BaseException) -> None:
        """Record a failed request that says nothing about the endpoint's health."""
        with self._lock:
            self.errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"[:300]

    def failed(self, exc: BaseException) -> None:
        """Record a failed request; the first failure marks the endpoint down and starts
        the background probe."""
        with self._lock:
            self.errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"[:300]
            if not self.healthy or self._closed.is_set():
                return
            self.healthy = False
            self.outages += 1
            self.down_since = time.time()
            self._thread = threading.Thread(target=self._probe_loop, name=f"kvstore-probe-{self.name}",
                                            daemon=True)
            self._thread.start()
        log.warning("tier %s marked unavailable: %s", self.name, self.last_error)

    def _probe_loop(self) -> None:
        delay = self._base
        while not self._closed.wait(delay * random.uniform(0.5, 1.5)):
            self.probes += 1
            try:
                self._probe()
            except Exception as exc:  # still down: back off further
                self.last_error = f"{type(exc).__name__}: {exc}"[:300]
                delay = min(delay * 2, self._max)
                continue
            with self._lock:
                self.healthy = True
                self.down_since = None
                self._thread = None
            log.warning("tier %s is available again", self.name)
            return

    def close(self) -> None:
        self._closed.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=5)

    def stats(self) -> dict:
        return {"healthy": self.healthy, "errors": self.errors, "outages": self.outages,
                "probes": self.probes, "unavailable_since": self.down_since,
                "last_error": self.last_error}
