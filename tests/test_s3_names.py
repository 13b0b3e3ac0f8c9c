"""Object names of the S3 tier (no server needed)."""

import pytest

from kvstore.keys import BlockKey
from kvstore.testing import make_keys

boto3 = pytest.importorskip("boto3")
from tiers._s3io import object_name, parse_name  # noqa: E402


@pytest.mark.parametrize("prefix", ["kvstore", "a/b", ""])
def test_names_round_trip(prefix):
    key = make_keys(2)[1]
    name = object_name(prefix, key)
    assert name == (f"{prefix}/" if prefix else "") + f"{key.namespace.hex()}/{key.hex()}"
    assert parse_name(prefix, name) == (key.namespace.hex(), key.hex())
    bare = BlockKey(key.digest)
    assert parse_name(prefix, object_name(prefix, bare)) == (None, key.hex())


@pytest.mark.parametrize("name", ["kvstore/x/y", "kvstore/" + "0" * 64, "other/" + "0" * 64 + "/" + "1" * 64,
                                  "kvstore/" + "g" * 64 + "/" + "1" * 64, "kvstore/_/" + "1" * 63,
                                  "kvstore/_/" + "1" * 64 + "/extra"])
def test_foreign_objects_are_ignored(name):
    assert parse_name("kvstore", name) is None
