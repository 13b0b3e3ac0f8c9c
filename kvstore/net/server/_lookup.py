"""``POST /v1/lookup`` on the admin port: how much of a prompt's prefix this server holds,
per tier, so a router can place the request without speaking the data protocol.

Request (JSON), one of:

- ``{"namespace": {"model": …, "dtype": …, "chunk_tokens": 256, "layout": …, "rank": 0,
  "world_size": 1, "salt": …}, "token_ids": [1, 2, …]}``: the keys of every full chunk,
  exactly as :meth:`kvstore.Namespace.chunk_keys` makes them;
- ``{"keys": ["<64 hex>", …], "chunk_tokens": 256}``: block keys in prefix order
  (``chunk_tokens`` optional, for the token counts). A key's digest is chained from its
  namespace's, so keys need no namespace beside them; one given is checked for form.

Answer: ``{"blocks": N, "prefix_blocks": n, "prefix_tokens": n·chunk | null,
"tiers": [{"name", "kind", "prefix_blocks", "prefix_tokens"}, …]}`` (tiers fastest
first). Read-only and unleased (see :mod:`kvstore._prefix`). Bad input: HTTP 400 naming
the field (:class:`BadLookup`); more than ``server.admin.lookup_max_tokens`` token ids
(or keys): 413 (:class:`LookupTooLarge`).

Cost: the keys are hashed (and mapped into a tenant's space) :data:`BATCH` at a time and
looked up in the index a batch per lock hold, stopping at the first block no tier
holds, so a request costs what the server holds of it, not what it names, and the
Store's lock is never held for a whole prompt.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any, Callable, Iterator

from kvstore._prefix import prefix_runs
from kvstore.errors import InvalidArgumentError
from kvstore.keys import BlockKey, Namespace

BATCH = 1024                    # keys hashed, mapped and looked up at a time
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
_NAMESPACE_FIELDS = {"model", "dtype", "chunk_tokens", "layout", "rank", "world_size", "salt"}


class BadLookup(ValueError):
    """The request body is not a valid lookup; the message names the field."""


class LookupTooLarge(BadLookup):
    """More token ids (or keys) than ``server.admin.lookup_max_tokens``: HTTP 413."""


def answer(store: Any, body: bytes, scope: Callable[[list[BlockKey]], list[BlockKey]] | None = None, *,
           max_tokens: int) -> dict[str, Any]:
    """The JSON-able answer for ``body``; raises :class:`BadLookup` (or
    :class:`LookupTooLarge` past ``max_tokens``). ``scope``: the bearer tenant's key
    mapping (:meth:`kvstore.net.server._tenants.Tenant.keys`)."""
    blocks, batches, chunk_tokens = parse(body, max_tokens)
    if scope is not None:
        batches = (scope(batch) for batch in batches)
    anywhere, per_tier = prefix_runs(store, batches)

    def tokens(n: int) -> int | None:
        return n * chunk_tokens if chunk_tokens is not None else None

    return {"blocks": blocks, "prefix_blocks": anywhere, "prefix_tokens": tokens(anywhere),
            "tiers": [{"name": name, "kind": kind, "prefix_blocks": n, "prefix_tokens": tokens(n)}
                      for name, kind, n in per_tier]}


def parse(body: bytes, max_tokens: int) -> tuple[int, Iterator[list[BlockKey]], int | None]:
    """``(number of blocks, their keys in batches of BATCH, chunk_tokens or None)``;
    the keys are hashed as the batches are taken."""
    try:
        request = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadLookup(f"body is not JSON: {exc}") from None
    except ValueError as exc:        # an integer of more digits than Python converts
        raise BadLookup(f"body is not JSON kvstore reads: {exc}") from None
    except RecursionError:
        raise BadLookup("body is not JSON kvstore reads: nested too deeply") from None
    if not isinstance(request, dict):
        raise BadLookup("body must be a JSON object")
    unknown = sorted(set(request) - {"namespace", "token_ids", "keys", "chunk_tokens"})
    if unknown:
        raise BadLookup(f"unknown field(s): {', '.join(unknown)}")
    if ("token_ids" in request) == ("keys" in request):
        raise BadLookup("give exactly one of token_ids (with a namespace) or keys")
    if "token_ids" in request:
        namespace = _namespace(request.get("namespace"))
        tokens = request["token_ids"]
        if not isinstance(tokens, list):
            raise BadLookup("token_ids: must be a list of integers")
        _at_most(len(tokens), max_tokens, "token_ids")
        if not set(map(type, tokens)) <= {int}:     # one pass in C; bools and floats are not token ids
            raise BadLookup("token_ids: must be a list of integers")
        try:
            batches = namespace.chunk_key_batches(tokens, BATCH)
            first = next(batches, [])                # checks the ids (range) before anything is answered
        except (InvalidArgumentError, OverflowError) as exc:
            raise BadLookup(f"token_ids: {exc}") from None
        return len(tokens) // namespace.chunk_tokens, itertools.chain([first], batches), namespace.chunk_tokens
    if "namespace" in request:
        given = request["namespace"]
        if not (isinstance(given, str) and _HEX64.match(given)):
            _namespace(given)
    keys = request["keys"]
    if not isinstance(keys, list):
        raise BadLookup("keys: must be a list of 64-hex-digit key digests")
    _at_most(len(keys), max_tokens, "keys")
    if not all(isinstance(k, str) and _HEX64.match(k) for k in keys):
        raise BadLookup("keys: must be a list of 64-hex-digit key digests")
    chunk_tokens = request.get("chunk_tokens")
    if chunk_tokens is not None and (type(chunk_tokens) is not int or chunk_tokens <= 0):
        raise BadLookup("chunk_tokens: must be a positive integer")
    batches = ([BlockKey(bytes.fromhex(k)) for k in keys[lo:lo + BATCH]] for lo in range(0, len(keys), BATCH))
    return len(keys), batches, chunk_tokens


def _at_most(count: int, max_tokens: int, field: str) -> None:
    if count > max_tokens:
        raise LookupTooLarge(f"{field}: {count} given, more than server.admin.lookup_max_tokens ({max_tokens}) "
                             "per request")


def _namespace(fields: Any) -> Namespace:
    if not isinstance(fields, dict):
        raise BadLookup("namespace: must be an object with model, dtype, chunk_tokens (layout, rank, "
                        "world_size, salt optional)")
    unknown = sorted(set(fields) - _NAMESPACE_FIELDS)
    if unknown:
        raise BadLookup(f"namespace: unknown field(s): {', '.join(unknown)}")
    missing = sorted({"model", "dtype", "chunk_tokens"} - set(fields))
    if missing:
        raise BadLookup(f"namespace: missing {', '.join(missing)}")
    for name in ("model", "dtype", "layout", "salt"):
        if name in fields and not isinstance(fields[name], str):
            raise BadLookup(f"namespace.{name}: must be a string")
    for name in ("chunk_tokens", "rank", "world_size"):
        if name in fields and type(fields[name]) is not int:
            raise BadLookup(f"namespace.{name}: must be an integer")
    try:
        return Namespace(**fields)
    except InvalidArgumentError as exc:
        raise BadLookup(f"namespace: {exc}") from None


__all__ = ["BATCH", "BadLookup", "LookupTooLarge", "answer"]
