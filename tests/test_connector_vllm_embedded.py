"""An embedded ``store`` is refused, at connector start-up, wherever vLLM runs the worker
outside the scheduler's process (issue 35, finding 4): the two sides would open two
different Stores, so saves would land in one and lookups ask the other. Driven with
vLLM's real VllmConfig / ParallelConfig and its connector factory."""

import pytest

from tests import vllm_support as vs

vs.require_vllm()

from kvstore.errors import ConfigError  # noqa: E402


def _connector(vc, role):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return KVConnectorFactory.create_connector(vc, role, vs.kv_cache_config(vc))


def _config(tmp_path, extra, backend):
    """vLLM's config with ``backend`` as its resolved executor backend. ParallelConfig
    checks that Ray is installed for "ray" and this venv has none: there the resolved
    value is set on the built config, as VllmConfig leaves it where Ray is."""
    from vllm.config import ParallelConfig

    parallel = ParallelConfig(distributed_executor_backend=None if backend == "ray" else backend)
    vc = vs.vllm_config(vs.model_dir(tmp_path), extra, parallel=parallel)
    if backend == "ray":
        vc.parallel_config.distributed_executor_backend = "ray"
    return vc


@pytest.mark.parametrize("backend", ["mp", "ray"])
@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_embedded_store_is_refused_when_the_worker_has_a_process_of_its_own(tmp_path, backend, role):
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    vc = _config(tmp_path, {"store": vs.store_config(name="refused")}, backend)
    assert vc.parallel_config.distributed_executor_backend == backend
    assert vc.parallel_config.world_size == 1
    with pytest.raises(ConfigError) as err:
        _connector(vc, KVConnectorRole[role])
    assert "'server'" in str(err.value) and repr(backend) in str(err.value)


def test_embedded_store_is_accepted_for_the_uniprocess_executor(tmp_path):
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    vc = _config(tmp_path, {"store": vs.store_config(name="uni")}, "uni")
    conn = _connector(vc, KVConnectorRole.SCHEDULER)
    try:
        assert conn.store.lookup([]) == 0
    finally:
        conn.shutdown()


def test_server_mode_is_accepted_for_the_mp_executor(tmp_path):
    """``server`` is the fix the error names: the same engine config with it starts."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    servers = pytest.importorskip("tests._servers", reason="the cache server is not in this build")
    srv = servers.ThreadServer(servers.config_dict())
    try:
        vc = _config(tmp_path, {"server": srv.address}, "mp")
        conn = _connector(vc, KVConnectorRole.SCHEDULER)
        conn.shutdown()
    finally:
        srv.stop()
