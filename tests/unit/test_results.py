import json

import pytest

from specframe import results
from specframe.errors import SpecframeError

TARGET = {"id": "tiny", "weights_hash": "sha256:abc"}


def test_written_file_has_metrics_and_full_provenance(tmp_path):
    prov = results.provenance(target=TARGET, token_budget=1000, command=["specframe", "bench", "acceptance"])
    path = results.write_results(
        tmp_path / "r.json", kind="acceptance", metrics={"al": 2.5}, per_prompt=[{"id": 0, "al": 2.5}], provenance=prov
    )
    document = results.read_results(path)
    assert document["metrics"] == {"al": 2.5} and document["per_prompt"] == [{"id": 0, "al": 2.5}]
    p = document["provenance"]
    assert p["command"] == "specframe bench acceptance"
    assert p["git_commit"] and p["target"] == TARGET and p["token_budget"] == 1000
    assert p["machine"]["cpu_count"] >= 1 and p["date"].endswith("+00:00")
    assert [f.name for f in tmp_path.iterdir()] == ["r.json"]  # no temp file left behind


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.pop("provenance"), "results file has no 'provenance'"),
        (lambda d: d["provenance"].pop("command"), "results without provenance (command missing)"),
        (lambda d: d["provenance"].update(git_commit=None), "results without provenance (git commit unknown)"),
        (lambda d: d["provenance"].update(target={"id": "x"}), "results without provenance (target id or weights hash missing)"),
        (lambda d: d.update(schema="other"), "not a specframe results file"),
    ],
)
def test_results_without_provenance_are_refused(tmp_path, mutate, message):
    prov = results.provenance(target=TARGET, command=["x"])
    path = results.write_results(tmp_path / "r.json", kind="k", metrics={}, per_prompt=[], provenance=prov)
    document = json.loads(path.read_text())
    mutate(document)
    path.write_text(json.dumps(document))
    with pytest.raises(SpecframeError) as exc:
        results.read_results(path)
    assert str(exc.value).startswith(f"{path}: ") and message in str(exc.value)


def test_file_hash_of_directory_depends_on_names_and_contents(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "w.bin").write_bytes(b"123")
    first = results.file_hash(tmp_path / "a")
    (tmp_path / "a" / "w.bin").write_bytes(b"124")
    assert results.file_hash(tmp_path / "a") != first
    assert first.startswith("sha256:")


def test_writer_names_paths_inside_the_repository_relative_to_it(tmp_path, monkeypatch):
    repo = tmp_path / "checkout"
    (repo / ".git").mkdir(parents=True)
    run = repo / "runs" / "bench" / "train" / "peagle" / "step-00000150"
    prov = results.provenance(target=TARGET, command=["specframe", "train", "--output", str(run.parent),
                                                      f"--cache={repo}/runs/cache"])
    prov["git_commit"] = "abc"
    metrics = {"methods": {"peagle/k3": {"checkpoint": str(run)}}, "elsewhere": "/opt/x/y"}
    path = results.write_results(repo / "benchmarks" / "results" / "r.json", kind="bench.acceptance",
                                 metrics=metrics, per_prompt=[], provenance=prov)
    document = json.loads(path.read_text())
    assert document["metrics"]["methods"]["peagle/k3"]["checkpoint"] == "runs/bench/train/peagle/step-00000150"
    assert document["provenance"]["command"] == ("specframe train --output runs/bench/train/peagle "
                                                 "--cache=runs/cache")
    assert document["metrics"]["elsewhere"] == "/opt/x/y"  # outside the repository: left as it is
    assert results.absolute_paths(document) == ["/opt/x/y"]
    # threads the figures ran on are part of the machine record
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    threads = results.machine()["threads"]
    assert threads["torch"] >= 1 and threads["environment"]["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert results._ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_writer_names_the_work_folder_by_its_variable(tmp_path, monkeypatch):
    # a long preset's cache and checkpoints live under $SPECFRAME_HOME, outside the checkout, and its job runs from a
    # git worktree inside that same folder: the worktree's paths are relative, the work folder's are $SPECFRAME_HOME
    home = tmp_path / "home"
    repo = home / "worktrees" / "abc"
    (repo / ".git").mkdir(parents=True)
    monkeypatch.setenv("SPECFRAME_HOME", str(home))
    cache = home / "bench" / "cpu-large" / "cache-1"
    prov = results.provenance(target=TARGET, command=["pytest", "benchmarks", "--results-dir", str(repo / "r")])
    path = results.write_results(repo / "benchmarks" / "results" / "r.json", kind="bench.training",
                                 metrics={"m": 1}, per_prompt=[], provenance=prov,
                                 config={"command": f"specframe train --cache {cache} --output={home}/bench/x"})
    document = json.loads(path.read_text())
    assert document["config"]["command"] == ("specframe train --cache $SPECFRAME_HOME/bench/cpu-large/cache-1 "
                                             "--output=$SPECFRAME_HOME/bench/x")
    assert document["provenance"]["command"] == "pytest benchmarks --results-dir r"
    assert results.absolute_paths(document) == []


def test_no_committed_results_file_holds_an_absolute_path():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    files = sorted(root.rglob("*.json")) + sorted(root.rglob("*.md"))
    assert files, root
    for path in files:
        text = path.read_text()
        document = json.loads(text) if path.suffix == ".json" else text
        assert results.absolute_paths(document) == [], path
