"""The GPU check and TTFT benchmarks run end to end on any machine (CPU figures where
there is no GPU) and report what they skipped and why."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _run(args, tmp_path):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_gpu_check_runs_and_labels_its_figures(tmp_path):
    out = tmp_path / "gpu_check.json"
    text = _run(["benchmarks/gpu_check.py", "--quick", "--skip-tests", "--out", str(out)], tmp_path)
    result = json.loads(out.read_text())
    measured = [r for r in result["rows"] if "skipped" not in r]
    names = {r["check"].removeprefix("D2H ").removeprefix("H2D ").removeprefix("D2D ") for r in measured}
    assert names >= {"save (dram)", "load (dram)", "save (gpu tier)", "load (gpu tier)"}
    assert not [r for r in result["rows"] if "failed" in r] and result["passed"]
    timed = [r for r in measured if "ratio" in r]
    assert all(r["bytes_ok"] and r["store_gbps"] > 0 and r["baseline_gbps"] > 0 for r in timed)
    checked = {r["check"] for r in measured if "note" in r}
    assert {"reopen, stale pinning", "paged host syncs per call"} <= checked
    assert {"NVMe corrupt byte -> miss (device_verify=False)", "NVMe corrupt byte -> miss (device_verify=True)"} <= checked
    assert all(r["bytes_ok"] for r in measured)
    if not torch.cuda.is_available():
        assert result["device"] == "cpu" and "no CUDA" in result["device_name"]
        assert any(r["check"].startswith("kvikio") and "no CUDA" in r["skipped"] for r in result["rows"])
        assert any(r["check"] == "stream order" and "CUDA" in r["skipped"] for r in result["rows"])
    assert "kvstore GB/s" in text


def test_a_broken_check_is_a_failed_row_and_the_others_still_run(tmp_path):
    from benchmarks import gpu_check
    from benchmarks._gpu_checks import Context, verdict

    def broken(ctx):
        raise KeyError("no such tier field")

    def fine(ctx):
        return [verdict("fine", ctx.dev, True, "ran")]

    ctx = Context(dev=torch.device("cpu"), block=4096, n=2, rounds=1, quick=True, workdir=str(tmp_path))
    rows = gpu_check.run_checks(ctx, [broken, fine])
    assert rows[0]["check"] == "broken" and "KeyError" in rows[0]["failed"] and not gpu_check.passed(rows[0])
    assert rows[1]["note"] == "ran" and gpu_check.passed(rows[1])
    text = gpu_check.table({"device": "cpu", "device_name": "x", "rows": rows,
                            "conformance": {"passed": True, "summary": "skipped"}})
    assert "FAILED: KeyError" in text and "ok: ran" in text


@pytest.mark.slow
def test_ttft_benchmark_tiny(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "ttft.json"
    _run(["benchmarks/ttft.py", "--model", "tiny", "--lengths", "64,160", "--chunk-tokens", "16",
          "--new-tokens", "4", "--repeats", "1", "--out", str(out)], tmp_path)
    result = json.loads(out.read_text())
    assert result["identical"] is True
    assert [r["tokens"] for r in result["load"]["dram"]] == [64, 160]
    assert [r["cached_tokens"] for r in result["load"]["dram"]] == [48, 144]
    assert out.with_suffix(".png").stat().st_size > 0
