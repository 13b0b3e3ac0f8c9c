"""boto3 plumbing for the S3 tier: building clients, checking the bucket at start-up, and
sorting botocore's exceptions into miss / corrupt / unavailable / I/O failure.

Nothing here keeps state; :mod:`tiers.s3.tier` owns the clients it builds. botocore clients
are thread-safe, so one client serves every worker thread.
"""

from __future__ import annotations

import http.client
from dataclasses import dataclass
from typing import Any

from kvstore.config.tiers import S3TierConfig
from kvstore.errors import ConfigError

# S3 error codes that mean "the service is overloaded or failing right now": back off.
_THROTTLE_CODES = frozenset({"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout",
                             "RequestTimeTooSkewed", "Throttling", "ThrottlingException",
                             "RequestLimitExceeded", "TooManyRequests", "503", "500", "502", "504"})
_MISSING_CODES = frozenset({"NoSuchKey", "NotFound", "404"})


_D = S3TierConfig.defaults()


@dataclass(frozen=True)
class S3Settings:
    """Connection settings of one S3 tier: the subset of ``S3TierConfig`` boto3 needs,
    with that model's defaults (it is their one definition)."""

    name: str
    bucket: str
    endpoint_url: str | None = _D.endpoint_url
    region: str | None = _D.region
    addressing_style: str = _D.addressing_style
    profile: str | None = _D.profile
    concurrency: int = _D.concurrency
    connect_timeout_s: float = _D.connect_timeout_s
    read_timeout_s: float = _D.read_timeout_s
    max_attempts: int = _D.max_attempts
    sign_payload: bool = _D.sign_payload

    @property
    def where(self) -> str:
        return self.endpoint_url or f"AWS S3 ({self.region or 'default region'})"


def make_session(s: S3Settings) -> Any:
    """The boto3 session whose credential chain (environment, shared config/credentials
    files, ``profile``, instance metadata) signs every request of the tier."""
    import boto3
    import botocore.exceptions

    try:
        return boto3.session.Session(profile_name=s.profile)
    except botocore.exceptions.ProfileNotFound as exc:
        raise ConfigError(f"tiers.{s.name}.profile: AWS profile {s.profile!r} not found ({exc})") from exc


def make_client(s: S3Settings, *, session: Any = None, max_attempts: int | None = None,
                pool_connections: int | None = None, timeout_s: float | None = None) -> Any:
    """A boto3 S3 client of ``session`` (a new :func:`make_session` when not given).

    Checksums that botocore would compute on every request are off because every object
    carries its own XXH3 block header, verified on each read. Unless ``sign_payload``,
    request bodies are sent as ``UNSIGNED-PAYLOAD``: botocore would otherwise SHA-256
    every body over plain http, and the server hash it again, for an integrity check
    the block header already makes end to end (responses are never signed either).
    """
    from botocore.config import Config

    session = session or make_session(s)
    cfg = Config(
        region_name=s.region,
        connect_timeout=timeout_s or s.connect_timeout_s,
        read_timeout=timeout_s or s.read_timeout_s,
        retries={"max_attempts": max_attempts or s.max_attempts, "mode": "standard"},
        max_pool_connections=pool_connections or s.concurrency,
        s3={"addressing_style": s.addressing_style, "payload_signing_enabled": s.sign_payload},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        tcp_keepalive=True,
    )
    try:
        return session.client("s3", endpoint_url=s.endpoint_url, config=cfg)
    except ValueError as exc:  # botocore rejects malformed endpoint URLs with ValueError
        raise ConfigError(f"tiers.{s.name}.endpoint_url: {exc}") from exc


def check_bucket(client: Any, s: S3Settings, *, create: bool) -> None:
    """Fail at start-up, naming the setting, when the bucket, credentials or endpoint are
    wrong; create the bucket first when ``create`` is set and it does not exist."""
    import botocore.exceptions

    try:
        reply = client.head_bucket(Bucket=s.bucket)
        _check_region(client, s, reply)
        return
    except botocore.exceptions.NoCredentialsError as exc:
        raise ConfigError(f"tiers.{s.name}: no AWS credentials found (set AWS_ACCESS_KEY_ID/"
                          f"AWS_SECRET_ACCESS_KEY, a shared credentials file, or tiers.{s.name}.profile)") from exc
    except botocore.exceptions.ClientError as exc:
        status = status_of(exc)
        if status == 404 and create:
            _create_bucket(client, s)
            return
        if status == 404:
            raise ConfigError(f"tiers.{s.name}.bucket: bucket {s.bucket!r} does not exist at {s.where} "
                              f"(create it, or set tiers.{s.name}.create_bucket: true)") from exc
        if status in (401, 403):
            raise ConfigError(f"tiers.{s.name}: credentials were refused by {s.where} for bucket "
                              f"{s.bucket!r} (HTTP {status}); check AWS_ACCESS_KEY_ID/"
                              f"AWS_SECRET_ACCESS_KEY or tiers.{s.name}.profile") from exc
        if status == 400 or error_code(exc) == "AuthorizationHeaderMalformed":  # signed for the wrong region
            raise ConfigError(f"tiers.{s.name}.region: {s.where} refused a request for bucket {s.bucket!r} "
                              f"signed for region {client.meta.region_name!r}; set tiers.{s.name}.region to "
                              f"the bucket's region ({exc})") from exc
        raise ConfigError(f"tiers.{s.name}.bucket: checking bucket {s.bucket!r} at {s.where} failed: "
                          f"{exc}") from exc
    except Exception as exc:
        if is_unavailable(exc):
            raise ConfigError(f"tiers.{s.name}.endpoint_url: cannot reach {s.where}: {exc}") from exc
        raise


def _check_region(client: Any, s: S3Settings, reply: dict) -> None:
    """AWS names the bucket's region in every HeadBucket reply; botocore follows a
    region redirect there, but the tier's direct object requests (``tiers.s3.http``)
    sign for the client's region and would all be refused. Only for AWS itself: other
    S3 implementations may name a zone group here and accept any signing region (those
    that do not refuse the HeadBucket already)."""
    if s.endpoint_url:
        return
    headers = reply.get("ResponseMetadata", {}).get("HTTPHeaders", {})
    actual, signing = headers.get("x-amz-bucket-region"), client.meta.region_name
    if actual and signing and actual != signing:
        raise ConfigError(f"tiers.{s.name}.region: bucket {s.bucket!r} is in region {actual!r}, "
                          f"not {signing!r}; set tiers.{s.name}.region: {actual}")


def _create_bucket(client: Any, s: S3Settings) -> None:
    import botocore.exceptions

    kwargs: dict[str, Any] = {"Bucket": s.bucket}
    if s.region and s.region != "us-east-1":
        kwargs["CreateBucketConfiguration"] = {"LocationConstraint": s.region}
    try:
        client.create_bucket(**kwargs)
    except botocore.exceptions.ClientError as exc:
        if error_code(exc) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            raise ConfigError(f"tiers.{s.name}.bucket: cannot create bucket {s.bucket!r} at "
                              f"{s.where}: {exc}") from exc


def error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def status_of(exc: BaseException) -> int:
    response = getattr(exc, "response", None) or {}
    return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def is_missing(exc: BaseException) -> bool:
    """The object does not exist (a miss, not a failure)."""
    return error_code(exc) in _MISSING_CODES or status_of(exc) == 404


def is_bad_range(exc: BaseException) -> bool:
    """A ranged GET beyond the object's end: the object is shorter than the block it
    claims to be (corrupt), not a transport failure."""
    return error_code(exc) == "InvalidRange" or status_of(exc) == 416


def is_unavailable(exc: BaseException) -> bool:
    """The endpoint is down, slow or overloaded: the tier should back off and probe."""
    import botocore.exceptions
    import urllib3.exceptions

    if isinstance(exc, botocore.exceptions.ClientError):
        return error_code(exc) in _THROTTLE_CODES or status_of(exc) >= 500
    return isinstance(exc, (botocore.exceptions.EndpointConnectionError,
                            botocore.exceptions.ConnectionError,
                            botocore.exceptions.HTTPClientError,
                            urllib3.exceptions.HTTPError,
                            http.client.HTTPException,
                            ConnectionError, TimeoutError))
