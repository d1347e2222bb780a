"""``specframe train`` end to end on the tiny target."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file

from specframe.cli import main
from tests.train_fixtures import build


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    target, chat = build(root)
    cfg = root / "small.toml"
    cfg.write_text("[drafter]\nlayers = 2\ndraft_vocab_size = 100\nk_train = 3\n")
    return target, chat, cfg


def run(*args):
    result = CliRunner().invoke(main, list(map(str, args)), catch_exceptions=False)
    return result.exit_code, result.output


def base(assets, out, *extra):
    target, chat, cfg = assets
    return ("train", "--drafter", "peagle", "--target", target, "--data", chat, "--seq-len", 48, "--output", out,
            "--config", cfg, "--mask-builder", "dense", *extra)


def test_train_writes_a_checkpoint_and_resumes(assets, tmp_path):
    out = tmp_path / "run"
    code, text = run(*base(assets, out, "--max-steps", 2, "--eval-every", 1, "--json"))
    assert code == 0, text
    summary = json.loads(text[text.index("{"):])
    assert summary["steps"] == 2
    ckpt = out / "step-00000002"
    assert summary["checkpoint"] == str(ckpt)
    info = json.loads((ckpt / "drafter.json").read_text())
    assert info["drafter"] == "peagle" and info["draft_vocab_size"] == 100 and info["num_hidden_layers"] == 2
    assert load_file(str(ckpt / "model.safetensors"))["lm_head.weight"].shape[0] == 100
    config = json.loads((out / "config.json").read_text())
    assert config["depth"] == 3 and config["drafter_options"]["layers"] == 2 and config["memory_budget_enforced"] is False
    evals = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if "val_loss" in x]
    assert [e["step"] for e in evals] == [1, 2] and len(evals[0]["val_accuracy"]) == 3
    # a run extended past its recorded length is a changed run, continued on purpose (test_resume_changed.py)
    code, text = run(*base(assets, out, "--max-steps", 3, "--resume", out, "--allow-changed-settings", "--json"))
    assert code == 0, text
    assert json.loads(text[text.index("{"):])["steps"] == 3
    assert sorted(p.name for p in out.glob("step-*")) == ["step-00000003"]


def test_clear_errors(assets, tmp_path):
    code, text = run(*base(assets, tmp_path / "a", "--partitions", 0))
    assert code == 2 and "--partitions must be positive" in text
    bad = tmp_path / "bad.yaml"
    bad.write_text("drafter:\n  layerz: 2\n")
    target, chat, _ = assets
    code, text = run("train", "--drafter", "peagle", "--target", target, "--data", chat, "--output", tmp_path / "b",
                     "--config", bad)
    assert code == 2 and "layerz" in text and "known options" in text
    code, text = run("train", "--drafter", "peagl", "--target", target, "--data", chat, "--output", tmp_path / "c")
    assert code == 2 and "did you mean 'peagle'" in text


def test_help_documents_every_option():
    code, text = run("train", "--help")
    assert code == 0
    for flag in ("--drafter", "--target", "--seq-len", "--depth", "--data", "--cache", "--mask-builder",
                 "--partitioner", "--partitions", "--memory-budget", "--max-steps", "--output", "--resume",
                 "--config", "--lr", "--batch-size", "--save-every", "--eval-every", "--seed", "--json"):
        assert flag in text


def test_profile_prints_time_per_phase(assets, tmp_path):
    """Asserts what does not depend on the machine's speed: every phase is in the table and in the raw seconds, a
    phase that ran took time (unrounded: printed, a fast machine rounds them to 0.00 s), the table shows those
    seconds and the shares add up to the whole."""
    from specframe.engine.profile import PHASES

    code, text = run(*base(assets, tmp_path / "run", "--max-steps", 2, "--eval-every", 1, "--profile", "--json"))
    assert code == 0, text
    summary = json.loads(text[text.index("{\n"):])
    seconds, table = summary["profile_seconds"], summary["profile"]
    assert table.startswith("profile: 2 steps") and "training tokens/s" in table
    rows = {line.split()[0]: line.split()[1:] for line in table.splitlines()[2:] if line.split()[0] in PHASES}
    assert set(rows) == set(seconds) == set(PHASES)
    assert all(seconds[phase] > 0 for phase in ("data", "forward", "loss", "backward", "optimizer", "eval",
                                                "checkpoint")), seconds
    total = sum(seconds.values())
    for phase, (printed, share, _) in rows.items():
        assert printed == f"{seconds[phase]:.2f}" and share == f"{seconds[phase] / total:.1%}"
    assert abs(sum(float(share.rstrip("%")) for _, share, _ in rows.values()) - 100.0) < 0.5
    code, text = run(*base(assets, tmp_path / "plain", "--max-steps", 1))
    assert code == 0 and "profile:" not in text


def test_options_inline_train_and_are_recorded(assets, tmp_path):
    """``--drafter peagle:layers=1`` (issue 55, item 2): inline options go over --config's table (layers 2 there) and
    the run records what it trained (the file's other options kept); a bad inline key is refused before a target is
    loaded, naming the drafter and the key."""
    out = tmp_path / "inline"
    args = list(base(assets, out, "--max-steps", 1, "--json"))
    args[args.index("peagle")] = "peagle:layers=1"
    code, text = run(*args)
    assert code == 0, text
    config = json.loads((out / "config.json").read_text())
    assert config["drafter"] == "peagle"
    assert config["drafter_options"]["layers"] == 1 and config["drafter_options"]["draft_vocab_size"] == 100
    args[args.index("peagle:layers=1")] = "peagle:layerz=1"
    args[args.index("--output") + 1] = tmp_path / "refused"
    code, text = run(*args)
    assert code == 2 and "drafter 'peagle' options: unknown key 'layerz' (did you mean 'layers'?)" in text
    assert not (tmp_path / "refused").exists()
