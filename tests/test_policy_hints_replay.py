"""``policy_replay --hints``: the simulated client's truth and accuracy, and hints given
through a real Store keep a continuing conversation that LRU alone loses."""

import pytest

from benchmarks._policy_hints import continues, hint_scope, hints_table, run_hints, simulate
from kvstore import Hint
from kvstore._replay import PAYLOAD_BYTES, replay_store, to_keys

# A conversation [1, 2, 3] continues as [1, 2, 4, 5] after three one-off requests that
# push it out of a 5-block LRU cache.
REQUESTS = [[1, 2, 3], [10, 11], [12, 13], [14, 15], [1, 2, 4, 5]]
TIMES = [0.0, 1.0, 2.0, 3.0, 4.0]


def test_truth_is_whether_the_last_full_block_comes_back():
    assert continues(to_keys(REQUESTS)) == [True, False, False, False, False]


@pytest.mark.parametrize("precision, recall", [(1.0, 1.0), (0.8, 0.8), (0.6, 0.6), (0.3, 0.5)])
def test_the_simulated_client_reaches_its_accuracy(precision, recall):
    truth = [i % 3 == 0 for i in range(30000)]
    hinted, got_precision, got_recall = simulate(truth, precision, recall, seed=5)
    assert got_precision == pytest.approx(precision, abs=0.02)
    assert got_recall == pytest.approx(recall, abs=0.02)
    right = sum(h and t for h, t in zip(hinted, truth))
    assert right / sum(hinted) == pytest.approx(got_precision)


def test_a_hint_keeps_the_conversation_through_the_store_and_expires():
    trace = to_keys(REQUESTS)
    config = {"tiers": [{"name": "t", "kind": "dram", "capacity": 5 * PAYLOAD_BYTES, "eviction": "lru"}],
              "io_threads": 1}
    hint = Hint(retain_s=60)
    lru = replay_store(config, trace, times_s=TIMES)
    hinted = replay_store(config, trace, hints=[hint, None, None, None, None], times_s=TIMES)
    late = replay_store(config, trace, hints=[hint, None, None, None, None], times_s=[0, 100, 200, 300, 400])
    assert lru.hits == 0
    assert hinted.hits == 2          # blocks 1 and 2 of the second turn
    assert late.hits == 0            # the hint expired before the one-offs came


def test_run_hints_reports_every_accuracy_beside_lru_and_belady():
    requests = REQUESTS * 20
    results = run_hints(requests, [float(i) for i in range(len(requests))], retain_s=30, seed=1,
                        fractions=[0.5])
    (row,) = results["rows"]
    assert [(h["precision"], h["recall"]) for h in row["hinted"]] == [(1.0, 1.0), (1.0, 0.8), (0.8, 0.8), (0.6, 0.6), (0.3, 0.5),
                                                                     (0.0, 1.0)]
    assert all(0 <= h["prefix_hit_rate"] <= row["belady"] + 1e-9 for h in row["hinted"])
    assert row["lru"] <= row["belady"]


def test_hint_scope_stops_before_the_partial_last_block():
    trace = to_keys(REQUESTS)
    assert hint_scope(trace, "request") is None
    assert hint_scope(trace, "full-blocks") == [2, 1, 1, 1, 3]
    config = {"tiers": [{"name": "t", "kind": "dram", "capacity": 5 * PAYLOAD_BYTES, "eviction": "lru"}],
              "io_threads": 1}
    hint = Hint(retain_s=60)
    scoped = replay_store(config, trace, hints=[hint, None, None, None, None], times_s=TIMES,
                          hint_blocks=hint_scope(trace, "full-blocks"))
    assert scoped.hits == 2          # the conversation's two full blocks, kept by the hint
    with pytest.raises(ValueError, match="scope"):
        hint_scope(trace, "blocks")


def test_run_hints_replays_the_wrong_client_at_more_seeds_and_tables_it():
    requests = REQUESTS * 20
    results = run_hints(requests, [float(i) for i in range(len(requests))], retain_s=30, seed=1,
                        fractions=[0.5], wrong_seeds=[2, 3])
    (row,) = results["rows"]
    assert [e["seed"] for e in row["wrong_hints_by_seed"]] == [1, 2, 3]
    assert results["hint_scope"] == "full-blocks"
    assert all("protect_s" in h["hint_trust"] for h in row["hinted"])
    table = hints_table(results)
    assert "by client seed 1, 2, 3" in table and "scope full-blocks" in table
    assert "of the P1/R0.8 gain over LRU" in table and "worst of 3 seeds" in table
