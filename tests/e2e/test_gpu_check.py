"""`make gpu-check` stays runnable: without a GPU it refuses clearly, and its CPU parts run and pass here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check would run for real")
def test_without_a_gpu_it_refuses_with_one_clear_line(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "r.json")], capture_output=True,
                          text=True)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: gpu-check needs a CUDA GPU (torch.cuda.is_available() is False); --device cpu runs the CPU parts"]
    assert not (tmp_path / "r.json").exists()


@pytest.mark.slow
def test_cpu_parts_run_and_pass(tmp_path):
    out = tmp_path / "gpu-check.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--long-context", "0", "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    status = {p["part"].split(" (")[0].split(":")[0]: p["status"] for p in result["parts"]}
    assert status == {"bf16 training": "ok", "fp16 training with a gradient scaler": "ok",
                      "prefetched features over 3 epochs equal no prefetch": "ok", "mask builders agree": "ok",
                      "2 ranks": "skipped", "flex over varied lengths compiles a bounded number of graphs": "skipped",
                      "target spread by --device-map auto equals one device": "skipped",
                      "lossless decoding, target on the device": "ok",
                      "tree decoding with the target over 2 GPUs equals plain": "skipped",
                      "vLLM speculative decoding": "skipped"}
    agree = next(p for p in result["parts"] if p["part"].startswith("mask builders"))["detail"]
    assert set(agree) == {"peagle", "eagle3", "pard", "parallelspec", "dflash"}
    fp16 = next(p for p in result["parts"] if p["part"].startswith("fp16"))["detail"]
    assert set(fp16) == set(agree)
    # one line per check, then the total
    lines = [line for line in done.stdout.splitlines() if line.startswith("[gpu-check]")]
    assert len(lines) == len(result["parts"]) + 1
    assert result["failed"] == [] and result["provenance"]["git_commit"]
