"""Shared pieces of the config models: the frozen base, sizes (``"64GiB"``), the
empty-token check, YAML without aliases (:func:`load_yaml`) and values cut short for
messages (:func:`shown`)."""

from __future__ import annotations

import re
import reprlib
from types import SimpleNamespace
from typing import Annotated, Any, Mapping

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, model_validator


class AliasRefused(yaml.composer.ComposerError):
    """A config's YAML holds an alias (see :class:`_NoAliases`)."""


class _NoAliases(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses an alias (``*name``, a ``<<: *name`` merge too):
    nine anchors of nine aliases each stand for 9⁹ values, and whatever walks them (a
    copy, a validator, an error message) never ends. A config writes its values out."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise AliasRefused(None, None, f"found the alias *{shown(event.anchor, 40)[1:-1]}: "
                                              "kvstore configs do not expand YAML aliases; write the value out",
                                              event.start_mark)
        return super().compose_node(parent, index)


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` without aliases (:class:`_NoAliases`); raises ``yaml.YAMLError``
    (:class:`AliasRefused` for an alias)."""
    return yaml.load(text, Loader=_NoAliases)


_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 60
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = _SHOWN.maxset = 4
_SHOWN.maxlevel = 2


def shown(value: Any, limit: int = 60) -> str:
    """``repr(value)`` for an error message: at most about ``limit`` characters, nested
    containers cut after a few items and two levels (never walked whole)."""
    if limit == 60:
        return _SHOWN.repr(value)
    short = reprlib.Repr()
    short.maxstring = short.maxother = limit
    short.maxlist = short.maxtuple = short.maxdict = short.maxset = 4
    short.maxlevel = 2
    return short.repr(value)

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
                raise ValueError(f"size must not be negative, got {shown(value)}")
            raise ValueError(f"not a size: {shown(value)} (use e.g. 4096, '512MiB', '64GiB')")
        number, unit = m.groups()
        if unit.lower() not in _UNITS:
            raise ValueError(f"unknown size unit {shown(unit)} in {shown(value)}; use B, KiB, MiB, GiB, TiB, KB, MB, "
                             "GB or TB")
        return int(float(number) * _UNITS[unit.lower()])
    raise ValueError(f"not a size: {shown(value)}")


_BINARY_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def format_size(nbytes: float) -> str:
    """``nbytes`` for people, in the largest binary unit that keeps it at 1 or more:
    ``"512 B"``, ``"4 KiB"``, ``"1.5 GiB"`` (one decimal at most; what
    :func:`parse_size` reads back, to that rounding). The start line of ``kvstore serve``
    and ``kvstore stats`` use it."""
    value, unit = float(nbytes), "B"
    for name in _BINARY_UNITS:
        if abs(value) < (1024 if unit == "B" else 1023.95):   # never "1024.0 KiB"
            break
        value, unit = value / 1024, name
    if unit == "B":
        return f"{int(value)} B"
    text = f"{value:.1f}"
    return f"{text[:-2] if text.endswith('.0') else text} {unit}"


Size = Annotated[int, BeforeValidator(parse_size)]


# ``Field(json_schema_extra=SECRET)`` declares a secret: ``kvstore config show`` prints
# MASK in its place (``store.secrets_of`` finds them), errors never echo it, and a
# config that holds MASK there is refused (a shown config is never served as it is).
SECRET = {"secret": True}
MASK = "**********"   # pydantic's SecretStr mask


def is_secret(field: Any) -> bool:
    return isinstance(field.json_schema_extra, dict) and bool(field.json_schema_extra.get("secret"))


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _no_mask(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            masked = [n for n, f in cls.model_fields.items() if is_secret(f) and data.get(n) == MASK]
            if masked:
                raise ValueError(f"{' and '.join(masked)}: {MASK!r} is the mask `kvstore config show` prints, "
                                 "not the secret; put the real value back (`kvstore config show --secrets` "
                                 "prints it)")
        return data


def _no_empty_token(data: Any, remedy: str = "give a token, or remove the key to run without one") -> Any:
    """A ``token`` key given as empty, ``null`` or ``~`` (in the file or a ``KVSTORE_…``
    variable) is a mistake, not a request to turn authentication off."""
    if isinstance(data, Mapping) and "token" in data:
        token = data["token"]
        if token is None or (isinstance(token, str) and not token.strip()):
            raise ValueError(f"token is set but empty (empty, null or ~); {remedy}")
    return data



def field_defaults(model: type[BaseModel]) -> SimpleNamespace:
    """The defaults of ``model``'s fields (those that have one), by name. Code that takes a
    setting outside the config (a tier's keyword arguments) reads its default here, so the
    model stays the one definition."""
    return SimpleNamespace(**{n: f.default for n, f in model.model_fields.items() if not f.is_required()})


__all__ = ["AliasRefused", "MASK", "SECRET", "Size", "is_secret", "field_defaults", "load_yaml", "parse_size", "shown"]
