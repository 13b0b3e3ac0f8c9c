"""``kvstore.transport``: transport selection (``select_transport``, ``TRANSPORTS``,
``FallbackCounter``, ``describe_selection``, defined in :mod:`kvstore.net.client.selection`)
and ``nixl_available`` (:mod:`kvstore.net.nixl`). Importing it never loads NIXL."""

from kvstore.net.client.selection import TRANSPORTS, FallbackCounter, describe_selection, select_transport
from kvstore.net.nixl import nixl_available

__all__ = ["FallbackCounter", "TRANSPORTS", "describe_selection", "nixl_available", "select_transport"]
