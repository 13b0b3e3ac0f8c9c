"""The soak of issue 20: a real ``kvstore serve`` on 127.0.0.1 under bounded attack
loops, beside one well-behaved client. Used by ``tests/test_server_soak.py`` (which
asserts bounds: every good op right, RSS under a stated bound, each limit reached) and
``benchmarks/server_soak.py`` (which records the figures).

The good client reads 4 KiB blocks one at a time throughout, in quiet windows
alternating with attacked ones (:data:`ATTACK_S` seconds of attack in all): in an
attacked window an attacker process (``python -m benchmarks._server_soak attack``) runs
its loops from its own loopback addresses (127.0.0.2-9, so per-address limits apply to
it and not to the good client on 127.0.0.1):

- stalled HELLOs: rounds of :data:`STALL_WIDTH` connections, each a HELLO header and a
  part of its body, held until the server's handshake deadline closes them;
- oversized HELLO headers: a HELLO announcing 8 KiB (over the 4 KiB cap) or 1 GiB;
- stalled PUT bodies (authenticated): :data:`PUT_WIDTH` PUTs of :data:`PUT_BYTES` each,
  most of the payload sent, then silence, until the read deadline closes them (together
  they announce twice the server's buffer budget);
- connection floods: :data:`FLOOD_PER_ADDRESS` connections from each of
  :data:`FLOOD_ADDRESSES` addresses, past ``max_connections_per_ip`` and, together,
  past ``max_connections`` (silent, so past ``max_unauthenticated_connections`` the
  oldest are closed to make room), held a moment, then closed; round after round;
- malformed frames: random bytes, bad magic or version, a PUT whose sizes wrap past
  2**64 (authenticated).

The server's RSS (``VmRSS`` of ``/proc/PID/status``) is sampled every 20 ms throughout.
"""

from __future__ import annotations

import json
import os
import random
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "soak-token"
BLOCK = 4096                  # the good client's GETs
GOOD_KEYS = 64
ATTACK_S = 8.0                # in all, over WINDOWS attacked windows
WINDOWS = 4
QUIET_WINDOW_S = 1.0          # each quiet window (WINDOWS + 1 of them, around the attacked ones)
STALL_WIDTH = 48              # stalled HELLOs held at once (one address)
PUT_WIDTH = 16                # stalled PUTs held at once: 4x the buffer budget announced, 3x sent
PUT_BYTES = 8 << 20           # each announces this much (max_inflight_bytes) and sends 6/8 of it
FLOOD_ADDRESSES = [f"127.0.0.{i}" for i in range(5, 10)]
FLOOD_PER_ADDRESS = 70        # > max_connections_per_ip; 5 x 70 > max_connections
FLOOD_PAUSE_S = 0.5           # between bursts (each held 0.3 s)
SERVER = {"host": "127.0.0.1", "port": 0, "admin_port": 0, "token": TOKEN, "transport": "tcp",
          "handshake_timeout_s": 0.5, "read_timeout_s": 0.5, "max_connections": 256,
          "max_connections_per_ip": 64, "max_inflight_bytes": "8MiB", "max_inflight_bytes_total": "32MiB"}
CONFIG = {"tiers": [{"name": "hot", "kind": "dram", "capacity": "64MiB", "pin": False}], "server": SERVER}
# What the attacks may make the server hold beyond its quiet RSS: the buffer budget
# (max_inflight_bytes_total, 32 MiB), up to 64 KiB per open connection (a 4 KiB HELLO
# body, the connection's state, the event loop's per-socket objects: 16 MiB), and 16 MiB
# for the interpreter's own heap growth (allocator arenas, metrics). The stalled PUTs
# alone send 96 MiB: unbudgeted, they would pass it.
RSS_BOUND_BYTES = (32 << 20) + SERVER["max_connections"] * (64 << 10) + (16 << 20)


# -- the server -------------------------------------------------------------------------------

class Served:
    """``python -m kvstore serve`` on a config in a temporary directory."""

    def __init__(self, config: dict, tmp: Path) -> None:
        cfg = tmp / "soak.yaml"
        cfg.write_text(yaml.safe_dump(config))
        self.stderr_path = tmp / "server.err"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("KVSTORE_CONFIG", None)
        with open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvstore", "serve", "--config", str(cfg)], cwd=ROOT,
                                         env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        line = self.proc.stdout.readline()
        parts = dict(p.split("=", 1) for p in line.split() if "=" in p)
        if "serving on" not in line:
            self.close()
            raise RuntimeError(f"server did not start: {line!r} {self.stderr_path.read_text()}")
        self.port = int(line.split("serving on ", 1)[1].split()[0].rsplit(":", 1)[1])
        self.admin_port = int(parts["admin"])
        self.address = f"127.0.0.1:{self.port}"

    def rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def http(self, path: str) -> tuple[int, bytes]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}{path}", timeout=10) as resp:
            return resp.status, resp.read()

    def refused(self) -> dict[str, float]:
        out = {}
        for line in self.http("/metrics")[1].decode().splitlines():
            if line.startswith("kvstore_refused_connections_total{"):
                reason = line.split('reason="', 1)[1].split('"', 1)[0]
                out[reason] = float(line.rsplit(" ", 1)[1])
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stdout:
            self.proc.stdout.close()


# -- the well-behaved client --------------------------------------------------------------------

def _good_ops(client: Any, keys: list, blocks: list[np.ndarray], lat: list[float], *, count: int | None = None,
              seconds: float | None = None, until: threading.Event | None = None) -> tuple[int, int]:
    """Sequential single-block GETs, each timed (into ``lat``) and its bytes checked,
    for ``count`` ops, ``seconds``, or until ``until`` is set. Returns (failed, wrong)."""
    dst = np.empty(BLOCK, np.uint8)
    failed = wrong = 0
    deadline = time.monotonic() + (seconds if seconds is not None else 120.0)
    i = 0
    while (count is None or i < count) and (until is None or not until.is_set()) and time.monotonic() < deadline:
        k = i % len(keys)
        t0 = time.perf_counter()
        try:
            ok = client.load([keys[k]], [dst]).result(30)
        except Exception:
            ok = [False]
        lat.append(time.perf_counter() - t0)
        if ok != [True]:
            failed += 1
        elif not np.array_equal(dst, blocks[k]):
            wrong += 1
        i += 1
    return failed, wrong


def _latency(lat: list[float], failed: int, wrong: int) -> dict[str, Any]:
    arr = np.array(lat) * 1e6
    return {"ops": len(lat), "failed": failed, "wrong": wrong, "p50_us": float(np.percentile(arr, 50)),
            "p95_us": float(np.percentile(arr, 95)), "p99_us": float(np.percentile(arr, 99)),
            "max_us": float(arr.max())}


def run(tmp: Path, attack_s: float = ATTACK_S, only: list[str] | None = None) -> dict[str, Any]:
    """The whole soak; returns its figures (see :func:`summary`). Quiet and attacked
    windows alternate (:data:`WINDOWS` of each, then a last quiet one), so load from
    elsewhere on the machine weighs on both alike; an attacked window lasts from the
    attacker's start until its loops (and the connections they hold) are done.
    ``only``: run just these attack loops (names of :data:`ATTACKS`)."""
    from kvstore.client import Client
    from kvstore.testing import make_keys, payload

    served = Served(CONFIG, tmp)
    attacker = None
    try:
        keys = make_keys(GOOD_KEYS, salt="soak-good")
        blocks = [payload(i, BLOCK) for i in range(GOOD_KEYS)]
        with Client(served.address, token=TOKEN, transport="tcp", pool_size=1, timeout_s=30) as client:
            assert all(client.save(keys, blocks).result(30))
            _good_ops(client, keys, blocks, [], count=500)                    # warm up
            rss_quiet = served.rss()
            attacker = subprocess.Popen([sys.executable, "-m", "benchmarks._server_soak", "attack", str(served.port),
                                         ",".join(only or ATTACKS)], cwd=ROOT,
                                        env={**os.environ, "PYTHONPATH": str(ROOT)},
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert attacker.stdout.readline().strip() == "ready"
            samples, health = [], []
            stop = threading.Event()

            def sample() -> None:
                while not stop.is_set():
                    samples.append(served.rss())
                    time.sleep(0.02)

            def probe() -> None:
                while not stop.is_set():
                    try:
                        health.append(served.http("/healthz")[0])
                    except OSError as exc:
                        health.append(repr(exc))
                    stop.wait(0.5)

            watchers = [threading.Thread(target=sample, daemon=True), threading.Thread(target=probe, daemon=True)]
            for w in watchers:
                w.start()
            quiet_lat: list[float] = []
            attack_lat: list[float] = []
            quiet_bad = [0, 0]
            attack_bad = [0, 0]
            attacks: dict[str, int] = {}
            attacked_s = 0.0
            window_s = attack_s / WINDOWS
            for w in range(WINDOWS + 1):
                f, x = _good_ops(client, keys, blocks, quiet_lat, seconds=QUIET_WINDOW_S)
                quiet_bad[0] += f
                quiet_bad[1] += x
                if w == WINDOWS:
                    break
                done = threading.Event()
                result: list[str] = []

                def wait_attacker() -> None:
                    result.append(attacker.stdout.readline())
                    done.set()

                attacker.stdin.write(f"attack {window_s}\n")
                attacker.stdin.flush()
                t0 = time.monotonic()
                reader = threading.Thread(target=wait_attacker, daemon=True)
                reader.start()
                f, x = _good_ops(client, keys, blocks, attack_lat, until=done)
                attacked_s += time.monotonic() - t0
                attack_bad[0] += f
                attack_bad[1] += x
                reader.join(60)
                for name, n in json.loads(result[0]).items():
                    attacks[name] = attacks.get(name, 0) + n
            stop.set()
            for w in watchers:
                w.join(5)
        refused = served.refused()
        stats = json.loads(urllib.request.urlopen(urllib.request.Request(
            f"http://127.0.0.1:{served.admin_port}/stats", headers={"Authorization": f"Bearer {TOKEN}"}),
            timeout=10).read())
        quiet, attacked = _latency(quiet_lat, *quiet_bad), _latency(attack_lat, *attack_bad)
        rss_peak = max(samples) if samples else served.rss()
        return {"config": SERVER, "attack_s": attack_s, "windows": WINDOWS, "attacked_wall_s": round(attacked_s, 2),
                "attacks_run": only or list(ATTACKS), "quiet": quiet, "under_attack": attacked,
                "p99_ratio": attacked["p99_us"] / quiet["p99_us"], "p50_ratio": attacked["p50_us"] / quiet["p50_us"],
                "rss_quiet_bytes": rss_quiet, "rss_peak_bytes": rss_peak, "rss_growth_bytes": rss_peak - rss_quiet,
                "rss_bound_bytes": RSS_BOUND_BYTES, "rss_samples": len(samples),
                "healthz": {"probes": len(health), "ok": sum(h == 200 for h in health),
                            "other": [h for h in health if h != 200][:5]},
                "attacks": attacks, "refused": refused,
                "buffer_waits": stats["server"].get("buffer_waits"),
                "server_stderr_tracebacks": served.stderr_path.read_text().count("Traceback")}
    finally:
        if attacker is not None:
            try:
                attacker.stdin.close()
                attacker.wait(30)
            except Exception:
                attacker.kill()
        served.close()


def summary(r: dict[str, Any]) -> str:
    mib = 1 << 20
    return (f"good-client GET p99: quiet {r['quiet']['p99_us']:.0f} us, "
            f"under attack {r['under_attack']['p99_us']:.0f} us "
            f"({r['p99_ratio']:.2f}x; {r['under_attack']['ops']} ops, {r['under_attack']['failed']} failed, "
            f"{r['under_attack']['wrong']} wrong); p50 quiet "
            f"{r['quiet']['p50_us']:.0f} us, under attack {r['under_attack']['p50_us']:.0f} us; server RSS quiet "
            f"{r['rss_quiet_bytes'] / mib:.1f} MiB, peak {r['rss_peak_bytes'] / mib:.1f} MiB (+"
            f"{r['rss_growth_bytes'] / mib:.1f} MiB, bound +{r['rss_bound_bytes'] / mib:.0f} MiB); "
            f"/healthz {r['healthz']['ok']}/{r['healthz']['probes']}; refused {r['refused']}; attacks {r['attacks']}")


# -- the attacker (its own process) -------------------------------------------------------------

def _frames() -> Any:
    from kvstore.net import protocol as P
    return P


def _connect(port: int, src: str, timeout: float = 3.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(src, 0))


def _drain(sock: socket.socket, timeout: float = 5.0) -> bool:
    """Read until the server closes (True) or ``timeout`` passes (False)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except (socket.timeout, OSError):
        return False
    finally:
        sock.close()


def _hello(sock: socket.socket, token: str = TOKEN) -> None:
    from kvstore.net.auth import hello_proof
    P = _frames()

    def call(body: bytes, rid: int) -> bytes:
        sock.sendall(P.pack_header(P.Op.HELLO, rid, len(body)) + body)
        head = _recv_exact(sock, P.HEADER_BYTES)
        hdr = P.parse_header(head, P.Limits(1 << 40, 1 << 30), reply=True)
        body = _recv_exact(sock, hdr.body_len)
        if hdr.status:
            raise ConnectionError(body.decode(errors="replace"))
        return body

    nonce = bytes.fromhex(P.decode_json(call(P.encode_json({"client": "soak", "protocol": P.VERSION}), 1))["challenge"])
    call(P.encode_json({"client": "soak", "protocol": P.VERSION, "proof": hello_proof(token, nonce, "soak")}), 2)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return out


def _stalled_hellos(port: int, stop: threading.Event, counts: dict) -> None:
    P = _frames()
    body = P.encode_json({"client": "stall", "protocol": P.VERSION, "pad": "x" * 200})
    while not stop.is_set() and counts["stalled_hello_rounds"] < 100:
        held = []
        for _ in range(STALL_WIDTH):
            try:
                s = _connect(port, "127.0.0.2")
                s.sendall(P.pack_header(P.Op.HELLO, 1, len(body)) + body[:20])
                held.append(s)
            except OSError:
                counts["connect_failed"] += 1
        counts["stalled_hellos"] += len(held)
        counts["stalled_hellos_closed"] += sum(_drain(s) for s in held)
        counts["stalled_hello_rounds"] += 1


def _oversized_hellos(port: int, stop: threading.Event, counts: dict) -> None:
    P = _frames()
    while not stop.is_set() and counts["oversized_hellos"] < 1500:
        size = 8192 if counts["oversized_hellos"] % 2 else 1 << 30
        try:
            s = _connect(port, "127.0.0.3")
            s.sendall(P.pack_header(P.Op.HELLO, 1, size) + b"{" * 64)
            counts["oversized_hellos_closed"] += _drain(s)
        except OSError:
            counts["connect_failed"] += 1
        counts["oversized_hellos"] += 1
        time.sleep(0.003)


def _stalled_puts(port: int, stop: threading.Event, counts: dict) -> None:
    from kvstore.testing import make_keys
    P = _frames()
    chunk = bytes(1 << 20)
    rnd = 0
    while not stop.is_set() and rnd < 20:
        held = []
        rnd += 1
        for i in range(PUT_WIDTH):
            for _ in range(40):             # the flood may hold every slot: try again a moment later
                try:
                    s = _connect(port, "127.0.0.4")
                    _hello(s)
                    body = P.encode_records(P.PUT_REC, make_keys(1, salt=f"stall-{rnd}-{i}"), [PUT_BYTES], [0])
                    s.sendall(P.pack_header(P.Op.PUT, 3, len(body), PUT_BYTES) + body)
                    held.append(s)
                    break
                except OSError:
                    counts["connect_failed"] += 1
                    if stop.wait(0.05):
                        break
        for s in held:                      # most of each payload; a server out of budget stops reading
            s.settimeout(0.1)
            try:
                for _ in range(PUT_BYTES * 6 // 8 // len(chunk)):
                    s.sendall(chunk)
            except OSError:
                counts["stalled_put_backpressured"] += 1
        counts["stalled_puts"] += len(held)
        counts["stalled_puts_closed"] += sum(_drain(s, 10.0) for s in held)


def _flood(port: int, stop: threading.Event, counts: dict) -> None:
    while not stop.is_set() and counts["flood_rounds"] < 30:
        held = []
        for src in FLOOD_ADDRESSES:
            for _ in range(FLOOD_PER_ADDRESS):
                try:
                    held.append(_connect(port, src, timeout=2.0))
                except OSError:
                    counts["connect_failed"] += 1
        counts["flood_connections"] += len(held)
        stop.wait(0.3)
        for s in held:
            s.close()
        counts["flood_rounds"] += 1
        stop.wait(FLOOD_PAUSE_S)            # bursts: the other attacks get slots between them


def _malformed(port: int, stop: threading.Event, counts: dict) -> None:
    from kvstore.testing import make_keys
    P = _frames()
    rng = random.Random(7)
    evil = P.encode_records(P.PUT_REC, make_keys(2, salt="evil"), [(1 << 64) - 8, 8 + 16], [0, 0])
    while not stop.is_set() and counts["malformed"] < 1500:
        kind = counts["malformed"] % 4
        try:
            s = _connect(port, "127.0.0.3")
            if kind == 0:
                s.sendall(bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 200))))
            elif kind == 1:
                s.sendall(b"XX" + P.pack_header(P.Op.PING, 1)[2:])
            elif kind == 2:
                s.sendall(struct.pack("<2sBBIIIQ", b"KV", 9, 1, 1, 0, 0, 0))
            else:
                _hello(s)
                s.sendall(P.pack_header(P.Op.PUT, 3, len(evil), 16) + evil + bytes(16))
            counts["malformed_closed"] += _drain(s)
        except OSError:
            counts["connect_failed"] += 1
        counts["malformed"] += 1
        time.sleep(0.003)


ATTACKS = {"stalled_hellos": _stalled_hellos, "oversized_hellos": _oversized_hellos, "stalled_puts": _stalled_puts,
           "flood": _flood, "malformed": _malformed}


def attack(port: int, duration_s: float, only: list[str] | None = None) -> dict[str, int]:
    """Every attack loop of issue 20 (or those in ``only``, which may name issue 34's
    too: ``benchmarks/_soak_attacks.py``) in its own thread for ``duration_s`` (each
    also capped in count)."""
    from benchmarks import _soak_attacks
    loops = {**ATTACKS, **_soak_attacks.ATTACKS}
    counts: dict[str, int] = {k: 0 for k in (
        "stalled_hellos", "stalled_hellos_closed", "stalled_hello_rounds", "oversized_hellos",
        "oversized_hellos_closed", "stalled_puts", "stalled_puts_closed", "stalled_put_backpressured",
        "flood_connections", "flood_rounds", "malformed", "malformed_closed", "connect_failed")}
    if set(only or ATTACKS) - set(ATTACKS):
        counts.update({k: 0 for k in _soak_attacks.COUNTS})
    stop = threading.Event()
    threads = [threading.Thread(target=loops[name], args=(port, stop, counts), daemon=True)
               for name in (only or ATTACKS)]
    for t in threads:
        t.start()
    time.sleep(duration_s)
    stop.set()
    for t in threads:
        t.join(30)
    return counts


if __name__ == "__main__":
    if sys.argv[1:2] == ["attack"]:
        # attack PORT NAMES [ADMIN_PORT]; then "attack SECONDS [NAMES]" lines on stdin
        from benchmarks import _soak_attacks
        port, names = int(sys.argv[2]), sys.argv[3].split(",")
        _soak_attacks.TARGET.update(port=port, admin_port=int(sys.argv[4]) if len(sys.argv) > 4 else 0)
        _frames()
        from kvstore import client, testing  # noqa: F401
        from kvstore.net import auth  # noqa: F401
        print("ready", flush=True)
        for command in sys.stdin:
            words = command.split()
            window = words[2].split(",") if len(words) > 2 else names
            print(json.dumps(attack(port, float(words[1]), window)), flush=True)
    else:
        with tempfile.TemporaryDirectory() as d:
            print(summary(run(Path(d))))
