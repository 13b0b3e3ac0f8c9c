"""Access-trace recording: the public prefix-hash format, digests only, bounded rotation,
and reading traces back with errors that name the bad line."""

import json
import os
import stat

import numpy as np
import pytest

from kvstore import Namespace
from kvstore.config import TraceConfig, load_config
from kvstore.errors import ConfigError, InvalidArgumentError
from kvstore.store import Store
from kvstore.trace import TraceRecorder, hash_id, read_trace, trace_files

NS = Namespace(model="m", dtype="bf16", chunk_tokens=4)


def _store(tmp_path, **trace):
    return Store.from_config({"tiers": [{"name": "hot", "kind": "dram", "capacity": 1 << 20}],
                              "trace": {"path": str(tmp_path / "trace.jsonl"), **trace}})


def _lines(path):
    return [json.loads(line) for line in open(path)]


def test_store_records_lookups_in_the_public_format_without_payloads(tmp_path):
    keys = NS.chunk_keys(list(range(12)))
    payload = np.full(1000, 0xAB, np.uint8)
    with _store(tmp_path, block_tokens=4) as store:
        assert store.lookup(keys) == 0
        store.save(keys, [payload] * 3).result()
        assert store.lookup(keys) == 3
    records = _lines(tmp_path / "trace.jsonl")
    # The save of blocks the lookup named is implied by the lookup: not written.
    assert [r.get("op") for r in records] == [None, None]
    for record in records:
        assert set(record) >= {"timestamp", "input_length", "output_length", "hash_ids"}
        assert record["hash_ids"] == [hash_id(k) for k in keys]
        assert record["input_length"] == 12 and record["output_length"] == 0
    assert records[1]["block_bytes"] == 1000
    assert hash_id(keys[0]) == int.from_bytes(keys[0].digest[:8], "big") >> 1
    text = (tmp_path / "trace.jsonl").read_bytes()
    assert b"\xab" not in text and "ab" * 8 not in text.decode()  # no payload, no raw digests


def test_a_save_nobody_looked_up_is_recorded_as_a_save(tmp_path):
    prompt, tail = NS.chunk_keys(list(range(8))), NS.chunk_keys(list(range(16)))[2:]
    with _store(tmp_path) as store:
        store.lookup(prompt)
        store.save(tail, [bytearray(64)] * len(tail)).result()
    lookup, save = _lines(tmp_path / "trace.jsonl")
    assert "op" not in lookup and save["op"] == "save"
    assert save["hash_ids"] == [hash_id(k) for k in tail] and save["block_bytes"] == 64
    requests = list(read_trace([tmp_path / "trace.jsonl"]))
    assert [r.is_save for r in requests] == [False, True]


def test_recording_rotates_and_stays_bounded(tmp_path):
    config = TraceConfig(path=str(tmp_path / "t.jsonl"), max_bytes=4096, max_files=3)
    recorder = TraceRecorder(config)
    keys = NS.chunk_keys(list(range(40)))
    for _ in range(200):
        recorder.lookup(keys)
    recorder.close()
    files = trace_files(tmp_path / "t.jsonl")
    assert [f.name for f in files] == ["t.jsonl.2", "t.jsonl.1", "t.jsonl"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl", "t.jsonl.1", "t.jsonl.2"]
    assert all(f.stat().st_size <= 4096 for f in files)
    stamps = [r.timestamp for r in read_trace(files)]
    assert stamps == sorted(stamps) and len(stamps) > 3


def test_trace_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="trace.max_files"):
        load_config({"tiers": [{"name": "a", "kind": "dram", "capacity": 4096}],
                     "trace": {"path": "x", "max_files": 0}})
    with pytest.raises(ConfigError, match="trace.payload"):
        load_config({"tiers": [{"name": "a", "kind": "dram", "capacity": 4096}],
                     "trace": {"path": "x", "payload": True}})
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="trace.path"):
        _store(tmp_path / "file")   # its parent is a file


@pytest.mark.parametrize("line, problem", [
    ("{not json", "not JSON"),
    ("[1, 2]", "expected an object"),
    ('{"hash_ids": [1, "2"]}', "hash_ids must be a list of integers"),
    ('{"hash_ids": [1], "op": "delete"}', "op must be"),
    ('{"hash_ids": [1], "block_bytes": -4}', "block_bytes"),
])
def test_a_bad_trace_line_is_named(tmp_path, line, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "hash_ids": [1, 2]}\n' + line + "\n")
    with pytest.raises(InvalidArgumentError, match=f"line 2: {problem}"):
        list(read_trace([path]))
    with pytest.raises(InvalidArgumentError, match="cannot read trace"):
        list(read_trace([tmp_path / "missing.jsonl"]))


# -- the trace file is the server's own (issue 34 item 7) -------------------------------------

def test_a_planted_symlink_is_refused_and_its_target_untouched(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("root only\n")
    victim.chmod(0o600)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "trace.jsonl").symlink_to(victim)
    with pytest.raises(ConfigError, match="trace.path: .*is a symbolic link"):
        TraceRecorder(TraceConfig(path=str(tmp_path / "logs" / "trace.jsonl")))
    assert victim.read_text() == "root only\n"


def test_trace_files_are_private(tmp_path):
    old = os.umask(0o022)
    try:
        recorder = TraceRecorder(TraceConfig(path=str(tmp_path / "t.jsonl"), max_bytes=4096, max_files=3))
        for _ in range(200):
            recorder.lookup(NS.chunk_keys(list(range(40))))
        recorder.close()
    finally:
        os.umask(old)
    files = trace_files(tmp_path / "t.jsonl")
    assert len(files) == 3 and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    (tmp_path / "open.jsonl").write_text("")
    (tmp_path / "open.jsonl").chmod(0o644)
    TraceRecorder(TraceConfig(path=str(tmp_path / "open.jsonl"))).close()     # made private when opened
    assert stat.S_IMODE((tmp_path / "open.jsonl").stat().st_mode) == 0o600


def test_a_directory_others_can_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ConfigError, match=r"trace.path: the directory .*writable by other users \(mode 777\)"):
        TraceRecorder(TraceConfig(path=str(shared / "t.jsonl")))
    assert not (shared / "t.jsonl").exists()
    shared.chmod(0o1777)                                                  # sticky, as /tmp: allowed
    TraceRecorder(TraceConfig(path=str(shared / "t.jsonl"))).close()


def test_one_long_line_never_passes_max_bytes(tmp_path):
    recorder = TraceRecorder(TraceConfig(path=str(tmp_path / "t.jsonl"), max_bytes=4096, max_files=2))
    keys = NS.chunk_keys(list(range(4 * 1000)))      # 1,000 ids: about 20 KB as one line
    recorder.lookup(keys, block_bytes=64)
    recorder.lookup(keys[:3])
    recorder.close()
    files = trace_files(tmp_path / "t.jsonl")
    assert all(f.stat().st_size <= 4096 for f in files)
    first, second = (r for f in files for r in _lines(f))
    assert first["truncated_from"] == 1000 and 0 < len(first["hash_ids"]) < 1000
    assert first["hash_ids"] == [hash_id(k) for k in keys[:len(first["hash_ids"])]]    # a prefix of the request
    assert first["input_length"] == 256 * len(first["hash_ids"]) and "truncated_from" not in second
    assert [len(r.hash_ids) for r in read_trace(files)] == [len(first["hash_ids"]), 3]
