"""KV events for cache-aware routers, in vLLM's wire format.

The Store reports each block stored in or removed from a tier; this module turns those
reports into vLLM's ``KVEventBatch`` messages (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``; ``medium`` = the tier's name) and publishes them exactly as vLLM's
``ZmqEventPublisher`` does, so routers that read vLLM's events (llm-d, Dynamo, vLLM's
production router) read ours unchanged:

- a ZMQ PUB socket sends multipart ``(topic, seq, payload)``: ``seq`` is an 8-byte
  big-endian batch number counting from 0, ``payload`` the msgpack of one batch;
- an optional ROUTER socket answers a replay request ``(identity, b"", start_seq)`` with
  every kept batch from ``start_seq`` on, each ``(identity, b"", topic, seq, payload)``,
  then the end marker ``(identity, b"", b"", seq -1, b"")``; ``buffer_steps`` batches
  are kept;
- an endpoint with ``*`` or ``::``, or an ``ipc://``/``inproc://`` one, is bound; any
  other is connected to (a subscriber or proxy that binds). The replay socket always binds.

Block hashes: a key's 32-byte digest becomes the integer vLLM itself publishes for its
own 32-byte block hashes by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``): the
digest's low 64 bits, big-endian. Routers that index vLLM's events as uint64 take ours
as they are; ``parent_block_hash`` is the previous chunk's digest mapped the same way.

Token ids are prompt content: they are published only where a caller passed them with a
save (kept for the last ``token_blocks`` keys); a ``BlockStored`` without them carries
``token_ids=[]`` and ``block_size=0`` (as vLLM's own placeholder events do), counted
in ``tokens_missing``.

Threading: the observer methods (:meth:`stored`, :meth:`removed`, :meth:`cleared`,
:meth:`note_tokens`) are thread-safe and cheap (the Store calls them under its lock, in
index order); one publisher thread owns both sockets, encodes and sends. When more than
``max_queue`` reports wait, they are replaced by one ``AllBlocksCleared`` (counted in
``overflows``): a router then forgets what it knew, which costs it hits, never
correctness.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from typing import Any, Iterable, Sequence

import msgspec
import numpy as np

from kvstore._extras import install_hint
from kvstore.config import EventsConfig
from kvstore.errors import ConfigError, InvalidArgumentError
from kvstore.keys import BlockKey

log = logging.getLogger("kvstore.events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_MASK64 = (1 << 64) - 1
_MAX_EVENTS_PER_BATCH = 1024


# -- vLLM's message classes, field for field (vllm/distributed/kv_events.py) -------------

class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events; the msgpack tag is the class name, as in vLLM."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def block_hash(digest: bytes) -> int:
    """The event hash of a key digest: its low 64 bits, big-endian (vLLM's own mapping)."""
    return int.from_bytes(digest, "big") & _MASK64


# -- the publisher -----------------------------------------------------------------------

class EventPublisher:
    """Publishes the Store's block movements (see the module docstring). ``tier_names``
    in level order: a removal given as a level bitmask names its tiers from it."""

    def __init__(self, config: EventsConfig, tier_names: Sequence[str]) -> None:
        try:
            import zmq
        except ImportError as exc:
            raise ConfigError(f"events: publishing KV events needs pyzmq ({install_hint('events')})") from exc
        self._zmq = zmq
        self._config = config
        self._tiers = list(tier_names)
        self._topic = config.topic.encode()
        self._pending: deque[tuple] = deque()
        self._oldest: float | None = None      # monotonic time of the oldest waiting report
        self._cond = threading.Condition()
        self._tokens: OrderedDict[bytes, list[int]] = OrderedDict()
        self._tokens_lock = threading.Lock()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.counters = dict.fromkeys(("batches", "events", "blocks_stored", "blocks_removed", "cleared",
                                       "tokens_missing", "overflows", "replays", "errors"), 0)
        self.sequence = -1                     # the last batch number sent
        self.last_lag_s = 0.0                  # report-to-send time of the last batch
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(100_000)
        self._replay = None
        try:
            self.endpoint = _attach(self._pub, config.endpoint, "events.endpoint", zmq)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
                self.replay_endpoint = _attach(self._replay, config.replay_endpoint, "events.replay_endpoint",
                                               zmq, bind=True)
            else:
                self.replay_endpoint = None
        except BaseException:
            self._close_sockets()
            raise
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvstore-events", daemon=True)
        self._thread.start()

    # -- observer calls (any thread; the Store may hold its lock) -------------------------

    def stored(self, level: int, keys: Sequence[BlockKey]) -> None:
        """``keys`` entered tier ``level``."""
        if keys:
            self._report(("stored", level, list(keys)))

    def removed(self, level: int, keys: Sequence[BlockKey]) -> None:
        """``keys`` left tier ``level``."""
        if keys:
            self._report(("removed", level, list(keys)))

    def removed_masks(self, plan: Iterable[tuple[BlockKey, int]]) -> None:
        """Each ``(key, mask)`` left every tier whose bit is set in ``mask``."""
        for level in range(len(self._tiers)):
            self.removed(level, [key for key, mask in plan if mask >> level & 1])

    def cleared(self) -> None:
        """Every block left every tier."""
        self._report(("cleared",))

    def note_tokens(self, keys: Sequence[BlockKey], token_ids: Sequence[Sequence[int]]) -> None:
        """Remember each key's chunk tokens for its ``BlockStored`` events (the last
        ``token_blocks`` keys are kept)."""
        if len(token_ids) != len(keys):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(token_ids)} token id lists")
        limit = self._config.token_blocks
        if not limit:
            return
        rows = [_token_list(tokens) for tokens in token_ids]
        with self._tokens_lock:
            for key, row in zip(keys, rows):
                self._tokens[key.digest] = row
                self._tokens.move_to_end(key.digest)
            while len(self._tokens) > limit:
                self._tokens.popitem(last=False)

    def _report(self, item: tuple) -> None:
        with self._cond:
            if len(self._pending) >= self._config.max_queue:
                self._pending.clear()
                self._pending.append(("cleared",))
                self.counters["overflows"] += 1
            if not self._pending:
                self._oldest = time.monotonic()
            self._pending.append(item)
            self._cond.notify()

    # -- what the server's /metrics and stats() show ----------------------------------------

    def stats(self) -> dict[str, Any]:
        with self._cond:
            queued = len(self._pending) + self._busy     # reports taken but not yet sent
            since = [t for t, live in ((self._sending_since, self._busy), (self._oldest, self._pending)) if live]
            lag = time.monotonic() - min(since) if since else 0.0
        return {**self.counters, "sequence": self.sequence, "queued": queued, "lag_s": lag,
                "last_lag_s": self.last_lag_s, "endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint}

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every report so far is sent; ``False`` on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while (self._pending or self._busy) and time.monotonic() < deadline:
                self._cond.wait(0.01)
            return not self._pending and not self._busy

    def close(self) -> None:
        """Send what is waiting, then stop the thread and close both sockets. Idempotent."""
        if not self._running:
            return
        self.flush(1.0)
        with self._cond:
            self._running = False
            self._cond.notify()
        self._thread.join(5.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    # -- the publisher thread ---------------------------------------------------------------

    _busy = 0          # reports the publisher thread took and has not finished sending
    _sending_since = 0.0   # when the oldest of those was reported

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        poller = self._zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, self._zmq.POLLIN)
        while True:
            with self._cond:
                if not self._pending and self._running:
                    self._cond.wait(0.01 if self._replay is not None else 0.1)
                if not self._pending and not self._running:
                    return
                items = list(self._pending)
                self._pending.clear()
                since = self._oldest
                self._busy = len(items)
                self._sending_since = since
            try:
                if self._replay is not None and poller.poll(0):
                    self._serve_replay()
                if items:
                    for events in _chunks(self._events(items), _MAX_EVENTS_PER_BATCH):
                        self._send(encoder.encode(KVEventBatch(ts=time.time(), events=events)), len(events))
                    self.last_lag_s = time.monotonic() - since if since is not None else 0.0
            except Exception:       # a publishing fault must never stop the thread
                self.counters["errors"] += 1
                log.exception("publishing KV events failed")
            finally:
                with self._cond:
                    self._busy = 0
                    self._cond.notify_all()

    def _send(self, payload: bytes, num_events: int) -> None:
        seq = self.sequence + 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.sequence = seq
        self.counters["batches"] += 1
        self.counters["events"] += num_events

    def _serve_replay(self) -> None:
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("ignoring a malformed replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            self.counters["replays"] += 1
            for seq, payload in list(self._buffer):
                if seq >= first:
                    self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _events(self, items: list[tuple]) -> list[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        for item in items:
            if item[0] == "cleared":
                out.append(AllBlocksCleared())
                self.counters["cleared"] += 1
            elif item[0] == "removed":
                out.append(BlockRemoved(block_hashes=[block_hash(k.digest) for k in item[2]],
                                        medium=self._tiers[item[1]]))
                self.counters["blocks_removed"] += len(item[2])
            else:
                out += self._stored_events(self._tiers[item[1]], item[2])
        return out

    def _stored_events(self, medium: str, keys: list[BlockKey]) -> list[BlockStored]:
        """One ``BlockStored`` per run of keys that chain onto each other and agree on
        whether (and how many) tokens are known: vLLM's event is one chain."""
        with self._tokens_lock:
            rows = [self._tokens.get(k.digest) for k in keys]
        events: list[BlockStored] = []
        run: list[int] = []
        for j, key in enumerate(keys):
            if run:
                prev = run[-1]
                same = (rows[j] is None) == (rows[prev] is None) and (
                    rows[j] is None or len(rows[j]) == len(rows[prev]))
                if not (same and key.parent == keys[prev].digest):
                    events.append(self._stored_event(medium, keys, rows, run))
                    run = []
            run.append(j)
        if run:
            events.append(self._stored_event(medium, keys, rows, run))
        self.counters["blocks_stored"] += len(keys)
        return events

    def _stored_event(self, medium: str, keys: list[BlockKey], rows: list, run: list[int]) -> BlockStored:
        first = keys[run[0]]
        known = rows[run[0]] is not None
        if not known:
            self.counters["tokens_missing"] += len(run)
        return BlockStored(
            block_hashes=[block_hash(keys[j].digest) for j in run],
            parent_block_hash=block_hash(first.parent) if first.parent else None,
            token_ids=[t for j in run for t in rows[j]] if known else [],
            block_size=len(rows[run[0]]) if known else 0,
            lora_id=None, medium=medium, lora_name=None)


def _token_list(tokens: Any) -> list[int]:
    arr = np.asarray(tokens)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidArgumentError(f"token_ids: each entry must be a flat sequence of integers, got "
                                   f"dtype {arr.dtype} shape {arr.shape}")
    return arr.tolist()


def _attach(sock: Any, endpoint: str, field: str, zmq: Any, *, bind: bool = False) -> str:
    """Bind or connect as vLLM does; returns the endpoint in use (a bound port 0 resolved)."""
    binds = bind or "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
    try:
        if binds:
            sock.bind(endpoint)
            return sock.getsockopt_string(zmq.LAST_ENDPOINT)
        sock.connect(endpoint)
        return endpoint
    except zmq.ZMQError as exc:
        raise ConfigError(f"{field}: cannot {'bind' if binds else 'connect'} {endpoint!r}: {exc}") from exc


def _chunks(items: list, size: int) -> Iterable[list]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def open_events(config: EventsConfig | None, tier_names: Sequence[str]) -> EventPublisher | None:
    """The publisher for ``config``, or ``None`` when events are not configured."""
    return EventPublisher(config, tier_names) if config is not None else None


__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "EventPublisher", "KVEventBatch", "block_hash",
           "open_events"]
