"""A tier on a Mooncake Store pool: distributed DRAM (and SSD) over Mooncake's transfer
engine, shared by every node that points at the same master.

Each block is one Mooncake object named ``<prefix>:<namespace hex>:<key hex>`` whose value
is the verified block format of :mod:`kvstore.block` (header + payload). Every read checks
it: a block that fails is a miss, is removed from the pool and is counted in
``corrupt_blocks``; its bytes never reach the caller.

Blocks move through one registered host staging buffer (``staging_bytes`` of payload per
round, their headers on top). Mooncake pays per piece of an object (two pieces put
0.84-0.90x of one, ``benchmarks/cluster.py``), more than a copy costs, so every put is
one piece:

- a spill from a DRAM tier that keeps header frames (the Store's build sets them when
  this tier is next below DRAM) goes from the slot itself: the header is written into
  the page before the slot's payload;
- any other source is copied into the staging buffer behind its header (host memory
  hashed in the same pass); a host payload larger than the staging buffer goes as two
  pieces instead (header staged, payload in place).

Reads land headers in the staging buffer and host payloads straight in the caller's
buffer over TCP (``batch_get_into_multi_buffers``: two pieces, no copy); device buffers,
and every payload under RDMA (which moves registered memory only), go through the
staging buffer. Batches larger than the staging buffer go in several rounds; one batch
uses it at a time.

Faults are misses, never wrong bytes: an unreachable master marks the tier unavailable
(:class:`~kvstore.errors.TierUnavailableError`, which the Store counts and treats as a
miss), a background probe brings it back by itself, and a failed transfer from a storage
node that died is a miss counted in ``faults``. The byte budget covers what this node wrote
or found; the Store's eviction runs over it as over every tier. Mooncake keeps no listing
for a client, so ``recover()`` finds nothing: blocks other nodes wrote are found by
``contains``/``read_into`` asking the pool.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, Sequence

import numpy as np

from kvstore.block import HEADER_BYTES, VERSION, encode_header, parse_block_header, verify_payload
from kvstore.buffers import copy_bytes, host_view, is_device, nbytes_of
from kvstore.buffers.host import copy_batch_hashed
from kvstore.buffers.framed import frame_of
from kvstore.buffers.runs import runs
from kvstore.config.tiers import MooncakeTierConfig
from kvstore.errors import ConfigError, CorruptBlockError, InvalidArgumentError, TierUnavailableError
from kvstore.keys import BlockKey
from kvstore.tiers._health import Health
from kvstore.tiers.base import Tier, TierCapabilities, buffer_size_error, check_batch, given_checksums

log = logging.getLogger(__name__)
_D = MooncakeTierConfig.defaults()   # keyword defaults: the config model's (one definition)

_ALIGN = 4096
# Large staged puts are copied (and hashed) on two threads, as the DRAM tier's copies are.
_COPY_THREADS = min(2, os.cpu_count() or 1)
# Mooncake's error codes (mooncake-store/include/types.h) that this tier tells apart.
_NOT_FOUND = -704
_BUFFER_OVERFLOW = -600
_NO_SPACE = (-200, -10)           # SEGMENT/replica allocation failed: the pool is full
_RPC_FAIL_MIN, _RPC_FAIL_MAX = -999, -900   # master unreachable


def _object_name(prefix: str, key: BlockKey) -> str:
    ns = key.namespace.hex() if key.namespace is not None else "0"
    return f"{prefix}:{ns}:{key.digest.hex()}"


_STAGE, _TWO = "stage", "two"   # how a source goes when not from its frame (MooncakeTier._how)


def _master_down(rc: int) -> bool:
    return _RPC_FAIL_MIN <= rc <= _RPC_FAIL_MAX


class MooncakeTier(Tier):
    """Blocks in a Mooncake Store pool. Thread-safe; batches take turns on the staging buffer."""

    def __init__(self, capacity_bytes: int, *, master: str, metadata_server: str, name: str = "mooncake",
                 protocol: str = _D.protocol, device: str = _D.device, local_hostname: str | None = _D.local_hostname,
                 global_segment_size: int = _D.global_segment_size, local_buffer_size: int = _D.local_buffer_size,
                 staging_bytes: int = _D.staging_bytes, prefix: str = _D.prefix) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise ConfigError(f"tiers.{name}.kind: the mooncake tier needs Mooncake's Python package "
                              f"(pip install mooncake-transfer-engine, or -non-cuda without a GPU): {exc}") from exc
        if protocol not in ("tcp", "rdma"):
            raise ConfigError(f"tiers.{name}.protocol: {protocol!r} is not 'tcp' or 'rdma'")
        if staging_bytes < _ALIGN:
            raise ConfigError(f"tiers.{name}.staging_bytes: {staging_bytes} is below {_ALIGN}")
        self.name = name
        self.prefix = prefix
        self._protocol = protocol
        self._capacity = capacity_bytes
        self._used = 0
        self._sizes: dict[BlockKey, int] = {}
        self._lock = threading.Lock()          # index and counters
        self._batch_lock = threading.Lock()    # the staging buffer: one batch at a time
        # The transfer engine picks its own TCP listen port, which another process can hold
        # (the engine then fails "cannot start handshake daemon"): a failed setup is tried
        # twice more, on a fresh local port unless one was configured.
        for attempt in range(3):
            host = local_hostname or f"127.0.0.1:{_free_port()}"
            self._store = MooncakeDistributedStore()
            rc = self._store.setup(host, metadata_server, global_segment_size, local_buffer_size, protocol,
                                   device, master)
            if rc == 0:
                break
            self._store.close()
        if rc != 0:
            raise ConfigError(f"tiers.{name}.master: cannot join the Mooncake pool at master {master!r} "
                              f"with metadata server {metadata_server!r} (setup returned {rc})")
        # staging_bytes of payload per round, with room for their headers on top (one per
        # 4 KiB), so a 64 MiB move group of blocks goes in one round
        self._staging_payload = staging_bytes
        size = staging_bytes + -(-HEADER_BYTES * -(-staging_bytes // _ALIGN) // _ALIGN) * _ALIGN
        raw = np.empty(size + _ALIGN, np.uint8)
        start = (-raw.ctypes.data) % _ALIGN
        self._staging = raw[start:start + size]
        rc = self._store.register_buffer(self._staging.ctypes.data, size)
        if rc != 0:
            self._store.close()
            raise ConfigError(f"tiers.{name}.staging_bytes: Mooncake refused to register the staging buffer "
                              f"({rc})")
        self._copy_pool = ThreadPoolExecutor(_COPY_THREADS - 1 or 1, thread_name_prefix=f"kvstore-{name}-copy")
        self._health = Health(name, self._probe)
        self._counters = dict.fromkeys(("gets", "puts", "deletes", "corrupt_blocks", "faults", "found",
                                        "bytes_read", "bytes_written"), 0)
        self._closed = False
        self.capabilities = TierCapabilities(device="mooncake", persistent=False, alignment=1, max_concurrency=1,
                                             write_checksums=True, shared=True)

    def _probe(self) -> None:
        rc = self._store.batch_is_exist([f"{self.prefix}:.probe"])[0]
        if rc < 0:
            raise TierUnavailableError(f"master unreachable (is_exist returned {rc})", tier=self.name)

    def _fault(self, rc: int, what: str) -> None:
        """Count a failed request; an unreachable master marks the tier unavailable."""
        if _master_down(rc):
            self._health.failed(TierUnavailableError(f"{what}: master unreachable ({rc})", tier=self.name))
        else:
            with self._lock:
                self._counters["faults"] += 1
            self._health.count(TierUnavailableError(f"{what} failed ({rc})", tier=self.name))

    def _rounds(self, sizes: Sequence[int], needs: Sequence[int]) -> Iterator[list[int]]:
        """Split a batch into rounds of indexes whose staged bytes (``needs``: what each
        block puts in the staging buffer) fit it."""
        cap = self._staging.nbytes
        for n, need in zip(sizes, needs):
            if need > cap:
                raise InvalidArgumentError(f"[{self.name}] a {n}-byte block does not fit staging_bytes "
                                           f"{self._staging_payload}")
        yield from runs(needs, cap)

    def _direct(self, buf: Any) -> bool:
        """Whether a payload moves straight between the caller's memory and the pool: host
        memory over TCP (RDMA moves registered memory only, so it stages)."""
        return self._protocol == "tcp" and not is_device(buf)

    # -- accounting -------------------------------------------------------------------------

    def nbytes(self, key: BlockKey) -> int | None:
        return self._sizes.get(key)

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Known keys from the index; others (another node's blocks) from the pool. A pool
        that does not answer reports them absent."""
        known = [k in self._sizes for k in keys]
        ask = [i for i, hit in enumerate(known) if not hit]
        if ask and self._health.healthy:
            found = self._store.batch_is_exist([_object_name(self.prefix, keys[i]) for i in ask])
            for i, rc in zip(ask, found):
                known[i] = rc == 1
        return known

    def find(self, keys: Sequence[BlockKey]) -> list[int | None]:
        """Indexed keys from the index; the others asked of the pool (``batch_is_exist``,
        then the object's size): an object of a block's size (header + payload) is
        indexed and budgeted while the budget has room. Its header and checksum are
        checked when it is read."""
        sizes = self._sizes
        out: list[int | None] = [sizes.get(k) for k in keys]
        ask = [j for j, n in enumerate(out) if n is None]
        if not ask:
            return out
        self._health.check()
        names = [_object_name(self.prefix, keys[j]) for j in ask]
        exist = self._store.batch_is_exist(names)
        if any(_master_down(rc) for rc in exist):
            self._fault(min(exist), "is_exist")
            raise TierUnavailableError("master unreachable during a lookup", tier=self.name)
        for j, name, rc in zip(ask, names, exist):
            if rc != 1:
                continue
            total = self._store.get_size(name)
            if _master_down(total):
                self._fault(total, f"get_size {name}")
                raise TierUnavailableError("master unreachable during a lookup", tier=self.name)
            n = total - HEADER_BYTES
            if n <= 0:
                continue
            with self._lock:
                if keys[j] in self._sizes:
                    out[j] = self._sizes[keys[j]]
                elif self._used + n <= self._capacity:
                    self._sizes[keys[j]] = n
                    self._used += n
                    self._counters["found"] += 1
                    out[j] = n
        return out

    # -- reads ------------------------------------------------------------------------------

    def read_into(self, keys: Sequence[BlockKey], dsts: Sequence[Any]) -> list[bool]:
        check_batch(keys, dsts)
        sizes = [nbytes_of(d) for d in dsts]
        for key, n in zip(keys, sizes):
            known = self._sizes.get(key)
            if known is not None and known != n:
                raise buffer_size_error(n, known, self.name)
        self._health.check()
        direct = [self._direct(d) for d in dsts]
        out = [False] * len(keys)
        needs = [HEADER_BYTES + (0 if d else n) for n, d in zip(sizes, direct)]
        with self._batch_lock:
            for idx in self._rounds(sizes, needs):
                self._read_round(keys, dsts, sizes, direct, idx, out)
        return out

    def _read_round(self, keys, dsts, sizes, direct, idx: list[int], out: list[bool]) -> None:
        """Headers land in the staging buffer; payloads land in the caller's buffer where
        they move directly (a failed check leaves it unspecified, as a miss may), else in
        the staging buffer, and are copied out only once verified."""
        base = self._staging.ctypes.data
        heads, payloads, ptrs, at = [], [], [], 0
        for i in idx:
            heads.append(at)
            at += HEADER_BYTES
            if direct[i]:
                view = host_view(dsts[i], writable=True)
            else:
                view = self._staging[at:at + sizes[i]]
                at += sizes[i]
            payloads.append(view)
            ptrs.append([base + heads[-1], view.ctypes.data])
        names = [_object_name(self.prefix, keys[i]) for i in idx]
        got = self._store.batch_get_into_multi_buffers(names, ptrs, [[HEADER_BYTES, sizes[i]] for i in idx])
        for i, name, h, payload, rc in zip(idx, names, heads, payloads, got):
            if rc == _NOT_FOUND:
                self._forget(keys[i])          # evicted or removed by another node
                continue
            if rc == _BUFFER_OVERFLOW:
                continue                        # stored with another size: not this block
            if rc < 0:
                self._fault(rc, f"get {name}")
                continue
            try:
                if rc != HEADER_BYTES + sizes[i]:
                    raise CorruptBlockError(f"object has {rc} bytes, expected {HEADER_BYTES + sizes[i]}")
                head = parse_block_header(self._staging[h:h + HEADER_BYTES], digest=keys[i].digest)
                if head.version != VERSION or head.length != sizes[i]:
                    raise CorruptBlockError(f"header says version {head.version}, {head.length} bytes")
                verify_payload(payload, sizes[i], head.checksum, head.flags)
            except CorruptBlockError as exc:
                if rc == HEADER_BYTES + sizes[i]:
                    self._corrupt(keys[i], name, exc)
                continue                        # a shorter object is another block's size: a miss
            if not direct[i]:
                copy_bytes(dsts[i], payload)
            out[i] = True
            with self._lock:
                self._counters["gets"] += 1
                self._counters["bytes_read"] += sizes[i]
                if keys[i] not in self._sizes and self._used + sizes[i] <= self._capacity:
                    self._sizes[keys[i]] = sizes[i]   # another node wrote it: budget it here too
                    self._used += sizes[i]
        if any(_master_down(rc) for rc in got):
            raise TierUnavailableError("master unreachable during a read", tier=self.name)

    def _forget(self, key: BlockKey) -> None:
        with self._lock:
            n = self._sizes.pop(key, None)
            if n is not None:
                self._used -= n

    def _corrupt(self, key: BlockKey, name: str, exc: CorruptBlockError) -> None:
        """A bad object is forgotten, removed from the pool and counted; never returned."""
        log.warning("tier %s: dropping corrupt object %s: %s", self.name, name, exc)
        self._forget(key)
        with self._lock:
            self._counters["corrupt_blocks"] += 1
        self._store.batch_remove([name], True)

    # -- writes -----------------------------------------------------------------------------

    def write(self, keys: Sequence[BlockKey], srcs: Sequence[Any],
              checksums: Sequence[int | None] | None = None) -> list[bool]:
        """See :meth:`Tier.write`; ``checksums`` (the writer's XXH3-64 per source, as a
        spill from DRAM hands them) go into the object headers as they are: no second hash
        of the payload, and a source changed since its writer hashed it is a corrupt
        object on its first read."""
        check_batch(keys, srcs)
        sums = given_checksums(keys, checksums)
        self._health.check()
        out = [False] * len(keys)
        todo: list[int] = []
        first: dict[BlockKey, int] = {}
        with self._lock:
            reserved = 0
            for j, key in enumerate(keys):
                if key in first:
                    continue
                first[key] = j
                if key in self._sizes:
                    out[j] = True
                    continue
                n = nbytes_of(srcs[j])
                if self._used + reserved + n <= self._capacity:
                    todo.append(j)
                    reserved += n
        sizes = {j: nbytes_of(srcs[j]) for j in todo}
        how = self._how(srcs, sums, sizes, todo)
        with self._batch_lock:
            try:
                needs = [HEADER_BYTES + sizes[j] if how[j] is _STAGE else HEADER_BYTES if how[j] is _TWO else 0
                         for j in todo]
                for rnd in self._rounds([sizes[j] for j in todo], needs):
                    self._write_round(keys, srcs, sums, [todo[r] for r in rnd], sizes, how, out)
            except TierUnavailableError:
                # The Store counts the whole batch as failed: forget what earlier rounds
                # put, so the budget stays in step with its index (find() sees them again).
                for j in todo:
                    if out[j]:
                        self._forget(keys[j])
                raise
        for j, key in enumerate(keys):
            out[j] = out[first[key]]
        return out

    def _how(self, srcs: Sequence[Any], sums: list[int | None], sizes: dict[int, int],
             todo: list[int]) -> dict[int, Any]:
        """How each source goes (Mooncake pays per piece of an object, more than a copy):
        one piece from its header frame (a DRAM slot's, see
        :class:`~kvstore.buffers.framed.FramedView`; each frame once per batch, and only
        with the lender's checksum, so whoever writes a frame writes the same header);
        one piece staged behind its header; or, a host payload too large for the staging
        buffer, two pieces (header staged, payload in place). The frame's value is its
        header view."""
        how: dict[int, Any] = {}
        used: set[int] = set()
        cap = self._staging.nbytes
        for j in todo:
            direct = self._direct(srcs[j])
            frame = frame_of(srcs[j]) if direct and sums[j] is not None else None
            if frame is not None and frame.nbytes >= HEADER_BYTES and frame.ctypes.data not in used:
                used.add(frame.ctypes.data)
                how[j] = frame[frame.nbytes - HEADER_BYTES:]
            elif direct and HEADER_BYTES + sizes[j] > cap:
                how[j] = _TWO
            else:
                how[j] = _STAGE
        return how

    def _write_round(self, keys, srcs, sums: list[int | None], idx: list[int], sizes: dict[int, int],
                     how: dict[int, Any], out: list[bool]) -> None:
        """One batch put, each object as :meth:`_how` says; staged host memory is hashed
        as it is copied (one pass)."""
        base, staging = self._staging.ctypes.data, self._staging
        ptrs, lens = [None] * len(idx), [None] * len(idx)
        host: list[tuple[int, int]] = []   # (position in idx, payload offset in staging)
        at = 0
        for r, j in enumerate(idx):
            n, way = sizes[j], how[j]
            if way is _TWO:
                payload = host_view(srcs[j])
                encode_header(keys[j].digest, payload, staging[at:at + HEADER_BYTES], payload_checksum=sums[j])
                ptrs[r], lens[r] = [base + at, payload.ctypes.data], [HEADER_BYTES, n]
                at += HEADER_BYTES
                continue
            if way is not _STAGE:     # the header view in the source's frame
                encode_header(keys[j].digest, srcs[j], way, payload_checksum=sums[j])
                ptrs[r], lens[r] = [way.ctypes.data], [HEADER_BYTES + n]
                continue
            off = at + HEADER_BYTES
            if is_device(srcs[j]):
                copy_bytes(staging[off:off + n], srcs[j])
                encode_header(keys[j].digest, staging[off:off + n], staging[at:off], payload_checksum=sums[j])
            else:
                host.append((r, off))
            ptrs[r], lens[r] = [base + at], [HEADER_BYTES + n]
            at = off + n
        if host:
            got = copy_batch_hashed([srcs[idx[r]] for r, _ in host], [sizes[idx[r]] for r, _ in host], staging,
                                    base, [off for _, off in host], True, self._copy_pool, _COPY_THREADS)
            for (r, off), csum in zip(host, got):
                j = idx[r]
                given = sums[j]
                encode_header(keys[j].digest, staging[off:off + sizes[j]], staging[off - HEADER_BYTES:off],
                              payload_checksum=csum if given is None else given)
        names = [_object_name(self.prefix, keys[j]) for j in idx]
        results = self._store.batch_put_from_multi_buffers(names, ptrs, lens)
        for j, name, rc in zip(idx, names, results):
            if rc == 0:
                with self._lock:
                    self._counters["puts"] += 1
                    self._counters["bytes_written"] += sizes[j]
                    if keys[j] not in self._sizes:
                        self._sizes[keys[j]] = sizes[j]
                        self._used += sizes[j]
                out[j] = True
            elif rc not in _NO_SPACE:
                self._fault(rc, f"put {name}")
        if any(_master_down(rc) for rc in results):
            raise TierUnavailableError("master unreachable during a write", tier=self.name)

    # -- removal, listing -------------------------------------------------------------------

    def delete(self, keys: Sequence[BlockKey]) -> int:
        """Forget the keys and remove their objects from the pool (forced: Mooncake's read
        lease would otherwise keep a just-read object for seconds)."""
        removed = []
        with self._lock:
            for key in dict.fromkeys(keys):
                n = self._sizes.pop(key, None)
                if n is not None:
                    self._used -= n
                    removed.append(key)
        self._health.check()
        if removed:
            results = self._store.batch_remove([_object_name(self.prefix, k) for k in removed], True)
            with self._lock:
                self._counters["deletes"] += sum(rc == 0 for rc in results)
            if any(_master_down(rc) for rc in results):
                self._fault(min(results), "remove")
                raise TierUnavailableError("master unreachable during a delete", tier=self.name)
        return len(removed)

    def keys(self) -> Iterator[BlockKey]:
        with self._lock:
            return iter(list(self._sizes))

    def stats(self) -> dict[str, Any]:
        with self._lock:
            counters = dict(self._counters)
            blocks = len(self._sizes)
        return {**self._health.stats(), **counters, "blocks": blocks}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._health.close()
        self._copy_pool.shutdown()
        try:
            self._store.unregister_buffer(self._staging.ctypes.data)
        finally:
            self._store.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((os.environ.get("MC_TCP_BIND_ADDRESS", "127.0.0.1"), 0))
        return s.getsockname()[1]
