"""Retention hints from engine requests, one reading for every connector.

A client asks for retention in the request's KV-transfer parameters, under the key
``"kvstore"`` (vLLM: ``kv_transfer_params``, sent as ``extra_body`` in the OpenAI API):

    {"kv_transfer_params": {"kvstore": {"retain_s": 600, "priority": 1}}}

and through the engine's own request priority where the engine has one. Engines order
priorities differently; each connector converts its engine's into kvstore's (a higher
``Hint.priority`` is kept longer) before calling :func:`request_hint`.

A malformed hint in a request is the client's mistake, not the engine's: it is logged
with what is wrong and the request runs unhinted (never a failed request, never an
engine that stops).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from kvstore.errors import InvalidArgumentError
from kvstore.hint import MAX_PRIORITY, Hint

log = logging.getLogger("kvstore.connectors")

PARAMS_KEY = "kvstore"


def request_hint(params: Mapping[str, Any] | None, priority: int = 0, *, request_id: Any = None) -> Hint | None:
    """The hint of one request: ``params[PARAMS_KEY]`` (a mapping of :class:`Hint`
    fields), with ``priority`` (already in kvstore's order, 0: none) where the params
    name none. ``None`` when the request asks for nothing or asks wrongly (logged)."""
    fields = params.get(PARAMS_KEY) if isinstance(params, Mapping) else None
    try:
        if fields is None:
            return Hint(None, min(priority, MAX_PRIORITY)) if priority > 0 else None
        if isinstance(fields, Mapping) and "priority" not in fields and not fields.get("discard") and priority > 0:
            fields = {**fields, "priority": min(priority, MAX_PRIORITY)}
        return Hint.from_dict(fields)
    except InvalidArgumentError as exc:
        log.warning("request %s: ignoring its kvstore retention hint: %s", request_id, exc)
        return None


def with_hint_actions(params: Mapping[str, Any] | None, envelope: Any) -> Mapping[str, Any] | None:
    """vLLM's orchestrator hints (``request.kv_hints``, a ``KvHintsEnvelope`` whose
    actions carry an ``action_type`` and a ``payload``): an action of type ``"kvstore"``
    carries the hint's fields in its payload, used where ``params`` name no hint."""
    if isinstance(params, Mapping) and PARAMS_KEY in params:
        return params
    for action in getattr(envelope, "actions", None) or ():
        if getattr(action, "action_type", None) == PARAMS_KEY:
            return {**(params or {}), PARAMS_KEY: getattr(action, "payload", None)}
    return params


__all__ = ["PARAMS_KEY", "request_hint", "with_hint_actions"]
