"""Pure functions of the S3 tier: object names and reply sizes (no server needed)."""

import pytest

from kvstore.keys import BlockKey
from kvstore.testing import make_keys

boto3 = pytest.importorskip("boto3")
from kvstore.tiers.s3.io import object_name, parse_name  # noqa: E402


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


def test_a_reply_without_content_length_is_an_io_failure_not_corruption():
    """Without a Content-Length nothing is known about the object: reading on would
    call a good object corrupt (and delete it), so it is a plain failure instead."""
    from types import SimpleNamespace

    from kvstore.errors import CorruptBlockError
    from kvstore.tiers.s3.io import _length, _size_of

    assert _length(SimpleNamespace(headers={"Content-Length": "1234"})) == 1234
    assert _size_of(SimpleNamespace(headers={"Content-Length": "128", "Content-Range": "bytes 0-127/4096"})) == 4096
    for headers in ({}, {"Content-Length": ""}, {"Content-Length": "-1"}):
        with pytest.raises(ValueError, match="Content-Length") as err:
            _length(SimpleNamespace(headers=headers))
        assert not isinstance(err.value, CorruptBlockError)
