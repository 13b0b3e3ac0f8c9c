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
    if cfg.kind == "nvme":
        from tiers.nvme import NvmeTier

        return NvmeTier(cfg.paths, cfg.capacity, name=cfg.name, direct_io=cfg.direct_io,
                        file_bytes=cfg.file_bytes, io_threads=cfg.io_threads,
                        index_sync=cfg.index_sync, access_flush_s=cfg.access_flush_s,
                        readahead_bytes=cfg.readahead_bytes, device_verify=cfg.device_verify)
    if cfg.kind == "gpu":
        from tiers.gpu import GpuTier

        return GpuTier(cfg.capacity, name=cfg.name, device=cfg.device)
    if cfg.kind == "remote":
        from tiers.remote import RemoteTier

        return RemoteTier(cfg.address, cfg.capacity, name=cfg.name, token=cfg.token, timeout_s=cfg.timeout_s,
                          tls=cfg.tls)
    if cfg.kind == "s3":
        try:
            from tiers.s3 import S3Tier
        except ImportError as exc:
            raise ConfigError(f"tiers.{cfg.name}.kind: the s3 tier needs boto3 "
                              f"(pip install 'kvstore[s3]'): {exc}") from exc

        return S3Tier(cfg.capacity, name=cfg.name, bucket=cfg.bucket, endpoint_url=cfg.endpoint_url,
                      prefix=cfg.prefix, region=cfg.region, addressing_style=cfg.addressing_style,
                      profile=cfg.profile, concurrency=cfg.concurrency,
                      connect_timeout_s=cfg.connect_timeout_s, read_timeout_s=cfg.read_timeout_s,
                      max_attempts=cfg.max_attempts, multipart_threshold=cfg.multipart_threshold,
                      part_size=cfg.part_size, create_bucket=cfg.create_bucket, sign_payload=cfg.sign_payload)
    if cfg.kind == "mooncake":
        from tiers.mooncake import MooncakeTier

        return MooncakeTier(cfg.capacity, name=cfg.name, master=cfg.master, metadata_server=cfg.metadata_server,
                            protocol=cfg.protocol, device=cfg.device, local_hostname=cfg.local_hostname,
                            global_segment_size=cfg.global_segment_size, local_buffer_size=cfg.local_buffer_size,
                            staging_bytes=cfg.staging_bytes, prefix=cfg.prefix)
    if cfg.kind == "redis":
        try:
            from tiers.redis import RedisTier
        except ImportError as exc:
            raise ConfigError(f"tiers.{cfg.name}.kind: the redis tier needs redis-py "
                              f"(pip install 'kvstore[redis]'): {exc}") from exc
        tls = cfg.tls if not isinstance(cfg.tls, bool) else None
        return RedisTier(cfg.capacity, name=cfg.name, url=cfg.url, nodes=cfg.nodes or (), cluster=cfg.cluster,
                         username=cfg.username, password=cfg.resolved_password(), tls=bool(cfg.tls),
                         tls_ca=tls and tls.ca, tls_cert=tls and tls.cert, tls_key=tls and tls.key,
                         prefix=cfg.prefix, concurrency=cfg.concurrency, timeout_s=cfg.timeout_s,
                         max_attempts=cfg.max_attempts, ttl_s=cfg.ttl_s)
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
