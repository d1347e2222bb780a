"""``run_config.resume_changes``: which settings a resumed run may change and which it may not (issue 56), compared
without a target or a training step. The CLI's refusal and ``--allow-changed-settings`` are in
tests/e2e/test_resume_changed.py."""

from __future__ import annotations

import json

import pytest

from specframe.engine import run_config
from specframe.errors import UsageError

#: the settings that decide the steps a run takes: changed on resume, each must be named
OPTIMISATION = ("target", "data", "cache", "seq_len", "depth", "max_steps", "epochs", "batch_size", "lr",
                "warmup_steps", "weight_decay", "grad_clip", "val_examples", "max_examples", "pack", "seed", "dtype",
                "chat_template", "feature_engine", "drafter_options")


def settings(**values):
    return run_config.resolve(run_config.build({"drafter": "peagle", "output": "run", **values}))


def record(cfg) -> dict:
    """What OUTPUT/config.json holds for ``cfg``: its settings as JSON, and the engine's record keys."""
    return {**json.loads(json.dumps(run_config.as_dict(cfg))), "steps": 10, "world_size": 1}


class Other:
    """A recorded value equal to nothing a command can give."""

    def __eq__(self, other):
        return False

    __hash__ = None


def test_the_same_settings_compare_equal():
    cfg = settings(lr=1e-3, max_steps=5, drafter_options={"layers": 2})
    assert run_config.resume_changes(record(cfg), cfg) == []


def test_the_settings_that_may_change_are_settings():
    assert run_config.RESUME_FREE <= set(run_config.fields())
    assert not set(OPTIMISATION) & run_config.RESUME_FREE


@pytest.mark.parametrize("name", sorted(set(run_config.fields()) - run_config.RESUME_FREE - {"drafter"}))
def test_every_other_setting_is_compared(name):
    """A new TrainConfig field is compared unless declared free: each one changed alone is named alone."""
    cfg = settings()
    recorded = record(cfg)
    recorded[name] = Other()
    changes = run_config.resume_changes(recorded, cfg)
    assert [c[0] for c in changes] == [name]


@pytest.mark.parametrize("name", sorted(run_config.RESUME_FREE))
def test_a_free_setting_may_change(name):
    cfg = settings()
    recorded = record(cfg)
    recorded[name] = Other()
    assert run_config.resume_changes(recorded, cfg) == []


def test_drafter_options_are_compared_one_by_one():
    cfg = settings(drafter_options={"layers": 2})
    recorded = record(cfg)
    options = sorted(recorded["drafter_options"])
    assert "layers" in options and "k_train" in options
    for option in options:
        changed = {**recorded, "drafter_options": {**recorded["drafter_options"], option: Other()}}
        assert [c[0] for c in run_config.resume_changes(changed, cfg)] == [f"drafter_options.{option}"]
    recorded["drafter_options"]["layers"] = 3
    assert run_config.resume_changes(recorded, cfg) == [("drafter_options.layers", 3, 2)]


def test_what_the_run_was_started_with_is_named_with_the_new_value():
    cfg = settings(lr=1e-3, max_steps=7, drafter_options={"layers": 2})
    recorded = record(settings(lr=3e-4, max_steps=5, drafter_options={"layers": 4}))
    changes = run_config.resume_changes(recorded, cfg)
    assert changes == [("max_steps", 5, 7), ("lr", 3e-4, 1e-3), ("drafter_options.layers", 4, 2)]
    assert run_config.describe_changes(changes) == \
        "--max-steps 5 -> 7, --lr 0.0003 -> 0.001, drafter option layers 4 -> 2"


def test_a_setting_the_record_lacks_is_not_compared():
    """A run recorded before a setting existed: its default then was the run's behaviour."""
    cfg = settings()
    recorded = record(cfg)
    del recorded["seed"], recorded["drafter_options"]["layers"]
    assert run_config.resume_changes(recorded, cfg) == []


def test_a_path_written_another_way_is_the_same_path(tmp_path, monkeypatch):
    data = tmp_path / "chat.jsonl"
    data.write_text("{}\n")
    (tmp_path / "other.jsonl").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    recorded = record(settings(data=str(data)))
    assert run_config.resume_changes(recorded, settings(data="chat.jsonl")) == []
    assert run_config.resume_changes(recorded, settings(data="./chat.jsonl")) == []
    changes = run_config.resume_changes(recorded, settings(data="other.jsonl"))
    assert changes == [("data", str(data), "other.jsonl")]


def test_a_yaml_and_a_toml_file_of_the_same_run_compare_equal(tmp_path):
    """Read as ``train --config`` reads them (PyYAML takes 3e-4 for a string, TOML's epochs 2 is an integer, the
    older [drafter] table, the drafter named by its flag): the record of one and the other are the same run."""
    (tmp_path / "run.yaml").write_text(
        "drafter: peagle\noutput: run\nlr: 3e-4\nepochs: 2\nseq-len: 64\ndrafter_options:\n  layers: 2\n")
    (tmp_path / "run.toml").write_text(
        'output = "run"\nlr = 0.0003\nepochs = 2\nseq_len = 64\n[drafter]\nlayers = 2\n')

    def from_file(path, **flags):
        return run_config.resolve(run_config.build(run_config.merge(run_config.load(path), flags)))

    yaml_run, toml_run = from_file(tmp_path / "run.yaml"), from_file(tmp_path / "run.toml", drafter="peagle")
    assert run_config.resume_changes(record(yaml_run), toml_run) == []
    assert run_config.resume_changes(record(toml_run), yaml_run) == []
    # the record, read back as --config, is the same run too
    (tmp_path / "config.json").write_text(json.dumps(record(yaml_run)))
    assert run_config.resume_changes(record(yaml_run), from_file(tmp_path / "config.json")) == []


def test_check_resume_refuses_and_allows(tmp_path):
    """Against a checkpoint folder: refused in one line naming both changes, or returned when allowed."""
    folder = tmp_path / "step-00000002"
    folder.mkdir()
    recorded = record(settings(max_steps=2))
    (folder / "config.json").write_text(json.dumps(recorded))
    (folder / "state.json").write_text(json.dumps({"step": 2}))
    cfg = settings(max_steps=3, lr=1e-3)
    with pytest.raises(UsageError, match=r"--max-steps 2 -> 3, --lr 0.0003 -> 0.001 \(nothing was written\)"):
        run_config.check_resume(folder, cfg)
    _, saved, changes = run_config.check_resume(folder, cfg, allow_changed=True)
    assert saved == recorded and [c[0] for c in changes] == ["max_steps", "lr"]
    assert run_config.check_resume(folder, settings(max_steps=2))[2] == []
