"""`specframe report` on a per-drafter run (benchmarks/test_jobs.py): it merges whatever drafters finished, names
the ones waiting or missing, ranks whole-set acceptance with intervals and reports quiet batch-1 speed only."""

from __future__ import annotations

import sys
from pathlib import Path

import attrs
import pytest
from click.testing import CliRunner

from specframe import results
from specframe.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

TARGET = {"id": "tiny", "weights_hash": "sha256:abc"}


def write(path, kind, metrics, config):
    prov = results.provenance(target=TARGET, token_budget=1000, command=["pytest"])
    return results.write_results(path, kind=kind, metrics=metrics, per_prompt=[], provenance=prov, config=config)


def whole(al: dict[str, tuple[float, float, float]], dataset="mt-bench") -> dict:
    return {"dataset": dataset, "engine": "vllm", "methods": {
        label: {"k": int(label.rsplit("k", 1)[1]), "prompt_turns": 160, "acceptance_length": v,
                "acceptance_length_interval": {"low": lo, "high": hi}, "equal_to_plain": 1.0}
        for label, (v, lo, hi) in al.items()}}


def speed(label: str, mean: float, quiet: bool = True, concurrency: int = 1) -> dict:
    return {"quiet": quiet, "concurrency": concurrency, "methods": {
        "plain": {"acceptance_length": 1.0},
        # as bench records them: the baseline is the drafter run without a checkpoint (never found by its name)
        "ngram/k3": {"acceptance_length": 1.3, "drafter": "ngram", "checkpoint": None,
                     "speedup_interval": {"mean": 1.2, "low": 1.1, "high": 1.3}},
        label: {"acceptance_length": 2.0, "drafter": label.split("/")[0], "checkpoint": "train/step-00000010",
                "speedup_interval": {"mean": mean, "low": mean - 0.1, "high": mean + 0.1}}},
        "ratios": {f"ngram/k3 / {label}": {"otps": {"mean": 1.2 / mean, "low": 1.1 / mean, "high": 1.3 / mean}}}}


@pytest.fixture
def partial(tmp_path):
    d = tmp_path / "cpu-large"
    write(d / "baselines" / "acceptance-mt-bench.json", "bench.acceptance.whole-set",
          whole({"ngram/k2": (1.20, 1.15, 1.25), "ngram/k5": (1.31, 1.25, 1.37)}),
          {"preset": "cpu-large", "dataset": "mt-bench", "drafters": ["peagle", "eagle3", "pard"]})
    write(d / "peagle" / "acceptance-mt-bench.json", "bench.acceptance.whole-set",
          whole({"peagle/k2": (1.8, 1.7, 1.9), "peagle/k3": (2.1, 2.0, 2.2)}), {"dataset": "mt-bench"})
    write(d / "peagle" / "speed-batch1.json", "bench.speed", speed("peagle/k3", 1.5), {"drafter": "peagle"})
    write(d / "peagle" / "speed-concurrent4.json", "bench.speed", speed("peagle/k3", 1.3, concurrency=4),
          {"drafter": "peagle"})
    write(d / "peagle" / "job.json", "bench.job", {"drafter": "peagle", "checkpoint_hash": "sha256:" + "1" * 64,
          "train_tokens": 1_024_000, "complete": True,
          "vllm_refused": {"peagle/k2": "served only at K = 7"}}, {"key": "x"})
    # EAGLE-3's job ran, but its speed shared the machine: waiting, and its speed is not reported
    write(d / "eagle3" / "speed-batch1.json", "bench.speed", speed("eagle3/k3", 9.9, quiet=False), {"drafter": "eagle3"})
    write(d / "eagle3" / "job.json", "bench.job", {"drafter": "eagle3", "checkpoint_hash": "sha256:" + "2" * 64,
          "train_tokens": 1_024_000, "complete": False, "waiting": "speed measured beside other load"}, {"key": "y"})
    return d


def test_a_partial_run_reports_what_finished_and_names_what_is_missing(partial):
    res = CliRunner().invoke(main, ["report", str(partial)])
    assert res.exit_code == 0, res.output
    text = (partial / "report.md").read_text()
    section = text[text.index("## The answer (one job per drafter)"):]
    assert "**Done:** peagle (1,024,000 training tokens" in section
    assert "**Waiting:** eagle3 (speed measured beside other load)" in section
    assert "**Not yet run:** pard (`make bench PRESET=cpu-large` continues)" in section
    assert "- **Not served by vLLM:** peagle/k2 (served only at K = 7)" in section
    # the ranking: each method at its best K, best first, with its interval
    assert "| 1 | peagle/k3 | vLLM | 2.10 [2.00, 2.20] | 160 | 100.0% |" in section
    assert "| 2 | ngram/k5 | vLLM | 1.31 [1.25, 1.37] | 160 | 100.0% |" in section
    # speed: quiet measurements only; over n-gram is the inverse of the stored n-gram / drafter ratio
    assert "| peagle | peagle/k3 | 2.00 |  | 1.50 [1.40, 1.60]x | 1.25 [1.15, 1.36]x |" in section
    assert "9.90" not in section
    assert "**Fastest drafter in vLLM at batch 1:** peagle/k3, 1.50 [1.40, 1.60]x plain vLLM: faster than" in section
    # 4 concurrent requests: a table of its own after batch 1's, with its own verdict
    four = section[section.index("**Speed in vLLM at 4 concurrent requests**"):]
    assert section.index("**Speed in vLLM at batch 1**") < section.index("**Speed in vLLM at 4 concurrent")
    assert "| peagle | peagle/k3 | 2.00 |  | 1.30 [1.20, 1.40]x |" in four
    assert "**Fastest drafter in vLLM at 4 concurrent requests:** peagle/k3, 1.30 [1.20, 1.40]x" in four
    assert "1.30 [1.20, 1.40]x" not in section[:section.index("**Speed in vLLM at 4 concurrent")]


def reference_subset(rows: dict[str, tuple[float, bool]], dataset="mt-bench") -> dict:
    """What a job writes for a drafter vLLM serves at no K: acceptance on the reference engine on a subset."""
    return {"dataset": dataset, "engine": "reference", "subset_of": 80, "prompt_turns": 4, "methods": {
        "plain": {"k": 0, "acceptance_length": 1.0},
        **{label: {"k": 7, "prompt_turns": 4, "acceptance_length": al, "lossless": same,
                   "acceptance_length_interval": {"low": al - 0.05, "high": al + 0.05}}
           for label, (al, same) in rows.items()}}}


def test_a_drafter_vllm_cannot_serve_is_ranked_and_timed_on_the_reference_engine_and_says_so(partial):
    """DSpark on vLLM's CPU build: its rows name the reference engine and their prompt turns, its scheduled
    verifier is a row of its own, and its reference-engine speed has a table of its own, never vLLM's."""
    write(partial / "dspark" / "reference-mt-bench.json", "bench.acceptance.subset",
          reference_subset({"dspark/k7": (1.12, True), "dspark/k7+scheduled": (1.09, True)}),
          {"drafter": "dspark", "dataset": "mt-bench", "prompts": ["81", "91"], "engine": "reference"})
    ref_speed = speed("dspark/k7", 0.4)
    ref_speed["engine"] = "reference"
    write(partial / "dspark" / "speed-reference.json", "bench.speed", ref_speed,
          {"drafter": "dspark", "engine": "reference"})
    res = CliRunner().invoke(main, ["report", str(partial)])
    assert res.exit_code == 0, res.output
    section = (partial / "report.md").read_text()
    section = section[section.index("## The answer (one job per drafter)"):]
    assert "| 3 | dspark/k7 | reference (2 of 80 prompts) | 1.12 [1.07, 1.17] | 4 | all |" in section
    assert "| 4 | dspark/k7+scheduled | reference (2 of 80 prompts) | 1.09 [1.04, 1.14] | 4 | all |" in section
    vllm_speed = section[section.index("**Speed in vLLM at batch 1**"):section.index("**Speed in vLLM at 4")]
    assert "dspark" not in vllm_speed
    reference = section[section.index("**Speed on the reference engine at batch 1**"):]
    assert "| dspark | dspark/k7 | 2.00 |  | 0.40 [0.30, 0.50]x |" in reference
    assert "**Fastest drafter on the reference engine at batch 1:** dspark/k7, 0.40 [0.30, 0.50]x plain decoding" \
        in reference
    # the answers' vLLM speed reads vLLM's files only
    from specframe.report import load_results
    from specframe.report.questions import speedup_by_k

    assert "dspark" not in speedup_by_k(load_results(partial), engine="vllm")
    # nor does it rank alone among the answers' reference-engine figures (P-EAGLE's are vLLM's)
    assert "**Highest AL on" not in (partial / "report.md").read_text()


def test_the_summary_prints_the_answer_and_writes_nothing(partial):
    res = CliRunner().invoke(main, ["report", str(partial), "--summary"])
    assert res.exit_code == 0, res.output
    assert "**Done:** peagle" in res.output and "**Not yet run:** pard" in res.output
    assert "**Fastest drafter in vLLM at batch 1:** peagle/k3" in res.output
    assert not (partial / "report.md").exists()
    res = CliRunner().invoke(main, ["report", str(partial), "--summary", "--json"])
    assert res.exit_code == 2 and "--summary prints the answer only" in res.output


def test_a_finished_job_is_skipped_only_under_its_own_key(tmp_path):
    from presets import PRESETS, resolve
    from test_jobs import finished_job, job_key

    p = PRESETS["cpu-large"]
    key = job_key(p, "peagle")
    assert key == job_key(attrs.evolve(p, drafters={**p.drafters, "new": {}}), "peagle")  # another drafter added
    def bumped(drafter: str) -> dict[str, int]:
        return {**p.job_revisions, drafter: p.job_revisions.get(drafter, 0) + 1}

    assert key == job_key(attrs.evolve(p, job_revisions=bumped("eagle3")), "peagle")  # another drafter rerun
    assert key != job_key(attrs.evolve(p, job_revisions=bumped("peagle")), "peagle")  # this drafter's change
    assert key != job_key(attrs.evolve(p, steps=p.steps + 1), "peagle")
    assert key != job_key(attrs.evolve(p, keep_drafter_at=(100,)), "peagle")  # other kept steps: another command
    assert key != job_key(attrs.evolve(p, drafters={**p.drafters, "peagle": {"layers": 2}}), "peagle")
    # the reference engine's verifiers: only the drafter's own entry is part of its key
    assert key == job_key(attrs.evolve(p, reference_verifiers={"dspark": ("scheduled",)}), "peagle")
    assert key == job_key(attrs.evolve(p, reference_verifiers={}), "peagle")
    installed = resolve("cpu-large")  # DSpark is a plugin drafter: in the preset once installed
    assert job_key(installed, "dspark") != job_key(attrs.evolve(installed, reference_verifiers={}), "dspark")
    write(tmp_path / "job.json", "bench.job", {"drafter": "peagle", "complete": True, "checkpoint_hash": "h"},
          {"key": key})
    assert finished_job(tmp_path, key)["checkpoint_hash"] == "h"
    assert finished_job(tmp_path, job_key(p, "eagle3")) is None
    write(tmp_path / "job.json", "bench.job", {"drafter": "peagle", "complete": False, "checkpoint_hash": "h"},
          {"key": key})
    assert finished_job(tmp_path, key) is None  # an incomplete job runs again


def test_the_large_presets_drafters_train_on_a_million_tokens_of_distinct_conversations():
    from presets import PRESETS

    from harness import too_few_tokens

    p = PRESETS["cpu-large"]
    assert p.data == "large" and p.pack and p.per_drafter_jobs and p.committed
    # the floor is on the tokens a run reports (packing fills the steps' slots only in part), checked by every job
    assert p.min_train_tokens >= 1_000_000
    # 354 tokens per packed 512-token sequence: what 500 steps gave P-EAGLE (708,319 tokens, at c69048f)
    assert p.steps * p.batch_size * 354 >= p.min_train_tokens
    assert p.steps // p.eval_every >= 8  # validation along one token axis at no fewer than 8 points
    # packed one pass: the conversations hold more tokens than the steps read (about 290 tokens each in the set)
    assert p.train_examples * 250 >= p.steps * p.batch_size * 354
    assert "cpu-long" not in PRESETS
    record = {"drafter": "peagle", "train_tokens": 708_319}
    assert "peagle trained on 708,319 tokens, fewer than the cpu-large preset's 1,000,000" in too_few_tokens(p, record)
    assert too_few_tokens(p, record | {"train_tokens": 1_000_000}) is None
    assert too_few_tokens(p, record | {"refused": "memory budget"}) is None  # the budget's refusal trains nothing
    assert too_few_tokens(PRESETS["cpu"], record) is None  # a preset without a floor


def test_a_drafter_has_one_colour_in_every_figure_and_the_curves_a_log_token_axis(partial):
    from matplotlib.colors import to_hex

    from specframe.report import COLOURS, colour, figures, load_results

    curve = [{"step": s, "train_tokens": t, "val_expected_al": a} for s, t, a in [(50, 100_000, 1.2), (100, 200_000, 1.4)]]
    for name in ("peagle", "eagle3"):
        write(partial / name / "training.json", "bench.training",
              {"methods": {name: {"learning_curve": curve, "val_expected_al": 1.4}}}, {"drafter": name})
    made = {name: fig for name, _, fig in figures(load_results(partial))}
    ax = made["learning-curves.png"].axes[0]
    assert ax.get_xscale() == "log"
    lines = {line.get_label(): to_hex(line.get_color()) for line in ax.get_lines()}
    assert lines["peagle"] == to_hex(COLOURS["peagle"]) and lines["eagle3"] == to_hex(COLOURS["eagle3"])
    assert colour("peagle/k3") == colour("peagle") != colour("eagle3/k3")
    assert colour("somebody-elses") == colour("somebody-elses/k2")  # a third-party drafter: fixed by its name


def _slow_run(tmp_path, peagle_speedup=(0.8, 0.7, 0.9), served=((1000, 1.0), (2000, 1.1), (4000, 1.2)),
              validation=((1000, 1.0), (2000, 1.3), (4000, 1.6))):
    """A per-drafter run whose served MT-Bench curve (K = 3, kept checkpoints plus the final one) gains exactly 0.1
    AL per doubling (1,000 -> 4,000 tokens), while its validation curve gains 0.3, and whose quiet batch-1 speed at
    K = 3 is AL 1.2 at round cost R = 1.5."""
    d = tmp_path / "cpu-large"
    curve = [{"train_tokens": t, "val_expected_al": al} for t, al in validation]
    write(d / "peagle" / "training.json", "bench.training", {"methods": {"peagle": {"learning_curve": curve}}},
          {"drafter": "peagle"})
    *kept, (final_tokens, final_al) = served
    points = [{"label": f"peagle/step{i}/k3", "step": i, "train_tokens": t, "checkpoint_hash": f"h{i}"}
              for i, (t, _) in enumerate(kept, 1)]
    rows = {f"peagle/step{i}/k3": {"k": 3, "acceptance_length": al,
                                   "acceptance_length_interval": {"low": al - 0.01, "high": al + 0.01}}
            for i, (_, al) in enumerate(kept, 1)}
    write(d / "peagle" / "curve-mt-bench.json", "bench.acceptance.whole-set",
          {"dataset": "mt-bench", "engine": "vllm", "methods": rows},
          {"drafter": "peagle", "dataset": "mt-bench", "k": 3, "points": points})
    write(d / "peagle" / "acceptance-mt-bench.json", "bench.acceptance.whole-set",
          whole({"peagle/k3": (final_al, final_al - 0.01, final_al + 0.01)}), {"drafter": "peagle",
                                                                            "dataset": "mt-bench"})
    write(d / "peagle" / "job.json", "bench.job", {"drafter": "peagle", "checkpoint_hash": "h", "complete": True,
                                                  "train_tokens": final_tokens}, {"key": "k"})
    mean, low, high = peagle_speedup

    def speed_doc(quiet=True, concurrency=1, r=1.5, repeats=3):
        return {"quiet": quiet, "concurrency": concurrency, "methods": {
            "plain": {"acceptance_length": 1.0},
            "peagle/k3": {"acceptance_length": 1.2, "round_cost_ratio": r,
                          "speedup_interval": {"mean": mean, "low": low, "high": high, "repeats": repeats}}}}

    write(d / "peagle" / "speed-batch1.json", "bench.speed", speed_doc(), {"drafter": "peagle"})
    # neither a speed beside load nor one at 4 requests at once counts (their R would say otherwise, and with more
    # repeats they would otherwise be preferred)
    write(d / "peagle" / "speed-loud.json", "bench.speed", speed_doc(quiet=False, r=9.0, repeats=5),
          {"drafter": "peagle"})
    write(d / "peagle" / "speed-concurrent4.json", "bench.speed", speed_doc(concurrency=4, r=0.5, repeats=5),
          {"drafter": "peagle"})
    return d


def test_the_served_curve_says_how_many_tokens_beating_plain_would_take(tmp_path):
    from specframe import report

    documents = report.load_results(_slow_run(tmp_path))
    even = report.tokens_to_beat_plain(documents)["peagle"]
    # break-even: served AL must reach R = 1.5, +0.3 AL = 3 doublings of the 4,000 tokens seen at 0.1 per doubling
    # (the validation curve's 0.3 per doubling would say 1 doubling: it is not what the projection reads)
    assert even["k"] == 3 and even["needed_al"] == pytest.approx(1.5) and even["tokens"] == pytest.approx(32_000)
    assert even["low"] < 32_000 < even["high"] and even["within_reach"]
    goal = report.tokens_to_beat_plain(documents, 1.3)["peagle"]
    assert goal["tokens"] == pytest.approx(4000 * 2 ** ((1.3 * 1.5 - 1.2) / 0.1))
    lines = report.summary(_slow_run(tmp_path))
    assert any("Training tokens to break even with plain vLLM at batch 1" in line and "about 32K" in line
               for line in lines)
    # 1.3x needs 7.5 doublings (about 724K): past ten times the 4,000 tokens seen, so an order of magnitude only
    line = next(line for line in lines if "Training tokens for 1.3x" in line)
    assert "not within reach of this budget (4K tokens): of order 10^6 tokens" in line and "724" not in line


def test_without_three_served_points_there_is_no_projection(tmp_path):
    from specframe import report

    documents = report.load_results(_slow_run(tmp_path, served=((2000, 1.1), (4000, 1.2))))
    assert report.tokens_to_beat_plain(documents) == {}
    line = next(line for line in report.answers(documents) if "Training tokens" in line)
    assert "no projection" in line and "validation curve is not used" in line


def test_no_extrapolation_once_a_drafter_beats_plain(tmp_path):
    from specframe import report

    documents = report.load_results(_slow_run(tmp_path, peagle_speedup=(1.2, 1.1, 1.3)))
    assert report.tokens_to_beat_plain(documents) == {}
    assert not any("Training tokens" in line for line in report.answers(documents))


def test_the_served_curve_is_a_table_and_a_figure_on_the_log_token_axis(tmp_path):
    from specframe.report import figures, load_results, summary

    run = _slow_run(tmp_path)
    text = "\n".join(summary(run))
    assert "| peagle | mt-bench | 3 | (1,000, 1.00 [0.99, 1.01]), (2,000, 1.10 [1.09, 1.11]), (4,000, 1.20 [1.19, " \
           "1.21]) |" in text
    assert "| peagle | peagle/k3 | 1.20 | 1.50 |" in text  # R beside the speedup: why it does not pay
    made = {name: fig for name, _, fig in figures(load_results(run))}
    ax = made["served-learning-curves.png"].axes[0]
    assert ax.get_xscale() == "log"
    data = [line for line in ax.get_lines() if line.get_marker() == "o"]  # the curve, not its error caps
    assert [list(line.get_xdata()) for line in data] == [[1000, 2000, 4000]]
    assert list(data[0].get_ydata()) == [1.0, 1.1, 1.2]
