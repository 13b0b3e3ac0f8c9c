"""What this node can use: RDMA devices, NIXL backends, CUDA / GPUDirect Storage, and
direct I/O on each configured NVMe directory.

Every probe returns :class:`Check` items — never raises — so ``kvstore doctor`` always
prints a full report; an absent capability carries the reason it is absent. Probes that
load native libraries which may crash (pyverbs from the system Python, NIXL plugins) run
in a child process with a timeout.
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvstore.config import StoreConfig

SYSTEM_PYTHON = "/usr/bin/python3"
SYSFS_INFINIBAND = Path("/sys/class/infiniband")
PROBE_TIMEOUT_S = 30.0

# Runs under whichever interpreter has pyverbs (Debian's python3-pyverbs installs for the
# system Python only); prints one JSON object.
_PYVERBS_SCRIPT = r"""
import json
try:
    import pyverbs.device as d
    from pyverbs.pyverbs_error import PyverbsRDMAError
except Exception as exc:
    print(json.dumps({"import_error": f"{type(exc).__name__}: {exc}"})); raise SystemExit
out = {"devices": []}
try:
    devs = d.get_device_list()
except PyverbsRDMAError as exc:
    devs = []
    out["list_error"] = str(exc)
for dev in devs:
    name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    entry = {"name": name, "ports": []}
    try:
        with d.Context(name=name) as ctx:
            attr = ctx.query_device()
            for port in range(1, attr.phys_port_cnt + 1):
                pa = ctx.query_port(port)
                entry["ports"].append({"port": port, "state": d.port_state_to_str(pa.state),
                                       "link_layer": d.link_layer_to_str(pa.link_layer)})
    except Exception as exc:
        entry["error"] = f"{type(exc).__name__}: {exc}"
    out["devices"].append(entry)
print(json.dumps(out))
"""


@dataclass
class Check:
    """One line of the report: ``area`` (rdma, nixl, cuda, gds, direct_io, transport),
    ``name`` (device, backend, directory), ``ok`` and a human-readable ``detail`` that
    says why when ``ok`` is False."""

    area: str
    name: str
    ok: bool
    detail: str
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_checks(config: StoreConfig | None = None, *, extra_paths: list[str] | None = None) -> list[Check]:
    """All probes, in report order. ``extra_paths`` are probed for direct I/O alongside
    the NVMe tiers' directories from ``config``."""
    checks: list[Check] = []
    checks += rdma_checks()
    checks += nixl_checks()
    checks += cuda_checks()
    checks += direct_io_checks(_nvme_paths(config) + list(extra_paths or []))
    return checks


def _nvme_paths(config: StoreConfig | None) -> list[str]:
    if config is None:
        return []
    return [p for t in config.tiers if t.kind == "nvme" for p in t.paths]


# --- RDMA -------------------------------------------------------------------------------

def rdma_checks() -> list[Check]:
    """RDMA devices and their ports, through pyverbs in this interpreter, else the system
    Python's pyverbs, else sysfs."""
    reasons = []
    result = _pyverbs_here()
    if "import_error" in result:
        reasons.append(f"pyverbs not importable in {sys.executable} ({result['import_error']})")
        result = _pyverbs_system()
        if "import_error" in result:
            reasons.append(f"pyverbs not usable through {SYSTEM_PYTHON} ({result['import_error']})")
            return _rdma_from_sysfs(reasons)
        source = f"pyverbs via {SYSTEM_PYTHON}"
    else:
        source = "pyverbs"
    if not result.get("devices"):
        why = result.get("list_error") or "device list is empty"
        return [Check("rdma", "devices", False, f"no RDMA devices ({source}: {why})")]
    return [_device_check(dev, source) for dev in result["devices"]]


def _device_check(dev: dict[str, Any], source: str) -> Check:
    if dev.get("error"):
        return Check("rdma", dev["name"], False, f"cannot open device: {dev['error']}", {"source": source})
    ports = dev.get("ports", [])
    active = [p for p in ports if "ACTIVE" in str(p.get("state", "")).upper()]
    desc = ", ".join(f"port {p['port']} {p['state']} {p['link_layer']}" for p in ports) or "no ports"
    if not active:
        return Check("rdma", dev["name"], False, f"no active port ({desc})", {"ports": ports, "source": source})
    return Check("rdma", dev["name"], True, desc, {"ports": ports, "source": source})


def _pyverbs_here() -> dict[str, Any]:
    try:
        import pyverbs  # noqa: F401
    except Exception as exc:
        return {"import_error": f"{type(exc).__name__}: {exc}"}
    return _run_json([sys.executable, "-c", _PYVERBS_SCRIPT])


def _pyverbs_system() -> dict[str, Any]:
    if not os.path.exists(SYSTEM_PYTHON):
        return {"import_error": f"{SYSTEM_PYTHON} does not exist"}
    return _run_json([SYSTEM_PYTHON, "-c", _PYVERBS_SCRIPT])


def _run_json(argv: list[str]) -> dict[str, Any]:
    """Run a probe child (it may load native code that crashes) and parse its JSON."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                              env=_probe_env(), cwd=_repo_root())
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"import_error": f"probe failed to run: {exc}"}
    for line in reversed(proc.stdout.strip().splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"import_error": f"probe exited with {proc.returncode}: {tail}"}


def _probe_env() -> dict[str, str]:
    env = dict(os.environ)
    if not SYSFS_INFINIBAND.exists():
        env.setdefault("UCX_MODULES", "^ib")  # bundled UCX crashes at exit without InfiniBand
    return env


def _repo_root() -> str:
    return str(Path(__file__).resolve().parent.parent)


def _rdma_from_sysfs(reasons: list[str]) -> list[Check]:
    why = "; ".join(reasons)
    if not SYSFS_INFINIBAND.is_dir():
        return [Check("rdma", "devices", False,
                      f"no RDMA devices ({SYSFS_INFINIBAND} does not exist: no RDMA driver loaded; {why})")]
    devices = sorted(p.name for p in SYSFS_INFINIBAND.iterdir())
    if not devices:
        return [Check("rdma", "devices", False, f"no RDMA devices ({SYSFS_INFINIBAND} is empty; {why})")]
    checks = []
    for name in devices:
        ports = []
        for port_dir in sorted((SYSFS_INFINIBAND / name / "ports").glob("*")):
            state = _read(port_dir / "state")
            ports.append({"port": int(port_dir.name), "state": state, "link_layer": _read(port_dir / "link_layer")})
        checks.append(_device_check({"name": name, "ports": ports}, f"sysfs ({why})"))
    return checks


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return "unknown"


# --- NIXL -------------------------------------------------------------------------------

def nixl_checks() -> list[Check]:
    """NIXL itself and each backend plugin it ships, created in a child process."""
    result = _run_json([sys.executable, "-m", "kvstore.net.nixl.probe"])
    if "import_error" in result:
        return [Check("nixl", "nixl", False,
                      f"NIXL not usable: {result['import_error']} "
                      "(install: pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1)")]
    checks = [Check("nixl", "nixl", True, f"nixl {result.get('version', '?')} loaded")]
    for name, info in sorted(result.get("backends", {}).items()):
        ok = bool(info.get("ok"))
        detail = f"loads; memory: {', '.join(info.get('mem_types', [])) or 'none'}" if ok else info.get("reason", "fails")
        checks.append(Check("nixl", f"backend {name}", ok, detail))
    return checks


# --- CUDA / GDS -------------------------------------------------------------------------

def cuda_checks() -> list[Check]:
    checks = []
    try:
        import torch
    except Exception as exc:
        return [Check("cuda", "cuda", False, f"torch not importable: {exc}"),
                Check("gds", "kvikio", False, "needs CUDA")]
    cuda_ok = False
    if torch.version.cuda is None:
        checks.append(Check("cuda", "cuda", False, f"torch {torch.__version__} is a CPU-only build"))
    elif not torch.cuda.is_available():
        checks.append(Check("cuda", "cuda", False, "no CUDA driver or GPU visible to torch"))
    else:
        cuda_ok = True
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        checks.append(Check("cuda", "cuda", True, f"{len(names)} GPU(s): {', '.join(names)}"))
    checks.append(_gds_check(cuda_ok))
    return checks


def _gds_check(cuda_ok: bool) -> Check:
    try:
        import kvikio
    except Exception as exc:
        return Check("gds", "kvikio", False, f"kvikio not installed ({type(exc).__name__}); "
                     "GPUDirect Storage path unavailable, NVMe tier uses POSIX/O_DIRECT")
    if not cuda_ok:
        return Check("gds", "kvikio", False, f"kvikio {getattr(kvikio, '__version__', '?')} installed "
                     "but there is no CUDA GPU; NVMe tier uses POSIX/O_DIRECT")
    try:
        compat = kvikio.defaults.is_compat_mode_preferred()
    except Exception as exc:
        return Check("gds", "kvikio", False, f"kvikio cannot query cuFile: {exc}")
    if compat:
        return Check("gds", "kvikio", False, "kvikio runs in compatibility mode (no cuFile/GDS driver): "
                     "GPU reads bounce through host memory")
    return Check("gds", "kvikio", True, "cuFile available: GPUDirect Storage reads/writes")


# --- direct I/O -------------------------------------------------------------------------

def direct_io_checks(paths: list[str]) -> list[Check]:
    if not paths:
        return [Check("direct_io", "nvme", False, "no NVMe tier configured (pass --path DIR to probe one)")]
    return [_probe_direct_io(p) for p in paths]


def _probe_direct_io(path: str) -> Check:
    """Create, write and read back one aligned 4 KiB block with ``O_DIRECT`` in ``path``."""
    if not hasattr(os, "O_DIRECT"):
        return Check("direct_io", path, False, "this OS has no O_DIRECT")
    if not os.path.isdir(path):
        return Check("direct_io", path, False, "directory does not exist")
    try:
        fd, name = tempfile.mkstemp(prefix=".kvstore-doctor-", dir=path)
    except OSError as exc:
        return Check("direct_io", path, False, f"cannot create a file: {exc.strerror}")
    os.close(fd)
    buf = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT requires
    try:
        buf.write(b"kvstore-doctor".ljust(4096, b"\0"))
        try:
            fd = os.open(name, os.O_RDWR | os.O_DIRECT)
        except OSError as exc:
            why = "filesystem does not support O_DIRECT (tmpfs/overlay?)" if exc.errno == 22 else exc.strerror
            return Check("direct_io", path, False, f"open with O_DIRECT failed: {why}")
        try:
            os.pwritev(fd, [buf], 0)
            back = mmap.mmap(-1, 4096)
            n = os.preadv(fd, [back], 0)
            same = n == 4096 and back[:] == buf[:]
            back.close()
        except OSError as exc:
            return Check("direct_io", path, False, f"O_DIRECT I/O failed: {exc.strerror}")
        finally:
            os.close(fd)
        if not same:
            return Check("direct_io", path, False, "O_DIRECT read-back differed from what was written")
        return Check("direct_io", path, True, f"O_DIRECT works ({_fs_type(path)})")
    finally:
        buf.close()
        try:
            os.unlink(name)
        except OSError:
            pass


def _fs_type(path: str) -> str:
    """The filesystem type of ``path`` from /proc/mounts (longest matching mount point)."""
    best, fstype = "", "unknown filesystem"
    real = os.path.realpath(path)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/")):
                    if len(parts[1]) >= len(best):
                        best, fstype = parts[1], parts[2]
    except OSError:
        pass
    return fstype


__all__ = ["Check", "cuda_checks", "direct_io_checks", "nixl_checks", "rdma_checks", "run_checks"]
