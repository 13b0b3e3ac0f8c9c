"""The vLLM connector outlives its cache server (issue 35, finding 2): with ``server``
set, an engine starts while the server is down, every lookup is a miss and every save
is skipped while it is unreachable (counted), a load the server cannot serve any more
fails closed through the usual path, and the connector reconnects on its own, to a
restarted same-host server too. vLLM's real Scheduler and CPU KV caches, a real
``kvstore serve`` subprocess on a loopback port (started, stopped, restarted)."""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch

from tests import vllm_support as vs

vs.require_vllm()
_missing = [m for m in ("kvstore.tiers.nvme", "kvstore.client", "kvstore.server") if importlib.util.find_spec(m) is None]
if _missing:
    pytest.skip(f"needs {', '.join(_missing)} (the NVMe tier and the cache server)", allow_module_level=True)

from kvstore.testing import free_port  # noqa: E402
from tests._serve import start_server, stop_server  # noqa: E402
from tests.test_connector_vllm import CHUNK, PROMPT, blocks_of, run_to_completion, same_pages, step  # noqa: E402


@pytest.fixture
def server(tmp_path):
    """``start()`` / ``stop()`` a ``kvstore serve`` on one port and NVMe directory."""
    port = free_port()
    config = tmp_path / "serve.yaml"
    config.write_text(f"""
server: {{host: 127.0.0.1, port: {port}, admin_port: null}}
placement: {{write: through}}
tiers:
  - {{name: hot, kind: dram, capacity: 32MiB}}
  - {{name: disk, kind: nvme, path: {tmp_path / 'nvme'}, capacity: 64MiB, file_bytes: 16MiB}}
""")

    class Server:
        address = f"127.0.0.1:{port}"
        proc = None

        def start(self):
            self.proc = start_server(str(config), port, tmp_path / "serve.log")

        def stop(self):
            if self.proc is not None:
                stop_server(self.proc)
                self.proc = None

    srv = Server()
    yield srv
    srv.stop()


@pytest.fixture
def engine(tmp_path, server):
    made = vs.Engines()

    def make(seed=None, prefix_caching=True):
        vc = vs.vllm_config(vs.model_dir(tmp_path), {"server": server.address, "chunk_tokens": CHUNK},
                            prefix_caching=prefix_caching)
        return made.make(vc, seed)

    yield make
    made.shutdown()


def finish(sched, worker, req):
    """Schedule ``req`` until vLLM finishes it (its saves may be dropped: never waits for
    them to land); the connector's saves of it."""
    return run_to_completion(sched, worker, req, landed=False)


def counters(connector) -> dict[str, int]:
    return connector.store.stats()["connectors"]["vllm"]


def wait_until(what, cond):
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, f"{what} did not happen"
        time.sleep(0.05)


def reachable(connector) -> bool:
    return connector.store.stats()["server_link"]["reachable"]


def test_engine_starts_without_its_server_and_hits_once_it_is_up(engine, server):
    # Nothing listens on the port yet. (vLLM's own prefix cache off: a later hit on this
    # engine can only come from the server.)
    sched, worker, caches = engine(seed=21, prefix_caching=False)
    saves = finish(sched, worker, vs.request("r1", PROMPT))
    assert saves                                      # the connector asked for them ...
    wait_until("the skipped saves are counted", lambda: counters(worker)["dropped_saves"] == 3)
    assert counters(sched.connector)["unreachable_lookups"] >= 1
    assert counters(sched.connector)["hit_tokens"] == 0

    server.start()
    wait_until("reconnect (scheduler)", lambda: reachable(sched.connector))
    wait_until("reconnect (worker)", lambda: reachable(worker))
    saves = finish(sched, worker, vs.request("r2", list(range(300, 400))))
    wait_until("the saves land", lambda: all(worker.store.contains([k for t in saves for k in t.keys_for(0)])))
    saved = torch.tensor(blocks_of(saves))
    expect = {n: t[saved].clone() for n, t in caches.items()}
    for t in caches.values():
        t.zero_()
    sched.add_request(vs.request("r3", list(range(300, 396)) + list(range(900, 910))))
    out, kv_out = step(sched, worker)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 96
    (load,) = out.kv_connector_metadata.loads
    assert not kv_out.invalid_block_ids
    loaded = torch.tensor(blocks_of([load]))
    assert all(torch.equal(caches[n][loaded], expect[n]) for n in caches)


def test_server_stopped_mid_run_fails_closed_and_comes_back_after_a_restart(engine, server):
    server.start()
    s1, w1, c1 = engine(seed=22)
    saves = finish(s1, w1, vs.request("r1", PROMPT))
    wait_until("the saves land", lambda: all(w1.store.contains([k for t in saves for k in t.keys_for(0)])))

    s2, w2, c2 = engine(prefix_caching=False)       # every later hit comes from the server
    before = {n: t.clone() for n, t in c2.items()}
    req = vs.request("r2", PROMPT[:96] + list(range(700, 710)))
    s2.add_request(req)
    out = s2.schedule()                               # planned from the server's answer ...
    (load,) = out.kv_connector_metadata.loads
    server.stop()                                     # ... which stops before the worker loads
    kv_out = vs.run_worker_step(w2, out.kv_connector_metadata)
    assert kv_out.invalid_block_ids == set(load.block_ids)     # fails closed: recomputed
    bad = torch.tensor(load.block_ids)
    assert all(torch.equal(c2[n][bad], before[n][bad]) for n in c2)
    s2.update_from_output(out, vs.model_output(out, kv_out))
    assert counters(w2)["failed_loads"] == 3
    deadline = time.monotonic() + 30
    while s2.has_unfinished_requests():               # the hooks never raise; vLLM recomputes
        step(s2, w2)
        assert time.monotonic() < deadline
    assert req.num_output_tokens == 1

    # While down: lookups are misses, saves skipped, the engine serves.
    finish(s2, w2, vs.request("r3", PROMPT[:64] + list(range(800, 840))))
    assert counters(s2.connector)["unreachable_lookups"] >= 1

    # Restarted on the same NVMe directory: both sides find it again (its new socket and
    # arena too) and the recovered chunks load byte-exact.
    server.start()
    wait_until("reconnect", lambda: reachable(s2.connector) and reachable(w2))
    s2.add_request(vs.request("r4", PROMPT[:96] + list(range(600, 620))))
    out, kv_out = step(s2, w2)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 96
    (load,) = out.kv_connector_metadata.loads
    assert not kv_out.invalid_block_ids
    assert same_pages(c1, blocks_of(saves), c2, blocks_of([load]))
