"""The S3 tier shared between processes, and under faults: the endpoint stopped in the
middle of loads, frozen (timeouts), restarted; every failure is a miss for the caller."""

import json
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from kvstore.store import Store
from kvstore.testing import make_keys, payload
from tests._swift import REGION, running_swift

pytestmark = pytest.mark.s3
BUCKET = "kvstore-faults"
BLOCK = 256 * 1024
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def swift(tmp_path_factory):
    yield from running_swift(tmp_path_factory, "swift-faults")


@pytest.fixture(scope="module")
def bucket(swift):
    swift.client().create_bucket(Bucket=BUCKET)
    return BUCKET


def _run(*args):
    proc = subprocess.run([sys.executable, "-m", "tests._s3_proc", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_two_processes_share_one_bucket(swift, bucket):
    prefix = f"shared-{uuid.uuid4().hex[:8]}"
    assert _run("save", swift.endpoint_url, bucket, prefix, 8, BLOCK) == {"saved": 8}
    got = _run("load", swift.endpoint_url, bucket, prefix, 8, BLOCK)
    assert got == {"lookup": 8, "loaded": 8, "exact": True, "parents": 7}


def _store(swift, prefix):
    return Store.from_config({"tiers": [{
        "name": "shared", "kind": "s3", "capacity": "64MiB", "bucket": BUCKET,
        "endpoint_url": swift.endpoint_url, "region": REGION, "addressing_style": "path",
        "prefix": prefix, "connect_timeout_s": 0.5, "read_timeout_s": 1.0, "max_attempts": 2}]})


def _wait_healthy(store, limit_s=120.0):
    """Poll until the tier's background probe has found the endpoint again."""
    deadline = time.monotonic() + limit_s
    while not store.stats()["tiers"][0]["healthy"]:
        assert time.monotonic() < deadline, "tier did not come back after the endpoint did"
        time.sleep(0.2)


def _load_all(store, keys, srcs):
    dsts = [np.zeros_like(s) for s in srcs]
    ok = store.load(keys, dsts).result()
    return ok, all(np.array_equal(s, d) for s, d, good in zip(srcs, dsts, ok) if good)


def test_server_stopped_during_loads_then_restarted(swift, bucket):
    keys = make_keys(16, salt="outage")
    srcs = [payload(i, BLOCK) for i in range(16)]
    with _store(swift, f"outage-{uuid.uuid4().hex[:8]}") as store:
        assert all(store.save(keys, srcs).result())
        results, failures = [], []
        stop = threading.Event()

        def loader():
            while not stop.is_set():
                try:
                    results.append(_load_all(store, keys, srcs))
                except BaseException as exc:  # the caller must never see one
                    failures.append(exc)

        thread = threading.Thread(target=loader)
        thread.start()
        while not results:
            time.sleep(0.05)
        swift.stop()
        time.sleep(1.0)   # loads keep running against the stopped endpoint
        n_during = len(results)
        while len(results) < n_during + 3:
            time.sleep(0.05)
        stop.set()
        thread.join()
        assert not failures, failures[0]
        assert all(exact for _, exact in results)        # never a wrong byte
        assert results[-1][0] == [False] * 16            # misses while down
        stats = store.stats()["tiers"][0]
        assert stats["healthy"] is False and stats["errors"] >= 1 and stats["outages"] == 1
        assert store.lookup(keys) == 16                 # still indexed: only unavailable

        swift.start()
        _wait_healthy(store)
        ok, exact = _load_all(store, keys, srcs)
        assert ok == [True] * 16 and exact
        more = make_keys(4, salt="after")
        assert all(store.save(more, [payload(i, BLOCK) for i in range(4)]).result())


def test_frozen_endpoint_times_out_and_fails_fast(swift, bucket):
    keys = make_keys(4, salt="frozen")
    srcs = [payload(i, BLOCK) for i in range(4)]
    with _store(swift, f"frozen-{uuid.uuid4().hex[:8]}") as store:
        assert all(store.save(keys, srcs).result())
        swift.pause_proxy()
        try:
            ok, _ = _load_all(store, keys, srcs)
            assert ok == [False] * 4
            tier = store.tiers[0]
            assert tier.stats()["healthy"] is False
            assert "timeout" in tier.stats()["last_error"].lower()
            # While marked down the tier refuses at once instead of waiting on the endpoint.
            errors = tier.stats()["errors"]
            with pytest.raises(ConnectionError, match="unavailable"):
                tier.read_into(keys[:1], [np.zeros(BLOCK, np.uint8)])
            assert tier.stats()["errors"] == errors
            assert store.save(make_keys(1, salt="frozen-new"), [srcs[0]]).result() == [False]
        finally:
            swift.resume_proxy()
        _wait_healthy(store)
        ok, exact = _load_all(store, keys, srcs)
        assert ok == [True] * 4 and exact


def test_backend_5xx_marks_unavailable_until_it_recovers(swift, bucket):
    """With Swift's object servers down the S3 endpoint still answers, with 5xx: that is
    an outage too, and the probe must not call it over while they stay down."""
    keys = make_keys(4, salt="5xx")
    srcs = [payload(i, BLOCK) for i in range(4)]
    with _store(swift, f"5xx-{uuid.uuid4().hex[:8]}") as store:
        assert all(store.save(keys, srcs).result())
        swift.stop("object")
        try:
            ok, _ = _load_all(store, keys, srcs)
            assert ok == [False] * 4
            stats = store.stats()["tiers"][0]
            assert stats["healthy"] is False
            assert "503" in stats["last_error"] or "ServiceUnavailable" in stats["last_error"]
            deadline = time.monotonic() + 30
            while store.stats()["tiers"][0]["probes"] < 3:  # probes ran, and failed
                assert time.monotonic() < deadline, "the tier stopped probing"
                time.sleep(0.2)
            assert store.stats()["tiers"][0]["healthy"] is False
            assert store.save(make_keys(1, salt="5xx-new"), [srcs[0]]).result() == [False]
            assert store.lookup(keys) == 4
        finally:
            swift.start()
        _wait_healthy(store)
        ok, exact = _load_all(store, keys, srcs)
        assert ok == [True] * 4 and exact


@pytest.fixture(scope="module")
def throttled(tmp_path_factory):
    """A second Swift whose rate limiter allows 2 object writes per second per bucket."""
    yield from running_swift(tmp_path_factory, "swift-slowdown", put_rate=2)


def test_slowdown_is_an_outage_then_writes_resume(throttled):
    raw = throttled.client()
    raw.create_bucket(Bucket=BUCKET)
    raw.put_object(Bucket=BUCKET, Key="seed", Body=b"x")  # the limiter starts at one object
    time.sleep(1.5)  # ...once the proxy's cached object count (1 s) has seen it
    keys = make_keys(12, salt="slow")
    srcs = [payload(i, 64 * 1024) for i in range(12)]
    with _store(throttled, f"slow-{uuid.uuid4().hex[:8]}") as store:
        assert store.save(keys, srcs).result() == [False] * 12  # no exception, just not stored
        tier = store.tiers[0]
        stats = store.stats()["tiers"][0]
        assert stats["outages"] >= 1 and stats["errors"] >= 1
        assert "SlowDown" in stats["last_error"]
        # Blocks of the failed batch that did land are not counted against the budget
        # the Store sees (it stored none of them).
        assert tier.used_bytes == 0 and store.stats()["blocks"] == 0
        _wait_healthy(store)
        # Swift's limiter charges rejected requests too: back off until its debt is paid.
        deadline, pause = time.monotonic() + 120, 2.0
        while not store.save(keys[:1], srcs[:1]).result()[0]:
            assert time.monotonic() < deadline, "writes never resumed after SlowDown"
            time.sleep(pause)
            pause = min(2 * pause, 8.0)
        dst = np.zeros_like(srcs[0])
        assert store.load(keys[:1], [dst]).result() == [True] and np.array_equal(dst, srcs[0])


def test_recover_with_object_servers_down_is_an_outage_not_a_partial_index(swift, bucket):
    """The listing answers (container server) but the header GETs get 5xx: recover()
    raises TierUnavailableError instead of returning blocks without sizes or parents,
    and succeeds once the object servers are back."""
    from kvstore.errors import TierUnavailableError
    from kvstore.tiers.s3 import S3Tier

    prefix = f"rec5xx-{uuid.uuid4().hex[:8]}"
    kwargs = dict(name="s3", bucket=bucket, endpoint_url=swift.endpoint_url, region=REGION,
                  addressing_style="path", prefix=prefix, concurrency=2, max_attempts=1)
    keys = make_keys(3, salt="rec5xx")
    writer = S3Tier(1 << 30, **kwargs)
    try:
        assert writer.write(keys, [payload(i, BLOCK) for i in range(3)]) == [True] * 3
    finally:
        writer.close()
    reader = S3Tier(1 << 30, **kwargs)
    try:
        swift.stop("object")
        try:
            with pytest.raises(TierUnavailableError):
                reader.recover()
            assert reader.stats()["healthy"] is False and reader.stats()["corrupt_blocks"] == 0
        finally:
            swift.start()
        deadline = time.monotonic() + 30
        while not reader.stats()["healthy"]:
            assert time.monotonic() < deadline, "the tier did not come back"
            time.sleep(0.2)
        assert {b.key for b in reader.recover()} == set(keys)
    finally:
        reader.close()
