"""Known answers: the key derivation and the on-media block format, byte for byte.

Every block on NVMe, in S3, Redis or Mooncake is found by its key and read back through
its header. A silent change to either (a hash input reordered, a field widened) would
orphan every stored block, or worse, make old blocks parse as something else. These
vectors were computed once from the code; a change that breaks them must bump the format
version and say how stored data migrates."""

from __future__ import annotations

import numpy as np

from kvstore.block import EXT_HEADER_BYTES, FLAG_SEGMENTED, checksum, encode_ext_header, header_bytes
from kvstore.keys import Namespace

NS = dict(model="llama-3-8b", dtype="bfloat16", chunk_tokens=4, layout="L32xH8xD128", rank=0, world_size=2, salt="")
NAMESPACE_DIGEST = "24fd4919b55b8161ea7ecbe9d74559fd46ce43c884c3e86a00bfa7b8e23437ed"
CHUNK_KEYS = ["56690405f40919d84ff104a61661b742f6a79b8b1a5aa95552ea5fb9cf336481",
              "8d0351ae1f57efda39db126512140d045ddf6a545d96867e990c9c7430b54832",
              "9128b59bf7b93d03e6e19684ec8cbc11be99ea630b10af40ce9317a1138e6f69"]
SALTED_FIRST_KEY = "9faaf9b7f089a91633dfa2bda5d0b6de14430bf8e594b4b0e9c8c08383821330"
HEADER_V1 = ("4b565342010000000001000000000000712d953b43a40894"
             "56690405f40919d84ff104a61661b742f6a79b8b1a5aa95552ea5fb9cf336481" "8d60c5cd8957cde5")
HEADER_V2 = ("4b565342020000000001000000000000712d953b43a40894"
             "8d0351ae1f57efda39db126512140d045ddf6a545d96867e990c9c7430b54832" "e9d9f26bdc0af4a9"
             "4b56535801000000" "56690405f40919d84ff104a61661b742f6a79b8b1a5aa95552ea5fb9cf336481"
             "00000000000000000000000000000000" "baa35530c861b003")


def test_namespace_and_chunk_keys():
    ns = Namespace(**NS)
    assert ns.digest.hex() == NAMESPACE_DIGEST
    assert [k.hex() for k in ns.chunk_keys(list(range(12)))] == CHUNK_KEYS
    assert Namespace(**{**NS, "salt": "tenant-a"}).chunk_keys([1, 2, 3, 4])[0].hex() == SALTED_FIRST_KEY


def test_payload_checksums():
    assert checksum(np.arange(256, dtype=np.uint8)) == 0x9408A4433B952D71                      # XXH3-64
    assert checksum(np.arange(1 << 20, dtype=np.uint32).view(np.uint8), FLAG_SEGMENTED) == 0x2B41CF3C3F50A34F


def test_block_headers_byte_for_byte():
    keys = Namespace(**NS).chunk_keys(list(range(8)))
    payload = np.arange(256, dtype=np.uint8)
    assert bytes(header_bytes(keys[0].digest, payload)).hex() == HEADER_V1
    out = np.zeros(EXT_HEADER_BYTES, np.uint8)
    encode_ext_header(keys[1].digest, keys[0].digest, payload, out)
    assert bytes(out).hex() == HEADER_V2
