"""The cache server's client: :class:`Client` (``client``) with one module per data-plane
transport — ``tcp`` (frames on the control connection), ``shm`` (the server's arena,
same host), ``nixl`` (one-sided NIXL transfers) — over ``wire`` (one connection: socket,
HELLO, frames; the staging region) and ``selection`` (which transport a client takes).
Imports only the leaf layer and the shared :mod:`kvstore.net` modules, never the Store
or the server.
"""

from kvstore.net.client.client import Client

__all__ = ["Client"]
