"""The one place configuration is read: a YAML file (or dict) plus ``KVSTORE_…``
environment overrides, validated into frozen, typed objects.

Overrides name a path with double underscores: ``KVSTORE_TIERS__0__CAPACITY=2GiB``,
``KVSTORE_TIERS__hot__EVICTION=arc`` (a tier by name), ``KVSTORE_SERVER__PORT=9000``.
Values are parsed as YAML scalars. ``KVSTORE_CONFIG`` names the config file itself.
A variable is an override only when the part after ``KVSTORE_`` up to the first ``__``
is a top-level field (``tiers``, ``placement``, ``server``, ``trace``, ``events``) and a
``__`` follows, or it is exactly a top-level scalar (``KVSTORE_IO_THREADS``). Any other
``KVSTORE_…`` variable (``KVSTORE_TOKEN``, a ``password_env`` variable, the
``KVSTORE_PORT=tcp://…`` and ``KVSTORE_SERVICE_HOST`` Kubernetes injects for a Service
named ``kvstore``) is ignored, with one warning naming them. Errors name the field and
the bad value; ``dump_config`` (``kvstore config show``) masks every secret.

The models live in submodules (``base``: sizes; ``tls``; ``admin``: the admin port's bounds; ``tiers``: one model per tier
kind; ``server``; ``store``: the whole config, loading and dump; ``checks``: the
pre-start checks ``kvstore serve`` and ``kvstore config validate`` share); every public
name is re-exported here.
"""

from __future__ import annotations

from kvstore.config.admin import AdminConfig
from kvstore.config.base import Size, _Frozen, _no_empty_token, parse_size
from kvstore.config.checks import AIOHTTP_MISSING, is_loopback, preflight
from kvstore.config.server import MIN_SALT_CHARS, ServerConfig, TenantConfig
from kvstore.config.store import (DEFAULT_CONFIG, MASK, EventsConfig, PlacementConfig, StoreConfig, TraceConfig,
                                  describe_errors, dump_config, is_override, load_config, secrets_of)
from kvstore.config.tiers import (AdmissionConfig, DramTierConfig, EvictionName, GpuTierConfig, MooncakeTierConfig,
                                  NvmeTierConfig, RedisTierConfig, RedisTlsConfig, RemoteTierConfig, S3TierConfig,
                                  TierConfig)
from kvstore.config.tls import ClientTlsConfig, ServerTlsConfig, TlsVersion

__all__ = ["AIOHTTP_MISSING", "AdminConfig", "AdmissionConfig", "ClientTlsConfig", "DEFAULT_CONFIG", "DramTierConfig",
           "EventsConfig", "GpuTierConfig", "MASK", "NvmeTierConfig", "PlacementConfig", "RedisTierConfig",
           "RedisTlsConfig", "RemoteTierConfig", "S3TierConfig", "ServerConfig", "ServerTlsConfig", "StoreConfig",
           "TenantConfig", "TierConfig", "TraceConfig", "describe_errors", "dump_config", "is_loopback",
           "is_override", "load_config", "parse_size", "preflight", "secrets_of"]
