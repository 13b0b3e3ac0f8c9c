"""The leaf layer tiers may use: callers' buffers and the copies between them.

Modules (each imports only :mod:`kvstore.errors` and its siblings here, never the Store,
the server, the client, tiers or policies; an import-linter contract checks it):

- :mod:`kvstore.buffers.views`: flat ``uint8`` views of host and device buffers, their
  sizes, and the one-off :func:`copy_bytes` (its names are re-exported here);
- :mod:`kvstore.buffers.host`: batched copies between callers' buffers and one mapped
  region (the DRAM tier's arena, the client's same-host path), optionally hashed;
- :mod:`kvstore.buffers.device`: batched host↔device and device↔device copies on a
  device's copy streams (:class:`~kvstore.buffers.device.DeviceCopier`);
- :mod:`kvstore.buffers.lanes`: one direction of a device copier (its stream and
  staging ring);
- :mod:`kvstore.buffers.streams`: the Store caller's CUDA stream order, carried to the
  threads that copy;
- :mod:`kvstore.buffers.framed`: payload views with writable room for a header right
  before them (:class:`~kvstore.buffers.framed.FramedView`);
- :mod:`kvstore.buffers.pinning`: registering a host range with CUDA
  (:class:`~kvstore.buffers.pinning.HostPin`).

Importing this package loads only the views; the copy modules load when first used.
"""

from kvstore.buffers.views import copy_bytes, device_view, host_view, is_device, is_torch, nbytes_of

__all__ = ["copy_bytes", "device_view", "host_view", "is_device", "is_torch", "nbytes_of"]
