"""The one place configuration is read: a YAML file (or dict) plus ``KVSTORE_…``
environment overrides, validated into frozen, typed objects.

Overrides name a path with double underscores: ``KVSTORE_TIERS__0__CAPACITY=2GiB``,
``KVSTORE_TIERS__hot__EVICTION=arc`` (a tier by name), ``KVSTORE_SERVER__PORT=9000``.
Values are parsed as YAML scalars. ``KVSTORE_CONFIG`` names the config file itself.
Errors name the field and the bad value.

The models live in submodules (``base``: sizes; ``tls``; ``tiers``: one model per tier
kind; ``server``; ``store``: the whole config, loading and dump); every public name is
re-exported here.
"""

from __future__ import annotations

from kvstore.config.base import Size, _Frozen, _no_empty_token, parse_size
from kvstore.config.server import MIN_SALT_CHARS, ServerConfig, TenantConfig
from kvstore.config.store import (DEFAULT_CONFIG, EventsConfig, PlacementConfig, StoreConfig, TraceConfig,
                                  describe_errors, dump_config, load_config)
from kvstore.config.tiers import (AdmissionConfig, DramTierConfig, EvictionName, GpuTierConfig, MooncakeTierConfig,
                                  NvmeTierConfig, RedisTierConfig, RedisTlsConfig, RemoteTierConfig, S3TierConfig,
                                  TierConfig)
from kvstore.config.tls import ClientTlsConfig, ServerTlsConfig, TlsVersion

__all__ = ["AdmissionConfig", "ClientTlsConfig", "DEFAULT_CONFIG", "DramTierConfig", "EventsConfig", "GpuTierConfig",
           "NvmeTierConfig", "PlacementConfig", "RedisTierConfig", "RedisTlsConfig", "RemoteTierConfig", "S3TierConfig",
           "ServerConfig", "ServerTlsConfig", "StoreConfig", "TenantConfig", "TierConfig", "TraceConfig",
           "describe_errors", "dump_config", "load_config", "parse_size"]
