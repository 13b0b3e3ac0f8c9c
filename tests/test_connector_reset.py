"""Issue 33 item 5: an engine's cache reset (vLLM ``reset_prefix_cache(reset_connector=
True)``, run by weight updates and ``pause_generation(clear_cache=True)``) drops what the
kvstore connector stored, through vLLM's real Scheduler, or fails the reset."""

import pytest

from tests import vllm_support as vs

vs.require_vllm()
servers = pytest.importorskip("tests._servers", reason="the cache server is not in this build")

from tests.test_connector_vllm import PROMPT, engines, run_to_completion, step  # noqa: E402,F401
from tests.test_connector_vllm_server import TOKEN  # noqa: E402
from tests.test_connector_vllm_server import engines as server_engines  # noqa: E402,F401
from tests.test_connector_vllm_server import server  # noqa: E402,F401
from tests.test_connector_vllm_tier import cascade, chunk_key, run, scheduled  # noqa: E402
from tests.test_connector_vllm_tier import engine as tier_engine  # noqa: E402,F401


def computed_from_store(sched, worker, req_id, tokens):
    sched.add_request(vs.request(req_id, tokens))
    out, _ = step(sched, worker)
    return out.scheduled_new_reqs[0].num_computed_tokens


def test_reset_drops_the_embedded_stores_chunks_and_later_saves_hit_again(engines):
    s1, w1, _ = engines(seed=1)
    saves = run_to_completion(s1, w1, vs.request("r1", PROMPT))
    old = [k for t in saves for k in t.keys_for(0)]
    other, ow, _ = engines(model_id="another-model")          # same Store, other namespace
    run_to_completion(other, ow, vs.request("o1", PROMPT))
    assert w1.store.stats()["blocks"] == 6
    assert s1.reset_prefix_cache(reset_connector=True) is True
    assert not any(w1.store.contains(old))
    assert w1.store.stats()["blocks"] == 3                    # the other engine's chunks stay
    assert computed_from_store(s1, w1, "r2", PROMPT) == 0
    run_to_completion(s1, w1, vs.request("r3", list(range(300, 400))))
    assert computed_from_store(s1, w1, "r4", list(range(300, 400))) == 96   # new saves serve again


def test_an_old_weights_save_landing_after_the_reset_is_never_loaded(engines):
    """A save still in flight at the reset (old weights' bytes) lands after the clear:
    it lands under the old generation's keys, which no request of this engine asks for."""
    s1, w1, _ = engines(seed=1)
    saves = run_to_completion(s1, w1, vs.request("r1", PROMPT))
    old = [k for t in saves for k in t.keys_for(0)]
    assert s1.reset_prefix_cache(reset_connector=True) is True
    late = [bytearray(64) for _ in old]
    assert w1.store.save(old, late).result() == [True] * len(old)   # the late save, after the clear
    assert computed_from_store(s1, w1, "r2", PROMPT) == 0


def test_reset_in_server_mode_clears_this_engines_namespaces_on_the_server(server_engines, server):
    s1, w1, _ = server_engines(seed=3)
    run_to_completion(s1, w1, vs.request("r1", PROMPT))
    run_to_completion(s1, w1, vs.request("salted", PROMPT, cache_salt="tenant-a"))
    assert server.store.stats()["blocks"] == 6
    assert s1.reset_prefix_cache(reset_connector=True) is True
    assert server.store.stats()["blocks"] == 0
    s2, w2, _ = server_engines()
    assert computed_from_store(s2, w2, "r2", PROMPT) == 0


class _NoScopedClear:
    """A StoreAPI whose clear() cannot be limited to namespaces."""

    def __init__(self, store):
        self._store = store

    def clear(self):
        raise AssertionError("must not empty a store that other engines may share")

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_reset_fails_where_the_store_cannot_drop_namespaces(engines):
    s1, w1, _ = engines(seed=1)
    run_to_completion(s1, w1, vs.request("r1", PROMPT))
    side = s1.connector._scheduler
    side.store = _NoScopedClear(side.store)
    assert s1.connector.reset_cache() is False
    assert s1.reset_prefix_cache(reset_connector=True) is False


def test_worker_role_connector_reports_it_cannot_reset(engines):
    _, w1, _ = engines()
    assert w1.reset_cache() is False


def test_tier_reset_drops_its_rows_and_forgets_hits(tier_engine):
    tier1, req, _ = cascade(tier_engine)
    keys = [chunk_key(tier1, req, i) for i in range(3)]
    assert all(tier1.store.contains(keys))
    tier1.drain_jobs()                  # what vLLM's TieringManager.reset_cache calls
    assert not any(tier1.store.contains(keys))
    s2, tier2 = tier_engine()
    s2.add_request(vs.request("r2", PROMPT[:96] + list(range(600, 640))))
    outs = run(s2, tier2, lambda out: scheduled(out, "r2"))
    assert scheduled(outs[-1], "r2").num_computed_tokens == 0


def test_tier_reset_through_vllms_scheduler(tier_engine):
    tier1, req, _ = cascade(tier_engine)
    keys = [chunk_key(tier1, req, i) for i in range(3)]
    s2, tier2 = tier_engine()            # same embedded Store and namespace
    assert all(tier2.store.contains(keys))
    assert s2.reset_prefix_cache(reset_connector=True) is True
    assert not any(tier2.store.contains(keys))


def test_tier_reset_where_the_store_cannot_drop_namespaces_still_serves_no_old_row(tier_engine, caplog):
    tier1, req, _ = cascade(tier_engine)
    keys = [chunk_key(tier1, req, i) for i in range(3)]
    real = tier1.store
    tier1.store = _NoScopedClear(real)
    tier1.drain_jobs()                  # logged, not raised: vLLM's reset goes on
    assert "could not drop" in caplog.text
    assert all(real.contains(keys))     # the old rows stay stored...
    fresh = [chunk_key(tier1, req, i) for i in range(3)]
    assert not any(real.contains(fresh))   # ...under a namespace this tier no longer reads


def test_tier_reset_moves_to_a_new_generation(tier_engine):
    """An engine on a shared server that still runs the old weights writes rows under
    the old namespace after this tier's reset: they are never this tier's hits."""
    tier1, req, _ = cascade(tier_engine)
    before = [chunk_key(tier1, req, i) for i in range(3)]
    tier1.drain_jobs()
    tier1.store.save(before, [bytearray(8)] * 3).result()    # an old-weights replica's late rows
    after = [chunk_key(tier1, req, i) for i in range(3)]
    assert set(before).isdisjoint(after) and not any(tier1.store.contains(after))
