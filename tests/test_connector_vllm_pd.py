"""Disaggregated prefill/decode through a store (issue 38 items 1-2): a producer and a
consumer, each a vLLM Scheduler (real classes) with its worker-side connector over real
CPU KV caches, sharing a real ``kvstore serve`` subprocess. The producer's params
travel to the consumer in ``SamplingParams(extra_args={"kv_transfer_params": ...})``,
as vLLM's offline API carries them."""

from __future__ import annotations

import time

import pytest
import torch

from tests import vllm_support as vs

vs.require_vllm()
pytest.importorskip("kvstore.client", reason="the cache server is not in this build")

from kvstore.client import Client  # noqa: E402
from kvstore.testing import free_port  # noqa: E402
from tests._serve import start_server, stop_server  # noqa: E402
from tests.test_connector_vllm import CHUNK, PROMPT, same_pages  # noqa: E402

DONE = 30.0    # every request here ends well within this: a hang fails the test


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("pd")
    port = free_port()
    cfg = d / "serve.yaml"
    cfg.write_text(f"server: {{host: 127.0.0.1, port: {port}, admin_port: null}}\n"
                   "tiers:\n  - {name: hot, kind: dram, capacity: 64MiB}\n")
    proc = start_server(str(cfg), port, d / "serve.log")
    yield f"127.0.0.1:{port}"
    stop_server(proc)


@pytest.fixture
def engines(tmp_path, server):
    model = vs.model_dir(tmp_path)
    with Client(server) as c:
        c.clear()
    made = vs.Engines()

    def make(role, seed=None, policy="recompute", **options):
        extra = {"server": server, "chunk_tokens": CHUNK, **options}
        return made.make(vs.vllm_config(model, extra, role=role, policy=policy), seed)

    yield make
    made.shutdown()


class Run:
    """One request driven through a scheduler and its worker until vLLM let it go."""

    def __init__(self, sched, worker, req, layers=None):
        self.sched, self.worker, self.req, self.layers = sched, worker, req, layers
        self.params = None
        self.saves, self.loads, self.computed = [], [], 0
        self.status = None
        self.held_at_finish = None      # whether vLLM still kept its blocks when it finished
        sched.add_request(req)

    def step(self):
        out = self.sched.schedule()
        meta = out.kv_connector_metadata
        self.saves += [s for s in meta.saves if s.req_id == self.req.request_id]
        self.loads += [s for s in meta.loads if s.req_id == self.req.request_id]
        self.computed += out.num_scheduled_tokens.get(self.req.request_id, 0)
        kv_out = vs.run_worker_step(self.worker, meta, out.finished_req_ids, layerwise_layers=self.layers)
        engine_outs = self.sched.update_from_output(out, vs.model_output(out, kv_out))
        for outs in engine_outs.values():
            for o in outs.outputs:
                if o.request_id == self.req.request_id and o.finish_reason is not None:
                    self.params, self.status = o.kv_transfer_params, self.req.status
                    self.held_at_finish = self.held
        if not out.num_scheduled_tokens:
            time.sleep(0.005)     # transfers only: let the store's threads run

    @property
    def held(self):
        return self.req.request_id in self.sched.requests

    def finish(self):
        deadline = time.monotonic() + DONE
        while self.held:
            self.step()
            assert time.monotonic() < deadline, "request did not end"
        return self


def stats(sched):
    return sched.connector.store.stats()["connectors"]["vllm"]


def blocks(transfers):
    return [b for t in transfers for b in t.block_ids]


@pytest.mark.parametrize("layerwise", [False, True])
def test_handoff_is_byte_exact_and_counted_on_both_sides(engines, layerwise):
    ps, pw, pc = engines("kv_producer", seed=31, layerwise=layerwise)
    prod = Run(ps, pw, vs.request("p1", PROMPT), layers=vs.layer_names() if layerwise else None).finish()
    h = prod.params["kvstore"]["handoff"]
    assert (h["chunks"], h["tokens"], h["chunk_tokens"]) == (3, 96, CHUNK)
    assert h["source"].startswith("server:") and h["deadline"] > time.time() - 60
    assert stats(ps)["handoffs_sent"] == 1
    assert prod.held_at_finish         # blocks kept until the saves settled (finished_sending)

    cs, cw, cc = engines("kv_consumer", seed=32)
    cons = Run(cs, cw, vs.request("c1", PROMPT, kv_transfer_params=prod.params))
    cons.step()
    assert cons.req.status.name == "WAITING_FOR_REMOTE_KVS"     # loaded asynchronously
    cons.finish()
    (load,) = cons.loads
    assert load.is_async and load.wait_until == h["deadline"]
    assert cons.computed == len(PROMPT) - 96       # only the last partial chunk is computed
    assert same_pages(pc, blocks(prod.saves)[:len(load.block_ids)], cc, load.block_ids)
    assert stats(cs)["handoffs_received"] == 1 and stats(cs)["failed_handoffs"] == 0


def test_consumer_loads_only_what_its_own_prefix_cache_lacks(engines):
    ps, pw, pc = engines("kv_producer", seed=33)
    cs, cw, cc = engines("kv_consumer", seed=34)
    # The consumer computed the first chunk itself before (kept in its prefix cache).
    own = Run(cs, cw, vs.request("own", PROMPT[:CHUNK + 5])).finish()
    assert own.loads == [] and own.computed == CHUNK + 5
    prod = Run(ps, pw, vs.request("p1", PROMPT)).finish()
    cons = Run(cs, cw, vs.request("c1", PROMPT, kv_transfer_params=prod.params)).finish()
    (load,) = cons.loads
    assert load.first_chunk == 1 and len(load.block_ids) == 2 * (CHUNK // vs.BLOCK)
    assert cons.computed == len(PROMPT) - 96
    assert same_pages(pc, blocks(prod.saves)[CHUNK // vs.BLOCK:3 * CHUNK // vs.BLOCK], cc, load.block_ids)


def test_consumer_that_asks_before_the_saves_land_waits_and_loads(engines, server):
    ps, pw, pc = engines("kv_producer", seed=35)
    prod = Run(ps, pw, vs.request("p1", PROMPT)).finish()
    with Client(server) as c:
        c.clear()                                  # as if the producer's saves had not landed yet
    cs, cw, cc = engines("kv_consumer", seed=36)
    cons = Run(cs, cw, vs.request("c1", PROMPT, kv_transfer_params=prod.params))
    for _ in range(5):
        cons.step()
    assert cons.req.status.name == "WAITING_FOR_REMOTE_KVS"     # waiting for the keys, not recomputing
    again = Run(ps, pw, vs.request("p2", PROMPT)).finish()     # the producer's saves land now
    cons.finish()
    (load,) = cons.loads
    assert cons.computed == len(PROMPT) - 96
    assert same_pages(pc, blocks(again.saves)[:len(load.block_ids)], cc, load.block_ids)
    assert stats(cs)["handoffs_received"] == 1 and stats(cs)["failed_handoffs"] == 0


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_keys_that_never_arrive_end_by_the_deadline_as_a_failed_load(engines, server, policy):
    ps, pw, _ = engines("kv_producer", seed=37, handoff_wait_s=3.0)
    cs, cw, cc = engines("kv_consumer", seed=38, policy=policy)
    prod = Run(ps, pw, vs.request("p1", PROMPT)).finish()
    with Client(server) as c:
        c.clear()                                  # the saves are lost: they never arrive
    before = {n: t.clone() for n, t in cc.items()}
    cons = Run(cs, cw, vs.request("c1", PROMPT, kv_transfer_params=prod.params)).finish()
    (load,) = cons.loads
    assert stats(cs)["failed_handoffs"] == 1 and stats(cs)["handoffs_received"] == 0
    if policy == "recompute":
        assert cons.status.name == "FINISHED_LENGTH_CAPPED"
        assert cons.computed == len(PROMPT)                    # recomputed, nothing loaded
    else:
        assert cons.status.name == "FINISHED_ERROR"
        ids = torch.tensor(load.block_ids)                    # nothing was written into its blocks
        assert all(torch.equal(cc[n][ids], before[n][ids]) for n in cc)


def test_params_for_another_prompt_are_ignored(engines):
    ps, pw, _ = engines("kv_producer", seed=39)
    prod = Run(ps, pw, vs.request("p1", PROMPT)).finish()
    cs, cw, _ = engines("kv_consumer")
    other = [t + 1 for t in PROMPT]
    cons = Run(cs, cw, vs.request("c1", other, kv_transfer_params=prod.params)).finish()
    assert cons.loads == [] and cons.computed == len(other)     # no wait, no load: computed
    bad = {"kvstore": {"handoff": {**prod.params["kvstore"]["handoff"], "chunks": "3"}}}
    cons = Run(cs, cw, vs.request("c2", PROMPT, kv_transfer_params=bad)).finish()
    assert all(not load.wait_until for load in cons.loads)     # malformed: a plain lookup


def test_kv_both_hands_off_only_requests_that_ask(engines):
    s, w, _ = engines("kv_both", seed=40)
    plain = Run(s, w, vs.request("plain", PROMPT)).finish()
    assert plain.params is None and not plain.held_at_finish
    asked = Run(s, w, vs.request("asked", PROMPT[:70], kv_transfer_params={"do_remote_decode": True})).finish()
    assert asked.params["kvstore"]["handoff"]["chunks"] == 2 and asked.held_at_finish


def test_handoff_params_sit_beside_a_retention_hint(caplog):
    from kvstore.connectors._vllm_scheduler import vllm_hint
    from kvstore.hint import Hint

    handoff = {"v": 1, "source": "server:h:1", "first_key": "0" * 64, "last_key": "0" * 64, "chunks": 1,
               "chunk_tokens": CHUNK, "tokens": CHUNK, "deadline": 0.0, "lease_expires": 0.0}
    req = vs.request("h", PROMPT, kv_transfer_params={"kvstore": {"retain_s": 600, "handoff": handoff}})
    assert vllm_hint(req) == Hint(600.0)
    with caplog.at_level("WARNING"):
        assert vllm_hint(vs.request("h2", PROMPT, kv_transfer_params={"kvstore": {"handoff": handoff}})) is None
    assert "hint" not in caplog.text      # a handoff alone is no malformed hint
