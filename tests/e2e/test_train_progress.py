"""``specframe train`` without a terminal (progress lines), --epochs, and --report-to trackers."""

from __future__ import annotations

import json
import math
import re
import sys

import pytest
from click.testing import CliRunner

from specframe.cli import main
from specframe.engine import tracking
from tests.train_fixtures import build

STEP_LINE = re.compile(r"^step (\d+)/(\d+)  loss \d+\.\d{4}  [\d,]+ tokens/s  elapsed \d+:\d\d  ETA \d+:\d\d$")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("progress")
    target, chat = build(root)
    cfg = root / "small.toml"
    cfg.write_text("[drafter]\nlayers = 1\ndraft_vocab_size = 64\nk_train = 3\n")
    return root, target, chat, cfg


def invoke(*args):
    # CliRunner's stdout is not a terminal, as in `make demo > log`
    return CliRunner().invoke(main, list(map(str, args)))


def train_args(assets, out, *extra):
    _, target, chat, cfg = assets
    return ("train", "--drafter", "peagle", "--target", target, "--data", chat, "--seq-len", 48, "--output", out,
            "--config", cfg, "--mask-builder", "dense", "--val-examples", 2, *extra)


@pytest.fixture(scope="module")
def tensorboard_run(assets):
    out = assets[0] / "tb-run"
    result = invoke(*train_args(assets, out, "--max-steps", 4, "--log-every", 2, "--eval-every", 2,
                                "--report-to", "tensorboard"))
    assert result.exit_code == 0, result.output
    return out, result


def test_plain_progress_lines_when_stdout_is_not_a_terminal(tensorboard_run):
    _, result = tensorboard_run
    lines = result.stdout.splitlines()
    assert lines[0].startswith("training 4 steps of 2 sequences: ")
    steps = [STEP_LINE.match(line) for line in lines if line.startswith("step ")]
    assert all(steps), lines
    assert [(int(m.group(1)), int(m.group(2))) for m in steps] == [(2, 4), (4, 4)]
    evals = [line for line in lines if line.startswith("eval step ")]
    assert len(evals) == 2 and "expected AL" in evals[0]  # step 2 and the final evaluation
    assert lines[-2].startswith("trained 4 steps; checkpoint ")


def test_tensorboard_events_hold_the_metrics_and_the_config(tensorboard_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = tensorboard_run
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("train_loss", "tokens_per_second", "peak_memory_bytes", "lr", "grad_norm", "train_accuracy/depth0",
                "val_loss", "val_expected_al", "val_accuracy/depth0", "val_accuracy/depth2"):
        assert tag in tags, sorted(tags)
    assert [e.step for e in acc.Scalars("train_loss")] == [1, 2, 3, 4]
    assert [e.step for e in acc.Scalars("val_loss")] == [2, 4]
    assert all(e.value > 0 for e in acc.Scalars("tokens_per_second") + acc.Scalars("peak_memory_bytes"))
    losses = [m["train_loss"] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
              if "train_loss" in m]
    assert [e.value for e in acc.Scalars("train_loss")] == pytest.approx(losses, rel=1e-6)
    config = [t for t in acc.Tags()["tensors"] if t.startswith("config")]
    assert config, acc.Tags()
    text = acc.Tensors(config[0])[0].tensor_proto.string_val[0].decode()
    assert '"drafter": "peagle"' in text and '"report_to": "tensorboard"' in text


def test_json_sends_progress_to_stderr_and_epochs_set_the_length(assets, tmp_path):
    out = tmp_path / "run"
    result = invoke(*train_args(assets, out, "--epochs", 0.5, "--log-every", 1, "--json"))
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)  # stdout is the result alone
    config = json.loads((out / "config.json").read_text())
    steps = math.ceil(0.5 * config["train_sequences"] / 2)
    assert summary["steps"] == config["steps"] == steps and config["epochs"] == 0.5
    assert config["conversations"] == 12 and config["max_examples"] is None and config["pack"] is True
    lines = [line for line in result.stderr.splitlines() if line.startswith("step ")]
    assert [int(STEP_LINE.match(line).group(1)) for line in lines] == list(range(1, steps + 1))


def test_epochs_rule():
    from specframe.engine import TrainConfig
    from specframe.engine.schedule import resolve_steps

    def steps(**kw):
        return resolve_steps(TrainConfig(drafter="peagle", output="o", batch_size=4, **kw), 10)

    assert steps() == 3  # one epoch: ceil(10 / 4)
    assert steps(epochs=2) == 5 and steps(epochs=0.1) == 1 and steps(epochs=1.2) == 3
    assert steps(max_steps=7) == 7
    with pytest.raises(tracking.UsageError, match="at most one of --max-steps and --epochs"):
        steps(max_steps=7, epochs=1)


def test_a_missing_tracker_library_is_one_clear_error_and_nothing_is_written(assets, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` now raises ImportError
    out = tmp_path / "run"
    result = invoke(*train_args(assets, out, "--max-steps", 1, "--report-to", "none,tensorboard"))
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        "error: --report-to tensorboard: not installed; pip install tensorboard (or specframe[tensorboard]), or drop "
        "it from --report-to (nothing was written)"
    ]
    assert not out.exists()


def test_report_to_names_are_checked():
    assert tracking.parse_report_to("none") == []
    assert tracking.parse_report_to(" TensorBoard , wandb,tensorboard") == ["tensorboard", "wandb"]
    with pytest.raises(tracking.UsageError, match="did you mean 'wandb'"):
        tracking.parse_report_to("wandbb")


@pytest.mark.slow  # wandb starts its own service process: 10-20 s
def test_wandb_logs_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is optional (pip install 'specframe[wandb]')")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    trackers = tracking.open_trackers(["wandb"], tmp_path, {"drafter": "peagle", "seq_len": 48})
    try:
        trackers.log({"step": 1, "train_loss": 1.5, "val_accuracy": [0.5, 0.25], "note": "x"}, 1)
    finally:
        trackers.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), list((tmp_path / "wandb").rglob("*"))
