import numpy as np
import pytest

from kvstore import block
from kvstore.errors import CorruptBlockError

DIGEST = bytes(range(32))


def _encoded(payload: np.ndarray) -> np.ndarray:
    buf = np.zeros(block.HEADER_BYTES + payload.nbytes, np.uint8)
    buf[block.HEADER_BYTES:] = payload
    block.encode_header(DIGEST, payload, buf[:block.HEADER_BYTES])
    return buf


def test_round_trip_returns_view_without_copy():
    payload = np.random.default_rng(0).integers(0, 256, 10000, dtype=np.uint8)
    buf = _encoded(payload)
    view = block.verify(DIGEST, buf)
    assert np.array_equal(np.frombuffer(view, np.uint8), payload)
    buf[block.HEADER_BYTES] ^= 0  # same memory: the view is inside buf
    assert np.shares_memory(np.frombuffer(view, np.uint8), buf)


@pytest.mark.parametrize("where", [0, 5, 10, 20, 30, 60, 64, 5000, -1])
def test_any_flipped_byte_is_detected(where):
    payload = np.random.default_rng(1).integers(0, 256, 8000, dtype=np.uint8)
    buf = _encoded(payload)
    buf[where] ^= 0x40
    with pytest.raises(CorruptBlockError):
        block.verify(DIGEST, buf)


def test_wrong_key_truncation_and_length():
    payload = np.ones(4096, np.uint8)
    buf = _encoded(payload)
    with pytest.raises(CorruptBlockError, match="another key"):
        block.verify(bytes(32), buf)
    with pytest.raises(CorruptBlockError, match="truncated"):
        block.verify(DIGEST, buf[:-1])
    with pytest.raises(CorruptBlockError, match="length"):
        block.verify(DIGEST, buf, payload_length=10)
    with pytest.raises(CorruptBlockError):
        block.parse_header(buf[:10])


def test_verify_payload_apart():
    payload = np.arange(256, dtype=np.uint8)
    header = block.header_bytes(DIGEST, payload)
    length, csum = block.parse_header(header, digest=DIGEST)
    block.verify_payload(payload, length, csum)
    payload[3] = 0
    with pytest.raises(CorruptBlockError):
        block.verify_payload(payload, length, csum)


PARENT = bytes(range(100, 132))


def _ext_header(parent, payload=np.arange(100, dtype=np.uint8)) -> bytearray:
    out = bytearray(block.EXT_HEADER_BYTES)
    block.encode_ext_header(DIGEST, parent, payload, out)
    return out


@pytest.mark.parametrize("parent", [PARENT, None])
def test_extended_header_round_trip(parent):
    payload = np.arange(100, dtype=np.uint8)
    header = _ext_header(parent, payload)
    version, length, csum = block.parse_any_header(header, digest=DIGEST)
    assert (version, length, csum) == (block.EXT_VERSION, 100, block.checksum(payload))
    assert block.header_size(version) == block.EXT_HEADER_BYTES
    assert block.parse_extension(header) == parent


@pytest.mark.parametrize("where", list(range(64, 128, 7)) + [127])
def test_any_flipped_extension_byte_is_detected(where):
    header = _ext_header(PARENT)
    header[where] ^= 0x10
    with pytest.raises(CorruptBlockError, match="extension"):
        block.parse_extension(header)


def test_extension_only_verifies_with_its_own_header():
    mine, other = _ext_header(PARENT), _ext_header(None, np.ones(7, np.uint8))
    spliced = mine[:64] + other[64:]
    block.parse_any_header(spliced, digest=DIGEST)  # the first 64 bytes are still fine
    with pytest.raises(CorruptBlockError, match="extension checksum"):
        block.parse_extension(spliced)
    with pytest.raises(CorruptBlockError, match="truncated"):
        block.parse_extension(mine[:100])


def test_version_1_readers_reject_version_2_and_unknown_flags():
    header = _ext_header(PARENT)
    with pytest.raises(CorruptBlockError, match="version 2"):
        block.parse_header(header, digest=DIGEST)
    v1 = bytearray(block.header_bytes(DIGEST, np.ones(3, np.uint8)))
    assert block.parse_any_header(v1)[0] == block.VERSION
    v1[6] = 2  # a flag no version defines, with a matching header checksum
    v1[56:64] = block.checksum(memoryview(v1)[:56]).to_bytes(8, "little")
    with pytest.raises(CorruptBlockError, match="flags"):
        block.parse_any_header(v1)


def test_parent_of_wrong_size_is_refused():
    with pytest.raises(ValueError, match="parent digest"):
        block.encode_ext_header(DIGEST, b"short", np.ones(3, np.uint8), bytearray(block.EXT_HEADER_BYTES))


# -- the segmented checksum (FLAG_SEGMENTED) ----------------------------------------------

SEG = 64 << 10


def _block(version: int, flags: int, payload: np.ndarray) -> np.ndarray:
    head = block.header_size(version)
    buf = np.zeros(head + payload.nbytes, np.uint8)
    buf[head:] = payload
    if version == block.VERSION:
        block.encode_header(DIGEST, payload, buf[:head], flags=flags)
    else:
        block.encode_ext_header(DIGEST, PARENT, payload, buf[:head], flags=flags)
    return buf


@pytest.mark.parametrize("version", [block.VERSION, block.EXT_VERSION])
@pytest.mark.parametrize("flags", [0, block.FLAG_SEGMENTED])
@pytest.mark.parametrize("n", [0, 100, 3 * SEG + 5])
def test_both_versions_and_checksum_kinds_read_back(version, flags, n):
    payload = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    buf = _block(version, flags, payload)
    head = block.parse_block_header(buf, digest=DIGEST)
    assert (head.version, head.flags, head.length) == (version, flags, n)
    assert head.checksum == block.checksum(payload, flags)
    assert np.array_equal(np.frombuffer(block.verify(DIGEST, buf), np.uint8), payload)
    block.verify_payload(payload, n, head.checksum, head.flags)
    if n:
        buf[-1] ^= 0x01
        with pytest.raises(CorruptBlockError, match="payload checksum"):
            block.verify(DIGEST, buf)


def test_segmented_checksum_differs_from_plain_on_multi_segment_payloads():
    payload = np.random.default_rng(5).integers(0, 256, 4 * SEG, dtype=np.uint8)
    plain, seg = _block(1, 0, payload), _block(1, block.FLAG_SEGMENTED, payload)
    assert block.parse_header(plain)[1] != block.parse_header(seg)[1]
    # a header whose flag was cleared no longer matches its header checksum
    seg[6] = 0
    with pytest.raises(CorruptBlockError, match="header checksum"):
        block.parse_block_header(seg)
    # and a payload verified under the other kind fails, never passes
    length, csum = block.parse_header(plain)
    with pytest.raises(CorruptBlockError):
        block.verify_payload(payload, length, csum, block.FLAG_SEGMENTED)


def test_unknown_flags_are_refused_at_encode():
    with pytest.raises(ValueError, match="flags"):
        block.encode_header(DIGEST, np.ones(3, np.uint8), bytearray(64), flags=0x4)
