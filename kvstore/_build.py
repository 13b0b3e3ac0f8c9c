"""Builds tiers and policies from validated config. Tier modules are imported only when
configured, so optional dependencies (boto3, kvikio, cupy) load only where used."""

from __future__ import annotations

from kvstore.config import AdmissionConfig, TierConfig
from kvstore.errors import ConfigError
from policies import make_eviction
from policies.admission import AllOf, AlwaysAdmit, ByteBudgetAdmission, MinHitsAdmission
from policies.base import AdmissionPolicy, EvictionPolicy
from tiers.base import Tier


def build_tier(cfg: TierConfig) -> Tier:
    if cfg.kind == "dram":
        from tiers.dram import DramTier

        return DramTier(cfg.capacity, name=cfg.name, shm_path=cfg.shm_path, pin=cfg.pin)
    if cfg.kind == "gpu":
        from tiers.gpu import GpuTier

        return GpuTier(cfg.capacity, name=cfg.name, device=cfg.device)
    if cfg.kind == "remote":
        from tiers.remote import RemoteTier

        return RemoteTier(cfg.address, cfg.capacity, name=cfg.name, token=cfg.token, timeout_s=cfg.timeout_s)
    raise ConfigError(f"tiers.{cfg.name}.kind: tier kind {cfg.kind!r} is not available in this build")


def build_eviction(cfg: TierConfig) -> EvictionPolicy:
    try:
        policy = make_eviction(cfg.eviction)
    except ValueError as exc:
        raise ConfigError(f"tiers.{cfg.name}.eviction: {exc}") from None
    set_capacity = getattr(policy, "set_capacity", None)
    if set_capacity is not None:
        set_capacity(cfg.capacity)
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
