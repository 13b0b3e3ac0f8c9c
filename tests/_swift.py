"""A throwaway OpenStack Swift (with the s3api middleware) on 127.0.0.1 for tests and
benchmarks: a real S3 implementation, not an emulator.

``SwiftServer(root)`` writes a single-replica configuration under ``root`` (rings,
device directory, one conf per server), picks free ports, and runs memcached plus the
account, container, object and proxy servers. ``stop()`` ends every process it started
(or only the named ones) by PID, with their children; ``start()`` again brings the
stopped servers back on the same ports with the same data (used by the fault tests).
Not thread-safe.

S3 credentials: access key ``test:tester``, secret ``testing``, region ``us-east-1``,
path-style addressing.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from kvstore.testing import free_port

ACCESS_KEY = "test:tester"
SECRET_KEY = "testing"
REGION = "us-east-1"
_BINARIES = ("memcached", "swift-ring-builder", "swift-account-server", "swift-container-server",
             "swift-object-server", "swift-proxy-server")
_SERVERS = ("account", "container", "object")


_RING_SCRIPT = """
import ast, sys
from swift.common.ring import RingBuilder
root, ports = sys.argv[1], ast.literal_eval(sys.argv[2])
for kind, port in ports.items():
    b = RingBuilder(8, 1, 1)
    b.add_dev({"id": 0, "region": 1, "zone": 1, "ip": "127.0.0.1", "port": port,
               "device": "d1", "weight": 100})
    b.rebalance()
    b.save(f"{root}/{kind}.builder")
    b.get_ring().save(f"{root}/{kind}.ring.gz")
"""


def _swift_python() -> str:
    """The interpreter Swift's own scripts run under (Debian's python3)."""
    with open(shutil.which("swift-proxy-server") or "/usr/bin/swift-proxy-server") as fh:
        first = fh.readline()
    return first[2:].strip().split()[0] if first.startswith("#!") else "python3"


def missing_binaries() -> list[str]:
    """The Swift/memcached executables not on PATH (empty when Swift can run here)."""
    return [b for b in _BINARIES if shutil.which(b) is None]


def _server_conf(root: Path, kind: str, port: int) -> str:
    return f"""[DEFAULT]
devices = {root}/srv
mount_check = false
disable_fallocate = true
bind_ip = 127.0.0.1
bind_port = {port}
workers = 0
user = root
swift_dir = {root}
log_facility = LOG_LOCAL1
log_level = WARNING

[pipeline:main]
pipeline = {kind}-server

[app:{kind}-server]
use = egg:swift#{kind}
"""


def _proxy_conf(root: Path, port: int, memcached_port: int, put_rate: float | None) -> str:
    # Swift's own rate limiter, when asked for: object writes beyond `put_rate` per second
    # per bucket get "498 Rate Limited", which s3api answers as S3's 503 SlowDown.
    ratelimit = "ratelimit " if put_rate else ""
    # The limiter applies only once it sees objects in the bucket: keep cached counts fresh.
    recheck = "recheck_container_existence = 1\n" if put_rate else ""
    ratelimit_conf = (f"\n[filter:ratelimit]\nuse = egg:swift#ratelimit\ncontainer_ratelimit_0 = {put_rate}\n"
                      "max_sleep_time_seconds = 0.1\nrate_buffer_seconds = 1\n") if put_rate else ""
    return f"""[DEFAULT]
bind_ip = 127.0.0.1
bind_port = {port}
workers = 0
user = root
swift_dir = {root}
log_level = WARNING

[pipeline:main]
pipeline = catch_errors gatekeeper healthcheck proxy-logging cache listing_formats s3api tempauth {ratelimit}copy slo dlo proxy-logging proxy-server

[app:proxy-server]
use = egg:swift#proxy
account_autocreate = true
{recheck}
[filter:s3api]
use = egg:swift#s3api
location = {REGION}

[filter:tempauth]
use = egg:swift#tempauth
user_test_tester = {SECRET_KEY} .admin

[filter:cache]
use = egg:swift#memcache
memcache_servers = 127.0.0.1:{memcached_port}

[filter:catch_errors]
use = egg:swift#catch_errors

[filter:gatekeeper]
use = egg:swift#gatekeeper

[filter:healthcheck]
use = egg:swift#healthcheck

[filter:proxy-logging]
use = egg:swift#proxy_logging

[filter:listing_formats]
use = egg:swift#listing_formats

[filter:copy]
use = egg:swift#copy

[filter:slo]
use = egg:swift#slo

[filter:dlo]
use = egg:swift#dlo
{ratelimit_conf}"""


class SwiftServer:
    """One Swift cluster (one replica, one device) living under ``root``."""

    def __init__(self, root: str | os.PathLike, *, put_rate: float | None = None) -> None:
        missing = missing_binaries()
        if missing:
            raise RuntimeError(f"Swift is not installed (missing {', '.join(missing)}); "
                               "run scripts/deps/20-swift.sh")
        self.root = Path(root)
        self.put_rate = put_rate
        self.ports = {name: free_port() for name in ("memcached", "proxy", *_SERVERS)}
        self.endpoint_url = f"http://127.0.0.1:{self.ports['proxy']}"
        self._procs: dict[str, subprocess.Popen] = {}
        self._configure()

    def _configure(self) -> None:
        root = self.root
        (root / "srv" / "d1").mkdir(parents=True, exist_ok=True)
        (root / "swift.conf").write_text(
            "[swift-hash]\nswift_hash_path_suffix = kvstore-test\nswift_hash_path_prefix = kvstore\n\n"
            "[storage-policy:0]\nname = Policy-0\ndefault = yes\n")
        for kind in _SERVERS:
            (root / f"{kind}-server.conf").write_text(_server_conf(root, kind, self.ports[kind]))
        # One interpreter builds all three rings: the CLI costs seconds per call.
        ports = {kind: self.ports[kind] for kind in _SERVERS}
        subprocess.run([_swift_python(), "-c", _RING_SCRIPT, str(root), repr(ports)], check=True,
                       stdout=subprocess.DEVNULL)
        for kind in _SERVERS:
            if not (root / f"{kind}.ring.gz").exists():
                raise RuntimeError(f"ring building did not write {kind}.ring.gz under {root}")
        (root / "proxy-server.conf").write_text(
            _proxy_conf(root, self.ports["proxy"], self.ports["memcached"], self.put_rate))

    def _command(self, name: str) -> list[str]:
        if name == "memcached":
            return ["memcached", "-u", "root", "-l", "127.0.0.1", "-p", str(self.ports["memcached"]),
                    "-U", "0", "-m", "64"]
        return [f"swift-{name}-server", str(self.root / f"{name}-server.conf")]

    def start(self, timeout_s: float = 120.0) -> "SwiftServer":
        """Start every server not running yet and wait until the S3 endpoint answers."""
        with open(self.root / "swift.log", "ab") as log:
            for name in ("memcached", *_SERVERS, "proxy"):
                if name not in self._procs:
                    self._procs[name] = subprocess.Popen(self._command(name), stdout=log, stderr=log,
                                                         stdin=subprocess.DEVNULL)
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = dict(self.ports)
        while pending:
            for proc in self._procs.values():
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}; "
                                       f"see {self.root / 'swift.log'}")
            for name, port in list(pending.items()):
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    del pending[name]
                except OSError:
                    pass
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"Swift did not start in {timeout_s:.0f} s (waiting for {sorted(pending)})")
            if pending:
                time.sleep(0.1)
        while True:
            try:
                with urllib.request.urlopen(f"{self.endpoint_url}/healthcheck", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"Swift proxy healthcheck did not pass in {timeout_s:.0f} s")
            time.sleep(0.1)

    def pause_proxy(self) -> None:
        """Freeze the S3 endpoint (SIGSTOP): connections are accepted, nothing answers."""
        os.kill(self._procs["proxy"].pid, signal.SIGSTOP)

    def resume_proxy(self) -> None:
        os.kill(self._procs["proxy"].pid, signal.SIGCONT)

    @property
    def running(self) -> bool:
        return bool(self._procs)

    def cpu_seconds(self) -> float:
        """User + system CPU time used so far by every server process started here (and
        their children): what the server spent, for benchmarks on a shared machine."""
        ticks = 0
        for proc in list(self._procs.values()):
            for pid in [proc.pid, *_children(proc.pid)]:
                try:
                    with open(f"/proc/{pid}/stat") as fh:
                        fields = fh.read().rsplit(")", 1)[1].split()
                except OSError:  # exited meanwhile
                    continue
                ticks += int(fields[11]) + int(fields[12])  # utime, stime
        return ticks / os.sysconf("SC_CLK_TCK")

    def stop(self, *names: str) -> None:
        """Stop the named servers (``"object"``, ``"proxy"``, ...; default: all started
        here), by PID: the parent and then each of its children."""
        names = names or tuple(self._procs)
        procs = [self._procs.pop(n) for n in names if n in self._procs]
        for proc in procs:
            try:
                os.kill(proc.pid, signal.SIGCONT)  # a paused proxy must see its SIGTERM
            except ProcessLookupError:
                pass
        for proc in reversed(procs):
            for pid in [proc.pid, *_children(proc.pid)]:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                for pid in [proc.pid, *_children(proc.pid)]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                proc.wait(timeout=10)

    def client(self, **kwargs):
        """A plain boto3 S3 client for this server (for setup and raw access in tests)."""
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint_url, region_name=REGION,
                            aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                            config=Config(s3={"addressing_style": "path"}, **kwargs))

    def env(self) -> dict[str, str]:
        """AWS_* variables that point the standard credential chain at this server."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_DEFAULT_REGION": REGION}

    def __enter__(self) -> "SwiftServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _children(pid: int) -> list[int]:
    """Direct and indirect child PIDs of ``pid`` (from /proc), deepest last."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                kids = [int(x) for x in fh.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
        for kid in kids:
            out.append(kid)
            out.extend(_children(kid))
    return out


def require_swift() -> None:
    """Skip the calling test (fail it under CI) when Swift is not installed here."""
    import pytest

    from kvstore.testing import IN_CI

    missing = missing_binaries()
    if missing:
        reason = (f"OpenStack Swift is not installed (missing {', '.join(missing)}); "
                  "run scripts/deps/20-swift.sh")
        if IN_CI:
            pytest.fail(reason + " — CI must run the S3 tests", pytrace=False)
        pytest.skip(reason)


def aws_env(server: SwiftServer, home: str | os.PathLike) -> dict[str, str]:
    """Environment for the standard AWS credential chain pointed at ``server`` only:
    no shared config from the user's home, no instance-metadata lookups."""
    return {**server.env(), "AWS_CONFIG_FILE": str(Path(home) / "aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(Path(home) / "aws-credentials"),
            "AWS_EC2_METADATA_DISABLED": "true"}


_AWS_VARS_TO_CLEAR = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
                      "AWS_SESSION_TOKEN", "AWS_REGION")


def running_swift(tmp_path_factory, name: str = "swift", **server_kwargs):
    """Generator body for a pytest fixture: a started server with the AWS environment
    pointed at it; stops the server and restores the environment afterwards."""
    import pytest

    require_swift()
    root = tmp_path_factory.mktemp(name)
    server = SwiftServer(root, **server_kwargs).start()
    with pytest.MonkeyPatch.context() as mp:
        for var in _AWS_VARS_TO_CLEAR:
            mp.delenv(var, raising=False)
        for var, value in aws_env(server, root).items():
            mp.setenv(var, value)
        try:
            yield server
        finally:
            server.stop()
