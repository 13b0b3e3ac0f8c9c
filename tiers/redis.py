"""Redis / Valkey tier, standalone or Cluster (``kind: redis``), through redis-py.

One key per block, ``<prefix>:<namespace digest hex>:<key digest hex>`` (``_`` for keys
without a namespace); no hash tags, so a Cluster spreads blocks over every slot. The
value is the 128-byte version-2 block header (key digest, length, XXH3 checksum, parent
digest) followed by the payload. Every read verifies header, key digest, length and
checksum; a bad value is a miss, is deleted and is counted in ``corrupt_blocks``. Nodes
and processes sharing a prefix share the blocks: :meth:`recover` (Store start-up) finds
the others' through ``SCAN``, and :meth:`read_into` reads any key directly.

Capacity: the tier keeps a byte budget over the blocks it knows (its index) and never
evicts on its own choosing; the Store picks victims and calls :meth:`delete`. Redis may
still drop a block itself (``maxmemory`` eviction, ``ttl_s`` expiry, another node's
delete): reading it is then a clean miss and the tier forgets it.

Batches: a batch's keys are grouped by the node owning their slot, each group is one
pipeline on one pooled connection, groups run in parallel (``concurrency`` threads).
Payloads move without an extra copy (:mod:`tiers._redisio`): ``GET`` replies are
received straight into the caller's buffers and ``SET`` sends header and payload from
where they are. Device (CUDA) buffers go through a per-thread host staging buffer.

Faults: a node down, a reset or timed-out connection, a failover in progress (``MOVED``,
``CLUSTERDOWN``, uncovered slots) fail the batch with :class:`TierUnavailableError`,
which the Store counts and turns into misses; the tier then fails fast and probes the
servers in the background with backoff (:mod:`tiers._health`, shared with the S3
tier) until every slot is served again, and comes back by itself. Blocks stay indexed
through an outage. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from kvstore.block import EXT_HEADER_BYTES, encode_ext_header
from kvstore.buffers import copy_bytes, host_view, is_device, nbytes_of
from kvstore.buffers.views import ThreadBuffer
from kvstore.config.tiers import RedisTierConfig
from kvstore.errors import ConfigError, CorruptBlockError, InvalidArgumentError, TierIOError, TierUnavailableError
from kvstore.keys import BlockKey
from kvstore.tiers import _redisio as rio
from kvstore.tiers._redisconn import FAULTS, Endpoints, Fault, RedisSettings, startup_error
from kvstore.tiers._redisrecover import NO_NAMESPACE, check_header, header_requests, parse_name, read_header_replies
from kvstore.tiers._health import Health
from kvstore.tiers.base import (RecoveredBlock, Tier, TierCapabilities, buffer_size_error, check_batch, check_sizes,
                                given_checksums)

log = logging.getLogger(__name__)
_D = RedisTierConfig.defaults()   # keyword defaults: the config model's (one definition)
# Reply errors that mean "this node cannot serve the key right now", not a broken request.
_UNAVAILABLE = {"MOVED", "ASK", "CLUSTERDOWN", "TRYAGAIN", "LOADING", "MASTERDOWN", "READONLY", "BUSY"}


@dataclass
class _Entry:
    key: BlockKey
    nbytes: int


class RedisTier(Tier):
    """Blocks as Redis strings under ``prefix``, within ``capacity_bytes``.

    Connection settings mirror ``RedisTierConfig``. The constructor connects, detects
    (or checks) Cluster mode, and writes, reads and deletes a probe key under the prefix;
    wrong credentials, a missing permission, an unreachable server or a failed TLS
    handshake raise :class:`ConfigError` naming the setting.
    """

    @classmethod
    def from_config(cls, cfg: RedisTierConfig) -> "RedisTier":
        """The tier ``cfg`` describes: the password resolved, ``tls`` split into its files."""
        tls = cfg.tls if not isinstance(cfg.tls, bool) else None
        return cls(cfg.capacity, name=cfg.name, url=cfg.url, nodes=cfg.nodes or (), cluster=cfg.cluster,
                   username=cfg.username, password=cfg.resolved_password(), tls=bool(cfg.tls),
                   tls_ca=tls and tls.ca, tls_cert=tls and tls.cert, tls_key=tls and tls.key,
                   prefix=cfg.prefix, concurrency=cfg.concurrency, timeout_s=cfg.timeout_s,
                   max_attempts=cfg.max_attempts, ttl_s=cfg.ttl_s)

    def __init__(self, capacity_bytes: int, *, name: str = "redis", url: str | None = _D.url,
                 nodes: Sequence[str] = (), cluster: str | bool = _D.cluster, username: str | None = _D.username,
                 password: str | None = None, tls: bool = False, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None, prefix: str = _D.prefix,
                 concurrency: int = _D.concurrency, timeout_s: float = _D.timeout_s,
                 max_attempts: int = _D.max_attempts, ttl_s: float | None = _D.ttl_s) -> None:
        if capacity_bytes <= 0:
            raise InvalidArgumentError(f"redis tier capacity must be positive, got {capacity_bytes}")
        if not prefix or ":" in prefix.strip(":") or any(c in prefix for c in "*?[]"):
            raise ConfigError(f"tiers.{name}.prefix: use a non-empty name without ':' or glob characters "
                              f"(got {prefix!r})")
        if ttl_s is not None and ttl_s <= 0:
            raise ConfigError(f"tiers.{name}.ttl_s: must be positive (got {ttl_s})")
        self.name = name
        self.prefix = prefix.strip(":")
        self._capacity = int(capacity_bytes)
        self._ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self._settings = RedisSettings(name=name, url=url, nodes=tuple(nodes), cluster=cluster, username=username,
                                       password=password, tls=tls, tls_ca=tls_ca, tls_cert=tls_cert,
                                       tls_key=tls_key, concurrency=concurrency, timeout_s=timeout_s,
                                       max_attempts=max_attempts)
        self._endpoints = Endpoints(self._settings)
        try:
            self._check_access()
        except BaseException:
            self._endpoints.close()
            raise
        self._health = Health(name, self._endpoints.probe)
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix=f"kvstore-{name}")
        self._staging = ThreadBuffer()   # this thread's host buffer for device blocks
        self._index: dict[BlockKey, _Entry] = {}
        self._used = 0
        self._reserved = 0
        self._lock = threading.Lock()
        self._closed = False
        self._counters = dict.fromkeys(("gets", "puts", "deletes", "corrupt_blocks", "vanished", "faults",
                                        "oom_refused", "found", "bytes_read", "bytes_written"), 0)
        self.capabilities = TierCapabilities(device="redis", persistent=True, max_concurrency=concurrency,
                                             write_checksums=True, shared=True)

    def _check_access(self) -> None:
        """SET, GET, GETRANGE, STRLEN, DEL and SCAN under the prefix, as the tier will."""
        probe = f"{self.prefix}:probe".encode()
        groups = self._endpoints.route([probe])
        pool, _ = next(iter(groups.values()))
        conn = pool.get_connection()
        try:
            requests = [rio.pack(b"SET", probe, b"ok"), rio.pack(b"GET", probe), rio.pack(b"GETRANGE", probe, b"0", b"1"),
                        rio.pack(b"STRLEN", probe), rio.pack(b"DEL", probe)]
            replies = rio.run_batch(conn, requests, lambda r: [r.reply() for _ in requests])
            for client in self._endpoints.primaries():
                client.scan(0, match=f"{self.prefix}:*", count=1)
        except FAULTS as exc:
            raise startup_error(self._settings, exc) from exc
        finally:
            pool.release(conn)
        for reply in replies:
            if isinstance(reply, rio.ReplyError):
                raise startup_error(self._settings, reply)

    # -- naming and accounting ---------------------------------------------------------------

    def key_name(self, key: BlockKey) -> bytes:
        """``<prefix>:<namespace hex>:<key hex>`` as the Redis key."""
        ns = key.namespace.hex() if key.namespace else NO_NAMESPACE
        return f"{self.prefix}:{ns}:{key.hex()}".encode()

    def nbytes(self, key: BlockKey) -> int | None:
        entry = self._index.get(key)
        return entry.nbytes if entry else None

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """From the index (no request): stale for blocks Redis evicted or expired and for
        blocks other nodes wrote since :meth:`recover` (which :meth:`read_into` still finds)."""
        index = self._index
        return [k in index for k in keys]

    def find(self, keys: Sequence[BlockKey]) -> list[int | None]:
        """Indexed keys from the index; the others with one pipelined ``GETRANGE`` of the
        block header and ``STRLEN`` each (128 bytes back per key, no payload): a value
        whose header is this key's block is indexed and budgeted while the budget has
        room; a bad one is deleted and counted in ``corrupt_blocks``."""
        index = self._index
        out: list[int | None] = [index[k].nbytes if k in index else None for k in keys]
        ask = [j for j, n in enumerate(out) if n is None]
        if not ask:
            return out
        names = [self.key_name(keys[j]) for j in ask]
        outcomes = self._run(names, lambda i: header_requests(names[i]), read_header_replies)
        self._raise_faults(outcomes)
        corrupt = []
        with self._lock:
            for j, name, o in zip(ask, names, outcomes):
                if o is None or not isinstance(o, tuple):   # absent, or refused (e.g. NOPERM): not found
                    continue
                key = keys[j]
                try:
                    nbytes, _, _ = check_header(o, key.digest)
                except CorruptBlockError as exc:
                    log.warning("tier %s: dropping corrupt value %s: %s", self.name, name.decode(), exc)
                    self._counters["corrupt_blocks"] += 1
                    corrupt.append(name)
                    continue
                entry = self._index.get(key)
                if entry is not None:          # a concurrent read or write indexed it
                    out[j] = entry.nbytes
                elif self._used + self._reserved + nbytes <= self._capacity:
                    self._index[key] = _Entry(key, nbytes)
                    self._used += nbytes
                    self._counters["found"] += 1
                    out[j] = nbytes
        if corrupt:
            self._delete_names(corrupt, quiet=True)
        return out

    def _forget(self, key: BlockKey) -> None:
        """Caller holds the lock."""
        entry = self._index.pop(key, None)
        if entry is not None:
            self._used -= entry.nbytes

    # -- batches --------------------------------------------------------------------------

    def _run(self, names: Sequence[bytes], build: Callable[[int], list], parse: Callable[[rio.Reader, int], Any]
             ) -> list[Any]:
        """Per index: ``parse``'s outcome, or a :class:`Fault` where that key's node failed."""
        self._health.check()
        return self._endpoints.run(names, build, parse, self._pool)

    def _raise_faults(self, outcomes: Sequence[Any]) -> None:
        """Count and raise the batch's faults (node down, failover): the Store turns
        :class:`TierUnavailableError` into misses; the probe brings the tier back."""
        faults = {id(o): o for o in outcomes
                  if isinstance(o, Fault) or (isinstance(o, rio.ReplyError) and o.kind in _UNAVAILABLE)}
        if not faults:
            return
        first = next(iter(faults.values()))
        with self._lock:
            self._counters["faults"] += len(faults)
        self._health.failed(first)
        raise TierUnavailableError(f"{len(faults)} node request(s) failed: {first}", tier=self.name)

    # -- reads ------------------------------------------------------------------------------

    def read_into(self, keys: Sequence[BlockKey], dsts: Sequence[Any]) -> list[bool]:
        check_batch(keys, dsts)
        check_sizes(self.name, dsts, [self._index.get(key) for key in keys])
        if not keys:
            return []
        names = [self.key_name(k) for k in keys]
        staged = [is_device(d) for d in dsts]
        host = self._staging.get(sum(nbytes_of(d) for d, s in zip(dsts, staged) if s)) if any(staged) else None
        targets, at = [], 0
        for dst, s in zip(dsts, staged):
            if s:
                n = nbytes_of(dst)
                targets.append(memoryview(host[at:at + n]))
                at += n
            else:
                targets.append(memoryview(host_view(dst, writable=True)).cast("B"))
        headers = np.empty((len(keys), EXT_HEADER_BYTES), np.uint8)

        def parse(reader: rio.Reader, i: int) -> rio.ReadOutcome:
            return rio.read_block(reader, keys[i].digest, targets[i], memoryview(headers[i]))

        outcomes = self._run(names, lambda i: [rio.pack(b"GET", names[i])], parse)
        result = [False] * len(keys)
        corrupt, sizes = [], []
        with self._lock:
            for j, (key, o) in enumerate(zip(keys, outcomes)):
                if not isinstance(o, rio.ReadOutcome):
                    continue
                if o.status == "hit":
                    n = targets[j].nbytes
                    result[j] = True
                    self._counters["gets"] += 1
                    self._counters["bytes_read"] += n
                    if key not in self._index and self._used + self._reserved + n <= self._capacity:
                        # Another node wrote it: now this tier knows (and budgets) it too.
                        self._index[key] = _Entry(key, n)
                        self._used += n
                elif o.status == "nil":
                    if key in self._index:   # Redis evicted or expired it, or a peer deleted it
                        self._counters["vanished"] += 1
                        self._forget(key)
                elif o.status == "corrupt":
                    log.warning("tier %s: dropping corrupt value %s: %s", self.name, names[j].decode(), o.detail)
                    self._counters["corrupt_blocks"] += 1
                    self._forget(key)
                    corrupt.append(j)
                elif o.status == "size":
                    sizes.append((j, o.detail))
                elif o.status == "error" and o.detail.kind not in _UNAVAILABLE:
                    outcomes[j] = TierIOError(f"GET {names[j].decode()}: {o.detail}", tier=self.name)
                else:
                    outcomes[j] = o.detail
        if corrupt:
            self._delete_names([names[j] for j in corrupt], quiet=True)
        if sizes:
            j, n = sizes[0]
            raise buffer_size_error(targets[j].nbytes, n, self.name)
        self._raise_faults(outcomes)
        for o in outcomes:
            if isinstance(o, TierIOError):
                raise o
        for j, s in enumerate(staged):
            if s and result[j]:
                copy_bytes(dsts[j], targets[j])
        return result

    # -- writes -----------------------------------------------------------------------------

    def write(self, keys: Sequence[BlockKey], srcs: Sequence[Any],
              checksums: Sequence[int | None] | None = None) -> list[bool]:
        """See :meth:`Tier.write`; ``checksums`` (the writer's XXH3-64 per source, as a
        spill from DRAM hands them) go into the value headers as they are, so a source
        changed since its writer hashed it is a corrupt value on its first read."""
        check_batch(keys, srcs)
        sums = given_checksums(keys, checksums)
        self._health.check()
        first: dict[BlockKey, int] = {}
        for j, key in enumerate(keys):
            first.setdefault(key, j)
        done: dict[int, bool] = {}
        todo: list[int] = []
        with self._lock:   # reserve room before anything is sent
            for j in first.values():
                n = nbytes_of(srcs[j])
                if keys[j] in self._index:
                    done[j] = True
                elif self._used + self._reserved + n > self._capacity:
                    done[j] = False
                else:
                    self._reserved += n
                    todo.append(j)
        try:
            stored = self._write_new([keys[j] for j in todo], [srcs[j] for j in todo], [sums[j] for j in todo])
        finally:
            with self._lock:
                for j in todo:
                    self._reserved -= nbytes_of(srcs[j])
        done.update(zip(todo, stored))
        return [done[first[k]] for k in keys]

    def _write_new(self, keys: list[BlockKey], srcs: list[Any], sums: list[int | None]) -> list[bool]:
        if not keys:
            return []
        names = [self.key_name(k) for k in keys]
        sizes = [nbytes_of(s) for s in srcs]
        host = self._staging.get(sum(n for s, n in zip(srcs, sizes) if is_device(s))) if any(map(is_device, srcs)) \
            else None
        payloads, at = [], 0
        for src, n in zip(srcs, sizes):
            if is_device(src):
                copy_bytes(host[at:at + n], src)
                payloads.append(memoryview(host[at:at + n]))
                at += n
            else:
                payloads.append(memoryview(host_view(src)).cast("B"))
        headers = []
        for key, payload, given in zip(keys, payloads, sums):
            header = bytearray(EXT_HEADER_BYTES)
            encode_ext_header(key.digest, key.parent, payload, header, payload_checksum=given)
            headers.append(bytes(header))
        outcomes = self._run(names, lambda i: rio.pack_set(names[i], headers[i], payloads[i], self._ttl_ms),
                             lambda r, i: r.reply())
        result = [o == b"OK" for o in outcomes]
        with self._lock:
            for j, (key, ok, o) in enumerate(zip(keys, result, outcomes)):
                if ok:
                    self._counters["puts"] += 1
                    self._counters["bytes_written"] += sizes[j]
                    if key not in self._index:   # a racing writer of the same key may have won
                        self._index[key] = _Entry(key, sizes[j])
                        self._used += sizes[j]
                elif isinstance(o, rio.ReplyError) and o.kind == "OOM":
                    self._counters["oom_refused"] += 1   # maxmemory with noeviction: no room
        try:
            self._raise_faults(outcomes)
            for name, o in zip(names, outcomes):
                if isinstance(o, rio.ReplyError) and o.kind != "OOM":
                    raise TierIOError(f"SET {name.decode()}: {o}", tier=self.name)
        except (TierUnavailableError, TierIOError):
            # The Store counts the whole batch as failed: forget what did land so the
            # budget stays in step with its index (recover() finds those values again).
            with self._lock:
                for key, ok in zip(keys, result):
                    if ok:
                        self._forget(key)
            raise
        return result

    # -- removal, listing, recovery ---------------------------------------------------------

    def delete(self, keys: Sequence[BlockKey]) -> int:
        """Forget the keys and delete their values. Returns how many were indexed. While a
        node is down its values stay (``recover`` finds them again) and
        :class:`TierUnavailableError` is raised after the index is updated."""
        removed = []
        with self._lock:
            for key in dict.fromkeys(keys):
                if key in self._index:
                    self._forget(key)
                    removed.append(key)
        if removed:
            self._delete_names([self.key_name(k) for k in removed])
        return len(removed)

    def _delete_names(self, names: list[bytes], *, quiet: bool = False) -> None:
        try:
            outcomes = self._run(names, lambda i: [rio.pack(b"DEL", names[i])], lambda r, i: r.reply())
            self._raise_faults(outcomes)
        except TierUnavailableError:
            if not quiet:
                raise
            return
        with self._lock:
            self._counters["deletes"] += sum(isinstance(o, int) and o > 0 for o in outcomes)

    def _scan(self) -> Iterator[BlockKey]:
        """Every block key under the prefix on every primary (``SCAN``), without parents."""
        self._health.check()
        try:
            for client in self._endpoints.primaries():
                for name in client.scan_iter(match=f"{self.prefix}:*", count=1000):
                    key = parse_name(self.prefix, name)
                    if key is not None:
                        yield key
        except FAULTS as exc:
            self._health.failed(exc)
            raise TierUnavailableError(f"SCAN failed: {type(exc).__name__}: {exc}", tier=self.name) from exc

    def keys(self) -> Iterator[BlockKey]:
        """A fresh ``SCAN``: every block under the prefix, whichever node wrote it (keys
        carry their namespace; parents where this tier indexed them or in :meth:`recover`)."""
        with self._lock:
            known = {k: k for k in self._index}
        return iter([known.get(key, key) for key in self._scan()])

    def recover(self) -> list[RecoveredBlock]:
        """Rebuild the index from a ``SCAN`` of the prefix, least recently used first
        (``OBJECT IDLETIME``). Each value's header is read with ``GETRANGE`` and
        verified, its length checked with ``STRLEN``; a bad one is counted in
        ``corrupt_blocks``, deleted and left out. Blocks past the byte budget are still
        returned so the Store can evict down to it. Raises :class:`TierUnavailableError`
        when a node does not answer."""
        scanned = list(dict.fromkeys(self._scan()))
        names = [self.key_name(k) for k in scanned]
        outcomes = self._run(names, lambda i: header_requests(names[i]), read_header_replies) if names else []
        self._raise_faults(outcomes)
        now, found, corrupt = time.time(), [], []
        for key, name, o in zip(scanned, names, outcomes):
            if o is None:           # gone since the SCAN
                continue
            if isinstance(o, rio.ReplyError):   # refused (e.g. NOPERM): say so, delete nothing
                raise TierIOError(f"reading the header of {name.decode()}: {o}", tier=self.name)
            try:
                nbytes, parent, idle_s = check_header(o, key.digest)
            except CorruptBlockError as exc:
                log.warning("tier %s: dropping corrupt value %s: %s", self.name, name.decode(), exc)
                corrupt.append(name)
                continue
            full = BlockKey(key.digest, parent, key.namespace) if parent else key
            found.append(RecoveredBlock(full, nbytes, now - idle_s))
        if corrupt:
            with self._lock:
                self._counters["corrupt_blocks"] += len(corrupt)
            self._delete_names(corrupt, quiet=True)
        found.sort(key=lambda b: b.last_access)
        with self._lock:
            self._index = {b.key: _Entry(b.key, b.nbytes) for b in found}
            self._used = sum(b.nbytes for b in found)
        return found

    # -- lifecycle --------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        with self._lock:
            counters = dict(self._counters)
            blocks = len(self._index)
        return {**self._health.stats(), **counters, "blocks": blocks, "prefix": self.prefix,
                "mode": "cluster" if self._endpoints.clustered else "standalone",
                "endpoint": self._settings.where}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._health.close()
        self._pool.shutdown(wait=True)
        self._endpoints.close()

