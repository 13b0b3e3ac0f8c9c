"""Single-object S3 requests of the tier's hot path (GET, ranged GET, PUT, DELETE), signed
and sent with a boto3 client's own parts: its credentials, its SigV4 signer and payload
signing setting, the object URL its endpoint rules give, and its connection pool, timeouts
and proxies. What they skip is botocore's per-call pipeline around the bytes: parameter
validation, endpoint rule evaluation, event hooks, user-agent assembly, response parsing.
On this machine that pipeline costs 1–2 ms of CPU per request, as much as an S3 server
needs to move a 1 MiB block, and is the whole difference between the tier and a plain
``get_object``/``put_object`` (see ``benchmarks/s3.py``).

Everything else (bucket checks, listings, multipart uploads, the health probe) keeps
using the client. Failures look exactly like the client's: botocore's transport
exceptions, and :class:`botocore.exceptions.ClientError` with the S3 error code and HTTP
status, so :mod:`tiers.s3.client` sorts them the same way. Requests that fail with a
transport error, a 5xx or a throttling reply are retried up to ``max_attempts`` times in
all, with botocore's "standard" backoff (full jitter, at most 20 s). Thread-safe.
"""

from __future__ import annotations

import random
import re
import time
from typing import Any

from kvstore.tiers.s3.client import is_unavailable

_MAX_BACKOFF_S = 20.0
_ERROR_CODE = re.compile(rb"<Code>([^<]{1,128})</Code>")
_ERROR_MESSAGE = re.compile(rb"<Message>([^<]{0,1024})</Message>")
_PROBE_NAME = "kvstore-url-probe"


class ObjectRequests:
    """Signed requests for single objects of ``bucket``, through ``client``'s pool."""

    def __init__(self, client: Any, credentials: Any, bucket: str, *, max_attempts: int) -> None:
        self._session = client._endpoint.http_session  # the client's pool, timeouts and proxies
        self._credentials = credentials
        self._region = client.meta.region_name
        self._context = {"client_config": client.meta.config}  # S3SigV4Auth reads payload signing here
        self._max_attempts = max(1, int(max_attempts))
        # The client's endpoint rules (addressing style, region, custom endpoint) decide
        # where objects live; a presigned URL shows it without sending anything.
        url = client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": _PROBE_NAME})
        base = url.split("?", 1)[0]
        if not base.endswith("/" + _PROBE_NAME):
            raise RuntimeError(f"cannot derive object URLs of bucket {bucket!r} from {base!r}")
        self._base = base[:-len(_PROBE_NAME)]

    def get(self, name: str, *, first: int | None = None, last: int | None = None) -> Any:
        """GET an object (bytes ``first..last`` inclusive when given) and return the
        response before its body is read: ``.raw`` is the urllib3 response to stream from,
        which the caller must read to the end and release, or close."""
        headers = {} if first is None else {"Range": f"bytes={first}-{last}"}
        return self._send("GET", name, headers=headers, stream=True, operation="GetObject")

    def put(self, name: str, body: bytearray) -> None:
        """PUT ``body`` as the whole object (no user metadata)."""
        self._send("PUT", name, body=body, headers={"Content-Length": str(len(body))}, operation="PutObject")

    def delete(self, name: str) -> None:
        self._send("DELETE", name, operation="DeleteObject")

    def _send(self, method: str, name: str, *, operation: str, body: bytearray | None = None,
              headers: dict[str, str] | None = None, stream: bool = False) -> Any:
        from botocore.awsrequest import AWSRequest

        url = self._base + name
        for attempt in range(1, self._max_attempts + 1):
            request = AWSRequest(method, url, headers=dict(headers or {}), data=body, stream_output=stream)
            request.context.update(self._context)
            self._sign(request)
            try:
                response = self._session.send(request.prepare())
            except Exception as exc:
                if attempt == self._max_attempts or not is_unavailable(exc):
                    raise
                _backoff(attempt)
                continue
            if response.status_code < 300:
                return response
            error = _client_error(response, operation)
            if attempt == self._max_attempts or not _retryable_reply(response.status_code, error):
                raise error
            _backoff(attempt)
        raise AssertionError("unreachable")

    def _sign(self, request: Any) -> None:
        from botocore.auth import S3SigV4Auth
        from botocore.exceptions import NoCredentialsError

        if self._credentials is None:
            raise NoCredentialsError()
        S3SigV4Auth(self._credentials.get_frozen_credentials(), "s3", self._region).add_auth(request)


def _client_error(response: Any, operation: str) -> Exception:
    """The S3 error reply as botocore's ``ClientError`` (code from the XML body; the HTTP
    status as the code when there is no body, as for HEAD). Releases the connection."""
    from botocore.exceptions import ClientError

    try:
        body = response.content  # already read unless the request streams its reply
    except Exception:  # the body is only for the message; the status says enough
        body = b""
    finally:
        if response.raw is not None:
            response.raw.release_conn()
    code = _ERROR_CODE.search(body or b"")
    message = _ERROR_MESSAGE.search(body or b"")
    error = {"Code": code.group(1).decode("utf-8", "replace") if code else str(response.status_code),
             "Message": message.group(1).decode("utf-8", "replace") if message else ""}
    return ClientError({"Error": error, "ResponseMetadata": {"HTTPStatusCode": response.status_code,
                                                            "HTTPHeaders": dict(response.headers)}}, operation)


def _retryable_reply(status: int, error: Exception) -> bool:
    """5xx and throttling codes (``is_unavailable``), and 429 Too Many Requests."""
    return status == 429 or is_unavailable(error)


def _backoff(attempt: int) -> None:
    """botocore's standard retry delay after failed attempt ``attempt`` (1-based): full
    jitter under ``2 ** (attempt - 1)`` seconds, at most 20 s."""
    time.sleep(random.random() * min(2 ** (attempt - 1), _MAX_BACKOFF_S))
