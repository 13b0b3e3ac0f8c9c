"""``kvstore replay``: the what-if replay of an access trace through the real Store, on a
slice of the production trace in the repo and on a trace recorded from a live server."""

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks.policy_replay import replay
from kvstore import Namespace
from kvstore._replay import to_keys
from kvstore.cli import main
from kvstore.trace import read_trace

TRACE = Path(__file__).parent / "data" / "conversation_trace_400.jsonl"


def _run(capsys, *args):
    code = main(["replay", *map(str, args), "--no-progress"])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_replay_of_the_repo_trace_tries_every_change_and_recommends(tmp_path, capsys):
    config = tmp_path / "kvstore.yaml"
    config.write_text("tiers:\n"
                      "  - {name: hot, kind: dram, capacity: 64MiB, eviction: lru}\n"
                      f"  - {{name: warm, kind: nvme, path: {tmp_path / 'unused'}, capacity: 256MiB}}\n")
    code, out, _ = _run(capsys, TRACE, "--config", config, "--block-bytes", "1MiB", "--limit", "300",
                        "--policies", "lru,lineage,s3fifo", "--png", tmp_path / "r.png", "--json", tmp_path / "r.json")
    assert code == 0
    report = json.loads((tmp_path / "r.json").read_text())
    labels = [row["variant"] for row in report["rows"]]
    for tier in ("hot", "warm"):
        for change in ("eviction lineage", "eviction s3fifo", "min_hits 2", "min_hits 3",
                       "capacity x0.5", "capacity x2", "capacity x4"):
            assert f"{tier}: {change}" in labels
    assert labels[0] == "as configured" and set(report["belady"]) == {"x0.5", "x1", "x2", "x4"}
    assert not (tmp_path / "unused").exists()     # replays never touch the configured media
    for row in report["rows"]:
        # Per-tier hits add up to the prefix hits, and nothing beats the offline optimum.
        assert sum(row["tier_hit_rates"].values()) == pytest.approx(row["prefix_hit_rate"])
        capacity = sum(row["tier_capacity_blocks"].values())
        scale = next(k for k, f in (("x0.5", 0.5), ("x1", 1), ("x2", 2), ("x4", 4)) if capacity <= 320 * f)
        assert row["prefix_hit_rate"] <= report["belady"][scale] + 1e-9
    rows = {row["variant"]: row for row in report["rows"]}
    assert rows["warm: capacity x4"]["prefix_hit_rate"] >= rows["as configured"]["prefix_hit_rate"]
    assert rows["warm: min_hits 3"]["tier_bytes_written"]["warm"] < rows["as configured"]["tier_bytes_written"]["warm"]
    assert (tmp_path / "r.png").stat().st_size > 1000
    assert "Belady" in out and ("Recommendation (same capacities):" in out or "keep the configured" in out)
    if "Recommendation (same capacities):" in out:
        assert "Expected: prefix hit rate" in out
        assert any(label.startswith("recommended: ") for label in labels)


def test_a_single_tier_replay_matches_the_policy_model(tmp_path, capsys):
    """The configured row is the Store's own answer: the same as the policy model's."""
    requests = [r.hash_ids for r in read_trace([TRACE], limit=200)]
    trace = to_keys(requests)
    distinct = len({k for keys in trace for k in keys})
    blocks = distinct // 20
    config = tmp_path / "one.yaml"
    config.write_text(f"tiers:\n  - {{name: hot, kind: dram, capacity: {blocks * 4096}, eviction: lru}}\n")
    _run(capsys, TRACE, "--config", config, "--block-bytes", "4096", "--limit", "200", "--policies", "lru",
         "--png", "", "--json", tmp_path / "r.json")
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["rows"][0]["prefix_hit_rate"] == pytest.approx(replay("lru", trace, blocks), abs=1e-12)


def test_bad_input_is_named(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("tiers:\n  - {name: hot, kind: dram, capacity: 1MiB}\n")
    code, _, err = _run(capsys, TRACE, "--config", config, "--png", "")
    assert code == 2 and "records no block sizes; give --block-bytes" in err
    code, _, err = _run(capsys, TRACE, "--config", config, "--block-bytes", "lots", "--png", "")
    assert code == 2 and "--block-bytes" in err
    code, _, err = _run(capsys, TRACE, "--config", config, "--block-bytes", "4096", "--policies", "lru,nope")
    assert code == 2 and "unknown nope" in err
    (tmp_path / "bad.jsonl").write_text('{"hash_ids": [1, 2]}\n{"hash_ids": "x"}\n')
    code, _, err = _run(capsys, tmp_path / "bad.jsonl", "--config", config, "--block-bytes", "4096")
    assert code == 2 and "line 2: hash_ids must be a list of integers" in err


def test_replay_of_a_trace_recorded_by_a_live_server(tmp_path, capsys):
    """A server with ``trace:`` records its clients' traffic; replaying that trace with
    the server's own config reproduces the hit rate the clients saw."""
    from kvstore.client import Client
    from kvstore.testing import free_port
    from tests._serve import start_server, stop_server

    port, block = free_port(), 4096
    tiers = "tiers:\n  - {name: hot, kind: dram, capacity: 160KiB, eviction: lru}\n"
    config = tmp_path / "serve.yaml"
    config.write_text(f"server: {{host: 127.0.0.1, port: {port}, admin_port: null}}\n{tiers}"
                      f"trace: {{path: {tmp_path / 'trace.jsonl'}, max_bytes: 1MiB, max_files: 2}}\n")
    ns = Namespace(model="m", dtype="u8", chunk_tokens=1)
    rng = np.random.default_rng(7)
    conversations = [list(rng.integers(0, 1 << 30, 4)) for _ in range(12)]
    payload = np.full(block, 7, np.uint8)
    dsts = [np.empty(block, np.uint8) for _ in range(64)]
    hits = refs = 0
    proc = start_server(str(config), port, tmp_path / "serve.log")
    try:
        with Client(f"127.0.0.1:{port}") as client:
            for turn in range(60):
                tokens = conversations[int(rng.integers(0, len(conversations)))]
                tokens.extend(rng.integers(0, 1 << 30, int(rng.integers(1, 4))))
                keys = ns.chunk_keys(tokens)
                n = client.lookup(keys)
                hits, refs = hits + n, refs + len(keys)
                if n:
                    assert all(client.load(keys[:n], dsts[:n]).result())
                if n < len(keys):
                    client.save(keys[n:], [payload] * (len(keys) - n)).result()
    finally:
        stop_server(proc)
    recorded = list(read_trace([tmp_path / "trace.jsonl"]))
    assert len(recorded) == 60 and not any(r.is_save for r in recorded)
    assert {r.block_bytes for r in recorded[1:]} == {block}
    assert 0 < hits < refs
    replay_config = tmp_path / "replay.yaml"
    replay_config.write_text(tiers)
    code, out, err = _run(capsys, tmp_path / "trace.jsonl", "--config", replay_config, "--policies", "lru,lfu",
                        "--png", "", "--json", tmp_path / "r.json")
    assert code == 0, err
    assert "Expected" in out or "keep the configured" in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["block_bytes"] == block and report["block_refs"] == refs
    assert report["rows"][0]["prefix_hit_rate"] == pytest.approx(hits / refs, abs=1e-12)


# -- bad traces and bounded memory (issue 34 item 9) ------------------------------------------

@pytest.mark.parametrize("line, problem", [
    ("[" * 100_000 + "]" * 100_000, "line 2: not JSON a trace holds"),
    ('{"hash_ids": [1], "block_bytes": true}', "line 2: block_bytes must be a positive integer"),
    ('{"hash_ids": [1], "block_bytes": 1' + "0" * 30 + "}", "line 2: block_bytes must be a positive integer "
                                                          "of at most 1099511627776"),
], ids=["deep-json", "bool-size", "absurd-size"])
def test_a_bad_line_is_one_error_naming_it(tmp_path, capsys, line, problem):
    config = tmp_path / "c.yaml"
    config.write_text("tiers:\n  - {name: hot, kind: dram, capacity: 1MiB}\n")
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"hash_ids": [1, 2], "block_bytes": 4096}\n' + line + "\n")
    code, _, err = _run(capsys, trace, "--config", config, "--png", "")
    assert code == 2 and problem in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and len(err) < 400


def test_an_absurd_block_size_flag_is_refused(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("tiers:\n  - {name: hot, kind: dram, capacity: 1MiB}\n")
    code, _, err = _run(capsys, TRACE, "--config", config, "--block-bytes", "1000000TiB", "--png", "")
    assert code == 2 and "--block-bytes must be positive and at most 1TiB" in err


def test_distinct_blocks_past_max_blocks_are_refused_before_the_replay(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("tiers:\n  - {name: hot, kind: dram, capacity: 1MiB}\n")
    trace = tmp_path / "wide.jsonl"
    trace.write_text("".join(json.dumps({"hash_ids": list(range(i * 50, i * 50 + 50)), "block_bytes": 4096}) + "\n"
                             for i in range(10)))
    code, _, err = _run(capsys, trace, "--config", config, "--max-blocks", "120", "--png", "")
    assert code == 2 and "more than --max-blocks 120 distinct blocks (within its first 3 lines)" in err
    code, out, _ = _run(capsys, trace, "--config", config, "--max-blocks", "500", "--policies", "lru", "--png", "")
    assert code == 0 and "Belady" in out


def _two_tier(tmp_path):
    config = tmp_path / "kvstore.yaml"
    config.write_text("tiers:\n"
                      "  - {name: hot, kind: dram, capacity: 32MiB, eviction: lru}\n"
                      f"  - {{name: warm, kind: nvme, path: {tmp_path / 'unused'}, capacity: 128MiB}}\n")
    return config


def test_replay_defaults_to_the_whole_trace_and_says_why_steps_were_not_taken(tmp_path, capsys):
    """Issue 39: no --limit replays every line; each eviction and admission step not
    recommended is listed with its reason; the table never cuts a label."""
    code, out, _ = _run(capsys, TRACE, "--config", _two_tier(tmp_path), "--block-bytes", "1MiB",
                        "--policies", "lru,fifo", "--png", "", "--json", tmp_path / "r.json")
    assert code == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["trace_lines"] == len(TRACE.read_text().splitlines()) == 400
    assert report["objective"] == "hit"
    listed = {e["variant"] for e in report["not_recommended"]}
    recommended = next((r["variant"] for r in report["rows"] if r["kind"] == "recommended"), "")
    steps = {r["variant"] for r in report["rows"] if r["kind"] in ("eviction", "admission")}
    assert listed == {s for s in steps if s not in recommended}
    assert "Not recommended (--objective hit):" in out
    for entry in report["not_recommended"]:
        assert f"{entry['variant']}" in out and entry["reason"] in out
        assert "points" in entry["reason"]
    for row in report["rows"]:
        assert any(line.startswith(row["variant"] + " ") for line in out.splitlines())   # whole label


def test_objective_wear_recommends_a_write_cut_that_hit_alone_does_not(tmp_path, capsys):
    """--objective wear=W: a change that cuts a tier's writes for a little hit rate is
    worth it once writes weigh enough; under 'hit' it is not taken for that."""
    args = (TRACE, "--config", _two_tier(tmp_path), "--block-bytes", "1MiB", "--policies", "lru", "--png", "")
    _run(capsys, *args, "--json", tmp_path / "hit.json")
    _run(capsys, *args, "--objective", "wear=100", "--json", tmp_path / "wear.json")
    hit, wear = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("hit", "wear"))
    assert wear["objective"] == "wear=100"
    rows = {r["variant"]: r for r in wear["rows"]}
    base = rows["as configured"]["tier_bytes_written"]["warm"]
    cut = rows["warm: min_hits 3"]["tier_bytes_written"]["warm"]
    assert cut < base
    chosen = next(r for r in wear["rows"] if r["kind"] == "recommended")
    assert "warm: min_hits" in chosen["variant"]                    # writes weigh: a write cut wins
    assert chosen["tier_bytes_written"]["warm"] < base


def test_a_bad_objective_is_named(tmp_path, capsys):
    for bad in ("speed", "wear=-1", "wear=x"):
        code, _, err = _run(capsys, TRACE, "--block-bytes", "1MiB", "--objective", bad, "--png", "")
        assert code == 2 and f"--objective: unknown objective '{bad}'" in err
