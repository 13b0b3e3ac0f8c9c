"""The Store: a content-addressed, tiered store for KV-cache blocks (see DESIGN.md, Layout).

One package, one object: :class:`Store` (``facade``: the public API and lifecycle) over
the objects it composes: its index (``index``: where, sizes, leases, pins and the lock
that guards them), the movement of blocks between tiers (``mover``: admit, evict, spill,
promote, tier failures), the data path (``datapath``: save, load, prefetch,
write-through, flush, delete), recovery and shared-tier discovery (``recovery``),
reservations (``reservation``), hints (``hints``), per-tenant accounting (``tenants``) and
the construction of tiers and policies from a config (``build``).
"""

from kvstore.store.facade import Store
from kvstore.store.reservation import Reservation

__all__ = ["Reservation", "Store"]
