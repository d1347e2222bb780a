"""benchmarks/collect.py: a long preset's results files copied from the clone that ran them, with that clone's and
the work folder's paths made portable, only when new or changed, and never with an absolute path left in."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from collect import collect


def _document(clone: Path, home: Path) -> dict:
    return {"schema": "specframe.results/1", "metrics": {"run": str(home / "bench" / "cpu-large" / "train" / "peagle")},
            "provenance": {"command": f"pytest benchmarks --results-dir {clone}/benchmarks/results/cpu-large"}}


@pytest.fixture
def folders(tmp_path, monkeypatch):
    home, checkout = tmp_path / "home", tmp_path / "checkout"
    clone = home / "worktrees" / "abc123"
    monkeypatch.setenv("SPECFRAME_HOME", str(home))
    (clone / "benchmarks" / "results" / "cpu-large" / "peagle").mkdir(parents=True)
    checkout.mkdir()
    return home, clone, checkout


def test_a_new_file_is_written_portable_and_an_unchanged_one_is_left_alone(folders):
    home, clone, checkout = folders
    source = clone / "benchmarks" / "results" / "cpu-large" / "peagle" / "training.json"
    source.write_text(json.dumps(_document(clone, home)))
    # pytest-benchmark's session file at the top is not a result
    (clone / "benchmarks" / "results" / "cpu-large" / "pytest-benchmark.json").write_text("{}")

    written = collect(clone, "cpu-large", checkout)
    target = checkout / "benchmarks" / "results" / "cpu-large" / "peagle" / "training.json"
    assert written == [target]
    saved = json.loads(target.read_text())
    assert saved["metrics"]["run"] == "$SPECFRAME_HOME/bench/cpu-large/train/peagle"
    assert saved["provenance"]["command"] == "pytest benchmarks --results-dir benchmarks/results/cpu-large"
    assert target.read_text().endswith("}\n")
    assert collect(clone, "cpu-large", checkout) == []  # nothing changed: nothing rewritten

    source.write_text(json.dumps({**_document(clone, home), "per_prompt": [1]}))
    assert collect(clone, "cpu-large", checkout) == [target]
    # a kept gzip copy (plain vLLM's answers to a set) is copied byte for byte
    kept = clone / "benchmarks" / "results" / "cpu-large" / "baselines" / "contexts-mt-bench-k.json.gz"
    kept.parent.mkdir()
    kept.write_bytes(b"\x1f\x8bdata")
    copied = checkout / "benchmarks" / "results" / "cpu-large" / "baselines" / "contexts-mt-bench-k.json.gz"
    assert collect(clone, "cpu-large", checkout) == [copied] and copied.read_bytes() == b"\x1f\x8bdata"
    assert collect(clone, "cpu-large", checkout) == []


def test_a_file_with_a_foreign_absolute_path_is_refused_and_nothing_is_half_written(folders):
    _, clone, checkout = folders
    folder = clone / "benchmarks" / "results" / "cpu-large" / "peagle"
    (folder / "training.json").write_text(json.dumps({"metrics": {"run": "/elsewhere/runs/peagle"}}))
    with pytest.raises(SystemExit, match="absolute paths"):
        collect(clone, "cpu-large", checkout)
    assert not (checkout / "benchmarks").exists()


def test_a_clone_without_the_presets_results_is_named(folders):
    _, clone, checkout = folders
    with pytest.raises(SystemExit, match="is .* the clone that runs the cpu-ci preset"):
        collect(clone, "cpu-ci", checkout)
