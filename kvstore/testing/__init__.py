"""Test suites shipped in the package, so third-party tiers can run them too.

- :mod:`kvstore.testing.tier_conformance`: :class:`TierConformance`, the behaviour every
  tier must have, with its keys (:func:`make_keys`) and blocks (:func:`payload`);
- :mod:`kvstore.testing.env`: :func:`free_port` and :data:`IN_CI`.

Needs the test extra (pytest).
"""

from kvstore.testing.env import IN_CI, free_port
from kvstore.testing.tier_conformance import BLOCK, CAPACITY, TierConformance, make_keys, payload

__all__ = ["BLOCK", "CAPACITY", "IN_CI", "TierConformance", "free_port", "make_keys", "payload"]
