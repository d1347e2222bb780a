"""The ablation suite (benchmarks/test_ablations.py, issue 54 item 3): each variant's options reach its training run,
EAGLE-3 runs no P-EAGLE-only lever, the ablations preset trains on cpu-large's cache, winners waits for its levers,
the report pairs each variant with the baseline; and at ci scale a killed variant resumes, a finished one is skipped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from specframe import results
from specframe.cli import main

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

TARGET = {"id": "tiny", "weights_hash": "sha256:abc"}


class _Base:
    """Stands for the cache's workspace: nothing is prepared."""

    def target(self) -> str:
        return "default"

    def cache(self) -> Path:
        return Path("/nonexistent/cache")


@pytest.mark.parametrize("preset", ["ablations", "ablations-ci"])
def test_every_variants_options_reach_its_training_command(preset, tmp_path, monkeypatch):
    import test_ablations as suite
    from harness import Workspace
    from presets import ABLATIONS, FULL_VOCAB, PRESETS

    monkeypatch.setattr(suite, "cache_workspace", lambda ablation: _Base())
    ablation = Workspace(PRESETS[preset], tmp_path / "work", tmp_path / "results")
    seen = set()
    for drafter, variant in suite.cases_of(preset):
        if variant.name == suite.WINNERS:
            continue
        options, schedule = suite.plan(ablation, drafter, variant, 49152)
        ws = suite.variant_workspace(ablation, drafter, variant.name, options, schedule)
        args = ws.train_args(drafter, tmp_path / "out")
        config = args[args.index("--config") + 1]
        table = Path(config).read_text()
        for key, value in variant.options.items():
            expected = 49152 if value == FULL_VOCAB else value
            assert f"{key} = {json.dumps(expected)}\n" in table, (drafter, variant.name, table)
        # the defaults the suite began at, stated where they changed since, unless the variant moves that lever
        for key, value in ABLATIONS[preset].pinned.get(drafter, {}).items():
            if key not in variant.options:
                assert f"{key} = {json.dumps(value)}\n" in table, (drafter, variant.name, table)
        assert float(args[args.index("--lr") + 1]) == variant.schedule.get("lr", PRESETS[preset].lr)
        if "warmup_ratio" in variant.schedule:
            steps = round(variant.schedule["warmup_ratio"] * PRESETS[preset].steps)
            assert args[args.index("--warmup-steps") + 1] == str(steps)
        else:
            assert "--warmup-steps" not in args
        assert args[args.index("--seed") + 1] == str(variant.schedule.get("seed", 0))
        budget = variant.schedule.get("memory_budget", PRESETS[preset].memory_budget)
        assert args[args.index("--memory-budget") + 1] == budget
        seen.add(suite.variant_key(ws.preset, drafter, schedule))
    assert len(seen) == len([c for c in suite.cases_of(preset) if c[1].name != suite.WINNERS])  # one key each


def test_committed_variants_hold_the_key_the_suite_gives_them_now(tmp_path, monkeypatch):
    """A change to the suite that would rerun finished variants (hours each) shows here, not in the next session's
    run: every committed result's key is the one the suite computes for its variant today. A deliberate change that
    alters what a variant measures bumps the ablation's revision, and this test then asks for those files again."""
    import test_ablations as suite
    from harness import Workspace
    from presets import PRESETS, VARIANTS

    monkeypatch.setattr(suite, "cache_workspace", lambda ablation: _Base())
    ablation = Workspace(PRESETS["ablations"], tmp_path / "work", tmp_path / "results")
    files = sorted((ROOT / "benchmarks" / "results" / "ablations").glob("*/*.json"))
    assert files, "the ablation suite has committed results"
    for path in files:
        config = json.loads(path.read_text())["config"]
        drafter, name = config["drafter"], config["variant"]
        variant = next(v for v in VARIANTS if v.name == name)
        if variant.name == suite.WINNERS:
            continue  # its options come from the others' results
        options, schedule = suite.plan(ablation, drafter, variant, 49152)  # SmolLM2's vocabulary
        ws = suite.variant_workspace(ablation, drafter, name, options, schedule)
        assert suite.variant_key(ws.preset, drafter, schedule) == config["key"], path.name


def test_eagle3_runs_no_peagle_only_lever():
    from presets import ABLATIONS, VARIANTS

    ablation = ABLATIONS["ablations"]
    names = {v.name for v in ablation.variants_for("eagle3")}
    assert "mask_hidden_std" not in names and "no_cod_floor" not in names  # P-EAGLE's mask state; EAGLE-3: full grid
    assert {v.name for v in ablation.variants_for("peagle")} == {v.name for v in VARIANTS}
    assert [v.name for v in ablation.variants_for("eagle3")][0] == "baseline"
    assert [v.name for v in ablation.variants_for("eagle3")][-1] == "winners"


def test_the_ablations_preset_trains_on_cpu_larges_cache_with_at_least_250k_tokens(tmp_path, monkeypatch):
    import test_ablations as suite
    from harness import Workspace, default_work
    from presets import PRESETS, resolve

    monkeypatch.setenv("SPECFRAME_HOME", str(tmp_path / "home"))
    p, large = PRESETS["ablations"], PRESETS["cpu-large"]
    for field in ("target", "data", "train_examples", "val_examples", "seq_len", "draft_vocab", "threads", "pack",
                  "batch_size", "lr"):
        assert getattr(p, field) == getattr(large, field), field
    # 1,417 tokens a packed step at batch 4 (cpu-large's measured fill)
    assert p.min_train_tokens >= 250_000 and p.steps * 1417 >= p.min_train_tokens
    base = suite.cache_workspace(Workspace(p, tmp_path / "work", tmp_path / "results"))
    assert base.root == default_work(large) and base.preset == resolve("cpu-large")  # the key its own run built


def test_a_borrowed_cache_that_is_not_finished_is_refused_never_prepared(tmp_path, monkeypatch):
    import harness
    import test_ablations as suite
    from presets import PRESETS

    borrowed = suite.BorrowedCache(PRESETS["ablations-ci"], tmp_path / "other", tmp_path / "results")
    monkeypatch.setattr(harness, "run_cli", lambda *a, **k: pytest.fail("prepare started"))
    with pytest.raises(RuntimeError, match="is not finished .*make bench PRESET=ablations-ci"):
        borrowed.cache()
    assert not list((tmp_path / "other").glob("cache-*"))


def _finished(results_dir: Path, ablation, drafter: str, name: str, rows: list[list[int]]) -> None:
    import test_ablations as suite
    from presets import VARIANTS

    variant = next(v for v in VARIANTS if v.name == name)
    options, schedule = suite.resolved_options(variant.options, 320), dict(variant.schedule)
    key = suite.variant_key(suite.variant_preset(ablation.preset, drafter, options, schedule), drafter, schedule)
    path = results_dir / drafter / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"config": {"key": key}, "metrics": {
        "drafter": drafter, "variant": name, "val_per_sequence": rows, "options_changed": options}}))


def test_winners_waits_for_its_levers_then_joins_those_that_beat_the_baseline(tmp_path):
    import test_ablations as suite
    from harness import Workspace
    from presets import PRESETS, VARIANTS

    ablation = Workspace(PRESETS["ablations-ci"], tmp_path / "work", tmp_path / "results")
    winners = next(v for v in VARIANTS if v.name == "winners")
    base = [[i, 100, 20 + i % 3] for i in range(30)]
    better = [[i, 100, 40 + i % 3] for i in range(30)]
    _finished(ablation.results, ablation, "peagle", "baseline", base)
    _finished(ablation.results, ablation, "peagle", "mask_hidden_std", better)
    reason = suite.plan(ablation, "peagle", winners, 320)
    assert isinstance(reason, str) and "waiting" in reason and "full_vocab" in reason
    _finished(ablation.results, ablation, "peagle", "full_vocab", base)
    assert "only mask_hidden_std" in suite.plan(ablation, "peagle", winners, 320)
    # ahead on average but its interval straddles 0: no winner
    noisy = [[i, 100, 20 + i % 3 + (16 if i % 2 else -15)] for i in range(30)]
    _finished(ablation.results, ablation, "peagle", "full_vocab", noisy)
    assert "only mask_hidden_std" in suite.plan(ablation, "peagle", winners, 320)
    _finished(ablation.results, ablation, "peagle", "full_vocab", [[i, 100, 30 + i % 3] for i in range(30)])
    options, schedule = suite.plan(ablation, "peagle", winners, 320)
    assert options == {"mask_hidden_std": 1.0, "draft_vocab_size": 320}
    # and the flags the joined levers train with: full_vocab's budget, under which it alone fits
    assert schedule == next(v for v in VARIANTS if v.name == "full_vocab").schedule
    _finished(ablation.results, ablation, "peagle", "baseline", better)  # now neither beats it
    assert "no lever" in suite.plan(ablation, "peagle", winners, 320)


def _write(path: Path, drafter: str, variant: str, rows: list[list[int]], served: dict | None = None,
           beside: float | None = None) -> None:
    from specframe.report.ablations import KIND, interval

    band = interval({i: (acc, n) for i, n, acc in rows}, offset=1.0)
    metrics = {"drafter": drafter, "variant": variant, "options_changed": {} if variant == "baseline" else {"x": 1},
               "schedule": {}, "val_expected_al": band["estimate"],
               "val_expected_al_interval": {"low": band["low"], "high": band["high"]}, "val_per_sequence": rows,
               "train_tokens": 1000, "tokens_per_second": 100.0, "beside_cores": beside, "served": served,
               "complete": True}
    prov = results.provenance(target=TARGET, token_budget=1000, command=["pytest"])
    results.write_results(path, kind=KIND, metrics=metrics, per_prompt=[], provenance=prov,
                          config={"drafter": drafter, "variant": variant, "key": "k"})


def _served(al: float) -> dict:
    per = {f"q{i}#0": {"emitted": al * 10 + i % 2, "forwards": 10} for i in range(20)}
    return {"dataset": "mt-bench", "k": 3, "acceptance_length": al, "acceptance_length_interval": {"low": al - 0.1,
            "high": al + 0.1}, "per_prompt": per}


def test_the_reseeded_control_trains_the_baselines_command_with_only_the_seed_changed(tmp_path, monkeypatch):
    import test_ablations as suite
    from harness import Workspace
    from presets import CONTROL_SEED, PRESETS, RESEEDED, VARIANTS

    from specframe.report.ablations import CONTROL

    assert RESEEDED == CONTROL  # the suite's name for it is the one the report and the winners rule look for
    monkeypatch.setattr(suite, "cache_workspace", lambda ablation: _Base())
    ablation = Workspace(PRESETS["ablations"], tmp_path / "work", tmp_path / "results")
    commands = {}
    for name in ("baseline", RESEEDED):
        variant = next(v for v in VARIANTS if v.name == name)
        options, schedule = suite.plan(ablation, "peagle", variant, 49152)
        ws = suite.variant_workspace(ablation, "peagle", name, options, schedule)
        args = ws.train_args("peagle", tmp_path / "out")
        config = args.index("--config") + 1
        commands[name] = (args[:config] + args[config + 1:], Path(args[config]).read_text())
    (base, base_table), (control, control_table) = commands["baseline"], commands[RESEEDED]
    assert control_table == base_table
    changed = [i for i, (a, b) in enumerate(zip(base, control)) if a != b]
    assert len(base) == len(control) and [base[i - 1] for i in changed] == ["--seed"]
    assert (base[changed[0]], control[changed[0]]) == ("0", str(CONTROL_SEED))
    assert next(v for v in VARIANTS if v.name == RESEEDED).control


def test_winners_leaves_out_a_lever_that_moved_less_than_the_reseeded_control(tmp_path):
    import test_ablations as suite
    from harness import Workspace
    from presets import ABLATIONS, PRESETS, RESEEDED, VARIANTS

    ablation = Workspace(PRESETS["ablations"], tmp_path / "work", tmp_path / "results")
    winners = next(v for v in VARIANTS if v.name == "winners")
    gain = {"mask_hidden_std": 30, "full_vocab": 20, "frozen_head": 4}  # accepted depths more per 100 anchors
    rows = lambda extra: [[i, 100, 20 + extra + i % 3] for i in range(30)]  # noqa: E731
    for v in ABLATIONS["ablations"].variants_for("peagle"):
        if v.name not in ("winners", RESEEDED):
            _finished(ablation.results, ablation, "peagle", v.name, rows(gain.get(v.name, 0)))
    assert "waiting for peagle's reseeded" in suite.plan(ablation, "peagle", winners, 320)
    _finished(ablation.results, ablation, "peagle", RESEEDED, rows(-6))  # the seed alone moved it 0.06
    options, schedule = suite.plan(ablation, "peagle", winners, 320)
    # frozen_head's +0.04 lies above 0 on these sequences but is smaller than the control's 0.06; the control's
    # seed never joins
    assert options == {"mask_hidden_std": 1.0, "draft_vocab_size": 320}
    # and the flags the joined levers train with: full_vocab's budget, under which it alone fits
    assert schedule == next(v for v in VARIANTS if v.name == "full_vocab").schedule
    _finished(ablation.results, ablation, "peagle", RESEEDED, rows(2))
    options, _ = suite.plan(ablation, "peagle", winners, 320)
    assert options == {"mask_hidden_std": 1.0, "draft_vocab_size": 320, "train_head": False}


def test_the_report_marks_the_control_and_no_lever_it_outran(tmp_path):
    base = [[i, 100, 20 + i % 5] for i in range(40)]
    _write(tmp_path / "peagle" / "baseline.json", "peagle", "baseline", base)
    _write(tmp_path / "peagle" / "reseeded.json", "peagle", "reseeded", [[i, 100, 25 + i % 5] for i in range(40)])
    _write(tmp_path / "peagle" / "small.json", "peagle", "small", [[i, 100, 23 + i % 5] for i in range(40)])
    _write(tmp_path / "peagle" / "large.json", "peagle", "large", [[i, 100, 30 + i % 5] for i in range(40)])
    res = CliRunner().invoke(main, ["report", str(tmp_path)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    lines = (tmp_path / "report.md").read_text().splitlines()
    row = {name: next(line for line in lines if line.startswith(f"| peagle | {name} |"))
           for name in ("reseeded", "small", "large")}
    assert "+0.050 [+0.050, +0.050] (control)" in row["reseeded"]
    assert "+0.030 [+0.030, +0.030]" in row["small"] and "(wins)" not in row["small"]  # above 0, below the control
    assert "+0.100 [+0.100, +0.100] (wins)" in row["large"]
    order = [line.split("|")[2].strip() for line in lines if line.startswith("| peagle |")]
    assert order[:2] == ["baseline", "reseeded"]


def test_the_report_tables_each_variant_against_its_baseline(tmp_path):
    from specframe.report.ablations import paired_difference, validation_rows

    base = [[i, 100, 20 + i % 5] for i in range(40)]
    lever = [[i, 100, 30 + i % 5] for i in range(40)]  # +0.10 AL on every sequence
    _write(tmp_path / "peagle" / "baseline.json", "peagle", "baseline", base, _served(1.4))
    _write(tmp_path / "peagle" / "lever.json", "peagle", "lever", lever, _served(1.6), beside=0.83)
    _write(tmp_path / "eagle3" / "lever.json", "eagle3", "lever", lever)
    res = CliRunner().invoke(main, ["report", str(tmp_path)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    text = (tmp_path / "report.md").read_text()
    assert "## Ablations" in text
    (row,) = [line for line in text.splitlines() if line.startswith("| peagle | lever |")]
    assert "+0.100 [+0.100, +0.100] (wins)" in row  # paired: the per-sequence spread cancels
    assert "+0.20" in row and "x=1" in row and "(mt-bench, K=3)" in row
    (base_row,) = [line for line in text.splitlines() if line.startswith("| peagle | baseline |")]
    assert "(the baseline)" in base_row
    # tokens/s with the load beside it where it was recorded: a busy machine's figure says so
    assert row.endswith("| 1,000 | 100 (0.8) |") and base_row.endswith("| 1,000 | 100 |")
    (alone,) = [line for line in text.splitlines() if line.startswith("| eagle3 | lever |")]
    assert "no baseline yet" in alone and "not measured" in alone
    diff = paired_difference(validation_rows({"val_per_sequence": lever}), validation_rows({"val_per_sequence": base}))
    assert diff["units"] == 40 and diff["low"] <= diff["estimate"] <= diff["high"]
    summary = CliRunner().invoke(main, ["report", str(tmp_path), "--summary"])
    assert summary.exit_code == 0 and "| peagle | lever |" in summary.output


def _suite(work: Path, results_dir: Path, select: str) -> list[str]:
    return [sys.executable, "-m", "pytest", str(ROOT / "benchmarks" / "test_ablations.py"), "--preset",
            "ablations-ci", "--bench-work", str(work), "--results-dir", str(results_dir), "--benchmark-only",
            "-p", "no:cacheprovider", "-q", "-s", "-k", select]


@pytest.mark.slow
def test_ablations_ci_trains_each_variant_resumes_a_killed_one_and_skips_finished_ones(tmp_path):
    from specframe.engine import checkpoint

    work, res = tmp_path / "work", tmp_path / "results"
    log = open(tmp_path / "first.log", "w")
    first = subprocess.Popen(_suite(work, res, "peagle-baseline"), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    deadline = time.monotonic() + 900
    run = None
    while first.poll() is None and time.monotonic() < deadline:
        found = [r for r in (work / "variants").glob("peagle-baseline-*/train/peagle") if checkpoint.has_checkpoint(r)]
        if found:
            run = found[0]
            break
        time.sleep(0.1)
    assert first.poll() is None and run is not None, (tmp_path / "first.log").read_text()[-3000:]
    os.killpg(first.pid, signal.SIGKILL)  # mid-training: a checkpoint on disk, steps still to go
    first.wait()
    assert not (res / "peagle" / "baseline.json").exists()

    second = subprocess.run(_suite(work, res, "peagle"), cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    record = json.loads((run.parent / "peagle.bench-run.json").read_text())
    assert record["attempts"][0]["resumed"] and record["steps"] == 8
    assert "winners:" in second.stdout  # run or skipped, always with its reason
    vocab = json.loads((work / "tiny-target" / "config.json").read_text())["vocab_size"]
    expected = {"baseline": {"mask_hidden_std": 0.02, "draft_vocab_size": 128},
                "mask_hidden_std": {"mask_hidden_std": 1.0, "draft_vocab_size": 128},
                "full_vocab": {"mask_hidden_std": 0.02, "draft_vocab_size": vocab}}
    stamps = {}
    for name, options in expected.items():
        document = json.loads((res / "peagle" / f"{name}.json").read_text())
        m = document["metrics"]
        (folder,) = (work / "variants").glob(f"peagle-{name}-*")
        recorded = json.loads((folder / "train" / "peagle" / "config.json").read_text())["drafter_options"]
        assert {k: recorded[k] for k in options} == options, name  # what the run itself trained with
        band = m["val_expected_al_interval"]
        assert band["low"] <= m["val_expected_al"] <= band["high"] and band["sequences"] == len(m["val_per_sequence"])
        assert m["train_tokens"] > 0 and m["tokens_per_second"] > 0 and m["peak_rss_bytes"] > 0
        stamps[name] = (folder / "train" / "peagle" / "metrics.jsonl").stat().st_mtime_ns

    third = subprocess.run(_suite(work, res, "peagle"), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert third.returncode == 0, third.stdout[-3000:]
    assert third.stdout.count("complete in") == len(expected)
    for name in expected:
        (folder,) = (work / "variants").glob(f"peagle-{name}-*")
        assert (folder / "train" / "peagle" / "metrics.jsonl").stat().st_mtime_ns == stamps[name]

    report = CliRunner().invoke(main, ["report", str(res), "--summary"])
    assert report.exit_code == 0 and all(f"| peagle | {name} |" in report.output for name in expected)


def test_the_evaluation_records_each_held_out_sequences_chain(tmp_path):
    """The per-sequence record the suite bootstraps pools back to the evaluation's own chain AL."""
    from specframe.engine import TrainConfig, train
    from tests.train_fixtures import build, small_options

    target, chat = build(tmp_path / "assets")
    train(TrainConfig(drafter="peagle", output=str(tmp_path / "o"), target=str(target), data=str(chat), seq_len=48,
                      max_steps=1, batch_size=2, lr=3e-3, val_examples=3, mask_builder="dense",
                      drafter_options=small_options(k_train=3)), progress=False)
    last = [json.loads(x) for x in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines() if "val_loss" in x][-1]
    rows = last["val_chain_per_sequence"]
    assert len(rows) == 3 and len({i for i, _, _ in rows}) == 3  # one row per held-out sequence
    assert sum(n for _, n, _ in rows) == last["val_chain_anchors"]
    assert 1.0 + sum(acc for _, _, acc in rows) / sum(n for _, n, _ in rows) == pytest.approx(last["val_expected_al"])


def test_the_pins_hold_the_defaults_the_suite_began_at():
    """The suite's baseline is the family as it was when P-EAGLE's variants ran: a default changed since (adopted from
    the references, deviations rows 1 and 4) is pinned back to that value for every variant, or the baseline still
    to run (EAGLE-3's) would be compared with levers measured against another one."""
    from presets import ABLATIONS, PRE_ADOPTION

    from specframe import plugins

    assert ABLATIONS["ablations"].pinned == PRE_ADOPTION
    for drafter, pins in PRE_ADOPTION.items():
        today = plugins.get("drafter", drafter).Options()
        assert all(hasattr(today, key) for key in pins), (drafter, pins)
        # a pin equal to today's default pins nothing: it would only hide that the default has not changed
        assert all(getattr(today, key) != value for key, value in pins.items()), (drafter, pins)
