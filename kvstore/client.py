"""``from kvstore.client import Client``: the cache server's client, defined in
:mod:`kvstore.net.client`."""

from kvstore.net.client import Client

__all__ = ["Client"]
