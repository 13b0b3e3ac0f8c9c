"""benchmarks/cluster.py's cross-node rows, in miniature: node A's server started, a batch
saved through it, read back verified through a remote tier on node B, timed, stopped."""

from benchmarks._cluster_cross import cross_rows


def test_cross_node_row_for_the_remote_tier():
    rows, skipped = cross_rows(["remote"], block_bytes=64 * 1024, blocks=3, repeat=2)
    assert not skipped
    (row,) = rows
    assert row["path"].startswith("remote tier") and row["batches"] == 2 and row["verified"]
    assert row["batch_bytes"] == 3 * 64 * 1024 and row["gbps"] > 0 and row["p99_ms"] >= row["p50_ms"] > 0
