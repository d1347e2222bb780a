"""A per-drafter job (benchmarks/test_jobs.py, preset ci-jobs) killed in the middle of its training resumes from the
last checkpoint in its work folder and finishes the same job; a finished job is then skipped without retraining."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specframe.vllm import vllm_available

ROOT = Path(__file__).resolve().parents[2]


def _job(work: Path, results: Path, drafter: str) -> list[str]:
    return [sys.executable, "-m", "pytest", str(ROOT / "benchmarks" / "test_jobs.py"), "--preset", "ci-jobs",
            "--bench-work", str(work), "--results-dir", str(results), "--benchmark-only", "-p", "no:cacheprovider",
            "-q", "-s", "-k", f"test_drafter_job and {drafter}"]


@pytest.mark.slow
@pytest.mark.skipif(not vllm_available(), reason="the job measures in vLLM (make setup VLLM=cpu|gpu)")
def test_a_killed_drafter_job_resumes_from_its_checkpoint_and_a_finished_one_is_skipped(tmp_path):
    work, results = tmp_path / "work", tmp_path / "results"
    log = open(tmp_path / "first.log", "w")
    first = subprocess.Popen(_job(work, results, "peagle"), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    run = work / "train" / "peagle"
    deadline = time.monotonic() + 900
    from specframe.engine import checkpoint

    while not checkpoint.has_checkpoint(run) and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
    os.killpg(first.pid, signal.SIGKILL)  # mid-training: a checkpoint on disk, steps still to go
    first.wait()
    assert not (results / "peagle" / "job.json").exists()
    second = subprocess.run(_job(work, results, "peagle"), cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    record = json.loads((work / "train" / "peagle.bench-run.json").read_text())
    assert record["attempts"][0]["resumed"] and record["steps"] == 6
    job = json.loads((results / "peagle" / "job.json").read_text())
    hashes = {json.loads((results / "peagle" / f).read_text())["provenance"]["drafter_checkpoint_hash"]
              for f in job["metrics"]["files"]}
    assert hashes == {job["metrics"]["checkpoint_hash"]}  # every file of the drafter measured the same checkpoint
    assert {"training.json", "acceptance-mt-bench.json", "acceptance-gsm8k.json", "speed-batch1.json",
            "curve-mt-bench.json", "curve-gsm8k.json"} <= set(job["metrics"]["files"])
    # the served curve's earlier point: the drafter kept at step 3 (resumed past it or not), at the one curve K
    curve = json.loads((results / "peagle" / "curve-gsm8k.json").read_text())
    (point,) = curve["config"]["points"]
    assert point["step"] == 3 and 0 < point["train_tokens"] < record["train_tokens"]
    assert point["checkpoint_hash"] != job["metrics"]["checkpoint_hash"]
    assert curve["metrics"]["methods"][point["label"]]["k"] == curve["config"]["k"]
    if job["metrics"]["complete"]:  # skipped without training when run again (unless its speed shared the machine)
        stamp = (run / "metrics.jsonl").stat().st_mtime_ns
        third = subprocess.run(_job(work, results, "peagle"), cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert third.returncode == 0 and "complete in" in third.stdout
        assert (run / "metrics.jsonl").stat().st_mtime_ns == stamp
