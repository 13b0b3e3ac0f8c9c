"""Helpers shared by the benchmarks: result files, tables, timing."""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

RESULTS = Path(__file__).resolve().parent / "results"


def median_time(fn: Callable[[], Any], repeat: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn`` in seconds over ``repeat`` runs after ``warmup``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def write_json(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"machine": {"python": platform.python_version(), "cpu": platform.processor() or platform.machine()},
               **payload}
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


def print_table(headers: list[str], rows: list[list[Any]]) -> None:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)
