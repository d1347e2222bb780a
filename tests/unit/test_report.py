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
    for plot in ("speedup-by-k.png", "memory-by-context.png"):
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
    assert (d / "speedup-by-k.png").exists() and (d / "al-by-dataset.png").exists()


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
    assert "| peagle/k5 | 2.00 | 1.31x [1.20, 1.40] | n/a | 0.01 | 900 |" in text  # no timings to compute R
    assert "| peagle | 1.7 | per-depth product | 120 | 2048 | 900 |" in text and "| eagle3 | does not fit |" in text
    # a tie at the cap goes to the combination that needed less memory there
    assert "| peagle | >= 4096 (search cap) | chunked + peagle | 2048 |" in text
    assert "| eagle3 | none | dense + none |  |" in text


def _suite_results(d, drafters=("peagle", "eagle3", "pard")):
    """A folder shaped like the suites' output: sweeps over two sets (with per-prompt rows), a repeated speed run,
    training with learning curves, memory points with a budget."""
    for dataset, base in {"gsm8k": 1.5, "mt-bench": 1.2}.items():
        methods, rows = {"plain": {"acceptance_length": 1.0, "k": 0}}, []
        for i, name in enumerate(drafters):
            for k in (3, 5):
                al = base + 0.1 * i + 0.01 * k
                methods[f"{name}/k{k}"] = {"acceptance_length": al, "k": k, "drafter": name, "speedup": 0.5 + al / 10}
                rows += [{"method": f"{name}/k{k}", "acceptance_length": al + d} for d in (-0.1, 0.0, 0.1)]
            # older results measured chain-only drafters with the tree verifier too: never a tree row
            methods[f"{name}/tree"] = {"acceptance_length": 3.0, "k": 5, "drafter": name, "speedup": 0.7,
                                       "tree": {"depth": 5, "top_k": 4, "total_tokens": 16}}
        prov = results.provenance(target=TARGET, token_budget=100, command=["pytest"])
        results.write_results(d / f"acceptance-{dataset}.json", kind="bench.acceptance", metrics={"methods": methods},
                              per_prompt=rows, provenance=prov, config={"dataset": dataset, "ks": [3, 5]})
    speed = {"plain": {"acceptance_length": 1.0, "k": 0}}
    for name in drafters:
        speed[f"{name}/k5"] = {"acceptance_length": 1.2, "k": 5, "drafter": name, "speedup": 1.1,
                               "speedup_interval": {"mean": 1.1, "low": 1.0, "high": 1.2, "repeats": 5}}
    speed["fast/k5"] = {"acceptance_length": 1.2, "k": 5, "drafter": "fast", "speedup": 2.0,  # above AL x 1.05
                        "speedup_interval": {"mean": 2.0, "low": 1.9, "high": 2.1, "repeats": 5}}
    write(d, "speed-mt-bench.json", "bench.acceptance", {"methods": speed, "repeats": 5},
          {"dataset": "mt-bench", "k": 5})
    write(d, "training.json", "bench.training", {"memory_budget": "3GiB", "methods": {
        name: {"val_expected_al": 1.5, "val_expected_al_method": "chain", "learning_curve": [
            {"step": s, "train_tokens": 100 * s, "val_expected_al": 1.0 + 0.1 * s + 0.01 * i} for s in (1, 2, 3)]}
        for i, name in enumerate(drafters)}}, {})
    write(d, "memory.json", "bench.memory", {"memory_budget": "3GiB", "methods": {
        f"{name}/chunked/peagle": {"drafter": name, "mask_builder": "chunked", "partitioner": "peagle",
                                   "longest_seq_len": 2048, "points": [{"seq_len": 512, "peak_bytes": 2**30},
                                                                      {"seq_len": 2048, "peak_bytes": 2**31}]}
        for name in drafters}}, {})


def _legend_outside(fig, ax, legend):
    fig.canvas.draw()
    box, area = legend.get_window_extent(), ax.get_window_extent()
    return box.x0 >= area.x1 or box.y0 >= area.y1


def test_one_figure_per_question_with_its_series_and_labels(tmp_path):
    from matplotlib.container import BarContainer, ErrorbarContainer

    from specframe import report

    d = tmp_path / "cpu"
    _suite_results(d)
    made = {name: (question, fig) for name, question, fig in report.figures(report.load_results(d))}
    assert set(made) == {"al-by-dataset.png", "speedup-by-k.png", "learning-curves.png", "memory-by-context.png"}

    # AL: grouped bars, one series per drafter, one bar per set where measured, each drafter's best setting; only
    # eagle3 builds trees, so the other drafters' "tree" rows (AL 3.0 here) are left out
    fig = made["al-by-dataset.png"][1]
    ax = fig.axes[0]
    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    assert [b.get_label() for b in bars] == ["eagle3", "pard", "peagle", "fast"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["gsm8k", "mt-bench"]
    heights = {b.get_label(): [round(r.get_height(), 3) for r in b] for b in bars}
    assert heights == {"eagle3": [3.0, 3.0], "pard": [1.75, 1.45], "peagle": [1.55, 1.25], "fast": [1.2]}
    assert len(ax.collections) == 4  # an interval (error bars) per series
    assert "acceptance length" in ax.get_ylabel() and ax.get_xlabel() == "evaluation set"
    assert _legend_outside(fig, ax, ax.get_legend())

    # speedup: one line per drafter over K with intervals, the 1.0 line; the implausible 2.0x is not drawn
    fig = made["speedup-by-k.png"][1]
    ax = fig.axes[0]
    labels = ax.get_legend_handles_labels()[1]
    assert set(labels) == {"peagle", "eagle3", "pard", "break-even: plain decoding (1.0)"} and "fast" not in labels
    assert any(list(line.get_ydata()) == [1.0, 1.0] for line in ax.get_lines())
    series = {c.get_label(): (list(c.lines[0].get_xdata()), list(c.lines[0].get_ydata())) for c in ax.containers
              if isinstance(c, ErrorbarContainer)}
    assert series["peagle"][0] == [3, 5] and series["peagle"][1][1] == pytest.approx(1.1)  # the repeated run at K 5
    assert ax.get_xlabel().startswith("K") and "speedup" in ax.get_ylabel() and "mt-bench" in ax.get_title()
    assert _legend_outside(fig, ax, ax.get_legend())

    # learning curves: every drafter on one axis, AL against training tokens
    fig = made["learning-curves.png"][1]
    ax = fig.axes[0]
    assert sorted(ax.get_legend_handles_labels()[1]) == ["eagle3", "pard", "peagle"]
    line = next(x for x in ax.get_lines() if x.get_label() == "peagle")
    assert list(line.get_xdata()) == [100, 200, 300] and ax.get_xlabel() == "training tokens (log scale)" and ax.get_xscale() == "log"

    # memory: a series per drafter and combination, the budget line at 3 GiB
    fig = made["memory-by-context.png"][1]
    ax = fig.axes[0]
    labels = ax.get_legend_handles_labels()[1]
    assert "peagle (chunked + peagle)" in labels and "memory budget (3 GiB)" in labels and len(labels) == 4
    assert any(list(line.get_ydata()) == [3.0, 3.0] for line in ax.get_lines())
    assert ax.get_xscale() == "log" and "GiB" in ax.get_ylabel()
    assert _legend_outside(fig, ax, ax.get_legend())

    # the page shows each figure under its question, and the chain-only "tree" rows are labelled as chains
    assert CliRunner().invoke(main, ["report", str(d)]).exit_code == 0
    text = (d / "report.md").read_text()
    for name, (question, _) in made.items():
        assert f"**{question}**" in text and f"]({name})" in text and (d / name).stat().st_size > 1000
    assert "peagle/tree (chain k5: no tree)" in text and "| peagle | 1.55 (k5) | 1.25 (k5) |" in text
    assert "| eagle3 | 3.00 (tree) | 3.00 (tree) |" in text and "eagle3/tree (chain" not in text
    assert "| peagle | 1.5 | chain |" in text


def test_no_axes_shows_more_than_eight_series(tmp_path):
    from matplotlib.container import BarContainer

    from specframe import report

    d = tmp_path / "many"
    _suite_results(d, drafters=tuple(f"d{i}" for i in range(11)))
    for _, _, fig in report.figures(report.load_results(d)):
        for ax in fig.axes:
            bars = [c for c in ax.containers if isinstance(c, BarContainer)]
            series = [label for label in ax.get_legend_handles_labels()[1] if "break-even" not in label
                      and "budget" not in label]
            assert len(series) <= report.MAX_SERIES and len(bars) <= report.MAX_SERIES


def _vllm_suite_results(d, drafters=("peagle", "eagle3")):
    """The vLLM suite's files: per drafter, rows at K = 2, 3, 5 beside the reference engine's at K = 5."""
    for i, name in enumerate(drafters):
        methods = {"vllm/plain": {"acceptance_length": 1.0, "k": 0}, "reference/plain": {"acceptance_length": 1.0}}
        for k in (2, 3, 5):
            al = 1.2 + 0.05 * k + 0.1 * i
            mean = 1.0 + 0.02 * k + 0.1 * i if k != 5 or i else 1.9  # peagle at K 5: above AL x 1.05
            methods[f"vllm/k{k}"] = {"acceptance_length": al, "k": k, "lossless": True,
                                     "speedup_interval": {"mean": mean, "low": mean - 0.05, "high": mean + 0.05,
                                                          "repeats": 3}}
        methods["vllm"] = methods["vllm/k5"]
        methods["reference"] = {"acceptance_length": 1.45, "k": 5, "speedup_interval": {"mean": 0.6, "repeats": 3}}
        write(d, f"vllm-{name}.json", "bench.vllm", {"methods": methods, "engine": "vllm+reference"},
              {"drafter": name, "dataset": "mt-bench", "k": 5, "ks": [2, 3, 5]})


def test_speedup_figure_and_table_come_from_vllm_at_each_k_when_measured(tmp_path):
    from matplotlib.container import ErrorbarContainer

    from specframe import report

    d = tmp_path / "cpu"
    _suite_results(d)
    _vllm_suite_results(d)
    documents = report.load_results(d)
    made = {name: fig for name, _, fig in report.figures(documents)}
    ax = made["speedup-by-k.png"].axes[0]
    series = {c.get_label(): (list(c.lines[0].get_xdata()), list(c.lines[0].get_ydata())) for c in ax.containers
              if isinstance(c, ErrorbarContainer)}
    # the vLLM rows, not the reference engine's; peagle's implausible K = 5 ratio is left out
    assert set(series) == {"peagle", "eagle3"} and "in vLLM" in ax.get_title()
    assert series["peagle"] == ([2, 3], [pytest.approx(1.04), pytest.approx(1.06)])
    assert series["eagle3"][0] == [2, 3, 5] and series["eagle3"][1][2] == pytest.approx(1.2)
    lines = report.headline(documents)
    start = next(i for i, line in enumerate(lines) if line.startswith("Speedup over plain vLLM by K"))
    table = "\n".join(lines[start:start + 6])
    assert "K = 2" in table and "K = 5" in table
    assert "1.20x [1.15, 1.25], AL 1.55" in table  # eagle3 at K = 5
    assert "1.90x" not in table


def test_answers_state_each_question_with_its_interval(tmp_path):
    """The report opens with the comparison's answers: best AL per set with its interval (n-gram is a baseline, not
    a contender), learning per token (AL per doubling, regression interval) and per CPU-second (AL at the shortest
    run's training time), the fastest drafter in vLLM against plain, and against the runner-up with a Welch
    interval."""
    import math
    import statistics

    from specframe import report
    from specframe.stats import t975

    d = tmp_path / "cpu"
    methods = {"plain": {"acceptance_length": 1.0},
               "ngram/k5": {"acceptance_length": 2.5, "drafter": "ngram", "checkpoint": None},  # the baseline
               "peagle/k3": {"acceptance_length": 1.8, "k": 3}, "eagle3/k3": {"acceptance_length": 1.5, "k": 3}}
    rows = [{"method": m, "acceptance_length": al + e} for m, al in (("peagle/k3", 1.8), ("eagle3/k3", 1.5))
            for e in (-0.1, 0.0, 0.1)]
    prov = results.provenance(target=TARGET, token_budget=8000, command=["pytest"])
    results.write_results(d / "acceptance-gsm8k.json", kind="bench.acceptance", metrics={"methods": methods},
                          per_prompt=rows, provenance=prov, config={"dataset": "gsm8k", "ks": [3]})
    curves = {"peagle": (100.0, [1.1, 1.2, 1.3, 1.4]), "eagle3": (200.0, [1.1, 1.15, 1.2, 1.25])}
    write(d, "training.json", "bench.training", {"memory_budget": "3GiB", "methods": {
        name: {"val_expected_al": als[-1], "tokens_per_second": rate, "learning_curve": [
            {"step": i, "train_tokens": 1000 * 2**i, "val_expected_al": al} for i, al in enumerate(als)]}
        for name, (rate, als) in curves.items()}}, {})
    speeds = {"peagle": [1.2, 1.3, 1.25], "eagle3": [1.0, 1.05, 1.1], "pard": [0.9, 0.95, 1.0]}
    for name, reps in speeds.items():
        mean = math.exp(statistics.fmean(math.log(r) for r in reps))
        row = {"acceptance_length": 1.5, "k": 2, "speedup_interval": {
            "mean": mean, "low": mean - 0.15, "high": mean + 0.15, "repeats": 3, "values": reps}}
        write(d, f"vllm-{name}.json", "bench.vllm", {"methods": {"vllm/plain": {"acceptance_length": 1.0},
                                                                 "vllm/k2": row, "vllm": row, "reference": {
                                                                     "acceptance_length": 1.5, "k": 2,
                                                                     "speedup_interval": {"mean": 0.6}}}},
              {"drafter": name, "dataset": "mt-bench", "k": 2, "ks": [2]})
    lines = report.answers(report.load_results(d))
    text = "\n".join(lines)
    assert lines[0] == "## Answers"
    half = t975(2) * 0.1 / math.sqrt(3)
    assert (f"- **Highest AL on gsm8k:** peagle AL 1.80 [{1.8 - half:.2f}, {1.8 + half:.2f}] (k3); next eagle3 AL 1.50 "
            f"[{1.5 - half:.2f}, {1.5 + half:.2f}] (the intervals overlap)") in text
    assert "peagle +0.100 [+0.100, +0.100], eagle3 +0.050 [+0.050, +0.050]" in text  # exact lines: no residual
    assert "after 40 s of training steps" in text and "peagle 1.300, eagle3 1.250" in text
    assert "- **Fastest in vLLM:** peagle at K = 2, 1.25 [1.10, 1.40]x plain vLLM's tokens/s (AL 1.50): faster" in text
    a, b = [math.log(r) for r in speeds["peagle"]], [math.log(r) for r in speeds["eagle3"]]
    ratio = math.exp(statistics.fmean(a) - statistics.fmean(b))
    assert f"K = 2 peagle / eagle3 {ratio:.2f}x [" in text and ratio > 1  # the winner over the runner-up
    assert "ngram" not in text
    assert report.headline(report.load_results(d))[:len(lines)] == lines


def test_training_throughput_measured_beside_other_work_is_flagged(tmp_path):
    """The training table says how many cores other processes kept busy during each run, and names the runs whose
    tokens/s shared the machine; results from before this was measured keep the old table."""
    d = tmp_path / "cpu"
    write(d, "training.json", "bench.training", {"memory_budget": "3GiB", "methods": {
        "peagle": {"val_expected_al": 1.3, "val_expected_al_method": "chain", "tokens_per_second": 250.0,
                   "peak_rss_bytes": 2**30, "train_tokens": 900, "beside_cores": 0.02},
        "eagle3": {"val_expected_al": 1.3, "val_expected_al_method": "chain", "tokens_per_second": 90.0,
                   "peak_rss_bytes": 2**30, "train_tokens": 900, "beside_cores": 1.1},
        "pard": {"val_expected_al": 1.2, "val_expected_al_method": "chain", "tokens_per_second": 80.0,
                 "peak_rss_bytes": 2**30, "train_tokens": 900}}}, {})
    assert CliRunner().invoke(main, ["report", str(d)]).exit_code == 0
    text = (d / "report.md").read_text()
    assert "| train tokens | other load (cores) |" in text
    assert "| peagle | 1.3 | chain | 250 | 1024 | 900 | 0.02 |" in text
    assert "| pard | 1.2 | chain | 80 | 1024 | 900 | not measured |" in text
    assert "Throughput shared the machine for eagle3 (" in text  # and only for eagle3
    old = tmp_path / "old"
    write(old, "training.json", "bench.training", {"memory_budget": "3GiB", "methods": {
        "peagle": {"val_expected_al": 1.3, "tokens_per_second": 250.0, "peak_rss_bytes": 2**30, "train_tokens": 9}}},
        {})
    assert CliRunner().invoke(main, ["report", str(old)]).exit_code == 0
    text = (old / "report.md").read_text()
    assert "other load" not in text and "shared the machine" not in text


def test_the_demos_vllm_run_answers_which_drafter_is_fastest(tmp_path):
    """``bench acceptance --engine vllm`` (make demo's speed run) feeds the answers' vLLM line: its trained drafter's
    rows at batch 1 count, the baseline's (a drafter run without a checkpoint) never win, whatever their speed."""
    from specframe import report

    def row(drafter, k, mean, checkpoint):
        return {"acceptance_length": 1.4, "k": k, "drafter": drafter, "checkpoint": checkpoint,
                "speedup_interval": {"mean": mean, "low": mean - 0.02, "high": mean + 0.02, "repeats": 3}}

    methods = {"plain": {"acceptance_length": 1.0, "drafter": None, "checkpoint": None},
               "peagle/k2": row("peagle", 2, 1.06, "runs/demo/peagle/step-00000060"),
               "peagle/k3": row("peagle", 3, 1.01, "runs/demo/peagle/step-00000060"),
               "ngram/k2": row("ngram", 2, 1.33, None)}
    write(tmp_path, "vllm.json", "bench.acceptance", {"methods": methods, "concurrency": 1, "engine": "vllm"},
          {"dataset": "gsm8k", "engine": "vllm", "concurrency": 1})
    text = "\n".join(report.answers(report.load_results(tmp_path)))
    assert "- **Fastest in vLLM:** peagle at K = 2, 1.06 [1.04, 1.08]x" in text
    assert "ngram" not in text
    # at 4 requests at once it is not a batch-1 answer
    write(tmp_path, "vllm.json", "bench.acceptance", {"methods": methods, "concurrency": 4, "engine": "vllm"},
          {"dataset": "gsm8k", "engine": "vllm", "concurrency": 4})
    assert "Fastest in vLLM" not in "\n".join(report.answers(report.load_results(tmp_path)))
