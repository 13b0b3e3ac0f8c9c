import importlib.util
import subprocess
import sys

import pytest

from kvstore.errors import ConfigError
from kvstore.transport import FallbackCounter, nixl_available, select_transport


def test_auto_picks_fastest_available():
    assert select_transport("auto", local=True, nixl_ok=True) == "shm"
    assert select_transport("auto", local=True, nixl_ok=False) == "shm"
    assert select_transport("auto", local=False, nixl_ok=True) == "nixl"
    assert select_transport("auto", local=False, nixl_ok=False) == "tcp"


def test_explicit_choices():
    assert select_transport("tcp", local=True, nixl_ok=True) == "tcp"
    assert select_transport("nixl", local=True, nixl_ok=True) == "nixl"
    assert select_transport("shm", local=True, nixl_ok=False) == "shm"
    with pytest.raises(ConfigError, match="another host"):
        select_transport("shm", local=False, nixl_ok=True)
    with pytest.raises(ConfigError, match="nixl"):
        select_transport("nixl", local=False, nixl_ok=False)
    with pytest.raises(ConfigError, match="must be one of"):
        select_transport("rdma", local=False, nixl_ok=True)


def test_auto_falls_back_when_nixl_not_installed():
    """In a process where the nixl package cannot be found (its spec lookup hidden, as
    on a machine without it), auto picks TCP for remote clients and an explicit nixl
    says why it cannot."""
    code = (
        "import importlib.util as u\n"
        "orig = u.find_spec\n"
        "u.find_spec = lambda n, *a, **k: None if n == 'nixl' else orig(n, *a, **k)\n"
        "from kvstore.transport import nixl_available, select_transport\n"
        "ok, why = nixl_available()\n"
        "assert not ok and 'not installed' in why, why\n"
        "assert select_transport('auto', local=False) == 'tcp'\n"
        "try:\n"
        "    select_transport('nixl', local=False)\n"
        "except ValueError as e:\n"
        "    assert 'not installed' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('explicit nixl must fail without nixl')\n"
        "print('fallback-ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "fallback-ok" in out.stdout


def test_nixl_detection_matches_install():
    ok, detail = nixl_available()
    assert ok == (importlib.util.find_spec("nixl") is not None), detail


def test_fallback_counter(caplog):
    counter = FallbackCounter()
    with caplog.at_level("WARNING"):
        counter.record("10.0.0.2:5000", "nixl", RuntimeError("UCX endpoint failed"))
        counter.record("10.0.0.3:5000", "nixl", RuntimeError("boom"))
    assert counter.stats() == {"nixl->tcp": 2}
    assert counter.total == 2
    assert "falling back to tcp" in caplog.text and "UCX endpoint failed" in caplog.text
