import subprocess
import sys

import numpy as np
import pytest

from kvstore.errors import InvalidArgumentError
from kvstore.keys import BlockKey, Namespace

NS = dict(model="llama-3-8b", dtype="bfloat16", chunk_tokens=4, layout="L32xH8xD128", rank=0, world_size=2, salt="")


def test_chunk_keys_only_full_chunks_and_chained():
    ns = Namespace(**NS)
    keys = ns.chunk_keys(list(range(10)))
    assert len(keys) == 2
    assert keys[0].parent is None and keys[1].parent == keys[0].digest
    assert all(k.namespace == ns.digest for k in keys)


def test_same_prefix_same_keys_different_suffix_diverges():
    ns = Namespace(**NS)
    a = ns.chunk_keys([1, 2, 3, 4, 5, 6, 7, 8])
    b = ns.chunk_keys([1, 2, 3, 4, 5, 6, 7, 9])
    c = ns.chunk_keys([0, 2, 3, 4, 5, 6, 7, 8])
    assert a[0] == b[0] and a[1] != b[1]
    assert a[0] != c[0] and a[1] != c[1]  # a key identifies its whole prefix


def test_input_types_agree():
    torch = pytest.importorskip("torch")
    ns = Namespace(**NS)
    tokens = list(range(100, 116))
    expected = ns.chunk_keys(tokens)
    assert ns.chunk_keys(np.array(tokens, dtype=np.int32)) == expected
    assert ns.chunk_keys(np.array(tokens, dtype=np.int64)) == expected
    assert ns.chunk_keys(torch.tensor(tokens)) == expected


@pytest.mark.parametrize("field,value", [("model", "other"), ("dtype", "float16"), ("chunk_tokens", 2),
                                         ("layout", "x"), ("rank", 1), ("world_size", 4), ("salt", "tenant")])
def test_namespaces_differing_in_any_field_never_share_keys(field, value):
    tokens = list(range(16))
    a = Namespace(**NS).chunk_keys(tokens)
    b = Namespace(**{**NS, field: value}).chunk_keys(tokens)
    assert not set(a) & set(b)


def test_hex_and_bytes_round_trip():
    key = Namespace(**NS).chunk_keys(range(8))[1]
    assert BlockKey.from_hex(key.hex()) == key
    back = BlockKey.from_bytes(key.to_bytes())
    assert back == key and back.parent == key.parent and back.namespace == key.namespace
    with pytest.raises(InvalidArgumentError):
        BlockKey.from_hex("zz")
    with pytest.raises(InvalidArgumentError):
        BlockKey(b"short")


@pytest.mark.parametrize("bad", [[-1, 2, 3, 4], [[1, 2], [3, 4]], [1.5, 2.0, 3.0, 4.0]])
def test_bad_tokens_rejected(bad):
    with pytest.raises(InvalidArgumentError):
        Namespace(**NS).chunk_keys(bad)


def test_bad_namespace_rejected():
    with pytest.raises(InvalidArgumentError, match="chunk_tokens"):
        Namespace(**{**NS, "chunk_tokens": 0})
    with pytest.raises(InvalidArgumentError, match="rank"):
        Namespace(**{**NS, "rank": 2})


def test_keys_stable_across_interpreters_and_hash_seeds():
    code = ("from kvstore.keys import Namespace;"
            "ns = Namespace(model='m', dtype='fp16', chunk_tokens=16, salt='s');"
            "print(','.join(k.hex() for k in ns.chunk_keys(range(100))))")
    outs = set()
    for seed in ("0", "12345"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"}, cwd=str(__import__("pathlib").Path(__file__).parents[1]))
        outs.add(out.stdout.strip())
    assert len(outs) == 1
    here = Namespace(model="m", dtype="fp16", chunk_tokens=16, salt="s").chunk_keys(range(100))
    assert outs.pop() == ",".join(k.hex() for k in here)
