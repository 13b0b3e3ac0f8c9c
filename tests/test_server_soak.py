"""The soak of issue 20 (``benchmarks/_server_soak.py``): a real ``kvstore serve`` under
bounded attack loops (stalled and oversized HELLOs, stalled PUT bodies, connection
floods past both connection limits, malformed frames), 8 s in four windows alternating
with quiet ones, while a well-behaved client keeps reading. A test of bounds, not of timing: every good read succeeds with the
right bytes, the server's RSS stays within the stated bound over its quiet value,
``/healthz`` answers throughout, and every limit was reached and counted. The good
client's p99 quiet and under attack are printed (``benchmarks/server_soak.py`` records
them in ``benchmarks/results/server_soak.json``), never asserted."""

from __future__ import annotations

import pytest

from benchmarks import _server_soak as soak

pytestmark = pytest.mark.slow


def test_bounded_attacks_leave_the_good_client_served_and_the_server_within_its_memory_bound(tmp_path):
    r = soak.run(tmp_path)
    print("\n" + soak.summary(r))
    for phase in ("quiet", "under_attack"):
        assert r[phase]["failed"] == 0 and r[phase]["wrong"] == 0, (phase, r[phase])
    assert r["under_attack"]["ops"] >= 500                          # it kept working throughout
    assert r["rss_samples"] >= 50
    assert r["rss_growth_bytes"] < soak.RSS_BOUND_BYTES, soak.summary(r)
    assert r["healthz"]["probes"] >= 5 and r["healthz"]["ok"] == r["healthz"]["probes"], r["healthz"]
    for reason in ("handshake_timeout", "read_timeout", "TOO_LARGE", "PROTOCOL", "max_connections",
                   "max_connections_per_ip"):
        assert r["refused"].get(reason, 0) >= 1, (reason, r["refused"])
    a = r["attacks"]
    assert a["stalled_puts"] >= soak.PUT_WIDTH and a["stalled_puts_closed"] == a["stalled_puts"]
    assert a["stalled_hellos"] >= 1 and a["stalled_hellos_closed"] == a["stalled_hellos"]
    assert a["oversized_hellos"] >= 100 and a["oversized_hellos_closed"] == a["oversized_hellos"]
    assert a["flood_rounds"] >= 2 and a["malformed"] >= 100
    assert r["buffer_waits"] >= 1                                    # the stalled PUTs met the budget
    assert r["server_stderr_tracebacks"] == 0
