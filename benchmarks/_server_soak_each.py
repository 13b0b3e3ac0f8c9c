"""Each attack loop alone, beside a well-behaved tenant (issue 34): one ``kvstore serve``
with tenants ``good`` and ``evil`` (``benchmarks/_soak_attacks.py``) and the operator's
token (the loops of issue 20 authenticate with it), and one window per attack in turn
(a quiet one first), in the same run. In each window the good tenant, from 127.0.0.1:

- reads its 4 KiB blocks one at a time (each GET timed and its bytes checked), and on
  a connection of its own saves new 4 KiB blocks one at a time (timed; a save that
  does not return ``[True]`` within :data:`SAVE_TIMEOUT_S`, its client's timeout, is
  a failure);
- opens a new session every 0.2 s (a fresh ``Client``: connect, HELLO, PING, close);
- probes the admin port's ``/healthz`` every 0.25 s.

Between windows the server is let settle (PINGs answered fast again) and the good
tenant's read blocks are saved again, so each row starts alike. Used by
``benchmarks/server_soak.py`` (the per-attack table and JSON).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import _server_soak as soak
from benchmarks import _soak_attacks as attacks

EACH_S = 4.0                  # each attack's window
SAVE_EVERY_S = 0.01           # the good tenant's saves: one 4 KiB block, then this pause
SAVE_TIMEOUT_S = 2.0          # a save not stored within this (its client's timeout) failed
GOOD_KEYS = 64
SERVER = {**soak.SERVER, "tenants": attacks.TENANTS}
# a second tier: a re-save at another size lands there when the hot quota refuses it
CONFIG = {"tiers": [{"name": "hot", "kind": "dram", "capacity": "64MiB", "pin": False},
                    {"name": "warm", "kind": "dram", "capacity": "64MiB", "pin": False}], "server": SERVER}
ORDER = ["quiet", *soak.ATTACKS, *attacks.ATTACKS]


def _probe_loop(fn: Any, every_s: float, stop: threading.Event, out: list) -> threading.Thread:
    def loop() -> None:
        while not stop.is_set():
            try:
                out.append(bool(fn()))
            except Exception:
                out.append(False)
            stop.wait(every_s)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


def _settle(client: Any, keys: list, blocks: list, timeout_s: float = 60.0) -> float:
    """Wait (up to ``timeout_s``) until 5 PINGs in a row take under 20 ms, then save the
    good tenant's read blocks again; returns the seconds waited."""
    t0 = time.monotonic()
    fast = 0
    while fast < 5 and time.monotonic() - t0 < timeout_s:
        try:
            fast = fast + 1 if client.ping() < 0.02 else 0
        except Exception:
            fast = 0
            time.sleep(0.1)
    try:
        client.save(keys, blocks).result(30)
    except Exception:
        pass
    return time.monotonic() - t0


def _window(served: soak.Served, client: Any, saver: Any, keys: list, blocks: list,
            attacker: subprocess.Popen | None, name: str, window_s: float, serial: list[int]) -> dict[str, Any]:
    from kvstore.client import Client
    from kvstore.testing import make_keys, payload

    stop = threading.Event()
    sessions: list[bool] = []
    health: list[bool] = []

    def session() -> bool:
        with Client(served.address, token=attacks.GOOD, transport="tcp", pool_size=1, timeout_s=3) as c:
            c.ping()
        return True

    watchers = [_probe_loop(session, 0.2, stop, sessions),
                _probe_loop(lambda: served.http("/healthz")[0] == 200, 0.25, stop, health)]
    done = threading.Event()
    result: list[str] = []
    refused0 = served.refused()
    t0 = time.monotonic()
    if attacker is not None:
        attacker.stdin.write(f"attack {window_s} {name}\n")
        attacker.stdin.flush()
        threading.Thread(target=lambda: (result.append(attacker.stdout.readline()), done.set()), daemon=True).start()
    else:
        threading.Timer(window_s, done.set).start()
    get_lat: list[float] = []
    save_lat: list[float] = []
    saved = [0]

    def saves() -> None:   # on a connection of its own: a save stuck behind an attack holds no GET up
        while not done.is_set():
            serial[0] += 1
            key = make_keys(1, salt=f"good-save-{serial[0]}")
            t = time.perf_counter()
            try:
                ok = saver.save(key, [payload(serial[0], soak.BLOCK)]).result(SAVE_TIMEOUT_S * 3) == [True]
            except Exception:
                ok = False
            save_lat.append(time.perf_counter() - t)
            saved[0] += ok and save_lat[-1] <= SAVE_TIMEOUT_S
            done.wait(SAVE_EVERY_S)

    saving = threading.Thread(target=saves, daemon=True)
    saving.start()
    get_ok = wrong = 0
    dst = np.empty(soak.BLOCK, np.uint8)
    i = 0
    while not done.is_set():
        k = i % len(keys)
        t = time.perf_counter()
        try:
            ok = client.load([keys[k]], [dst]).result(30) == [True]
        except Exception:
            ok = False
        get_lat.append(time.perf_counter() - t)
        if ok and not np.array_equal(dst, blocks[k]):
            wrong += 1
            ok = False
        get_ok += ok
        i += 1
    wall = time.monotonic() - t0
    stop.set()
    saving.join(SAVE_TIMEOUT_S * 3 + 5)
    for w in watchers:
        w.join(10)
    save_ok = saved[0]
    refused1 = served.refused()

    def p(lat: list[float], q: float) -> float | None:
        return float(np.percentile(np.array(lat) * 1e6, q)) if lat else None

    return {"attack": name, "wall_s": round(wall, 2),
            "get_ops": len(get_lat), "get_ok": get_ok, "get_wrong": wrong, "get_p50_us": p(get_lat, 50),
            "get_p99_us": p(get_lat, 99), "saves": len(save_lat), "saves_ok": save_ok,
            "save_p99_us": p(save_lat, 99), "sessions": len(sessions), "sessions_ok": sum(sessions),
            "healthz": len(health), "healthz_ok": sum(health),
            "attacker": {k: v for k, v in json.loads(result[0]).items() if v} if result and result[0] else {},
            "refused": {k: v - refused0.get(k, 0) for k, v in refused1.items() if v - refused0.get(k, 0)}}


def _tenants_hot(served: soak.Served) -> dict[str, Any]:
    """Each tenant's bytes and blocks in the hot tier, from ``/stats`` (the operator's)."""
    req = urllib.request.Request(f"http://127.0.0.1:{served.admin_port}/stats",
                                 headers={"Authorization": f"Bearer {soak.TOKEN}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            tenants = json.loads(resp.read()).get("tenants", {})
    except OSError as exc:
        return {"error": repr(exc)}
    return {name: {k: t.get("tiers", {}).get("hot", {}).get(k) for k in ("used_bytes", "blocks")}
            for name, t in tenants.items()}


def run_each(tmp: Path, window_s: float = EACH_S, only: list[str] | None = None) -> dict[str, Any]:
    """One window per attack (``only``: those names, after the quiet one); returns the
    rows and the server's figures."""
    from kvstore.client import Client
    from kvstore.testing import make_keys, payload

    served = soak.Served(CONFIG, tmp)
    attacker = None
    rows = []
    try:
        keys = make_keys(GOOD_KEYS, salt="soak-each-good")
        blocks = [payload(i, soak.BLOCK) for i in range(GOOD_KEYS)]
        attacker = subprocess.Popen([sys.executable, "-m", "benchmarks._server_soak", "attack", str(served.port),
                                     ",".join(soak.ATTACKS), str(served.admin_port)], cwd=soak.ROOT,
                                    env={**os.environ, "PYTHONPATH": str(soak.ROOT)},
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert attacker.stdout.readline().strip() == "ready"
        serial = [0]
        with Client(served.address, token=attacks.GOOD, transport="tcp", pool_size=1, timeout_s=10) as client, \
                Client(served.address, token=attacks.GOOD, transport="tcp", pool_size=1,
                       timeout_s=SAVE_TIMEOUT_S) as saver:
            assert all(client.save(keys, blocks).result(30))
            for name in ["quiet", *(n for n in ORDER[1:] if only is None or n in only)]:
                settled = _settle(client, keys, blocks)
                row = _window(served, client, saver, keys, blocks, None if name == "quiet" else attacker, name,
                              window_s, serial)
                row["tenants_hot"] = _tenants_hot(served)
                row["settle_s"] = round(settled, 2)
                rows.append(row)
                print(f"  {name}: {row_summary(row)}", flush=True)
        return {"config": SERVER, "window_s": window_s, "rows": rows,
                "server_stderr_tracebacks": served.stderr_path.read_text().count("Traceback")}
    finally:
        if attacker is not None:
            try:
                attacker.stdin.close()
                attacker.wait(60)
            except Exception:
                attacker.kill()
        served.close()


def _pct(ok: int, n: int) -> float | None:
    return round(100.0 * ok / n, 1) if n else None


def table_rows(rows: list[dict[str, Any]]) -> list[list[Any]]:
    return [[r["attack"], r["get_ops"], r["get_p99_us"], _pct(r["get_ok"], r["get_ops"]), r["saves"],
             _pct(r["saves_ok"], r["saves"]), r["save_p99_us"], _pct(r["sessions_ok"], r["sessions"]),
             f"{r['healthz_ok']}/{r['healthz']}", r["wall_s"]] for r in rows]


TABLE_HEADERS = ["attack", "GETs", "GET p99 us", "GET ok %", "saves", "save ok %", "save p99 us",
                 "new sessions ok %", "/healthz ok", "window s"]


def row_summary(r: dict[str, Any]) -> str:
    p99 = f"{r['get_p99_us']:.0f} us" if r["get_p99_us"] is not None else "-"
    return (f"GET p99 {p99} ({r['get_ok']}/{r['get_ops']} ok), saves {r['saves_ok']}/{r['saves']} ok, "
            f"sessions {r['sessions_ok']}/{r['sessions']}, /healthz {r['healthz_ok']}/{r['healthz']}, "
            f"{r['wall_s']} s; attacker {r['attacker']}; refused {r['refused']}")

