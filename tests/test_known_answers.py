"""Known-answer vectors for what is stored on media: key digests and the block header.

Every block on NVMe and in S3 is found by its key digest and read back through its
header. A silent change to either (hash, namespace encoding, chunk byte order, header
layout, checksum) would orphan every stored block, so the exact bytes are pinned here.
A deliberate format change updates these vectors together with a format version bump.
"""

from __future__ import annotations

import numpy as np

from kvstore import block
from kvstore.keys import BlockKey, Namespace

NS = Namespace(model="meta-llama/Llama-3.1-8B", dtype="bfloat16", chunk_tokens=4,
               layout="L32xKV8xD128", rank=0, world_size=1)
PAYLOAD = bytes(range(256)) * 4


def test_namespace_digest():
    assert NS.digest.hex() == "47f7877b4b1c454a15d2b495f959b49905bdb887b639f00195237cb30d586a66"
    salted = Namespace("m", "f16", 16, rank=1, world_size=2, salt="tenant-a")
    assert salted.digest.hex() == "2bb40ea7eb9ed805babc3d59721610f3a6b08ae0a9203505bbfd0d87630d79d0"


def test_chunk_key_digests_and_chain():
    keys = NS.chunk_keys(list(range(10)))           # two full chunks; tokens 8, 9 get no key
    assert [k.hex() for k in keys] == [
        "7480466e9d8d0a3d5f90c13a7ecd4640a10ee45444377262992a471266aef2a2",
        "fcb13f1b4e0402de3e1623382687039ada55531a3e5c64e3812b03c4577dfbec",
    ]
    assert keys[0].parent is None and keys[1].parent == keys[0].digest
    assert keys[0].namespace == keys[1].namespace == NS.digest
    # the same tokens as a numpy array of another integer type give the same keys
    assert NS.chunk_keys(np.arange(10, dtype=np.int64)) == keys
    salted = Namespace("m", "f16", 16, rank=1, world_size=2, salt="tenant-a")
    assert salted.chunk_keys(np.arange(16, dtype=np.uint32))[0].hex() == \
        "06fdb8aa2cbcb9234b0c68a6e75af0fee223e281895c1c24efe6981b99d969f6"


def test_engine_hash_keys():
    first = NS.chunk_keys(list(range(4)))[0]
    assert NS.key_for(12345).hex() == "f1362d785b6167d46316305f101f16c78d2c14417331c090dd73556adbafc02f"
    assert NS.key_for("abc", first).hex() == "f9cca4f3cfae277c882a4d0252ccec659860c29b80f62f8b2510a1f1ff54e738"


def test_payload_checksum():
    assert block.checksum(PAYLOAD) == 12137474952470826274


def test_block_header_byte_for_byte():
    digest = bytes.fromhex("7480466e9d8d0a3d5f90c13a7ecd4640a10ee45444377262992a471266aef2a2")
    header = bytes(block.header_bytes(digest, PAYLOAD))
    assert header.hex() == (
        "4b565342" "0100" "0000" "0004000000000000" "228d398429f970a8"
        "7480466e9d8d0a3d5f90c13a7ecd4640a10ee45444377262992a471266aef2a2"
        "6c546081b28ae1d4")
    assert block.parse_header(header, digest=digest) == (len(PAYLOAD), block.checksum(PAYLOAD))


def test_extended_block_header_byte_for_byte():
    parent = bytes.fromhex("7480466e9d8d0a3d5f90c13a7ecd4640a10ee45444377262992a471266aef2a2")
    digest = bytes.fromhex("fcb13f1b4e0402de3e1623382687039ada55531a3e5c64e3812b03c4577dfbec")
    out = bytearray(block.EXT_HEADER_BYTES)
    block.encode_ext_header(digest, parent, PAYLOAD, out)
    assert out.hex() == (
        "4b565342" "0200" "0000" "0004000000000000" "228d398429f970a8"
        "fcb13f1b4e0402de3e1623382687039ada55531a3e5c64e3812b03c4577dfbec"
        "d0f7084f28c7a051"
        "4b565358" "01" "000000"
        "7480466e9d8d0a3d5f90c13a7ecd4640a10ee45444377262992a471266aef2a2"
        "00000000000000000000000000000000" "90c1a8a14c854059")
    assert block.parse_extension(bytes(out)) == parent
    assert BlockKey(digest, parent, NS.digest).to_bytes() == digest + parent + NS.digest
