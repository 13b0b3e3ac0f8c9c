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
