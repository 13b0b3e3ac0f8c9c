"""One frozen model per tier kind (``tiers:``), each the one definition of its settings
and defaults."""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal, Union

from pydantic import BeforeValidator, Field, SecretStr, field_validator, model_validator

from kvstore.config.base import SECRET, Size, _Frozen, _no_empty_token, field_defaults
from kvstore.config.tls import ClientTlsConfig, _tls_flag
from kvstore.errors import ConfigError
from kvstore.policies import EVICTION_NAMES

EvictionName = Literal[EVICTION_NAMES]   # the one registry of names: policies.EVICTION_NAMES


class AdmissionConfig(_Frozen):
    """``min_hits``: admit a block on its N-th offer; ``bytes_per_s``: write budget."""

    min_hits: int = Field(1, ge=1)
    bytes_per_s: Size | None = None


class _TierBase(_Frozen):
    name: str = Field(min_length=1)
    capacity: Size = Field(gt=0)
    eviction: EvictionName = "lru"
    admission: AdmissionConfig = AdmissionConfig()

    @classmethod
    def defaults(cls) -> Any:
        """This kind's defaults by name (a tier's keyword arguments default to them)."""
        return field_defaults(cls)

    def settings(self) -> dict[str, Any]:
        """This kind's own settings (not name, capacity, eviction, admission, kind) as the
        tier constructor's keyword arguments: ``Tier.from_config`` passes them on."""
        return {f: getattr(self, f) for f in type(self).model_fields if f != "kind" and f not in _TierBase.model_fields}


class DramTierConfig(_TierBase):
    kind: Literal["dram"]
    shm_path: str | None = None     # back the arena with a shared-memory file
    pin: bool | None = None         # register with CUDA; default: when CUDA is present


class GpuTierConfig(_TierBase):
    kind: Literal["gpu"]
    device: str = "cuda:0"


def nvme_dir_budget(capacity: int) -> int:
    """The disk bytes one NVMe directory's data files may take: its share of the tier's
    capacity plus room for block headers and free space between blocks. A data file is
    at most this big, whatever ``file_bytes`` says."""
    return capacity + capacity // 8 + (1 << 20)


class NvmeTierConfig(_TierBase):
    kind: Literal["nvme"]
    path: str | list[str]           # one directory per drive; several stripe
    direct_io: bool = True
    file_bytes: Size = Field(1 << 30, gt=0)   # size of each preallocated data file
    io_threads: int = Field(8, ge=1)
    index_sync: bool = True         # fsync each index commit (survives power loss)
    access_flush_s: float = Field(5.0, ge=0)  # how often last-access times reach the index
    readahead_bytes: Size = Field(32 << 20, ge=0)  # a sequential stream's read-ahead window; 0: off
    device_verify: bool = False     # segmented checksum: kvikio reads into CUDA memory verify on the device

    @field_validator("path")
    @classmethod
    def _some_path(cls, path: str | list[str]) -> str | list[str]:
        paths = [path] if isinstance(path, str) else path
        if not paths or any(not p for p in paths):
            raise ValueError("give one directory or a non-empty list of directories")
        if any(os.path.realpath(p) == os.path.sep for p in paths):
            raise ValueError("the root directory cannot hold a tier; give it a directory of its own")
        return path

    @model_validator(mode="after")
    def _files_fit(self) -> "NvmeTierConfig":
        # the default (1GiB) is capped by the tier; a size given larger than any file can be is a mistake
        largest = nvme_dir_budget(self.capacity // len(self.paths) + self.capacity % len(self.paths))
        if self.file_bytes > largest and self.file_bytes != type(self).model_fields["file_bytes"].default:
            raise ValueError(f"file_bytes ({self.file_bytes}) is larger than any data file of this tier can be "
                             f"({largest}: a directory's share of capacity, plus 1/8, plus 1MiB); give at most "
                             "that")
        return self

    @property
    def paths(self) -> list[str]:
        return [self.path] if isinstance(self.path, str) else list(self.path)

    def settings(self) -> dict[str, Any]:
        settings = super().settings()
        del settings["path"]
        return {"paths": self.paths, **settings}


class S3TierConfig(_TierBase):
    kind: Literal["s3"]
    bucket: str = Field(min_length=1)
    endpoint_url: str | None = None
    prefix: str = "kvstore"
    region: str | None = None
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    profile: str | None = None
    concurrency: int = Field(8, ge=1)
    connect_timeout_s: float = Field(2.0, gt=0)
    read_timeout_s: float = Field(10.0, gt=0)
    max_attempts: int = Field(3, ge=1)
    multipart_threshold: Size = Field(16 << 20, gt=0)
    part_size: Size = Field(8 << 20, ge=5 << 20)
    create_bucket: bool = False     # create the bucket at start-up when it does not exist
    sign_payload: bool = False      # SHA-256-sign request bodies (the block header already checks them)


class RemoteTierConfig(_TierBase):
    kind: Literal["remote"]
    address: str = Field(min_length=1)   # host:port or unix socket path
    token: str | None = Field(None, json_schema_extra=SECRET)

    _token_given = model_validator(mode="before")(_no_empty_token)
    timeout_s: float = Field(10.0, gt=0)
    tls: Annotated[ClientTlsConfig | None, BeforeValidator(_tls_flag)] = None   # TCP addresses only


class MooncakeTierConfig(_TierBase):
    kind: Literal["mooncake"]
    master: str = Field(min_length=1)            # the master's RPC address, host:port
    metadata_server: str = Field(min_length=1)   # e.g. http://host:port/metadata (or etcd://…)
    protocol: Literal["tcp", "rdma"] = "tcp"
    device: str = ""                             # RDMA device names, comma-separated ("" with tcp)
    local_hostname: str | None = None            # this node's host:port in the pool; default a free loopback port
    global_segment_size: Size = Field(0, ge=0)   # memory this node lends to the pool (0: a client only)
    local_buffer_size: Size = Field(64 << 20, ge=0)
    staging_bytes: Size = Field(64 << 20, ge=4096)  # the registered buffer blocks move through
    prefix: str = "kvstore"


class RedisTlsConfig(_Frozen):
    """TLS to Redis/Valkey: ``ca`` verifies the server (none: not verified); ``cert`` and
    ``key`` authenticate this client where the server asks for it."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    @model_validator(mode="after")
    def _pair(self) -> "RedisTlsConfig":
        if (self.cert is None) != (self.key is None):
            raise ValueError("give both cert and key, or neither")
        return self


class RedisTierConfig(_TierBase):
    """Redis or Valkey, standalone or Cluster (see ``docs/redis.md``)."""

    kind: Literal["redis"]
    url: str | None = None                      # redis://host:port[/db], rediss:// for TLS
    nodes: list[str] | None = None              # host:port of Cluster (or standalone) nodes
    cluster: Literal["auto"] | bool = "auto"
    username: str | None = None                 # ACL user (default: the server's default user)
    password: SecretStr | None = Field(None, json_schema_extra=SECRET)
    password_env: str | None = None             # name of an environment variable holding the password
    tls: RedisTlsConfig | bool = False          # true: TLS without client certificate or CA check
    prefix: str = Field("kvstore", min_length=1)
    concurrency: int = Field(8, ge=1)
    timeout_s: float = Field(2.0, gt=0)
    max_attempts: int = Field(3, ge=1)
    ttl_s: float | None = Field(None, gt=0)     # expire blocks in Redis after this long

    @model_validator(mode="after")
    def _one_source(self) -> "RedisTierConfig":
        if (self.url is None) == (not self.nodes):
            raise ValueError("give exactly one of url or nodes")
        if self.password is not None and self.password_env is not None:
            raise ValueError("give password or password_env, not both")
        return self

    def resolved_password(self) -> str | None:
        """The password, from ``password`` or the variable ``password_env`` names."""
        if self.password_env is None:
            return self.password.get_secret_value() if self.password is not None else None
        value = os.environ.get(self.password_env)
        if not value:
            raise ConfigError(f"tiers.{self.name}.password_env: environment variable {self.password_env} "
                              "is not set (or empty)")
        return value


TierConfig = Annotated[
    Union[DramTierConfig, GpuTierConfig, NvmeTierConfig, S3TierConfig, RemoteTierConfig, MooncakeTierConfig,
          RedisTierConfig],
    Field(discriminator="kind"),
]


__all__ = ["AdmissionConfig", "DramTierConfig", "EvictionName", "GpuTierConfig", "MooncakeTierConfig",
           "NvmeTierConfig", "RedisTierConfig", "RedisTlsConfig", "RemoteTierConfig", "S3TierConfig", "TierConfig"]
