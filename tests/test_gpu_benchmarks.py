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
    assert all(r["bytes_ok"] and r["store_gbps"] > 0 and r["baseline_gbps"] > 0 for r in measured)
    if not torch.cuda.is_available():
        assert result["device"] == "cpu" and "no CUDA" in result["device_name"]
        assert any(r["check"].startswith("kvikio") and "no CUDA" in r["skipped"] for r in result["rows"])
    assert "kvstore GB/s" in text


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
