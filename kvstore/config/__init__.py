"""The one place configuration is read: a YAML file (or dict) plus ``KVSTORE_…``
environment overrides, validated into frozen, typed objects.

Overrides name a path with double underscores: ``KVSTORE_TIERS__0__CAPACITY=2GiB``,
``KVSTORE_TIERS__hot__EVICTION=arc`` (a tier by name), ``KVSTORE_SERVER__PORT=9000``.
Values are parsed as YAML scalars. ``KVSTORE_CONFIG`` names the config file itself.
Errors name the field and the bad value.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Union

import yaml
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, SecretStr, ValidationError, field_validator,
                      model_validator)

from kvstore.errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any) -> int:
    """Bytes from ``4096``, ``"64GiB"``, ``"1.5 GB"``, ``"512M"``; binary for K/M/G/T
    and KiB/MiB/GiB/TiB, decimal for KB/MB/GB/TB."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative, got {value}")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if not m:
            if value.strip().startswith("-"):
                raise ValueError(f"size must not be negative, got {value!r}")
            raise ValueError(f"not a size: {value!r} (use e.g. 4096, '512MiB', '64GiB')")
        number, unit = m.groups()
        if unit.lower() not in _UNITS:
            raise ValueError(f"unknown size unit {unit!r} in {value!r}; use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB")
        return int(float(number) * _UNITS[unit.lower()])
    raise ValueError(f"not a size: {value!r}")


Size = Annotated[int, BeforeValidator(parse_size)]
EvictionName = Literal["lru", "fifo", "lfu", "s3fifo", "sieve", "arc", "lineage"]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AdmissionConfig(_Frozen):
    """``min_hits``: admit a block on its N-th offer; ``bytes_per_s``: write budget."""

    min_hits: int = Field(1, ge=1)
    bytes_per_s: Size | None = None


class _TierBase(_Frozen):
    name: str = Field(min_length=1)
    capacity: Size = Field(gt=0)
    eviction: EvictionName = "lru"
    admission: AdmissionConfig = AdmissionConfig()


class DramTierConfig(_TierBase):
    kind: Literal["dram"]
    shm_path: str | None = None     # back the arena with a shared-memory file
    pin: bool | None = None         # register with CUDA; default: when CUDA is present


class GpuTierConfig(_TierBase):
    kind: Literal["gpu"]
    device: str = "cuda:0"


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

    @property
    def paths(self) -> list[str]:
        return [self.path] if isinstance(self.path, str) else list(self.path)


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


def _no_empty_token(data: Any, remedy: str = "give a token, or remove the key to run without one") -> Any:
    """A ``token`` key given as empty, ``null`` or ``~`` (in the file or a ``KVSTORE_…``
    variable) is a mistake, not a request to turn authentication off."""
    if isinstance(data, Mapping) and "token" in data:
        token = data["token"]
        if token is None or (isinstance(token, str) and not token.strip()):
            raise ValueError(f"token is set but empty (empty, null or ~); {remedy}")
    return data


TlsVersion = Literal["1.2", "1.3"]


def _check_file(kind: str) -> Any:
    """A field validator: the file (or CA directory) exists and OpenSSL loads it."""
    from kvstore.net import tls as _tls

    check = {"ca": _tls.check_ca, "cert": _tls.check_cert}[kind]

    def validate(value: str | None) -> str | None:
        if value is not None:
            check(value)
        return value
    return validate


def _check_key(value: str | None, info: Any) -> str | None:
    """``key`` loads with ``cert`` (validated first: fields validate in order)."""
    from kvstore.net import tls as _tls

    cert = info.data.get("cert")   # absent when invalid (reported there); None: the pair check reports it
    if value is not None and cert is not None:
        _tls.check_pair(cert, value)
    return value


class ServerTlsConfig(_Frozen):
    """``server.tls``: the TCP listener (and the admin port) speak TLS with this
    certificate and key. ``ca`` verifies client certificates: required with
    ``require_client_cert`` (mutual TLS), checked when presented otherwise. The
    same-host Unix socket and shared memory stay plaintext (see ``docs/server.md``)."""

    cert: str = Field(min_length=1)           # PEM certificate chain, leaf first
    key: str = Field(min_length=1)            # its unencrypted PEM private key
    ca: str | None = None                     # PEM CA bundle (or hashed directory) for client certificates
    require_client_cert: bool = False         # mutual TLS: refuse clients without a certificate from ca
    min_version: TlsVersion = "1.2"

    _files = field_validator("cert")(_check_file("cert"))
    _ca = field_validator("ca")(_check_file("ca"))
    _key = field_validator("key")(_check_key)

    @model_validator(mode="after")
    def _mtls_needs_ca(self) -> "ServerTlsConfig":
        if self.require_client_cert and not self.ca:
            raise ValueError("require_client_cert: true needs ca (the CA that signs client certificates)")
        return self

    def context(self) -> Any:
        """A fresh :class:`ssl.SSLContext` (files read again: a restart picks up new ones)."""
        from kvstore.net import tls as _tls

        return _tls.server_context(self.cert, self.key, self.ca, self.require_client_cert, self.min_version)


class ClientTlsConfig(_Frozen):
    """TLS to a kvstore server (a remote tier's ``tls:``, ``Client(tls=...)``): the
    server's chain is verified against ``ca`` (none: the system's trust store) and,
    with ``check_hostname``, must name ``server_hostname`` (default: the host of the
    address); ``cert`` and ``key`` authenticate this client (mutual TLS)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_hostname: str | None = Field(None, min_length=1)
    check_hostname: bool = True               # false: the chain is still verified, the name is not
    min_version: TlsVersion = "1.2"

    _files = field_validator("cert")(_check_file("cert"))
    _ca = field_validator("ca")(_check_file("ca"))
    _key = field_validator("key")(_check_key)

    @model_validator(mode="after")
    def _pair(self) -> "ClientTlsConfig":
        if (self.cert is None) != (self.key is None):
            raise ValueError("give both cert and key (a client certificate), or neither")
        return self

    def context(self) -> Any:
        """A fresh :class:`ssl.SSLContext` for these settings."""
        from kvstore.net import tls as _tls

        return _tls.client_context(self.ca, self.cert, self.key, check_hostname=self.check_hostname,
                                   min_version=self.min_version)


def _tls_flag(value: Any) -> Any:
    """``tls: true`` is TLS verified against the system's trust store; ``false``: none."""
    if value is True:
        return {}
    if value is False:
        return None
    return value


def _no_empty_tenant_token(data: Any) -> Any:
    return _no_empty_token(data, "every tenant needs a token of its own")


class RemoteTierConfig(_TierBase):
    kind: Literal["remote"]
    address: str = Field(min_length=1)   # host:port or unix socket path
    token: str | None = None

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
    password: SecretStr | None = None
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


class PlacementConfig(_Frozen):
    write: Literal["back", "through", "selective"] = "back"
    promote_on_hit: bool = True
    prefetch_depth: int = Field(0, ge=0)
    selective_threshold: int = Field(2, ge=1)


MIN_SALT_CHARS = 16   # a tenant's salt (server.tenants.<i>.salt) is a secret


class TenantConfig(_Frozen):
    """One tenant of the cache server (``server.tenants``, see ``docs/server.md``,
    Tenants): clients that authenticate with ``token`` work in the key space of
    ``salt`` and store at most ``quota[tier]`` bytes in each tier named there."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    token: str = Field(min_length=1)
    salt: str = Field(min_length=1)
    quota: dict[str, Size] = {}     # tier name -> bytes (0: none in that tier); tiers not named: no cap

    _token_given = model_validator(mode="before")(_no_empty_tenant_token)

    @field_validator("salt")
    @classmethod
    def _some_salt(cls, salt: str) -> str:
        if not salt.strip():
            raise ValueError("salt is blank; give each tenant a salt of its own")
        # KV events carry keys mapped under the salt alone: whoever knows (or guesses) it
        # can test which of the tenant's prompts are cached. A secret, like the token.
        if len(salt) < MIN_SALT_CHARS:
            raise ValueError(f"salt has {len(salt)} characters, needs at least {MIN_SALT_CHARS}: it is a "
                             "secret, like the token (KV events carry keys mapped under it); e.g. "
                             "`python -c 'import secrets; print(secrets.token_hex(16))'`")
        return salt


class ServerConfig(_Frozen):
    host: str = "127.0.0.1"
    port: int = Field(7480, ge=0, le=65535)
    admin_port: int | None = Field(7481, ge=0, le=65535)
    socket_path: str | None = None
    token: str | None = None
    allow_unauthenticated: bool = False      # serve beyond loopback without a token (refused otherwise)

    _token_given = model_validator(mode="before")(_no_empty_token)
    # Each tenant's token opens its own key space (salt) with per-tier quotas; with
    # ``token`` as well, that token is the tenant named "default" (no quota).
    tenants: list[TenantConfig] = []
    transport: Literal["auto", "tcp", "shm", "nixl"] = "auto"
    max_frame_bytes: Size = Field(256 << 20, gt=0)
    max_batch: int = Field(4096, ge=1, le=1 << 20)   # records per request (bounded: size sums stay exact)
    max_inflight_bytes: Size = Field(1 << 30, gt=0)
    max_inflight_bytes_total: Size = Field(4 << 30, gt=0)   # every connection's buffers together
    idle_timeout_s: float = Field(300.0, gt=0)
    handshake_timeout_s: float = Field(5.0, gt=0)  # a connection must authenticate (HELLO) within this
    read_timeout_s: float = Field(30.0, gt=0)      # a frame's body or payload may stall this long at most
    max_connections: int = Field(1024, ge=1)       # open client connections; more are closed at accept
    max_connections_per_ip: int = Field(512, ge=1)  # open TCP connections from one address
    shm_lease_s: float = Field(30.0, gt=0)       # a same-host read lease ends after this at most
    shutdown_grace_s: float = Field(10.0, ge=0)  # requests in flight get this long at shutdown
    send_threads: int = Field(4, ge=0)           # threads sending large TCP GET replies (0: the event loop)
    tls: ServerTlsConfig | None = None           # TLS on the TCP listener and the admin port

    @model_validator(mode="after")
    def _distinct_tenants(self) -> "ServerConfig":
        """Names, tokens and salts each unique (one token, one key space); the
        ``token`` is the tenant "default", so that name and its token are taken."""
        seen: dict[str, dict[str, str]] = {"name": {}, "token": {}, "salt": {}}
        if self.token is not None and self.tenants:
            seen["name"]["default"] = "the name of server.token's tenant"
            seen["token"][self.token] = "server.token"
        for i, tenant in enumerate(self.tenants):
            for field_name in ("name", "token", "salt"):
                value = getattr(tenant, field_name)
                other = seen[field_name].get(value)
                if other is not None:
                    shown = f"this {field_name}" if field_name in ("token", "salt") else repr(value)
                    raise ValueError(f"tenants.{i}.{field_name}: {shown} is already {other}; each tenant "
                                     f"needs its own {field_name}")
                seen[field_name][value] = f"the {field_name} of tenants.{i}"
        return self


class TraceConfig(_Frozen):
    """Opt-in access-trace recording (see :mod:`kvstore.trace`): key digests only."""

    path: str = Field(min_length=1)               # the current file; rotated ones get .1, .2, ...
    max_bytes: Size = Field(64 << 20, ge=4096)    # rotate when the current file would pass this
    max_files: int = Field(4, ge=1)               # files kept, the current one included
    block_tokens: int = Field(256, ge=1)          # tokens per block, for input_length


class EventsConfig(_Frozen):
    """KV events for cache-aware routers, in vLLM's format (see :mod:`kvstore._events`).
    An endpoint with ``*``/``::`` or ``ipc://``/``inproc://`` is bound, any other
    connected to (as vLLM's ``ZmqEventPublisher``); the replay endpoint is bound."""

    endpoint: str = Field(min_length=1)           # ZMQ PUB, e.g. tcp://*:5557 or ipc:///run/kvstore-events
    replay_endpoint: str | None = None            # ZMQ ROUTER answering replay requests, e.g. tcp://*:5558
    topic: str = ""
    buffer_steps: int = Field(10_000, ge=1)       # batches kept for replay
    max_queue: int = Field(100_000, ge=1)         # reports waiting to be sent; past it: one AllBlocksCleared
    token_blocks: int = Field(16_384, ge=0)       # keys whose saved token ids are kept for BlockStored

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _zmq_endpoint(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError("a ZMQ endpoint starts with tcp://, ipc:// or inproc://")
        return value


class StoreConfig(_Frozen):
    tiers: list[TierConfig] = Field(min_length=1)
    placement: PlacementConfig = PlacementConfig()
    io_threads: int = Field(4, ge=1)
    server: ServerConfig = ServerConfig()
    trace: TraceConfig | None = None
    events: EventsConfig | None = None

    @field_validator("tiers")
    @classmethod
    def _unique_names(cls, tiers: list[Any]) -> list[Any]:
        names = [t.name for t in tiers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"tier names must be unique, repeated: {', '.join(dupes)}")
        return tiers

    @model_validator(mode="after")
    def _quota_tiers(self) -> "StoreConfig":
        names = [t.name for t in self.tiers]
        for i, tenant in enumerate(self.server.tenants):
            for tier in tenant.quota:
                if tier not in names:
                    raise ValueError(f"server.tenants.{i}.quota.{tier}: no tier named {tier!r} "
                                     f"(tiers: {', '.join(names)})")
        return self

    @model_validator(mode="after")
    def _gpu_first(self) -> "StoreConfig":
        kinds = [t.kind for t in self.tiers]
        if "gpu" in kinds[1:]:
            raise ValueError("a gpu tier must be the first (fastest) tier")
        return self


DEFAULT_CONFIG: dict[str, Any] = {
    "tiers": [
        {"name": "hot", "kind": "dram", "capacity": "1GiB", "eviction": "lru"},
        {"name": "warm", "kind": "nvme", "path": "./kvstore-data", "capacity": "8GiB", "eviction": "lru"},
    ],
    "placement": {"write": "back", "promote_on_hit": True},
}


def load_config(source: str | os.PathLike | Mapping[str, Any] | StoreConfig | None = None,
                *, env: Mapping[str, str] | None = None) -> StoreConfig:
    """Validate a config from a YAML path, a dict, or ``None`` (``$KVSTORE_CONFIG`` or
    the built-in default), applying ``KVSTORE_…`` overrides from ``env``
    (default ``os.environ``). Raises :class:`ConfigError` naming the bad field."""
    if isinstance(source, StoreConfig):
        return source
    env = os.environ if env is None else env
    if source is None:
        source = env.get("KVSTORE_CONFIG") or DEFAULT_CONFIG
    if isinstance(source, Mapping):
        raw = _deep_copy(source)
        origin = "config"
    else:
        path = Path(source)
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold a mapping, got {type(raw).__name__}")
        origin = str(path)
    _apply_env(raw, env)
    try:
        return StoreConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"invalid {origin}:\n" + _describe(exc)) from None


def describe_errors(exc: ValidationError, prefix: str = "") -> str:
    """A validation error's lines, each naming its field (under ``prefix``)."""
    return _describe(exc, prefix)


def _describe(exc: ValidationError, prefix: str = "") -> str:
    lines = []
    for err in exc.errors():
        parts = ([prefix] if prefix else []) + list(err["loc"])
        if len(parts) > 3 and parts[0] == "tiers":
            del parts[2]  # the union's tag (the tier kind) is noise in a field path
        loc = ".".join(str(p) for p in parts)
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        got = err.get("input")
        secret = bool(parts) and parts[-1] in ("token", "salt")   # never echoed into logs
        got_text = "" if err["type"] in ("missing",) or isinstance(got, (dict, list)) or secret \
            else f" (got {got!r})"
        lines.append(f"  {loc or '<root>'}: {msg}{got_text}")
    return "\n".join(lines)


def _deep_copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_deep_copy(v) for v in value]
    return value


def _apply_env(raw: dict[str, Any], env: Mapping[str, str]) -> None:
    for var, text in sorted(env.items()):
        if not var.startswith("KVSTORE_") or var == "KVSTORE_CONFIG":
            continue
        parts = [p.lower() for p in var[len("KVSTORE_"):].split("__")]
        if parts[0] not in StoreConfig.model_fields:
            raise ConfigError(f"environment override {var}: unknown field {parts[0]!r}")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        node: Any = raw
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if isinstance(node, list):
                index = _list_index(node, part, var)
                if last:
                    node[index] = value
                else:
                    node = node[index]
            else:
                if last:
                    node[part] = value
                else:
                    node = node.setdefault(part, {})


def _list_index(items: list[Any], part: str, var: str) -> int:
    if part.isdigit() and int(part) < len(items):
        return int(part)
    for i, item in enumerate(items):
        if isinstance(item, Mapping) and str(item.get("name", "")).lower() == part:
            return i
    raise ConfigError(f"environment override {var}: no list entry {part!r}")


def dump_config(config: StoreConfig) -> str:
    """The effective config as YAML (what ``kvstore config show`` prints)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


__all__ = ["AdmissionConfig", "ClientTlsConfig", "DEFAULT_CONFIG", "DramTierConfig", "EventsConfig", "GpuTierConfig",
           "NvmeTierConfig", "PlacementConfig", "RedisTierConfig", "RedisTlsConfig", "RemoteTierConfig", "S3TierConfig",
           "ServerConfig", "ServerTlsConfig", "StoreConfig", "TenantConfig", "TierConfig", "TraceConfig",
           "describe_errors", "dump_config", "load_config", "parse_size"]
