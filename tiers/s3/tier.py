"""S3-compatible object storage tier (AWS S3, MinIO, Swift s3api, ...) through boto3.

One object per block at ``<prefix>/<namespace digest hex>/<key digest hex>``; its body
is the 128-byte version-2 block header (key digest, length, XXH3 checksum, and the parent
digest so :meth:`recover` can rebuild full keys) followed by the payload; objects carry
no user metadata. Several processes and nodes may share one bucket and prefix: any of
them finds the others' blocks through :meth:`recover` (at Store start-up) or by reading a
key directly. Every read verifies header, key digest, length and checksum; a bad object
is a miss, is deleted and is counted in ``corrupt_blocks``.

The tier enforces a byte budget over the blocks it knows (its index) and never evicts on
its own: the Store picks victims and calls :meth:`delete`. While the endpoint is down the
tier fails fast with :class:`TierUnavailableError` and probes it in the background with
backoff and jitter (:mod:`tiers._health`); the Store turns those errors into misses.

Single-object GETs, PUTs and DELETEs are signed and sent with the boto3 client's own
credentials, signer and connection pool but without botocore's per-call pipeline
(:mod:`tiers.s3.http`); bucket checks, listings and multipart uploads use the client.

Thread-safe. Batches run on a pool of ``concurrency`` threads; ranged GETs and multipart
parts of large blocks on a second pool of the same size (the HTTP connection pool holds
both). Buffers: ``read_into`` fills caller buffers in place; ``write`` copies each
source once into a per-thread staging buffer that holds header + payload, reused
across calls, and keeps nothing after returning.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from kvstore.block import EXT_HEADER_BYTES, HEADER_BYTES
from kvstore.buffers import copy_bytes, host_view, is_device, nbytes_of
from kvstore.errors import (BufferSizeError, CorruptBlockError, InvalidArgumentError, TierIOError,
                            TierUnavailableError)
from kvstore.config.tiers import S3TierConfig
from kvstore.keys import BlockKey
from kvstore.tiers.s3 import io as s3io
from kvstore.tiers.s3.client import (S3Settings, check_bucket, is_bad_range, is_missing, is_unavailable, make_client,
                              make_session)
from kvstore.tiers.s3.http import ObjectRequests
from kvstore.tiers._health import Health
from kvstore.tiers.s3.stage import Staging
from kvstore.tiers.base import RecoveredBlock, Tier, TierCapabilities, check_batch, check_sizes, given_checksums

log = logging.getLogger(__name__)
_D = S3TierConfig.defaults()   # keyword defaults: the config model's (one definition)
_PROBE_TIMEOUT_S = 1.0


@dataclass
class _Entry:
    key: BlockKey
    nbytes: int
    last_access: float = 0.0
    header: int = EXT_HEADER_BYTES  # header bytes before the payload (64 for version-1 objects)


class _Outcome:
    """What happened to one key of a batch, decided in a worker thread."""

    __slots__ = ("ok", "exc")

    def __init__(self, ok: bool = False, exc: BaseException | None = None) -> None:
        self.ok, self.exc = ok, exc


class S3Tier(Tier):
    """Blocks as objects in ``bucket`` under ``prefix``, within ``capacity_bytes``.

    Connection settings mirror ``S3TierConfig``; credentials come from the standard AWS
    chain (environment, shared files, ``profile``). The constructor checks that the
    endpoint answers, the credentials work and the bucket exists (creating it when
    ``create_bucket``), and raises :class:`ConfigError` naming the setting otherwise.
    """

    def __init__(self, capacity_bytes: int, *, bucket: str, name: str = "s3",
                 endpoint_url: str | None = _D.endpoint_url, prefix: str = _D.prefix,
                 region: str | None = _D.region, addressing_style: str = _D.addressing_style,
                 profile: str | None = _D.profile, concurrency: int = _D.concurrency,
                 connect_timeout_s: float = _D.connect_timeout_s, read_timeout_s: float = _D.read_timeout_s,
                 max_attempts: int = _D.max_attempts, multipart_threshold: int = _D.multipart_threshold,
                 part_size: int = _D.part_size, create_bucket: bool = _D.create_bucket,
                 sign_payload: bool = _D.sign_payload) -> None:
        if capacity_bytes <= 0:
            raise InvalidArgumentError(f"S3 tier capacity must be positive, got {capacity_bytes}")
        if part_size < EXT_HEADER_BYTES:
            raise InvalidArgumentError(f"S3 tier part_size must be at least {EXT_HEADER_BYTES}, got {part_size}")
        self.name = name
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self._capacity = int(capacity_bytes)
        self._multipart_threshold = int(multipart_threshold)
        self._part_size = int(part_size)
        self._settings = S3Settings(name=name, bucket=bucket, endpoint_url=endpoint_url, region=region,
                                    addressing_style=addressing_style, profile=profile,
                                    concurrency=concurrency, connect_timeout_s=connect_timeout_s,
                                    read_timeout_s=read_timeout_s, max_attempts=max_attempts,
                                    sign_payload=sign_payload)
        # Per-block requests and the parts of large blocks each get `concurrency` connections.
        session = make_session(self._settings)
        self._client = make_client(self._settings, session=session, pool_connections=2 * concurrency)
        self._probe_client = make_client(self._settings, max_attempts=1, pool_connections=1,
                                         timeout_s=min(_PROBE_TIMEOUT_S, connect_timeout_s))
        check_bucket(self._client, self._settings, create=create_bucket)
        # Single-object GET/PUT/DELETE: the client's signer and pool, without botocore's
        # per-call pipeline (tiers.s3.http says what that saves).
        self._requests = ObjectRequests(self._client, session.get_credentials(), bucket, max_attempts=max_attempts)
        self._health = Health(name, self._probe)
        self._concurrency = concurrency
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix=f"kvstore-{name}")
        self._parts = ThreadPoolExecutor(concurrency, thread_name_prefix=f"kvstore-{name}-part")
        self._index: dict[BlockKey, _Entry] = {}
        self._used = 0
        self._reserved = 0
        self._lock = threading.Lock()
        self._staging = Staging(self._part_size, self._multipart_threshold)
        self._closed = False
        self._counters = dict.fromkeys(("gets", "puts", "deletes", "corrupt_blocks", "ranged_gets",
                                        "multipart_puts", "header_gets", "found", "bytes_read", "bytes_written"), 0)
        self.capabilities = TierCapabilities(device="s3", persistent=True, max_concurrency=concurrency,
                                             write_checksums=True, shared=True)

    def _probe(self) -> None:
        """HEAD an object that never exists: a 404 proves the whole object path answers
        (on Swift a bucket HEAD would pass with the object servers down)."""
        try:
            self._probe_client.head_object(Bucket=self.bucket, Key=f"{self.prefix}/.probe")
        except Exception as exc:
            if not is_missing(exc):
                raise

    # -- accounting -------------------------------------------------------------------------

    def nbytes(self, key: BlockKey) -> int | None:
        entry = self._index.get(key)
        return entry.nbytes if entry else None

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """From the index (no request): stale for blocks other nodes wrote since
        :meth:`recover`, which :meth:`read_into` still finds."""
        index = self._index
        return [k in index for k in keys]

    def find(self, keys: Sequence[BlockKey]) -> list[int | None]:
        """Indexed keys from the index; the others with one small ranged GET of the block
        header each (verified: it gives the payload size), ``concurrency`` at a time in
        prefix order, stopping after a round with a key not found (a prompt's cached
        prefix ends there). Found blocks are indexed and budgeted while the budget has
        room."""
        index = self._index
        out: list[int | None] = [index[k].nbytes if k in index else None for k in keys]
        ask = [j for j, n in enumerate(out) if n is None]
        if not ask:
            return out
        self._health.check()
        step = max(1, self._concurrency)
        for start in range(0, len(ask), step):
            chunk = ask[start:start + step]
            found = self._map(self._recover_one, [keys[j] for j in chunk], [0.0] * len(chunk))
            self._settle([_Outcome(exc=exc) for _, exc in found])
            missing = False
            with self._lock:
                for j, (entry, _) in zip(chunk, found):
                    if entry is None:
                        missing = True
                        continue
                    key = keys[j]
                    known = self._index.get(key)
                    if known is not None:
                        out[j] = known.nbytes
                    elif self._used + self._reserved + entry.nbytes <= self._capacity:
                        self._index[key] = _Entry(key, entry.nbytes, header=entry.header)
                        self._used += entry.nbytes
                        self._counters["found"] += 1
                        out[j] = entry.nbytes
                    else:
                        missing = True
            if missing:
                break
        return out

    def _map(self, fn, *iterables) -> list:
        """Run ``fn`` over a batch on the pool; a single item, or a pool of one, runs on
        the calling thread (a thread hand-off costs more than it buys there)."""
        items = list(zip(*iterables))
        if len(items) <= 1 or self._concurrency == 1:
            return [fn(*args) for args in items]
        return list(self._pool.map(fn, *zip(*items)))

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    # -- reads ------------------------------------------------------------------------------

    def read_into(self, keys: Sequence[BlockKey], dsts: Sequence[Any]) -> list[bool]:
        check_batch(keys, dsts)
        check_sizes(self.name, dsts, [self._index.get(key) for key in keys])
        self._health.check()
        outcomes = self._map(self._read_one, keys, dsts)
        return self._settle(outcomes)

    def _read_one(self, key: BlockKey, dst: Any) -> _Outcome:
        if not self._health.healthy:
            return _Outcome(exc=TierUnavailableError("endpoint unavailable", tier=self.name))
        entry = self._index.get(key)
        name = s3io.object_name(self.prefix, key)
        n = nbytes_of(dst)
        staged = is_device(dst)
        target = memoryview(self._staging.host(n) if staged else host_view(dst, writable=True))
        hb = entry.header if entry is not None else EXT_HEADER_BYTES
        try:
            if entry is not None and hb + n > self._part_size:
                self._count("ranged_gets")
                s3io.get_ranges_into(self._requests, name, key, target, self._part_size, self._parts, hb)
            else:
                hb = s3io.get_into(self._requests, name, key, target, entry and entry.nbytes)
            if staged:
                copy_bytes(dst, target)
        except CorruptBlockError as exc:
            self._corrupt(key, name, exc)
            return _Outcome()
        except BufferSizeError as exc:
            return _Outcome(exc=BufferSizeError(f"[{self.name}] {exc}"))
        except Exception as exc:
            if is_bad_range(exc):
                self._corrupt(key, name, CorruptBlockError(f"object {name} is shorter than its block"))
                return _Outcome()
            return self._failure(exc, missing_ok=True, key=key)
        with self._lock:
            self._counters["gets"] += 1
            self._counters["bytes_read"] += n
            if key not in self._index and self._used + self._reserved + n <= self._capacity:
                # Another node wrote it: now this tier knows (and budgets) it too.
                self._index[key] = _Entry(key, n, header=hb)
                self._used += n
        return _Outcome(ok=True)

    def _corrupt(self, key: BlockKey, name: str, exc: CorruptBlockError) -> None:
        """A bad object is forgotten, deleted (best effort) and counted; never returned."""
        log.warning("tier %s: dropping corrupt object %s: %s", self.name, name, exc)
        with self._lock:
            self._counters["corrupt_blocks"] += 1
            entry = self._index.pop(key, None)
            if entry is not None:
                self._used -= entry.nbytes
        try:
            self._requests.delete(name)
        except Exception as del_exc:
            if is_unavailable(del_exc):
                self._health.failed(del_exc)

    def _failure(self, exc: BaseException, *, missing_ok: bool = False, key: BlockKey | None = None) -> _Outcome:
        if missing_ok and is_missing(exc):
            if key is not None:  # deleted behind our back (another node's eviction)
                with self._lock:
                    entry = self._index.pop(key, None)
                    if entry is not None:
                        self._used -= entry.nbytes
            return _Outcome()
        if is_unavailable(exc):
            self._health.failed(exc)
            return _Outcome(exc=TierUnavailableError(f"{type(exc).__name__}: {exc}", tier=self.name))
        self._health.count(exc)
        return _Outcome(exc=TierIOError(f"{type(exc).__name__}: {exc}", tier=self.name))

    def _settle(self, outcomes: list[_Outcome]) -> list[bool]:
        """Per-key results, or the batch's first error: a size mismatch first (the caller's
        bug), then unavailability, then other I/O failures."""
        errors = [o.exc for o in outcomes if o.exc is not None]
        for kind in (BufferSizeError, TierUnavailableError):
            for exc in errors:
                if isinstance(exc, kind):
                    raise exc
        if errors:
            raise errors[0]
        return [o.ok for o in outcomes]

    # -- writes -----------------------------------------------------------------------------

    def write(self, keys: Sequence[BlockKey], srcs: Sequence[Any],
              checksums: Sequence[int | None] | None = None) -> list[bool]:
        """See :meth:`Tier.write`; ``checksums`` (the writer's XXH3-64 per source) go
        into the object headers as they are, so a source changed since its writer hashed
        it is a corrupt object on its first read."""
        check_batch(keys, srcs)
        sums = given_checksums(keys, checksums)
        self._health.check()
        first: dict[BlockKey, int] = {}
        for j, key in enumerate(keys):
            first.setdefault(key, j)
        order = list(first.values())
        outcomes = self._map(self._write_one, [keys[j] for j in order], [srcs[j] for j in order],
                             [sums[j] for j in order])
        if any(isinstance(o.exc, TierUnavailableError) for o in outcomes):
            # The Store will count the whole batch as failed: forget what did land, so the
            # budget stays in step with the Store's index (the objects stay in the bucket
            # and any later recover() finds them).
            with self._lock:
                for j, o in zip(order, outcomes):
                    entry = self._index.pop(keys[j], None) if o.ok else None
                    if entry is not None:
                        self._used -= entry.nbytes
        done = dict(zip(order, outcomes))
        return self._settle([done[first[k]] for k in keys])

    def _write_one(self, key: BlockKey, src: Any, csum: int | None = None) -> _Outcome:
        if not self._health.healthy:
            return _Outcome(exc=TierUnavailableError("endpoint unavailable", tier=self.name))
        n = nbytes_of(src)
        with self._lock:
            if key in self._index:
                return _Outcome(ok=True)
            if self._used + self._reserved + n > self._capacity:
                return _Outcome()
            self._reserved += n
        stored = False
        try:
            pieces = self._staging.stage(key, src, n, csum)
            name = s3io.object_name(self.prefix, key)
            if len(pieces) > 1:
                s3io.put_multipart(self._client, self.bucket, name, pieces, self._parts)
                self._count("multipart_puts")
            else:
                self._requests.put(name, pieces[0])
            stored = True
        except Exception as exc:
            return self._failure(exc)
        finally:
            with self._lock:
                self._reserved -= n
                if stored:
                    self._counters["puts"] += 1
                    self._counters["bytes_written"] += n
                    if key not in self._index:  # a racing writer of the same key may have won
                        self._index[key] = _Entry(key, n)
                        self._used += n
        return _Outcome(ok=True)

    # -- removal, listing, recovery ---------------------------------------------------------

    def delete(self, keys: Sequence[BlockKey]) -> int:
        """Forget the keys and delete their objects. Returns how many were indexed. When
        the endpoint is down the objects stay (a later :meth:`recover` finds them) and
        :class:`TierUnavailableError` is raised after the index is updated."""
        removed = []
        with self._lock:
            for key in dict.fromkeys(keys):
                entry = self._index.pop(key, None)
                if entry is not None:
                    self._used -= entry.nbytes
                    removed.append(key)
        self._health.check()
        outcomes = self._map(self._delete_one, removed)
        self._settle(outcomes)
        return len(removed)

    def _delete_one(self, key: BlockKey) -> _Outcome:
        try:
            self._requests.delete(s3io.object_name(self.prefix, key))
        except Exception as exc:
            return self._failure(exc, missing_ok=True)
        self._count("deletes")
        return _Outcome(ok=True)

    def _listing(self) -> Iterator[tuple[BlockKey, float]]:
        """Every block object under the prefix: ``(key without parent, mtime)``."""
        self._health.check()
        paginator = self._client.get_paginator("list_objects_v2")
        root = f"{self.prefix}/" if self.prefix else ""
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=root):
                for obj in page.get("Contents", ()):
                    parsed = s3io.parse_name(self.prefix, obj["Key"])
                    if parsed is None or obj["Size"] < HEADER_BYTES:
                        continue
                    ns, digest = parsed
                    yield BlockKey.from_hex(digest, namespace=ns), obj["LastModified"].timestamp()
        except (TierUnavailableError, TierIOError):
            raise
        except Exception as exc:
            raise self._failure(exc).exc from exc

    def keys(self) -> Iterator[BlockKey]:
        """A fresh bucket listing: every block under the prefix, whichever node wrote it
        (keys carry their namespace; parents are in :meth:`recover`'s keys)."""
        with self._lock:
            known = {k: k for k in self._index}
        return iter([known.get(key, key) for key, _ in self._listing()])

    def recover(self) -> list[RecoveredBlock]:
        """Rebuild the index from a bucket listing, oldest ``LastModified`` first. Each
        object's block header is read with one small ranged GET (``concurrency`` at a
        time) and verified; it gives the payload size and the parent digest. An object
        with a bad header is counted in ``corrupt_blocks``, deleted and left out. Blocks
        beyond the byte budget are still returned so the Store can evict down to it.
        Raises :class:`TierUnavailableError` / :class:`TierIOError` when a listing or
        header request fails."""
        listed = sorted(self._listing(), key=lambda t: t[1])
        found = self._map(self._recover_one, *zip(*listed)) if listed else []
        self._settle([_Outcome(exc=exc) for _, exc in found])
        entries = [entry for entry, _ in found if entry is not None]
        with self._lock:
            self._index = {e.key: e for e in entries}
            self._used = sum(e.nbytes for e in self._index.values())
        return [RecoveredBlock(e.key, e.nbytes, e.last_access) for e in entries]

    def _recover_one(self, key: BlockKey, mtime: float) -> tuple[_Entry | None, BaseException | None]:
        if not self._health.healthy:  # an earlier header request found the endpoint down
            return None, TierUnavailableError("endpoint unavailable", tier=self.name)
        name = s3io.object_name(self.prefix, key)
        try:
            hb, n, parent = s3io.get_header(self._requests, name, key)
        except CorruptBlockError as exc:
            self._corrupt(key, name, exc)
            return None, None
        except Exception as exc:
            if is_bad_range(exc):
                self._corrupt(key, name, CorruptBlockError(f"object {name} is shorter than a block header"))
                return None, None
            return None, self._failure(exc, missing_ok=True).exc  # missing: deleted meanwhile
        self._count("header_gets")
        full = BlockKey(key.digest, parent, key.namespace) if parent else key
        return _Entry(full, n, mtime, header=hb), None

    # -- lifecycle --------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        with self._lock:
            counters = dict(self._counters)
            blocks = len(self._index)
        return {**self._health.stats(), **counters, "blocks": blocks, "bucket": self.bucket,
                "prefix": self.prefix, "endpoint": self._settings.where}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._health.close()
        self._pool.shutdown(wait=True)
        self._parts.shutdown(wait=True)
        for client in (self._client, self._probe_client):
            client.close()
