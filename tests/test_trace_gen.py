"""The generated traces of ``benchmarks/trace_gen.py`` (issue 39): the conversation
trace's format and prefix-tree property, deterministic for a seed, and the statistics
its docstring gives, unlike the conversation trace's."""

import json

import pytest

from benchmarks import trace_gen
from benchmarks._policy_hints import load_timed_trace


def _tree_ok(records) -> bool:
    parent: dict[int, int | None] = {}
    for record in records:
        previous = None
        for i in record["hash_ids"]:
            if parent.setdefault(i, previous) != previous:
                return False
            previous = i
    return True


@pytest.mark.parametrize("name", list(trace_gen.WORKLOADS))
def test_deterministic_for_a_seed_and_in_the_trace_format(name, tmp_path):
    first, again, other = (trace_gen.WORKLOADS[name](seed) for seed in (1, 1, 2))
    assert first == again
    assert first != other
    assert _tree_ok(first) and _tree_ok(other)       # an id always has the same parent id
    times = [r["timestamp"] for r in first]
    assert times == sorted(times) and times[0] >= 0
    for record in first:
        assert set(record) == {"timestamp", "input_length", "output_length", "hash_ids"}
        blocks = len(record["hash_ids"])
        assert (blocks - 1) * 512 < record["input_length"] <= blocks * 512   # last block partial
    path = trace_gen.cached(name, 1, tmp_path)
    assert [json.loads(line) for line in path.read_text().splitlines()] == first
    requests, seconds = load_timed_trace(path, None)   # what policy_replay --hints reads
    assert requests == [r["hash_ids"] for r in first] and seconds[-1] == times[-1] / 1000


def test_single_turn_statistics():
    s = trace_gen.stats(trace_gen.single_turn(1))
    assert s["requests"] == 3600
    assert 0.8 < s["mean_gap_s"] < 1.2                   # long gaps (conversation: 0.29 s)
    assert s["continuing_share"] < 0.3                   # mostly single-turn (conversation: 0.44)
    assert s["shared_share"] > 0.5                       # shared system prompts


def test_agent_statistics():
    s = trace_gen.stats(trace_gen.agent(1))
    assert s["continuing_share"] > 0.8                   # loops: most requests come back
    assert s["shared_share"] > 0.9                       # long shared prefixes
    assert s["blocks_per_request"] > 20


def test_unknown_workload_is_named():
    with pytest.raises(ValueError, match="unknown workload 'chat'"):
        trace_gen.cached("chat")
