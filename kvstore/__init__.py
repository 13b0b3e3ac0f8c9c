"""kvstore: a content-addressed, tiered store for LLM KV-cache blocks."""

from kvstore.errors import KVStoreError
from kvstore.hint import Hint
from kvstore.keys import BlockKey, Namespace

__version__ = "0.1.0"


def __getattr__(name: str):
    # Store and Client are imported on first use: they pull in numpy, pydantic and the
    # tiers, which users of the leaf names (Namespace, BlockKey, Hint) do not need. Neither
    # imports torch (tests/test_torch_free.py).
    if name == "Store":
        from kvstore.store import Store

        return Store
    if name == "Client":
        from kvstore.net.client import Client

        return Client
    raise AttributeError(f"module 'kvstore' has no attribute {name!r}")


__all__ = ["BlockKey", "Client", "Hint", "KVStoreError", "Namespace", "Store", "__version__"]
