"""Builds tiers and policies from validated config. Tier modules are imported only when
configured, so optional dependencies (boto3, kvikio, cupy) load only where used."""

from __future__ import annotations

import importlib
import logging
import time
from typing import Sequence

from kvstore._extras import install_hint
from kvstore.config import AdmissionConfig, TierConfig
from kvstore.config.base import format_size
from kvstore.errors import ConfigError
from kvstore.policies import make_eviction
from kvstore.policies.admission import AllOf, AlwaysAdmit, ByteBudgetAdmission, MinHitsAdmission
from kvstore.policies.base import AdmissionPolicy, EvictionPolicy
from kvstore.tiers.base import Tier

log = logging.getLogger("kvstore.store")

# kind -> (module, class, the extra that installs its optional dependency: named when it is missing)
_TIER_CLASSES = {
    "dram": ("kvstore.tiers.dram", "DramTier", None), "gpu": ("kvstore.tiers.gpu", "GpuTier", None),
    "nvme": ("kvstore.tiers.nvme", "NvmeTier", None), "remote": ("kvstore.tiers.remote", "RemoteTier", None),
    "s3": ("kvstore.tiers.s3", "S3Tier", f"the s3 tier needs boto3 ({install_hint('s3')})"),
    "mooncake": ("kvstore.tiers.mooncake", "MooncakeTier", None),
    "redis": ("kvstore.tiers.redis", "RedisTier", f"the redis tier needs redis-py ({install_hint('redis')})"),
}


def build_tiers(cfgs: Sequence[TierConfig]) -> list[Tier]:
    """The tiers of a ``tiers:`` list, top first (see :func:`build_tier`); closes the ones
    built when a later one fails."""
    built: list[Tier] = []
    try:
        for i, cfg in enumerate(cfgs):
            built.append(build_tier(cfg, header_frames=header_frames(cfgs, i)))
    except BaseException:
        for tier in built:
            tier.close()
        raise
    return built


def header_frames(cfgs: Sequence[TierConfig], i: int) -> bool:
    """Whether tier ``i`` keeps header frames (:class:`~kvstore.tiers.dram.DramTier`):
    a DRAM tier with a Mooncake tier next below, which its spills then put as one
    piece per block."""
    return cfgs[i].kind == "dram" and i + 1 < len(cfgs) and cfgs[i + 1].kind == "mooncake"


def build_tier(cfg: TierConfig, *, header_frames: bool = False) -> Tier:
    """The tier ``cfg`` describes: its class's ``from_config`` (settings are the model's
    fields); ``header_frames`` (DRAM only: see :func:`header_frames`)."""
    if cfg.kind not in _TIER_CLASSES:
        raise ConfigError(f"tiers.{cfg.name}.kind: tier kind {cfg.kind!r} is not available in this build")
    module, cls, needs = _TIER_CLASSES[cfg.kind]
    try:
        tier_class = getattr(importlib.import_module(module), cls)
    except ImportError as exc:
        if needs is None:
            raise
        raise ConfigError(f"tiers.{cfg.name}.kind: {needs}: {exc}") from exc
    started = time.monotonic()
    try:
        tier = tier_class.from_config(cfg, **({"header_frames": True} if header_frames else {}))
    except Exception as exc:
        if not isinstance(exc, ConfigError):     # a ConfigError names its field already
            exc.add_note(f"tiers.{cfg.name} ({cfg.kind})")   # which tier: `kvstore serve` prints it
        raise
    log.info("tier %s (%s, %s) opened in %.2f s", cfg.name, cfg.kind, format_size(cfg.capacity),
             time.monotonic() - started)
    return tier


def build_eviction(cfg: TierConfig) -> EvictionPolicy:
    try:
        policy = make_eviction(cfg.eviction)
    except ValueError as exc:
        raise ConfigError(f"tiers.{cfg.name}.eviction: {exc}") from None
    policy.set_capacity(cfg.capacity)
    return policy


def build_admission(cfg: AdmissionConfig) -> AdmissionPolicy:
    parts: list[AdmissionPolicy] = []
    if cfg.min_hits > 1:
        parts.append(MinHitsAdmission(cfg.min_hits))
    if cfg.bytes_per_s:
        parts.append(ByteBudgetAdmission(cfg.bytes_per_s, 1.0))
    if not parts:
        return AlwaysAdmit()
    return parts[0] if len(parts) == 1 else AllOf(*parts)
