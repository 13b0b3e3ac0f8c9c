"""Test suites shipped in the package, so third-party tiers and policies can run them too.

- :mod:`kvstore.testing.tier_conformance`: :class:`TierConformance`, the behaviour every
  tier must have, with its keys (:func:`make_keys`) and blocks (:func:`payload`);
- :mod:`kvstore.testing.policy_conformance`: :class:`PolicyConformance`, the behaviour
  every eviction policy must have, and :func:`fill`, :func:`evict`, :func:`drain` that
  drive a policy as a Store does;
- :mod:`kvstore.testing.env`: :func:`free_port` and :data:`IN_CI`;
- :mod:`kvstore.testing.store_model`: the Store against a model of what it holds
  (Hypothesis state machines; imported on its own, not from here).

Needs the ``testing`` extra (pytest; hypothesis for the Store model): without pytest,
importing this package raises ``ModuleNotFoundError`` naming the extra.
"""

try:
    import pytest  # noqa: F401  (the conformance suites are pytest classes)
except ModuleNotFoundError as exc:
    from kvstore._extras import install_hint

    raise ModuleNotFoundError(f"kvstore.testing needs pytest ({install_hint('testing')})", name=exc.name) from exc

from kvstore.testing.env import IN_CI, free_port
from kvstore.testing.policy_conformance import NBYTES, PolicyConformance, drain, evict, fill
from kvstore.testing.tier_conformance import BLOCK, CAPACITY, TierConformance, make_keys, payload

__all__ = ["BLOCK", "CAPACITY", "IN_CI", "NBYTES", "PolicyConformance", "TierConformance", "drain", "evict", "fill",
           "free_port", "make_keys", "payload"]
