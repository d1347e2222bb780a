import json

import pytest
from click.testing import CliRunner

from specframe import results
from specframe.cli import main

TARGET = {"id": "tiny", "weights_hash": "sha256:abc"}


def write(directory, name, kind, metrics, config, budget=5000):
    prov = results.provenance(target=TARGET, token_budget=budget, command=["pytest"])
    return results.write_results(directory / name, kind=kind, metrics=metrics, per_prompt=[], provenance=prov,
                                 config=config)


@pytest.fixture
def results_dir(tmp_path):
    d = tmp_path / "run1"
    write(d, "memory-peagle.json", "memory",
          {"exponent": 1.02, "points": [{"seq_len": 512, "peak_bytes": 2**28}, {"seq_len": 4096, "peak_bytes": 2**31}]},
          {"drafter": "peagle", "mask_builder": "chunked"})
    for k, speedup in [(3, 1.3), (5, 1.5)]:
        write(d, f"acc-k{k}.json", "acceptance",
              {"al": 1 + k * 0.4, "speedup": speedup, "per_position_conditional": [0.8, 0.6, 0.5][:k]},
              {"drafter": "peagle", "verifier": "greedy", "engine": "reference", "k": k})
    (d / "pytest-benchmark.json").write_text(json.dumps({"benchmarks": []}))  # not ours: ignored
    return d


def test_report_has_tables_plots_and_provenance(results_dir):
    result = CliRunner().invoke(main, ["report", str(results_dir)])
    assert result.exit_code == 0, result.output
    text = (results_dir / "report.md").read_text()
    assert "## acceptance" in text and "## memory" in text and "## Provenance" in text
    assert "drafter=peagle, engine=reference, verifier=greedy, k=5 | 3 |" in text
    for plot in ("acceptance-acceptance.png", "acceptance-speedup.png", "memory-memory.png"):
        assert (results_dir / plot).stat().st_size > 1000
        assert f"]({plot})" in text


def test_report_refuses_results_without_provenance(results_dir):
    path = results_dir / "acc-k3.json"
    document = json.loads(path.read_text())
    del document["provenance"]["token_budget"]
    path.write_text(json.dumps(document))
    result = CliRunner().invoke(main, ["report", str(results_dir)])
    assert result.exit_code == 1
    assert result.stderr == f"error: {path}: results without provenance (token_budget missing)\n"
    assert not (results_dir / "report.md").exists()


def test_compare_two_directories(results_dir, tmp_path):
    other = tmp_path / "run2"
    write(other, "acc-k3.json", "acceptance", {"al": 2.4, "speedup": 1.2}, {"drafter": "peagle", "k": 3})
    result = CliRunner().invoke(main, ["report", str(results_dir), "--compare", str(other), "--json"])
    assert result.exit_code == 0, result.output
    page = (other / "compare-run1.md").read_text()
    assert "| drafter=peagle, engine=reference, verifier=greedy, k=3 | al | 2.2 | 2.4 | 0.2 | 1.091 |" in page
    assert "Only in one directory: acc-k5.json, memory-peagle.json" in page


def test_empty_directory_is_an_error(tmp_path):
    result = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert result.exit_code == 1 and result.stderr == f"error: no specframe results files in {tmp_path}\n"


def test_side_by_side_methods_become_rows_and_plots(tmp_path):
    d = tmp_path / "bench"
    methods = {
        "plain": {"acceptance_length": 1.0, "speedup": 1.0, "k": 0, "conditional": []},
        "peagle/k5": {"acceptance_length": 2.5, "speedup": 1.4, "k": 5, "drafter": "peagle",
                      "conditional": [0.8, 0.6, None, None, None]},
    }
    write(d, "speed.json", "bench.acceptance", {"methods": methods}, {"dataset": "mt-bench", "verifier": "greedy"})
    result = CliRunner().invoke(main, ["report", str(d)])
    assert result.exit_code == 0, result.output
    text = (d / "report.md").read_text()
    assert "| verifier=greedy, dataset=mt-bench: peagle/k5 | 2.5 | 5 | 1.4 |" in text
    assert "| verifier=greedy, dataset=mt-bench: plain | 1 | 0 | 1 |" in text
    assert (d / "bench.acceptance-acceptance.png").exists() and (d / "bench.acceptance-speedup.png").exists()


def test_headline_answers_per_drafter_from_the_suites_files(tmp_path):
    """The headline reads the suites' files: best AL per set (and where), speedup with its interval, the training
    table, the longest measured context and vLLM beside the reference engine."""
    d = tmp_path / "cpu"
    budget = {"peagle": 900, "eagle3": 900}
    for dataset, (pe, e3) in {"gsm8k": (2.1, 1.8), "humaneval": (1.6, 1.9)}.items():
        methods = {"plain": {"acceptance_length": 1.0}, "ngram/k5": {"acceptance_length": 1.2},
                   "peagle/k3": {"acceptance_length": pe - 0.3}, "peagle/k5": {"acceptance_length": pe},
                   "eagle3/tree": {"acceptance_length": e3}}
        write(d, f"acceptance-{dataset}.json", "bench.acceptance", {"methods": methods},
              {"dataset": dataset, "ks": [3, 5]}, budget=budget)
    speed = {"plain": {"acceptance_length": 1.0},
             "peagle/k5": {"acceptance_length": 2.0, "draft_seconds_per_round": 0.01,
                           "speedup_interval": {"mean": 1.31, "low": 1.2, "high": 1.4}}}
    write(d, "speed.json", "bench.acceptance", {"methods": speed, "repeats": 5}, {"dataset": "mt-bench", "k": 5},
          budget=budget)
    write(d, "training.json", "bench.training", {"memory_budget": "3GiB", "methods": {
        "peagle": {"val_expected_al": 1.7, "tokens_per_second": 120.0, "peak_rss_bytes": 2**31, "train_tokens": 900},
        "eagle3": {"refused": "error: memory budget ..."}}}, {})
    write(d, "memory.json", "bench.memory", {"memory_budget": "3GiB", "methods": {
        "a": {"drafter": "peagle", "mask_builder": "dense", "partitioner": "none", "longest_seq_len": 1024},
        "b": {"drafter": "peagle", "mask_builder": "dense", "partitioner": "peagle", "longest_seq_len": 4096,
              "at_cap": True, "peak_bytes": 3 * 2**30},
        "c": {"drafter": "peagle", "mask_builder": "chunked", "partitioner": "peagle", "longest_seq_len": 4096,
              "at_cap": True, "peak_bytes": 2 * 2**30},
        "d": {"drafter": "eagle3", "mask_builder": "dense", "partitioner": "none", "longest_seq_len": 0}}}, {})
    text = (d / "report.md").read_text() if CliRunner().invoke(main, ["report", str(d)]).exit_code == 0 else ""
    assert "| peagle | 2.10 (k5) | 1.60 (k5) | 900 |" in text
    assert "| eagle3 | 1.80 (tree) | 1.90 (tree) | 900 |" in text
    assert "| peagle/k5 | 2.00 | 1.31x [1.20, 1.40] | 0.01 | 900 |" in text
    assert "| peagle | 1.7 | 120 | 2048 | 900 |" in text and "| eagle3 | does not fit |" in text
    # a tie at the cap goes to the combination that needed less memory there
    assert "| peagle | >= 4096 (search cap) | chunked + peagle | 2048 |" in text
    assert "| eagle3 | none | dense + none |  |" in text
