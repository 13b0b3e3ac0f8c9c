"""The whole config (``StoreConfig``): placement, trace, events; loading from YAML or a
dict with ``KVSTORE_…`` overrides, error text, and dump."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Iterator, Literal, Mapping, get_args

import yaml
from pydantic import BaseModel, Field, SecretStr, ValidationError, field_validator, model_validator

from kvstore.config.base import MASK, AliasRefused, Size, _Frozen, is_secret, load_yaml, shown
from kvstore.config.server import ServerConfig
from kvstore.config.tiers import TierConfig
from kvstore.errors import ConfigError

log = logging.getLogger("kvstore.config")


class PlacementConfig(_Frozen):
    write: Literal["back", "through", "selective"] = "back"
    promote_on_hit: bool = True
    prefetch_depth: int = Field(0, ge=0)
    selective_threshold: int = Field(2, ge=1)


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
            raw = load_yaml(path.read_text()) or {}
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


# the tier kinds (the tag of TierConfig's union: a path part that names no field)
_TIER_KINDS = frozenset(get_args(model.model_fields["kind"].annotation)[0] for model in get_args(get_args(TierConfig)[0]))


def _describe(exc: ValidationError, prefix: str = "") -> str:
    lines = []
    for err in exc.errors():
        parts = ([prefix] if prefix else []) + list(err["loc"])
        if len(parts) >= 3 and parts[0] == "tiers" and parts[2] in _TIER_KINDS:
            del parts[2]  # the union's tag (the tier kind) is noise in a field path
        loc = ".".join(str(p) for p in parts)
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        got = err.get("input")
        secret = bool(parts) and parts[-1] in ("token", "salt", "password")   # never echoed into logs
        got_text = "" if err["type"] in ("missing",) or isinstance(got, (dict, list)) or secret \
            else f" (got {shown(got)})"
        lines.append(f"  {loc or '<root>'}: {msg}{got_text}")
    return "\n".join(lines)


def _deep_copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_deep_copy(v) for v in value]
    return value


# Variables named like an override but read by something else: never warned about.
_NOT_OVERRIDES = frozenset({"KVSTORE_CONFIG", "KVSTORE_TOKEN"})
_warned: set[frozenset[str]] = set()


def is_override(var: str) -> bool:
    """Whether environment variable ``var`` is a config override: ``KVSTORE_`` then a
    top-level field, then ``__`` and the rest of a path (``KVSTORE_SERVER__PORT``), or
    exactly a top-level scalar (``KVSTORE_IO_THREADS``). Anything else that starts with
    ``KVSTORE_`` (``KVSTORE_PORT=tcp://…`` from Kubernetes, ``KVSTORE_TOKEN``, a
    ``password_env`` variable) is not, and is ignored."""
    if not var.startswith("KVSTORE_"):
        return False
    parts = var[len("KVSTORE_"):].split("__")
    field = StoreConfig.model_fields.get(parts[0].lower())
    if field is None:
        return False
    return len(parts) > 1 or field.annotation in (int, float, str, bool)


def _apply_env(raw: dict[str, Any], env: Mapping[str, str]) -> None:
    ignored = sorted(v for v in env if v.startswith("KVSTORE_") and v not in _NOT_OVERRIDES and not is_override(v)
                     and v not in _password_envs(raw))
    if ignored and frozenset(ignored) not in _warned:
        _warned.add(frozenset(ignored))
        log.warning("ignoring environment variable(s) %s: not config overrides (an override is KVSTORE_ and a "
                    "field path with __ between parts, e.g. KVSTORE_SERVER__PORT)", ", ".join(ignored))
    for var, text in sorted(env.items()):
        if not is_override(var):
            continue
        parts = [p.lower() for p in var[len("KVSTORE_"):].split("__")]
        if not all(parts):
            raise ConfigError(f"environment override {var}: empty part in the path (parts are joined by __)")
        try:
            value = load_yaml(text)
        except AliasRefused:
            raise ConfigError(f"environment override {var}: kvstore configs do not expand YAML aliases "
                              f"(*name); write the value out (got {shown(text)})") from None
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
                if not isinstance(node, dict):
                    raise ConfigError(f"environment override {var}: {'.'.join(parts[:i])} is not a mapping")
                if last:
                    node[part] = value
                else:
                    node = node.setdefault(part, {})


def _password_envs(raw: Mapping[str, Any]) -> set[str]:
    tiers = raw.get("tiers")
    return {t["password_env"] for t in tiers if isinstance(t, Mapping) and isinstance(t.get("password_env"), str)} \
        if isinstance(tiers, list) else set()


def _list_index(items: list[Any], part: str, var: str) -> int:
    if part.isdigit() and int(part) < len(items):
        return int(part)
    for i, item in enumerate(items):
        if isinstance(item, Mapping) and str(item.get("name", "")).lower() == part:
            return i
    raise ConfigError(f"environment override {var}: no list entry {part!r}")


def secrets_of(model: BaseModel, prefix: str = "") -> Iterator[tuple[str, str]]:
    """``(field path, value)`` of every secret set in ``model``: the fields declared with
    ``json_schema_extra={"secret": True}`` (tokens, salts, passwords)."""
    for name, field in type(model).model_fields.items():
        value, loc = getattr(model, name), f"{prefix}{name}"
        if is_secret(field):
            if value is not None:
                yield loc, value.get_secret_value() if isinstance(value, SecretStr) else value
        elif isinstance(value, BaseModel):
            yield from secrets_of(value, f"{loc}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    yield from secrets_of(item, f"{loc}.{i}.")


def dump_config(config: StoreConfig, *, secrets: bool = False) -> str:
    """The effective config as YAML (what ``kvstore config show`` prints), every field
    given. It loads back to the same config: a field whose default is ``None`` is left
    out when unset (``token: null`` would be refused). Secrets print as :data:`MASK`
    (which the loader refuses) unless ``secrets``."""
    data = _dump(config)
    for loc, value in secrets_of(config):
        *path, last = loc.split(".")
        node: Any = data
        for part in path:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[last] = value if secrets else MASK
    return yaml.safe_dump(data, sort_keys=False)


def _dump(model: BaseModel) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        if value is None and field.default is None:
            continue
        if isinstance(value, BaseModel):
            out[name] = _dump(value)
        elif isinstance(value, list):
            out[name] = [_dump(v) if isinstance(v, BaseModel) else v for v in value]
        else:
            out[name] = model.model_dump(mode="json", include={name})[name]
    return out


__all__ = ["DEFAULT_CONFIG", "MASK", "EventsConfig", "PlacementConfig", "StoreConfig", "TraceConfig",
           "describe_errors", "dump_config", "is_override", "load_config", "secrets_of"]
