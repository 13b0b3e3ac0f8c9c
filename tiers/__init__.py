"""Storage tiers: one module per medium, all implementing :class:`tiers.base.Tier`."""
