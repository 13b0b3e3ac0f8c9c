"""The NIXL data plane: one-sided transfers between registered buffers.

A :class:`NixlEndpoint` owns one NIXL agent with the UCX backend (RDMA where the fabric
has it; cross-memory attach or TCP otherwise). NIXL's own metadata listener stays off:
agents trade :meth:`NixlEndpoint.metadata` blobs over kvstore's control connection,
both ways (UCX needs each side to know the other before a transfer can complete).

The server initiates every transfer, so its CPU never copies block bytes:

* get — :func:`send_blocks` holds reader leases on the DRAM tier's slots
  (:meth:`DramTier.view`) and WRITEs them into the client's buffers;
* put — :func:`receive_blocks` reserves slots (:meth:`DramTier.reserve`), READs the
  client's buffers into them and publishes them only once the transfer is complete.

Descriptors travel as :class:`Descs` (address, length, device id rows of one memory
kind; defined in :mod:`kvstore.net.nixl.descs` with :func:`descs_of` and :func:`staging_buffer`,
re-exported here); :meth:`Descs.to_bytes` is their wire form. All NIXL/UCX failures surface as
:class:`~kvstore.errors.TransportError`; a transfer that cannot be cancelled after a
timeout keeps its leases or reservation for good (``in_flight``), because UCX may still
touch that memory.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from contextlib import ExitStack
from typing import Any, Sequence

import numpy as np

from kvstore.errors import BufferSizeError, InvalidArgumentError, TransportError
from kvstore.keys import BlockKey
from kvstore.net.nixl.descs import Descs, descs_of, staging_buffer
from kvstore.net.nixl.env import prepare_ucx_env

log = logging.getLogger("kvstore.transport.nixl")   # its name before the net/ layout

DEFAULT_TIMEOUT_S = 30.0
# With copy threads, a transfer of at least this many descriptors is cut into one chunk
# per thread (see NixlEndpoint); smaller ones run on the calling thread.
SPLIT_DESCS = 8


def _nixl_call(what: str, fn, *args, **kwargs):
    """Call into NIXL, mapping its exceptions (plain ``Exception`` subclasses from the
    C++ bindings) to :class:`TransportError`."""
    try:
        return fn(*args, **kwargs)
    except (InvalidArgumentError, TransportError):
        raise
    except Exception as exc:
        raise TransportError(f"NIXL {what} failed: {type(exc).__name__}: {exc}") from exc


class NixlEndpoint:
    """One NIXL agent with a UCX backend. Thread-safe: NIXL runs in read-write
    thread-sync mode and registrations are guarded here. Registered buffers are kept referenced (so
    never freed) until deregistered or the endpoint closes.

    ``threads``: NIXL's UCX thread pool (``num_threads``): a transfer this endpoint starts
    with at least :data:`SPLIT_DESCS` descriptors is cut into one chunk per thread, each
    posted on its own UCX worker. Between processes of one host UCX moves bytes with
    cross-memory attach, a kernel copy made by the thread that posts the operation, so
    the threads are what lets one large transfer use more than one core. The pool's
    threads sleep while no transfer is in flight. 0: every transfer runs on the caller."""

    def __init__(self, role: str = "peer", *, workers: int = 1, threads: int = 0,
                 timeout_s: float = DEFAULT_TIMEOUT_S, progress_thread: bool = True) -> None:
        prepare_ucx_env()
        try:
            from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
        except Exception as exc:
            raise TransportError(f"NIXL is not available: {type(exc).__name__}: {exc}") from exc
        self.timeout_s = timeout_s
        self.name = f"kvstore-{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # RW sync: transfers from several threads run concurrently, registrations and
        # metadata changes exclude them; each of ``workers`` UCX workers serves a share
        # of the threads, so concurrent clients' transfers do not queue on one worker.
        conf = nixl_agent_config(enable_prog_thread=progress_thread, enable_listen_thread=False, backends=[],
                                 sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)
        self._agent = _nixl_call("agent creation", nixl_agent, self.name, conf)
        # NIXL counts the pool's workers (one per thread) in num_workers
        params = {"num_workers": str(max(1, workers) + max(0, threads))}
        if threads > 0:
            params.update(num_threads=str(threads), split_batch_size=str(SPLIT_DESCS))
        _nixl_call("UCX backend creation", self._agent.create_backend, "UCX", params)
        if "UCX" not in self._agent.backends:
            raise TransportError("NIXL's UCX backend did not start (see `kvstore doctor`)")
        self._lock = threading.Lock()
        self._regions: dict[int, tuple[Any, Any, int, int]] = {}  # id -> (buffer, reg descs, addr, end)
        self._next_region = 0
        self._peers: set[str] = set()
        self._stuck: list[Any] = []  # transfers NIXL could not cancel, and their leases: kept alive on purpose
        self._closed = False

    # -- memory registration --------------------------------------------------------------

    def register(self, buf: Any) -> int:
        """Register one contiguous buffer (host or GPU) with NIXL; returns a region id.
        Peers learn about it from the next :meth:`metadata`."""
        d = descs_of([buf])
        addr, n, dev = (int(x) for x in d.rows[0])
        reg = _nixl_call("memory registration", self._agent.register_memory, [(addr, n, dev, "")], d.mem)
        with self._lock:
            self._check_open()
            rid = self._next_region
            self._next_region += 1
            self._regions[rid] = (buf, reg, addr, addr + n)
        return rid

    def deregister(self, region: int) -> None:
        with self._lock:
            entry = self._regions.pop(region, None)
        if entry is not None:
            _nixl_call("memory deregistration", self._agent.deregister_memory, entry[1])

    def covers(self, descs: Descs) -> bool:
        """True when every descriptor lies inside one registered region."""
        with self._lock:
            spans = np.array([(a, e) for _, _, a, e in self._regions.values()], dtype=np.uint64).reshape(-1, 2)
        starts = descs.rows[:, 0:1]
        inside = (spans[:, 0] <= starts) & (starts + descs.rows[:, 1:2] <= spans[:, 1])  # rows x regions
        return bool(inside.any(axis=1).all())

    def ensure_registered(self, bufs: Sequence[Any]) -> bool:
        """Register each buffer not already inside a registered region. Returns True when
        anything was registered, i.e. peers need fresh :meth:`metadata`."""
        added = False
        for buf in bufs:
            if not self.covers(descs_of([buf])):
                self.register(buf)
                added = True
        return added

    # -- peers ----------------------------------------------------------------------------

    def metadata(self) -> bytes:
        """This agent's metadata (connection info and registered memory) for a peer."""
        return _nixl_call("metadata export", self._agent.get_agent_metadata)

    def add_peer(self, metadata: bytes) -> str:
        """Load (or refresh) a peer's metadata; returns the peer's agent name."""
        name = _nixl_call("peer metadata load", self._agent.add_remote_agent, bytes(metadata))
        name = name.decode() if isinstance(name, bytes) else str(name)
        with self._lock:
            self._peers.add(name)
        return name

    def remove_peer(self, name: str) -> None:
        """Forget a peer and drop its connection. Unknown names are ignored."""
        with self._lock:
            if name not in self._peers:
                return
            self._peers.discard(name)
        try:
            self._agent.remove_remote_agent(name)
        except Exception as exc:  # the peer may already be gone; nothing left to undo
            log.debug("removing NIXL peer %s: %s", name, exc)

    def progress(self) -> None:
        """Drive NIXL's backend once (for an endpoint without a progress thread that is
        the target of a peer's transfer: call it while waiting for the peer)."""
        _nixl_call("progress", self._agent.get_new_notifs)

    # -- transfers ------------------------------------------------------------------------

    def write(self, local: Descs, peer: str, remote: Descs, *, timeout_s: float | None = None) -> None:
        """Copy ``local[i]`` into the peer's ``remote[i]``; returns when complete."""
        self._transfer("WRITE", local, peer, remote, timeout_s)

    def read(self, local: Descs, peer: str, remote: Descs, *, timeout_s: float | None = None) -> None:
        """Copy the peer's ``remote[i]`` into ``local[i]``; returns when complete."""
        self._transfer("READ", local, peer, remote, timeout_s)

    def _transfer(self, op: str, local: Descs, peer: str, remote: Descs, timeout_s: float | None) -> None:
        if len(local) != len(remote):
            raise InvalidArgumentError(f"{len(local)} local descriptors but {len(remote)} remote")
        if len(local) == 0:
            return
        if local.sizes != remote.sizes:
            bad = next(i for i, (a, b) in enumerate(zip(local.sizes, remote.sizes)) if a != b)
            raise BufferSizeError(f"descriptor {bad}: local has {local.sizes[bad]} bytes, remote {remote.sizes[bad]}")
        self._check_open()
        agent = self._agent
        ldl = _nixl_call("descriptor list", agent.get_xfer_descs, local.rows, local.mem)
        rdl = _nixl_call("descriptor list", agent.get_xfer_descs, remote.rows, remote.mem)
        handle = _nixl_call(f"{op} setup to {peer}", agent.initialize_xfer, op, ldl, rdl, peer)
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        try:
            state = _nixl_call(f"{op} post to {peer}", agent.transfer, handle)
            spins = 0
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransportError(f"NIXL {op} to {peer} timed out")
                # spin briefly (small transfers finish in microseconds), then back off so a
                # long transfer does not burn a core
                spins += 1
                if spins > 200:
                    time.sleep(min(1e-3, 1e-5 * (spins - 200)))
                state = _nixl_call(f"{op} to {peer}", agent.check_xfer_state, handle)
            if state != "DONE":
                raise TransportError(f"NIXL {op} to {peer} failed (state {state})")
        except BaseException as exc:
            if not self._cancel(handle, peer):
                if isinstance(exc, TransportError):
                    exc.in_flight = True
                    raise
                raise TransportError(f"NIXL {op} to {peer} interrupted and could not be cancelled",
                                     in_flight=True) from exc
            raise
        self._release(handle)

    def _cancel(self, handle: Any, peer: str) -> bool:
        """Stop a failed or timed-out transfer. True when NIXL no longer touches its memory."""
        try:
            handle.release()
            return True
        except Exception:
            pass
        self.remove_peer(peer)  # tearing down the connection ends outstanding operations
        try:
            handle.release()
            return True
        except Exception as exc:
            log.error("NIXL transfer to %s cannot be cancelled (%s); its memory stays reserved", peer, exc)
            self.keep_forever(handle)
            return False

    def _release(self, handle: Any) -> None:
        try:
            handle.release()
        except Exception as exc:  # completed transfers release cleanly; log the odd one
            log.warning("releasing a completed NIXL transfer: %s", exc)

    def keep_forever(self, obj: Any) -> None:
        """Hold ``obj`` (a lease or reservation guarding memory that an uncancellable
        transfer may still touch) for the endpoint's lifetime."""
        with self._lock:
            self._stuck.append(obj)

    @property
    def stuck_transfers(self) -> int:
        with self._lock:
            return len(self._stuck)

    # -- lifetime -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("NIXL endpoint is closed")

    def close(self) -> None:
        """Drop peers and registrations. Buffers registered here may be freed afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers, self._peers = list(self._peers), set()
            regions, self._regions = list(self._regions.values()), {}
        for name in peers:
            try:
                self._agent.remove_remote_agent(name)
            except Exception as exc:
                log.debug("removing NIXL peer %s at close: %s", name, exc)
        for _, reg, _, _ in regions:
            try:
                self._agent.deregister_memory(reg)
            except Exception as exc:
                log.debug("deregistering at close: %s", exc)

    def __enter__(self) -> "NixlEndpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def send_blocks(endpoint: NixlEndpoint, tier: Any, keys: Sequence[BlockKey], peer: str, remote: Descs,
                *, timeout_s: float | None = None) -> list[bool]:
    """Serve a get: WRITE each stored block of ``tier`` (a :class:`DramTier` whose arena
    ``endpoint`` registered) into the peer's ``remote[i]``. Per key: True when sent,
    False on a miss. Reader leases keep every slot from reuse until the transfer ends.
    Raises :class:`BufferSizeError` when a remote buffer's size differs from its block
    (nothing is sent), :class:`TransportError` when the transfer fails."""
    if len(keys) != len(remote):
        raise InvalidArgumentError(f"{len(keys)} keys but {len(remote)} remote buffers")
    with ExitStack() as leases:
        hits, addrs = [], []
        for i, key in enumerate(keys):
            view = leases.enter_context(tier.view(key))
            if view is None:
                hits.append(False)
                continue
            if view.nbytes != remote.sizes[i]:
                raise BufferSizeError(f"block {key.hex()[:16]}… has {view.nbytes} bytes, "
                                      f"remote buffer {i} has {remote.sizes[i]}")
            hits.append(True)
            addrs.append((view.ctypes.data, view.nbytes, 0))
        if addrs:
            idx = [i for i, h in enumerate(hits) if h]
            try:
                endpoint.write(Descs("DRAM", np.array(addrs, dtype=np.uint64)), peer, remote.subset(idx),
                               timeout_s=timeout_s)
            except TransportError as exc:
                if exc.in_flight:
                    endpoint.keep_forever(leases.pop_all())  # UCX may still read these slots
                raise
    return hits


def receive_blocks(endpoint: NixlEndpoint, tier: Any, keys: Sequence[BlockKey], peer: str, remote: Descs,
                   *, timeout_s: float | None = None) -> list[bool]:
    """Serve a put: READ the peer's ``remote[i]`` straight into reserved slots of
    ``tier`` and publish them once complete. Per key: True when stored (now or before),
    False when there was no room. On failure nothing is stored and the slots are freed
    (or, for a transfer that cannot be cancelled, kept out of use for good)."""
    if len(keys) != len(remote):
        raise InvalidArgumentError(f"{len(keys)} keys but {len(remote)} remote buffers")
    reservation = tier.reserve(keys, remote.sizes)
    idx = [i for i, v in enumerate(reservation.views) if v is not None]
    try:
        if idx:
            local = descs_of([reservation.views[i] for i in idx])
            endpoint.read(local, peer, remote.subset(idx), timeout_s=timeout_s)
    except TransportError as exc:
        reservation.abandon() if exc.in_flight else reservation.abort()
        raise
    except BaseException:
        reservation.abort()
        raise
    return reservation.commit()


__all__ = ["DEFAULT_TIMEOUT_S", "SPLIT_DESCS", "Descs", "NixlEndpoint", "descs_of", "receive_blocks", "send_blocks",
           "staging_buffer"]
