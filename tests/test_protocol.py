"""The wire format: round trips of every body, strict rejection of bad frames, and a
fuzz test (Hypothesis) over the frame parser: arbitrary bytes either parse or raise
ProtocolError, nothing else."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.errors import ProtocolError
from kvstore.net import protocol as P
from kvstore.testing import make_keys

LIMITS = P.Limits(max_frame_bytes=1 << 20, max_batch=64)


def _frame(op, body=b"", payload=b"", rid=1):
    return P.pack_header(op, rid, len(body), len(payload)) + body + payload


def test_round_trips():
    keys = make_keys(5)
    frames = (_frame(P.Op.LOOKUP, P.encode_lookup(keys, 2.5)) + _frame(P.Op.CONTAINS, P.encode_keys(keys))
              + _frame(P.Op.PUT, P.encode_records(P.PUT_REC, keys[:2], [3, 4], [11, 2**64 - 1]), b"abcdefg")
              + _frame(P.Op.SHM_PUT, P.encode_records(P.STAGED, keys[:2], [3, 4], [0, 4096], [5, 6]))
              + _frame(P.Op.SHM_DONE, P.encode_u64(42)) + _frame(P.Op.HELLO, P.encode_json({"token": "t"})))
    reqs, used = P.parse_requests(frames, LIMITS)
    assert used == len(frames)
    (h1, (lease, k1)), (_, k2), (h3, (k3, rec3)), (_, (k4, rec4)), (_, lid), (_, hello) = reqs
    assert lease == 2.5 and k1 == keys and k2 == keys
    assert [k.to_bytes() for k in k1] == [k.to_bytes() for k in keys]  # parent/namespace survive
    assert k3 == keys[:2] and rec3["nbytes"].tolist() == [3, 4] and h3.payload_len == 7
    assert rec3["checksum"].tolist() == [11, 2**64 - 1]
    assert rec4["offset"].tolist() == [0, 4096] and rec4["checksum"].tolist() == [5, 6]
    assert lid == 42 and hello == {"token": "t"}
    assert P.decode_sizes(P.encode_sizes([5, P.MISS, P.SIZE_MISMATCH]), 3).tolist() == [5, -1, -2]
    summed = P.decode_summed(P.encode_summed([5, P.MISS], [2**63 + 1, 0]), 2)
    assert summed["nbytes"].tolist() == [5, -1] and summed["checksum"].tolist() == [2**63 + 1, 0]
    placed = np.zeros(2, P.PLACED)
    placed["nbytes"], placed["checksum"] = [7, P.MISS], [99, 0]
    lid, got = P.decode_placed(P.encode_placed(9, placed), 2)
    assert lid == 9 and got["nbytes"].tolist() == [7, -1] and got["checksum"].tolist() == [99, 0]


def test_partial_frame_is_left_for_later():
    frame = _frame(P.Op.CONTAINS, P.encode_keys(make_keys(2)))
    for cut in (1, P.HEADER_BYTES, len(frame) - 1):
        assert P.parse_requests(frame[:cut], LIMITS) == ([], 0)


@pytest.mark.parametrize("data,words", [
    (b"XX" + _frame(P.Op.PING)[2:], "magic"),
    (_frame(P.Op.PING)[:2] + bytes([P.VERSION + 1]) + _frame(P.Op.PING)[3:], "version"),
    (_frame(P.Op.PING)[:3] + b"\xee" + _frame(P.Op.PING)[4:], "opcode"),
    (struct.pack("<2sBBIIIQ", b"KV", P.VERSION, P.Op.PING, 1, 3, 0, 0), "status"),
    (struct.pack("<2sBBIIIQ", b"KV", P.VERSION, P.Op.PUT, 1, 0, 16, 1 << 40), "max_frame_bytes"),
    (struct.pack("<2sBBIIIQ", b"KV", P.VERSION, P.Op.CONTAINS, 1, 0, 1 << 30, 0), "body"),
    (_frame(P.Op.CONTAINS, struct.pack("<I", 65) + bytes(65 * 96)), "max_batch"),
    (_frame(P.Op.CONTAINS, struct.pack("<I", 2) + bytes(96)), "records"),
    (_frame(P.Op.LOOKUP, struct.pack("<dI", float("nan"), 0)), "lease"),
    (_frame(P.Op.LOOKUP, struct.pack("<dI", -1.0, 0)), "lease"),
    (_frame(P.Op.PUT, P.encode_records(P.PUT_REC, make_keys(1), [4], [0]), b"abc"), "announces"),
    (_frame(P.Op.HELLO, b"\xff\xfe"), "JSON"),
    (_frame(P.Op.HELLO, b"[1]"), "object"),
    (_frame(P.Op.SHM_DONE, b"1234"), "8-byte"),
    (_frame(P.Op.SHM_COMMIT, b"123"), "SHM_COMMIT body"),
    (_frame(P.Op.SHM_COMMIT, struct.pack("<QBI", 1, 7, 0)), "action"),
    (_frame(P.Op.SHM_RESERVE, P.encode_records(P.SIZED, make_keys(1) * 2, [1, 1])), "twice"),
    (_frame(P.Op.GET, P.encode_records(P.SIZED, make_keys(1) * 2, [1, 1])), "twice"),
    (P.pack_header(P.Op.STATS, 1, 0, 5) + b"12345", "payload"),
])
def test_bad_frames_name_the_problem(data, words):
    with pytest.raises(ProtocolError, match=words):
        P.parse_requests(data, LIMITS)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2048))
def test_fuzz_arbitrary_bytes(data):
    try:
        reqs, used = P.parse_requests(data, LIMITS)
    except ProtocolError:
        return
    assert 0 <= used <= len(data)


_ops = st.sampled_from([int(op) for op in P.Op])


@st.composite
def _mutated_frames(draw):
    """Valid-looking frames with fields drawn at random, then bytes flipped: reaches far
    deeper into the body decoders than random bytes do."""
    op = draw(_ops)
    n = draw(st.integers(0, 4))
    keys = make_keys(n, salt=str(draw(st.integers(0, 3))))
    kind = draw(st.sampled_from(["keys", "lookup", "sized", "staged", "put", "commit", "u64", "json", "raw"]))
    body = {"keys": lambda: P.encode_keys(keys),
            "lookup": lambda: P.encode_lookup(keys, draw(st.floats(allow_nan=True, allow_infinity=True))),
            "sized": lambda: P.encode_records(P.SIZED, keys, draw(st.lists(st.integers(0, 64), min_size=n, max_size=n))),
            "staged": lambda: P.encode_records(P.STAGED, keys, [8] * n, [0] * n, [1] * n),
            "put": lambda: P.encode_records(P.PUT_REC, keys, [4] * n, [2] * n),
            "commit": lambda: P.encode_commit(draw(st.integers(0, 9)), True, [3] * n),
            "u64": lambda: P.encode_u64(draw(st.integers(0, 2**64 - 1))),
            "json": lambda: P.encode_json({"k": draw(st.text(max_size=8))}),
            "raw": lambda: draw(st.binary(max_size=64))}[kind]()
    payload = draw(st.binary(max_size=256))
    frame = bytearray(P.pack_header(op, 1, len(body), len(payload)) + body + payload)
    for _ in range(draw(st.integers(0, 3))):
        if frame:
            frame[draw(st.integers(0, len(frame) - 1))] = draw(st.integers(0, 255))
    return bytes(frame)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_mutated_frames(), min_size=1, max_size=3))
def test_fuzz_mutated_frames(frames):
    data = b"".join(frames)
    try:
        reqs, used = P.parse_requests(data, LIMITS)
    except ProtocolError:
        return
    assert used <= len(data)
    for header, _ in reqs:
        assert header.op in P.Op._value2member_map_
        assert header.body_len + header.payload_len <= LIMITS.max_frame_bytes


def test_reservation_frames_round_trip():
    keys = make_keys(3)
    frames, used = P.parse_requests(_frame(P.Op.SHM_RESERVE, P.encode_records(P.SIZED, keys, [1, 2, 3]))
                                    + _frame(P.Op.SHM_COMMIT, P.encode_commit(42, False)), LIMITS)
    (h1, (got_keys, rec)), (h2, commit) = frames
    assert got_keys == keys and rec["nbytes"].tolist() == [1, 2, 3]
    assert commit[:2] == (42, False) and len(commit[2]) == 0
    rid, action, sums = P.decode_commit(P.encode_commit(7, True, [1, 2, 2**64 - 1]))
    assert (rid, action, sums.tolist()) == (7, True, [1, 2, 2**64 - 1])


@pytest.mark.parametrize("body, match", [
    (P.encode_commit(1, True, [1, 2])[:-1], "does not hold 2 checksums"),
    (struct.pack("<QBI", 1, 1, 5000), "max_batch"),
    (struct.pack("<QB", 1, 1), "at least"),
])
def test_bad_commit_bodies_are_refused(body, match):
    with pytest.raises(ProtocolError, match=match):
        P.parse_requests(_frame(P.Op.SHM_COMMIT, body), LIMITS)


def test_a_version_2_frame_is_refused_naming_both_versions():
    frame = bytearray(_frame(P.Op.PING))
    frame[2] = 2
    with pytest.raises(ProtocolError, match="unsupported protocol version 2 .this side speaks 3"):
        P.parse_requests(bytes(frame), LIMITS)


# -- size arithmetic (issue 20, finding 1): every length and count against the frame ---------

_EDGES = [0, 1, 7, 8, 2**31, 2**32 - 1, 2**32, P.MAX_FIELD - 1, P.MAX_FIELD, P.MAX_FIELD + 1,
          2**63 - 1, 2**63, 2**64 - 8, 2**64 - 1]
_SIZE = st.one_of(st.integers(0, 64), st.sampled_from(_EDGES), st.integers(0, 2**64 - 1))


@st.composite
def _sized_frames(draw):
    """Record batches whose sizes, offsets and lengths sit at the edges of u32/u64 and of
    MAX_FIELD, with the header's payload length the exact sum, the sum wrapped modulo
    2**64 (the old leak), the bytes actually sent, or anything."""
    kind = draw(st.sampled_from(["put", "get", "staged", "reserve", "nixl", "commit", "count"]))
    n = draw(st.integers(0, 4))
    keys = make_keys(n, salt="sized")
    sizes = draw(st.lists(_SIZE, min_size=n, max_size=n))
    sent = draw(st.binary(max_size=128))
    if kind == "put":
        op, body = P.Op.PUT, P.encode_records(P.PUT_REC, keys, sizes, [1] * n)
    elif kind in ("get", "reserve"):
        op = P.Op.GET if kind == "get" else P.Op.SHM_RESERVE
        body = P.encode_records(P.SIZED, keys, sizes)
    elif kind == "staged":
        offsets = draw(st.lists(_SIZE, min_size=n, max_size=n))
        op, body = P.Op.SHM_PUT, P.encode_records(P.STAGED, keys, sizes, offsets, [1] * n)
    elif kind == "nixl":
        op = draw(st.sampled_from([P.Op.NIXL_GET, P.Op.NIXL_PUT]))
        body = P.encode_nixl(0, 0, keys, sizes, draw(st.lists(_SIZE, min_size=n, max_size=n)), [1] * n)
    elif kind == "commit":   # a count that claims more checksums than the body holds, or fewer
        op = P.Op.SHM_COMMIT
        body = struct.pack("<QBI", 1, 1, draw(st.sampled_from([0, n, n + 1, 2**32 - 1]))) + bytes(8 * n)
    else:                     # a batch count at the u32 edges over a body of n records
        op = P.Op.CONTAINS
        body = struct.pack("<I", draw(st.sampled_from([n, n + 1, 2**31, 2**32 - 1]))) + b"".join(
            k.to_bytes() for k in keys)
    total = sum(sizes)
    payload_len = draw(st.sampled_from([total, total % 2**64, len(sent), draw(st.integers(0, 2**64 - 1))]))
    body_len = draw(st.sampled_from([len(body), len(body), 0, len(body) + 1, 2**32 - 1]))
    header = struct.pack("<2sBBIIIQ", P.MAGIC, P.VERSION, op, 1, 0, body_len, payload_len % 2**64)
    return header + body + sent


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_sized_frames())
def test_fuzz_size_arithmetic(frame):
    """Whatever the numbers, a frame either raises ProtocolError or decodes to sizes and
    offsets that fit in it exactly: no sum, end or count wraps."""
    try:
        reqs, used = P.parse_requests(frame, LIMITS)
    except ProtocolError:
        return
    assert used <= len(frame)
    for header, args in reqs:
        assert header.body_len + header.payload_len <= LIMITS.max_frame_bytes
        op = P.Op(header.op)
        if op in (P.Op.PUT, P.Op.GET, P.Op.SHM_RESERVE, P.Op.SHM_PUT, P.Op.NIXL_GET, P.Op.NIXL_PUT):
            keys, rec = args[-2:] if op in (P.Op.NIXL_GET, P.Op.NIXL_PUT) else args
            assert len(keys) == len(rec) <= LIMITS.max_batch
            sizes = [int(x) for x in rec["nbytes"]]
            assert all(0 <= s <= P.MAX_FIELD for s in sizes)
            if "offset" in rec.dtype.names:
                assert all(int(o) + int(s) <= 2 * P.MAX_FIELD for o, s in zip(rec["offset"], sizes))
            if op is P.Op.PUT:
                assert sum(sizes) == header.payload_len           # exact, in Python integers
                assert used >= P.HEADER_BYTES + header.body_len + header.payload_len   # all of it was there
            else:
                assert header.payload_len == 0
        elif op is P.Op.SHM_COMMIT:
            _, _, sums = args
            assert P.HEADER_BYTES + 13 + 8 * len(sums) <= used
        elif op is P.Op.CONTAINS:
            assert P.HEADER_BYTES + 4 + 96 * len(args) == used


_WIDE = P.Limits(max_frame_bytes=1 << 62, max_batch=64)   # so the record checks, not the frame cap, decide


@pytest.mark.parametrize("sizes, payload_len, limits, match", [
    ([2**64 - 8, 8 + 16], 16, _WIDE, "exceeds"),      # wraps to the payload length: the old cross-client leak
    ([2**64 - 1, 1], 0, _WIDE, "exceeds"),
    ([2**63, 2**63], 0, _WIDE, "exceeds"),
    ([P.MAX_FIELD + 1], 0, _WIDE, "exceeds"),
    ([P.MAX_FIELD, P.MAX_FIELD], 2 * P.MAX_FIELD, LIMITS, "max_frame_bytes"),   # each legal, the frame too big
    ([3, 4], 8, _WIDE, "announces 7"),                # more payload than the sizes
    ([3, 4], 6, _WIDE, "announces 7"),
    ([], 5, _WIDE, "announces 0"),
])
def test_each_put_size_wrap_and_overflow_is_refused(sizes, payload_len, limits, match):
    body = P.encode_records(P.PUT_REC, make_keys(len(sizes), salt="wrap"), sizes, [0] * len(sizes))
    frame = struct.pack("<2sBBIIIQ", P.MAGIC, P.VERSION, P.Op.PUT, 1, 0, len(body), payload_len) + body
    with pytest.raises(ProtocolError, match=match):
        P.parse_requests(frame + bytes(payload_len if payload_len < 64 else 0), limits)
