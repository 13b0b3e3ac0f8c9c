"""kvstore: a content-addressed, tiered store for LLM KV-cache blocks."""

from kvstore.errors import KVStoreError
from kvstore.hint import Hint
from kvstore.keys import BlockKey, Namespace

__version__ = "0.1.0"


def __getattr__(name: str):
    # Store and Client import tiers lazily: tiers import kvstore's leaf modules, so an
    # eager import here would be circular (import tiers.base -> kvstore.errors runs this
    # file -> kvstore.store -> from tiers.base import Tier, still half-initialized).
    if name == "Store":
        from kvstore.store import Store

        return Store
    if name == "Client":
        from kvstore.net.client import Client

        return Client
    raise AttributeError(f"module 'kvstore' has no attribute {name!r}")


__all__ = ["BlockKey", "Client", "Hint", "KVStoreError", "Namespace", "Store", "__version__"]
