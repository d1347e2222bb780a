"""``specframe train --resume`` continues a run under the settings it was started with (issue 56): a command that
changes what the steps compute is refused before anything is loaded or written, naming each changed setting;
``--allow-changed-settings`` continues anyway and the run's record says so. The comparison itself, field by field,
is in tests/unit/test_resume_settings.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from specframe.cli import main
from specframe.engine import checkpoint as ckpt
from tests.train_fixtures import build


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-step run (its arguments, its folder), copied by each test that resumes it."""
    root = tmp_path_factory.mktemp("resume-changed")
    target, chat = build(root)
    options = root / "small.toml"
    options.write_text("[drafter]\nlayers = 2\ndraft_vocab_size = 100\nk_train = 3\n")
    run_dir = root / "run"
    args = ["train", "--drafter", "peagle", "--target", target, "--data", chat, "--seq-len", 48, "--config", options,
            "--mask-builder", "dense", "--max-examples", 6, "--max-steps", 2]
    code, _, err = invoke(*args, "--output", run_dir)
    assert code == 0, err
    return root, args, run_dir


def invoke(*argv) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in argv])
    return result.exit_code, result.stdout, result.stderr


def copy(finished, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished[2], out)
    return out


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file's bytes and modification time: a refused command must not even rewrite a file as it was."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def test_a_changed_schedule_is_refused_naming_each_setting(finished, tmp_path):
    _, args, _ = finished
    out = copy(finished, tmp_path)
    before = snapshot(out)
    code, _, err = invoke(*args, "--max-steps", 3, "--lr", "1e-3", "--output", out, "--resume", out)
    assert code == 2, err
    assert "Traceback" not in err
    (line,) = errors(err)
    assert line.startswith(f"error: --resume {out}: the run was started with other settings: ")
    assert "--max-steps 2 -> 3" in line and "--lr 0.0003 -> 0.001" in line
    # the two ways on: the flag that continues, and a warm start for a new run
    assert "--allow-changed-settings" in line and "--init-from" in line
    assert f"--config {ckpt.resolve(out) / 'config.json'}" in line
    assert snapshot(out) == before


def test_a_changed_drafter_option_is_refused(finished, tmp_path):
    root, args, _ = finished
    out = copy(finished, tmp_path)
    wider = tmp_path / "wider.toml"
    wider.write_text("[drafter]\nlayers = 3\ndraft_vocab_size = 100\nk_train = 3\n")
    before = snapshot(out)
    argv = [wider if a == root / "small.toml" else a for a in args]
    code, _, err = invoke(*argv, "--output", out, "--resume", out)
    assert code == 2, err
    (line,) = errors(err)
    assert "drafter option layers 2 -> 3" in line
    assert "--max-steps" not in line and "--lr" not in line  # only what changed is named
    assert snapshot(out) == before


def test_allow_changed_settings_continues_and_records_it(finished, tmp_path):
    _, args, _ = finished
    out = copy(finished, tmp_path)
    code, text, err = invoke(*args, "--max-steps", 3, "--lr", "1e-3", "--output", out, "--resume", out,
                             "--allow-changed-settings", "--json")
    assert code == 0, err
    assert json.loads(text[text.index("{"):])["steps"] == 3
    assert "warning: --resume" in err and "--max-steps 2 -> 3" in err and "--lr 0.0003 -> 0.001" in err
    history = [{"step": 2, "changed": {"max_steps": {"recorded": 2, "now": 3},
                                       "lr": {"recorded": 0.0003, "now": 0.001}}}]
    record = json.loads((out / "config.json").read_text())
    assert record["changed_on_resume"] == history and record["lr"] == 0.001 and record["steps"] == 3
    assert json.loads((ckpt.resolve(out) / "config.json").read_text())["changed_on_resume"] == history
    # the changed run resumes under its new settings, and keeps the history of how it came by them
    code, _, err = invoke(*args, "--max-steps", 3, "--lr", "1e-3", "--output", out, "--resume", out)
    assert code == 0, err
    assert "warning: --resume" not in err
    assert json.loads((out / "config.json").read_text())["changed_on_resume"] == history


def test_an_unchanged_resume_proceeds(finished, tmp_path):
    """The same flags, with changes that leave the steps as they were (where the run saves, logs and evaluates, the
    device and the mask builder), or the run's own record as --config, resume without a word."""
    _, args, _ = finished
    out = copy(finished, tmp_path)
    code, _, err = invoke(*args, "--output", out, "--resume", out, "--eval-every", 1, "--log-every", 1,
                          "--device", "cpu", "--mask-builder", "chunked", "--save-every", 1)
    assert code == 0, err
    assert not errors(err) and "warning: --resume" not in err
    assert "changed_on_resume" not in json.loads((out / "config.json").read_text())
    code, _, err = invoke("train", "--config", out / "config.json", "--resume", out)
    assert code == 0, err
    assert not errors(err) and "warning: --resume" not in err


def test_the_flag_needs_a_resume(finished, tmp_path):
    _, args, _ = finished
    code, _, err = invoke(*args, "--output", tmp_path / "new", "--allow-changed-settings")
    assert code == 2
    assert errors(err) == ["error: --allow-changed-settings continues a run under new settings: give it with "
                           "--resume"]
    assert not (tmp_path / "new").exists()
