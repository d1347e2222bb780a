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
sys.path.insert(0, str(ROOT / "benchmarks"))


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


@pytest.mark.slow
@pytest.mark.skipif(not vllm_available(), reason="the job asks vLLM first (make setup VLLM=cpu|gpu)")
def test_a_drafter_vllm_serves_at_no_k_is_measured_on_the_reference_engine(tmp_path):
    """DSpark on vLLM's CPU build (no V2 model runner): every K is refused before an engine starts, and the job
    measures its whole block on the reference engine instead, verified greedily and through its confidence schedule:
    acceptance on a subset of each set and batch-1 speed beside plain decoding and n-gram, all lossless."""
    from presets import resolve

    from specframe.vllm.support import dspark_runner_problem

    if dspark_runner_problem() is None:
        pytest.skip("this vLLM serves DSpark itself (its V2 model runner)")
    work, results = tmp_path / "work", tmp_path / "results"
    run = subprocess.run(_job(work, results, "dspark"), cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    p = resolve("ci-jobs")
    job = json.loads((results / "dspark" / "job.json").read_text())["metrics"]
    assert {f"dspark/k{k}" for k in p.vllm_ks} <= set(job["vllm_refused"])
    assert not any(name.startswith(("acceptance-", "speed-batch", "curve-")) for name in job["files"])
    block = p.depth  # DSpark's block less its anchor: the depth it was trained at
    for dataset in p.datasets:
        document = json.loads((results / "dspark" / f"reference-{dataset}.json").read_text())
        assert document["kind"] == "bench.acceptance.subset" and document["metrics"]["engine"] == "reference"
        assert document["config"]["k"] == block and len(document["config"]["prompts"]) == p.speed_prompts
        methods = document["metrics"]["methods"]
        assert set(methods) == {"plain", f"dspark/k{block}", f"dspark/k{block}+scheduled"}
        assert methods[f"dspark/k{block}+scheduled"]["verifier"] == "scheduled"
        for label in (f"dspark/k{block}", f"dspark/k{block}+scheduled"):
            m = methods[label]
            assert m["lossless"] and 1.0 <= m["acceptance_length"] <= block + 1
            iv = m["acceptance_length_interval"]
            assert iv["low"] <= m["acceptance_length"] <= iv["high"]
    speed = json.loads((results / "dspark" / "speed-reference.json").read_text())
    assert speed["kind"] == "bench.speed" and speed["metrics"]["engine"] == "reference"
    assert speed["metrics"]["concurrency"] == 1 and speed["metrics"]["repeats"] == p.vllm_repeats
    assert set(speed["metrics"]["methods"]) == {"plain", f"ngram/k{block}", f"dspark/k{block}",
                                                f"dspark/k{block}+scheduled"}
    assert all(m.get("lossless", True) for m in speed["metrics"]["methods"].values())
    hashes = {json.loads((results / "dspark" / f).read_text())["provenance"]["drafter_checkpoint_hash"]
              for f in job["files"]}
    assert hashes == {job["checkpoint_hash"]}
