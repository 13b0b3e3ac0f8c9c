"""Disaggregated prefill/decode through the store (vLLM): a prefill engine (producer)
hands a request's prompt KV to a decode engine (consumer) as chunks in a store both
reach, with ``kv_transfer_params`` saying which.

Producer (``kv_role: kv_producer``; under ``kv_both`` a request that asks with
``do_remote_decode: true`` or ``{"kvstore": {"handoff": true}}``): the prompt's chunks
are saved as they are computed (the connector's usual saves); when the request
finishes, ``request_finished`` returns ``(True, params)``, so vLLM keeps its blocks
until every rank reports the request's saves settled (``finished_sending``), then
frees them; the producer then leases the chunks for ``handoff_lease_s``, so they
outlive eviction pressure until a consumer loads them (a lease expires by itself: what
no consumer claims is freed). The params::

    {"kvstore": {"handoff": {"v": 1, "source": "server:HOST:PORT" | "embedded:HOST:PID",
                             "first_key": HEX, "last_key": HEX, "chunks": N,
                             "chunk_tokens": C, "tokens": N*C,
                             "deadline": UNIX_S, "lease_expires": UNIX_S}}}

Consumer (``kv_consumer`` or ``kv_both``): a request that arrives with those params
(``request.kv_transfer_params``) is offered the handed-off chunks beyond what its own
prefix cache holds, loaded asynchronously (``(n, True)``). The keys are the consumer's
own, hashed from its prompt; the params' first and last key (chained digests) must
match them, or the params are ignored (another model, layout, salt or prompt: never
wrong KV). The worker's load first waits, woken by the saves that land the keys
(``lookup(wait_s=)``, never polling), until the params' ``deadline`` (at most
``timeout_s`` from now), then loads and verifies what is there; chunks not there by
then fail through the usual path (``kv_load_failure_policy``: ``recompute`` or
``fail``), never a hang, never a load reported for bytes not verified.

Clocks: ``deadline`` and ``lease_expires`` are wall-clock (``time.time()``) seconds;
engines on different hosts need synchronised clocks (NTP) for them to mean the same.

Threading: :class:`Handoffs` runs on vLLM's scheduler thread; :func:`waiting_load`
runs the wait on a small pool of its own, off the worker thread.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping, Sequence

from kvstore.connectors._hints import PARAMS_KEY
from kvstore.connectors._metrics import ConnectorMetrics
from kvstore.connectors._server_store import ServerStore
from kvstore.keys import BlockKey

log = logging.getLogger(__name__)

FIELD = "handoff"     # params[PARAMS_KEY][FIELD]
VERSION = 1
_NORMAL_FINISH = {"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_REPETITION"}


class BadHandoff(ValueError):
    """Handoff params that cannot be used; the message names the field."""


def source_of(store: Any) -> str:
    """Where a producer's chunks are: its cache server, or its embedded Store (which no
    other process reaches)."""
    if isinstance(store, ServerStore):
        return f"server:{store.address}"
    return f"embedded:{socket.gethostname()}:{os.getpid()}"


def asks_for_handoff(params: Any) -> bool:
    """Whether a request's ``kv_transfer_params`` ask its producer to hand it off:
    vLLM's disaggregation flag ``do_remote_decode`` or ``{"kvstore": {"handoff": true}}``."""
    if not isinstance(params, Mapping):
        return False
    if params.get("do_remote_decode") is True:
        return True
    ours = params.get(PARAMS_KEY)
    return isinstance(ours, Mapping) and ours.get(FIELD) is True


def without_handoff(params: Any) -> Any:
    """``params`` minus the handoff field (what the retention-hint reader sees)."""
    if not isinstance(params, Mapping):
        return params
    ours = params.get(PARAMS_KEY)
    if not isinstance(ours, Mapping) or FIELD not in ours:
        return params
    rest = {k: v for k, v in ours.items() if k != FIELD}
    out = {k: v for k, v in params.items() if k != PARAMS_KEY}
    if rest:
        out[PARAMS_KEY] = rest
    return out


def parse(params: Any) -> dict[str, Any] | None:
    """The handoff of a request's ``kv_transfer_params`` (``None``: none given); raises
    :class:`BadHandoff` naming what is wrong."""
    ours = params.get(PARAMS_KEY) if isinstance(params, Mapping) else None
    h = ours.get(FIELD) if isinstance(ours, Mapping) else None
    if h is None or h is True:
        return None
    if not isinstance(h, Mapping):
        raise BadHandoff(f"{PARAMS_KEY}.{FIELD}: must be an object (or true, to ask a producer for one)")
    if h.get("v") != VERSION:
        raise BadHandoff(f"{PARAMS_KEY}.{FIELD}.v: version {h.get('v')!r} is not {VERSION}")
    for name in ("first_key", "last_key"):
        value = h.get(name)
        if not isinstance(value, str) or len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
            raise BadHandoff(f"{PARAMS_KEY}.{FIELD}.{name}: must be 64 lowercase hex digits")
    for name in ("chunks", "chunk_tokens", "tokens"):
        if type(h.get(name)) is not int or h[name] <= 0:
            raise BadHandoff(f"{PARAMS_KEY}.{FIELD}.{name}: must be a positive integer")
    for name in ("deadline", "lease_expires"):
        if isinstance(h.get(name), bool) or not isinstance(h.get(name), (int, float)):
            raise BadHandoff(f"{PARAMS_KEY}.{FIELD}.{name}: must be wall-clock seconds")
    if not isinstance(h.get("source"), str):
        raise BadHandoff(f"{PARAMS_KEY}.{FIELD}.source: must be a string")
    return dict(h)


class Handoffs:
    """Both roles of the handoff for one scheduler-side connector (see the module
    docstring). ``producer``: every request is handed off (``kv_producer``); otherwise
    only those that ask (``kv_both``)."""

    def __init__(self, config: Any, shape: Any, store: Any, metrics: ConnectorMetrics, *, producer: bool,
                 do_save: bool, do_load: bool) -> None:
        self.config, self.shape, self.store, self.metrics = config, shape, store, metrics
        self.producer, self.do_save, self.do_load = producer, do_save, do_load
        self.source = source_of(store)
        self._announce: list[str] = []                          # for the workers' next step
        self._sent: dict[str, list[list[BlockKey]]] = {}       # blocks kept until durable: their keys
        self._given: dict[str, dict[str, Any] | None] = {}     # consumer: request -> parsed params
        self._loading: set[str] = set()                        # consumer: handoff loads in flight
        self._offered: set[str] = set()                        # consumer: the last offer was a handoff

    # -- producer ---------------------------------------------------------------------------

    def finished(self, request: Any, keys: list[list[BlockKey]], saved_chunks: int) -> tuple[bool, dict | None]:
        """``request_finished``'s answer for a request whose first ``saved_chunks``
        prompt chunks (keys ``keys[rank]``) are stored or being saved."""
        # A handoff load still in flight stays in _loading: vLLM may end the request (the
        # fail policy) before its load's outcome is counted (outcomes()).
        self._given.pop(request.request_id, None)
        self._offered.discard(request.request_id)
        if not self.do_save or not (self.producer or asks_for_handoff(getattr(request, "kv_transfer_params", None))):
            return False, None
        if getattr(request.status, "name", "") not in _NORMAL_FINISH:
            return False, None
        chunks = min(saved_chunks, len(keys[0]) if keys else 0)
        if chunks <= 0:
            return False, None
        now = time.time()
        params = {PARAMS_KEY: {FIELD: {
            "v": VERSION, "source": self.source, "first_key": keys[0][0].digest.hex(),
            "last_key": keys[0][chunks - 1].digest.hex(), "chunks": chunks, "chunk_tokens": self.shape.chunk_tokens,
            "tokens": chunks * self.shape.chunk_tokens, "deadline": now + self.config.handoff_wait_s,
            "lease_expires": now + self.config.handoff_lease_s}}}
        self._sent[request.request_id] = [k[:chunks] for k in keys]
        self._announce.append(request.request_id)
        self.metrics.add("handoffs_sent")
        return True, params

    def take_announced(self) -> list[str]:
        """Requests whose blocks vLLM keeps until the workers report their saves settled."""
        out, self._announce = self._announce, []
        return out

    def settled(self, finished_sending: Any) -> None:
        """Workers report handed-off requests whose saves settled: lease their chunks
        for ``handoff_lease_s`` (only what is stored is leased)."""
        for req_id in finished_sending or ():
            keys = self._sent.pop(req_id, None)
            for rank_keys in keys or ():
                try:
                    self.store.lookup(rank_keys, self.config.handoff_lease_s)
                except Exception as exc:   # noqa: BLE001 - a hook's exception would end vLLM's engine loop
                    log.warning("request %s: leasing its handed-off chunks failed (%s: %s)", req_id,
                                type(exc).__name__, exc)

    # -- consumer ---------------------------------------------------------------------------

    def offer(self, request: Any, keys: list[list[BlockKey]]) -> dict[str, Any] | None:
        """The usable handoff of ``request`` (its params checked against its own keys
        ``keys``), or ``None``: none given, malformed, not for these keys, from a store
        this engine cannot reach, or past its deadline (each logged once). No side
        effect beyond remembering the answer: vLLM may ask several times."""
        if not self.do_load:
            return None
        req_id = request.request_id
        if req_id in self._given:
            h = self._given[req_id]
        else:
            h = self._check(request, keys)
            self._given[req_id] = h
        if h is not None and time.time() >= h["deadline"] and req_id not in self._loading:
            h = None               # too late to wait: what the store holds now is a plain hit
        if h is None:
            self._offered.discard(req_id)
        else:
            self._offered.add(req_id)
        return h

    def _check(self, request: Any, keys: list[list[BlockKey]]) -> dict[str, Any] | None:
        try:
            h = parse(getattr(request, "kv_transfer_params", None))
        except BadHandoff as exc:
            log.warning("request %s: ignoring its kvstore handoff params: %s", request.request_id, exc)
            return None
        if h is None:
            return None
        why = None
        ours = keys[0] if keys else []
        if h["chunk_tokens"] != self.shape.chunk_tokens:
            why = f"chunk_tokens {h['chunk_tokens']} differs from this engine's {self.shape.chunk_tokens}"
        elif h["chunks"] > len(ours):
            why = f"{h['chunks']} chunks handed off, the prompt has {len(ours)} full chunks"
        elif ours[0].digest.hex() != h["first_key"] or ours[h["chunks"] - 1].digest.hex() != h["last_key"]:
            why = "its keys are not this engine's for this prompt (another model, layout, parallelism or salt)"
        elif h["source"].startswith("embedded:") and h["source"] != self.source:
            why = f"the producer's store ({h['source']}) is embedded in another process"
        if why is not None:
            log.warning("request %s: ignoring its kvstore handoff: %s", request.request_id, why)
            return None
        return h

    def planned(self, request: Any) -> float:
        """A load of ``request`` was planned: the deadline its worker waits until where
        the last offer was a handoff, else 0."""
        if request.request_id not in self._offered:
            return 0.0
        self._loading.add(request.request_id)
        return float(self._given[request.request_id]["deadline"])

    def outcomes(self, outcomes: Mapping[int, tuple[str, int | None]]) -> None:
        """Count the handoff loads the workers reported (verified, or failed). A request
        whose handoff failed is not offered it again (one wait per request): recomputed,
        it asks the store as any request does."""
        for req_id, failed in outcomes.values():
            if req_id in self._loading:
                self._loading.discard(req_id)
                self.metrics.add("handoffs_received" if failed is None else "failed_handoffs")
                if failed is not None and req_id in self._given:
                    self._given[req_id] = None


# -- worker side ------------------------------------------------------------------------------

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _waiters() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            # Each waiting load holds a thread (and, in server mode, a connection) until
            # its keys land or its deadline; loads whose keys are there return at once.
            _pool = ThreadPoolExecutor(16, thread_name_prefix="kvstore-handoff")
        return _pool


def waiting_load(store: Any, keys: Sequence[BlockKey], dsts: Sequence[Any], wait_until: float, cap_s: float,
                 lease_s: float) -> "Future[list[bool]]":
    """Load ``keys`` into ``dsts`` once the store holds them all, waiting (woken by
    the saves that land them) until ``wait_until`` (wall clock), at most ``cap_s``;
    then what is there is loaded and verified. Resolves to ``True`` only for a block
    verified in its buffer."""
    def run() -> list[bool]:
        left = min(max(0.0, wait_until - time.time()), cap_s)
        n = store.lookup(keys, lease_s, wait_s=left) if left > 0 else store.lookup(keys, lease_s)
        if n <= 0:
            return [False] * len(keys)
        ok = store.load(keys[:n], dsts[:n]).result(timeout=cap_s)
        return [bool(x) for x in ok] + [False] * (len(keys) - n)

    return _waiters().submit(run)


def settled(futures: Sequence[Future]) -> bool:
    """Whether every save of ``futures`` is over, including store saves a device copy
    handed on (a copy's future resolves to them)."""
    for f in futures:
        if not f.done():
            return False
        inner = f.result() if f.exception() is None else None
        if isinstance(inner, list) and any(isinstance(x, Future) and not x.done() for x in inner):
            return False
    return True


__all__ = ["BadHandoff", "FIELD", "Handoffs", "asks_for_handoff", "parse", "settled", "source_of",
           "waiting_load", "without_handoff"]
