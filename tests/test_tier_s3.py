"""The S3 tier against a real S3 implementation (OpenStack Swift + s3api on loopback):
conformance, object layout, verification of every read, large blocks, recovery, Store
integration and start-up checks of bad configuration."""

import uuid

import numpy as np
import pytest

from kvstore.block import EXT_HEADER_BYTES, HEADER_BYTES, parse_any_header, parse_extension
from kvstore.errors import BufferSizeError, ConfigError
from kvstore.keys import Namespace
from kvstore.store import Store
from kvstore.testing import CAPACITY, TierConformance, free_port, make_keys, payload
from tests._swift import REGION, running_swift

pytestmark = pytest.mark.s3
BUCKET = "kvstore-test"


@pytest.fixture(scope="module")
def swift(tmp_path_factory):
    yield from running_swift(tmp_path_factory, "swift-tier")


@pytest.fixture(scope="module")
def raw(swift):
    client = swift.client()
    client.create_bucket(Bucket=BUCKET)
    return client


def make_tier(swift, capacity=CAPACITY, prefix=None, **kwargs):
    from kvstore.tiers.s3 import S3Tier

    return S3Tier(capacity, name="s3-test", bucket=BUCKET, endpoint_url=swift.endpoint_url, region=REGION,
                  addressing_style="path", prefix=prefix or f"t-{uuid.uuid4().hex[:12]}", concurrency=4,
                  **kwargs)


@pytest.fixture
def tier(swift, raw):
    t = make_tier(swift)
    yield t
    t.close()


class TestS3Conformance(TierConformance):
    CONCURRENCY_ROUNDS = 6


def _object(raw, tier, key):
    from kvstore.tiers.s3.io import object_name

    return object_name(tier.prefix, key)


def test_object_layout(tier, raw):
    keys = make_keys(2)
    srcs = [payload(i) for i in range(2)]
    assert tier.write(keys, srcs) == [True, True]
    listed = sorted(o["Key"] for o in raw.list_objects_v2(Bucket=BUCKET, Prefix=tier.prefix + "/")["Contents"])
    ns = keys[0].namespace.hex()
    assert listed == sorted(f"{tier.prefix}/{ns}/{k.hex()}" for k in keys)
    obj = raw.get_object(Bucket=BUCKET, Key=f"{tier.prefix}/{ns}/{keys[1].hex()}")
    body = obj["Body"].read()
    assert len(body) == EXT_HEADER_BYTES + len(srcs[1])
    assert parse_any_header(body, digest=keys[1].digest)[:2] == (2, len(srcs[1]))
    assert parse_extension(body[:EXT_HEADER_BYTES]) == keys[0].digest  # keys[1] chains after keys[0]
    assert body[EXT_HEADER_BYTES:] == srcs[1].tobytes()
    assert obj["Metadata"] == {}  # the parent travels in the body, not in user metadata
    first = raw.get_object(Bucket=BUCKET, Key=f"{tier.prefix}/{ns}/{keys[0].hex()}")["Body"].read()
    assert parse_extension(first[:EXT_HEADER_BYTES]) is None


@pytest.mark.parametrize("damage", ["flip_payload", "truncate", "other_key", "garbage", "flip_parent",
                                    "other_extension"])
def test_corrupt_object_is_a_miss_deleted_and_counted(tier, raw, damage):
    keys = make_keys(2, salt=damage)
    srcs = [payload(i) for i in range(2)]
    tier.write(keys, srcs)
    name = _object(raw, tier, keys[0])
    body = bytearray(raw.get_object(Bucket=BUCKET, Key=name)["Body"].read())
    if damage == "flip_payload":
        body[HEADER_BYTES + 1000] ^= 0xFF
    elif damage == "truncate":
        body = body[:-10]
    elif damage == "other_key":
        body = raw.get_object(Bucket=BUCKET, Key=_object(raw, tier, keys[1]))["Body"].read()
    elif damage == "flip_parent":  # keys[0] has no parent: claim one, header checksum intact
        body[HEADER_BYTES + 4] = 1
    elif damage == "other_extension":  # keys[1]'s extension (a real parent), spliced in
        other = raw.get_object(Bucket=BUCKET, Key=_object(raw, tier, keys[1]))["Body"].read()
        body[HEADER_BYTES:EXT_HEADER_BYTES] = other[HEADER_BYTES:EXT_HEADER_BYTES]
    else:
        body = b"not a block at all"
    raw.put_object(Bucket=BUCKET, Key=name, Body=bytes(body))
    dst = np.zeros(len(srcs[0]), np.uint8)
    assert tier.read_into(keys, [dst, np.zeros(len(srcs[1]), np.uint8)]) == [False, True]
    assert tier.stats()["corrupt_blocks"] == 1
    assert tier.contains(keys) == [False, True]
    assert tier.used_bytes == len(srcs[1])
    with pytest.raises(Exception, match="NoSuchKey|Not Found|404"):
        raw.head_object(Bucket=BUCKET, Key=name)


def test_large_blocks_use_multipart_and_ranged_reads(swift, raw):
    part = 5 << 20
    block = 2 * part + 12345  # three parts; the header shifts every range by 64 bytes
    t = make_tier(swift, capacity=4 * block, multipart_threshold=part, part_size=part)
    try:
        keys = make_keys(2, salt="big")
        srcs = [payload(i, block) for i in range(2)]
        assert t.write(keys, srcs) == [True, True]
        head = raw.head_object(Bucket=BUCKET, Key=_object(raw, t, keys[0]))
        assert head["ETag"].strip('"').endswith("-3")  # really a three-part upload
        dsts = [np.zeros(block, np.uint8) for _ in keys]
        assert t.read_into(keys, dsts) == [True, True]
        assert all(np.array_equal(s, d) for s, d in zip(srcs, dsts))
        stats = t.stats()
        assert stats["multipart_puts"] == 2 and stats["ranged_gets"] == 2
        # A same-size object with one byte changed in the middle part: still caught.
        name = _object(raw, t, keys[1])
        body = bytearray(raw.get_object(Bucket=BUCKET, Key=name)["Body"].read())
        body[HEADER_BYTES + part + 7] ^= 1
        raw.put_object(Bucket=BUCKET, Key=name, Body=bytes(body))
        assert t.read_into(keys[1:], dsts[1:]) == [False]
        assert t.stats()["corrupt_blocks"] == 1
        # Cut short: the last ranges fall beyond the object's end.
        name = _object(raw, t, keys[0])
        own = raw.get_object(Bucket=BUCKET, Key=name)["Body"].read()
        raw.put_object(Bucket=BUCKET, Key=name, Body=own[:part])
        assert t.read_into(keys[:1], dsts[:1]) == [False]
        assert t.stats()["corrupt_blocks"] == 2 and t.used_bytes == 0
    finally:
        t.close()


def test_recover_rebuilds_full_keys_oldest_first(swift, raw):
    prefix = f"rec-{uuid.uuid4().hex[:8]}"
    first = make_tier(swift, prefix=prefix)
    ns = Namespace(model="m", dtype="fp16", chunk_tokens=4)
    keys = ns.chunk_keys(np.arange(12))
    for i, key in enumerate(keys):  # one at a time, so LastModified orders them
        first.write([key], [payload(i, 1000 + i)])
        if i < len(keys) - 1:
            __import__("time").sleep(1.1)  # S3 LastModified has one-second resolution
    first.close()
    second = make_tier(swift, prefix=prefix)
    try:
        blocks = second.recover()
        assert [b.key for b in blocks] == keys
        assert [b.key.parent for b in blocks] == [None, keys[0].digest, keys[1].digest]
        assert all(b.key.namespace == ns.digest for b in blocks)
        assert [b.nbytes for b in blocks] == [1000, 1001, 1002]
        assert second.used_bytes == 3003
        assert set(second.keys()) == set(keys)
        dst = np.zeros(1001, np.uint8)
        assert second.read_into([keys[1]], [dst]) == [True] and np.array_equal(dst, payload(1, 1001))
    finally:
        second.close()


def record_requests(tier):
    """Every HTTP request ``tier`` sends from now on (its boto3 client and its direct
    object requests share one connection pool), as botocore prepared requests."""
    session = tier._client._endpoint.http_session
    sent, send = [], session.send

    def recording(request):
        sent.append(request)
        return send(request)

    session.send = recording
    return sent


def _header(request, name):
    value = request.headers.get(name)
    return value.decode() if isinstance(value, bytes) else value


def _chain(n, size=1000):
    keys = Namespace(model="m", dtype="fp16", chunk_tokens=4).chunk_keys(np.arange(4 * n))
    return keys, [payload(i, size + i) for i in range(n)]


def test_recover_reads_parents_from_headers_and_drops_bad_ones(swift, raw):
    """recover() takes each block's size and parent from its verified header (a ranged
    GET, no metadata): a damaged extension is counted, deleted and left out."""
    prefix = f"hdr-{uuid.uuid4().hex[:8]}"
    first = make_tier(swift, prefix=prefix)
    keys, srcs = _chain(4)
    assert first.write(keys, srcs) == [True] * 4
    first.close()
    bad = f"{prefix}/{keys[2].namespace.hex()}/{keys[2].hex()}"
    body = bytearray(raw.get_object(Bucket=BUCKET, Key=bad)["Body"].read())
    body[HEADER_BYTES + 8 + 5] ^= 0x01  # one bit of the stored parent digest
    raw.put_object(Bucket=BUCKET, Key=bad, Body=bytes(body))
    second = make_tier(swift, prefix=prefix)
    sent = record_requests(second)
    try:
        blocks = second.recover()
        ranged = [r for r in sent if r.method == "GET" and _header(r, "Range") == "bytes=0-127"]
        assert len(ranged) == 4 and not any(r.method == "HEAD" for r in sent)  # one header GET per object
        assert {b.key for b in blocks} == {keys[0], keys[1], keys[3]}
        assert {b.key: b.key.parent for b in blocks} == {keys[0]: None, keys[1]: keys[0].digest,
                                                         keys[3]: keys[2].digest}
        assert {b.key: b.nbytes for b in blocks} == {k: len(s) for k, s in zip(keys, srcs) if k != keys[2]}
        stats = second.stats()
        assert stats["corrupt_blocks"] == 1 and stats["header_gets"] == 3
        assert second.used_bytes == sum(len(s) for k, s in zip(keys, srcs) if k != keys[2])
        with pytest.raises(Exception, match="NoSuchKey|Not Found|404"):
            raw.head_object(Bucket=BUCKET, Key=bad)
        dst = np.zeros(len(srcs[3]), np.uint8)
        assert second.read_into([keys[3]], [dst]) == [True] and np.array_equal(dst, srcs[3])
    finally:
        second.close()


def test_version_1_objects_with_parent_metadata_still_recover_and_read(swift, raw):
    """Objects written before the parent moved into the body (64-byte header, parent in
    x-amz-meta-kv-parent) are recovered with their parent and read back verified."""
    from kvstore.block import encode_header

    prefix = f"v1-{uuid.uuid4().hex[:8]}"
    keys, srcs = _chain(2)
    for key, src in zip(keys, srcs):
        body = bytearray(HEADER_BYTES) + src.tobytes()
        encode_header(key.digest, src, body)
        meta = {"kv-parent": key.parent.hex()} if key.parent else {}
        raw.put_object(Bucket=BUCKET, Key=f"{prefix}/{key.namespace.hex()}/{key.hex()}", Body=bytes(body),
                       Metadata=meta)
    t = make_tier(swift, prefix=prefix)
    try:
        blocks = t.recover()
        assert {b.key: (b.key.parent, b.nbytes) for b in blocks} == {
            keys[0]: (None, len(srcs[0])), keys[1]: (keys[0].digest, len(srcs[1]))}
        dsts = [np.zeros(len(s), np.uint8) for s in srcs]
        assert t.read_into(keys, dsts) == [True, True]
        assert all(np.array_equal(s, d) for s, d in zip(srcs, dsts))
        assert t.stats()["corrupt_blocks"] == 0
    finally:
        t.close()


def test_ranged_reads_of_recovered_blocks_use_the_stored_header_size(swift, raw):
    """A large version-1 object (64-byte header) found by recover() is read in ranges
    that start where its own payload starts."""
    from kvstore.block import encode_header

    part = 5 << 20
    prefix = f"v1big-{uuid.uuid4().hex[:8]}"
    keys, _ = _chain(1)
    src = payload(3, part + 4321)
    body = bytearray(HEADER_BYTES) + src.tobytes()
    encode_header(keys[0].digest, src, body)
    raw.put_object(Bucket=BUCKET, Key=f"{prefix}/{keys[0].namespace.hex()}/{keys[0].hex()}", Body=bytes(body))
    t = make_tier(swift, capacity=4 * part, prefix=prefix, part_size=part)
    try:
        assert [b.nbytes for b in t.recover()] == [len(src)]
        dst = np.zeros(len(src), np.uint8)
        assert t.read_into(keys, [dst]) == [True] and np.array_equal(dst, src)
        assert t.stats()["ranged_gets"] == 1
    finally:
        t.close()


@pytest.mark.parametrize("sign", [False, True])
def test_payload_signing_setting(swift, raw, sign):
    """By default PUT bodies go as UNSIGNED-PAYLOAD (the block header checks them end to
    end); sign_payload=True sends their SHA-256 and Swift verifies it. Both store."""
    import hashlib

    t = make_tier(swift, sign_payload=sign)
    sent = record_requests(t)
    try:
        keys = make_keys(1, salt=f"sign-{sign}")
        src = payload(5)
        assert t.write(keys, [src]) == [True]
        put, = [r for r in sent if r.method == "PUT"]
        assert _header(put, "X-Amz-Content-SHA256") == (hashlib.sha256(bytes(put.body)).hexdigest() if sign
                                                        else "UNSIGNED-PAYLOAD")
        dst = np.zeros_like(src)
        assert t.read_into(keys, [dst]) == [True] and np.array_equal(dst, src)
    finally:
        t.close()


def test_reads_blocks_written_by_another_instance_without_recover(swift, raw):
    prefix = f"peer-{uuid.uuid4().hex[:8]}"
    a, b = make_tier(swift, prefix=prefix), make_tier(swift, prefix=prefix)
    try:
        keys = make_keys(2, salt="peer")
        a.write(keys, [payload(i) for i in range(2)])
        dsts = [np.zeros(CAPACITY // 16, np.uint8) for _ in keys]
        assert b.contains(keys) == [False, False]  # b's index is from before a wrote
        assert b.read_into(keys, dsts) == [True, True]
        assert b.contains(keys) == [True, True]
        with pytest.raises(BufferSizeError):
            b.read_into(keys[:1], [np.zeros(10, np.uint8)])
    finally:
        a.close()
        b.close()


def test_find_reads_headers_of_another_instances_blocks_and_stops_at_a_gap(swift, raw):
    prefix = f"find-{uuid.uuid4().hex[:8]}"
    a = make_tier(swift, prefix=prefix)
    b = make_tier(swift, prefix=prefix)   # concurrency 4: headers in rounds of 4
    try:
        keys = make_keys(12, salt="find")
        written = [0, 1, 2, 3, 4, 10]     # a gap at 5: the round holding it is the last one asked
        assert a.write([keys[j] for j in written], [payload(j) for j in written]) == [True] * 6
        n = len(payload(0))
        assert b.find(keys) == [n] * 5 + [None] * 7
        stats = b.stats()
        assert stats["found"] == 5 and stats["header_gets"] == 5
        assert b.contains(keys[:5]) == [True] * 5 and b.used_bytes == 5 * n
        assert b.contains(keys[10:11]) == [False]   # its round (8-11) was never asked
        assert b.find(keys[10:11]) == [n]
    finally:
        a.close()
        b.close()


def test_store_finds_what_another_store_saved_after_it_started(swift, raw):
    cfg = _store_config(swift)
    keys = make_keys(3, salt="store-find")
    srcs = [payload(i) for i in range(3)]
    with Store.from_config(cfg) as reader, Store.from_config(cfg) as writer:
        assert reader.lookup(keys) == 0
        assert writer.save(keys, srcs).result() == [True] * 3
        assert reader.lookup(keys) == 3
        dsts = [np.zeros_like(s) for s in srcs]
        assert reader.load(keys, dsts).result() == [True] * 3
        assert all(np.array_equal(s, d) for s, d in zip(srcs, dsts))


def _store_config(swift, **tier):
    return {"tiers": [{"name": "shared", "kind": "s3", "capacity": "64MiB", "bucket": BUCKET,
                       "endpoint_url": swift.endpoint_url, "region": REGION, "addressing_style": "path",
                       "prefix": f"store-{uuid.uuid4().hex[:8]}", **tier}]}


def test_store_saves_and_loads_through_s3(swift, raw):
    with Store.from_config(_store_config(swift)) as store:
        keys = make_keys(6, salt="store")
        srcs = [payload(i) for i in range(6)]
        assert store.save(keys, srcs).result() == [True] * 6
        dsts = [np.zeros_like(s) for s in srcs]
        assert store.load(keys, dsts).result() == [True] * 6
        assert all(np.array_equal(s, d) for s, d in zip(srcs, dsts))
        entry = store.stats()["tiers"][0]
        assert entry["healthy"] is True and entry["errors"] == 0 and entry["puts"] == 6


def test_store_counts_corruption(swift, raw):
    with Store.from_config(_store_config(swift)) as store:
        keys = make_keys(2, salt="store-corrupt")
        store.save(keys, [payload(i) for i in range(2)]).result()
        s3 = store.tiers[0]
        raw.put_object(Bucket=BUCKET, Key=_object(raw, s3, keys[0]), Body=b"\0" * (HEADER_BYTES + 10))
        dsts = [np.zeros(CAPACITY // 16, np.uint8) for _ in keys]
        assert store.load(keys, dsts).result() == [False, True]
        assert store.stats()["tiers"][0]["corruptions"] == 1


def test_create_bucket_option(swift, raw):
    bucket = f"made-{uuid.uuid4().hex[:8]}"
    cfg = _store_config(swift, bucket=bucket, create_bucket=True)
    with Store.from_config(cfg) as store:
        assert store.save(make_keys(1), [payload(0)]).result() == [True]
    assert raw.head_bucket(Bucket=bucket)["ResponseMetadata"]["HTTPStatusCode"] == 200


def test_unknown_bucket_is_a_config_error(swift, raw):
    with pytest.raises(ConfigError, match=r"tiers\.shared\.bucket: bucket 'no-such-bucket' does not exist"):
        Store.from_config(_store_config(swift, bucket="no-such-bucket"))


def test_wrong_credentials_are_a_config_error(swift, raw, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(ConfigError, match=r"tiers\.shared: credentials were refused"):
        Store.from_config(_store_config(swift))


def test_missing_credentials_are_a_config_error(swift, raw, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(ConfigError, match=r"tiers\.shared: no AWS credentials found"):
        Store.from_config(_store_config(swift))


def test_credentials_from_a_profile_in_the_shared_file(swift, raw, monkeypatch, tmp_path):
    from tests._swift import ACCESS_KEY, SECRET_KEY

    creds = tmp_path / "credentials"
    creds.write_text(f"[kvtest]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with Store.from_config(_store_config(swift, profile="kvtest")) as store:
        assert store.save(make_keys(1, salt="profile"), [payload(0)]).result() == [True]


def test_unknown_profile_is_a_config_error(swift, raw):
    with pytest.raises(ConfigError, match=r"tiers\.shared\.profile: AWS profile 'nobody' not found"):
        Store.from_config(_store_config(swift, profile="nobody"))


def test_unreachable_endpoint_is_a_config_error(swift, raw):
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ConfigError, match=r"tiers\.shared\.endpoint_url: cannot reach http://127\.0\.0\.1"):
        Store.from_config(_store_config(swift, endpoint_url=dead, connect_timeout_s=0.5, max_attempts=1))


def test_wrong_region_is_a_config_error(swift, raw):
    """Object requests are signed for the configured region and never follow a region
    redirect, so a region the server refuses must fail at start-up, naming the setting."""
    with pytest.raises(ConfigError, match=r"tiers\.shared\.region: .* signed for region 'eu-west-1'"):
        Store.from_config(_store_config(swift, region="eu-west-1"))


def test_direct_object_requests_fail_like_the_client(tier, raw):
    """The tier's single-object requests (tiers.s3.http) skip botocore's per-call
    pipeline but must sign, address and fail exactly as the boto3 client does: same
    object, same S3 error codes and statuses, retries counted against max_attempts."""
    import botocore.exceptions

    from kvstore.tiers.s3.client import error_code, is_missing, status_of

    requests = tier._requests
    name = f"{tier.prefix}/direct"
    requests.put(name, bytearray(b"abc" * 1000))
    assert raw.get_object(Bucket=BUCKET, Key=name)["Body"].read() == b"abc" * 1000
    reply = requests.get(name, first=3, last=5)
    assert reply.status_code == 206 and reply.raw.read() == b"abc"
    reply.raw.release_conn()
    requests.delete(name)
    with pytest.raises(botocore.exceptions.ClientError) as direct:
        requests.get(name)
    with pytest.raises(botocore.exceptions.ClientError) as boto:
        raw.get_object(Bucket=BUCKET, Key=name)
    assert error_code(direct.value) == error_code(boto.value) == "NoSuchKey"
    assert status_of(direct.value) == status_of(boto.value) == 404 and is_missing(direct.value)
    requests.put(name, bytearray(b"abc"))
    sent = record_requests(tier)
    with pytest.raises(botocore.exceptions.ClientError) as beyond:
        requests.get(name, first=10, last=20)
    assert error_code(beyond.value) == "InvalidRange" and status_of(beyond.value) == 416
    assert len(sent) == 1  # a 4xx is an answer, not a failure: never retried
    requests.delete(name)


def test_direct_object_requests_retry_transport_failures(swift, raw):
    """A refused connection is retried up to max_attempts in all, then raised as the
    transport error the client would raise."""
    import botocore.exceptions

    from kvstore.tiers.s3.http import ObjectRequests

    t = make_tier(swift, max_attempts=2)
    try:
        requests = ObjectRequests(t._client, None, BUCKET, max_attempts=2)
        with pytest.raises(botocore.exceptions.NoCredentialsError):
            requests.get("anything")
        dead = f"http://127.0.0.1:{free_port()}"
        requests._base = requests._base.replace(swift.endpoint_url, dead)
        requests._credentials = t._requests._credentials
        sent = record_requests(t)
        with pytest.raises(botocore.exceptions.EndpointConnectionError):
            requests.get("anything")
        assert len(sent) == 2
    finally:
        t.close()


def test_bucket_in_another_region_is_a_config_error(swift):
    """AWS names a bucket's region in its HeadBucket reply (and botocore follows the
    redirect there): a reply naming another region than the one requests are signed
    for is refused at start-up, naming the setting. Other endpoints may name a zone
    group there and accept any signing region, so only AWS itself is checked."""
    from kvstore.tiers.s3.client import S3Settings, _check_region, make_client

    client = make_client(S3Settings(name="shared", bucket=BUCKET, endpoint_url=swift.endpoint_url, region=REGION))
    s = S3Settings(name="shared", bucket=BUCKET, region=REGION)  # AWS itself: no endpoint_url
    try:
        other = S3Settings(name="shared", bucket=BUCKET, endpoint_url=swift.endpoint_url, region=REGION)
        _check_region(client, other, {"ResponseMetadata": {"HTTPHeaders": {"x-amz-bucket-region": "default"}}})
        _check_region(client, s, {"ResponseMetadata": {"HTTPHeaders": {"x-amz-bucket-region": REGION}}})
        _check_region(client, s, {"ResponseMetadata": {"HTTPHeaders": {}}})  # Swift says nothing
        with pytest.raises(ConfigError, match=r"tiers\.shared\.region: bucket 'kvstore-test' is in region "
                                              r"'eu-west-1', not 'us-east-1'"):
            _check_region(client, s, {"ResponseMetadata": {"HTTPHeaders": {"x-amz-bucket-region": "eu-west-1"}}})
    finally:
        client.close()
