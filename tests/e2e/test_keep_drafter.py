"""``train --keep-drafter-at``: checkpoints kept whole along a run, for learning curves measured later on the served
drafter (issue 57: served acceptance at several points of one run)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file

from specframe.cli import main
from specframe.engine import checkpoint
from tests.train_fixtures import build


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("keep")
    target, chat = build(root)
    cfg = root / "small.toml"
    cfg.write_text("[drafter]\nlayers = 1\ndraft_vocab_size = 100\nk_train = 2\n")
    return target, chat, cfg


def train(assets, out, *extra):
    target, chat, cfg = assets
    args = ["train", "--drafter", "peagle", "--target", target, "--data", chat, "--seq-len", 48, "--output", out,
            "--config", cfg, "--mask-builder", "dense", "--lr", "1e-2", *extra]
    result = CliRunner().invoke(main, list(map(str, args)))
    return result.exit_code, result.output


def test_kept_checkpoints_survive_the_rolling_one(assets, tmp_path):
    out = tmp_path / "run"
    # steps 1 and 3 are no save steps (the last save before step 3 is step 2's): keeping them writes their own
    code, text = train(assets, out, "--max-steps", 4, "--save-every", 2, "--keep-drafter-at", "4,3,1", "--json")
    assert code == 0, text
    assert sorted(p.name for p in out.glob("step-*")) == ["step-00000004"]
    kept = checkpoint.kept(out)
    assert [p.name for p in kept] == ["step-00000001", "step-00000003", "step-00000004"]
    for path in kept:  # whole checkpoints: a kept folder resumes and loads like the run's own
        assert json.loads((path / "state.json").read_text())["step"] == int(path.name.split("-")[1])
    early = load_file(str(kept[0] / "model.safetensors"))
    final = load_file(str(out / "step-00000004" / "model.safetensors"))
    assert any(not early[name].equal(final[name]) for name in final), "the kept step-1 drafter is the final one"
    assert checkpoint.drafter_hash(kept[2]) == checkpoint.drafter_hash(out / "step-00000004")
    assert checkpoint.drafter_hash(kept[1]) != checkpoint.drafter_hash(kept[2])
    assert json.loads((out / "config.json").read_text())["keep_drafter_at"] == [1, 3, 4]


def test_a_run_stopped_before_its_kept_copy_keeps_it_when_resumed(assets, tmp_path, monkeypatch):
    """A kill between step 2's checkpoint and its kept copy (what the job harness's kill test hit under load): the
    resumed run starts after step 2, so only the resume can keep that drafter, and it must be the uninterrupted
    run's step-2 drafter."""
    from specframe.engine.loop import Trainer

    whole = tmp_path / "whole"
    code, text = train(assets, whole, "--max-steps", 4, "--save-every", 2, "--keep-drafter-at", 2)
    assert code == 0, text
    out = tmp_path / "run"
    keep = Trainer.keep

    def killed(self, last):
        raise SystemExit("killed after the step's checkpoint, before its kept copy")

    monkeypatch.setattr(Trainer, "keep", killed)
    code, _ = train(assets, out, "--max-steps", 4, "--save-every", 2, "--keep-drafter-at", 2)
    assert code != 0 and checkpoint.resolve(out).name == "step-00000002" and checkpoint.kept(out) == []
    monkeypatch.setattr(Trainer, "keep", keep)
    code, text = train(assets, out, "--max-steps", 4, "--save-every", 2, "--keep-drafter-at", 2, "--resume", out)
    assert code == 0, text
    assert [p.name for p in checkpoint.kept(out)] == ["step-00000002"]
    assert checkpoint.drafter_hash(checkpoint.kept(out)[0]) == checkpoint.drafter_hash(checkpoint.kept(whole)[0])
    assert checkpoint.resolve(out).name == "step-00000004"


def test_a_step_past_the_run_is_refused(assets, tmp_path):
    out = tmp_path / "run"
    code, text = train(assets, out, "--max-steps", 2, "--keep-drafter-at", "1,5")
    assert code != 0
    assert "--keep-drafter-at 5" in text and "2 steps" in text, text
    assert not checkpoint.has_checkpoint(out)


@pytest.mark.parametrize("value", ["0", "a,b"])
def test_bad_steps_are_refused(assets, tmp_path, value):
    code, text = train(assets, tmp_path / "run", "--max-steps", 1, "--keep-drafter-at", value)
    assert code != 0 and "--keep-drafter-at" in text, text
    assert "Traceback" not in text


def test_keep_replaces_a_kept_step_and_a_killed_staging_copy(tmp_path):
    out = tmp_path / "run"
    ckpt = out / "step-00000004"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text('{"step": 4}')
    (ckpt / "model.safetensors").write_text("new")
    stale = out / checkpoint.KEPT / ".step-00000004.tmp"
    stale.mkdir(parents=True)
    (stale / "half").write_text("a kill left this")
    old = out / checkpoint.KEPT / "step-00000004"
    old.mkdir()
    (old / "state.json").write_text('{"step": 4}')
    (old / "model.safetensors").write_text("old")
    kept = checkpoint.keep(out, ckpt)
    assert kept == old and (kept / "model.safetensors").read_text() == "new"
    assert sorted(p.name for p in (out / checkpoint.KEPT).iterdir()) == ["step-00000004"]
