"""Checkpoints under a kill at every step of a save, and exact resume of optimizer, scheduler and RNG state.

The kill is simulated in process: every filesystem operation a save performs (mkdir, file writes, safetensors writes,
fsync, rename, tree removal) is counted, and the n-th raises ``Killed`` (a BaseException, so no ``except OSError``
clean-up runs: the disk is left exactly as a SIGKILL would leave it after n - 1 operations). For every n the output
directory must still resolve to a complete checkpoint that loads, and training resumed from it must end with the
weights of an uninterrupted run. ``tests/e2e/test_kill.py`` does the same with real SIGKILLs at two points (slow).
"""

from __future__ import annotations

import builtins
import json
import os
import pathlib
import shutil

import pytest
import safetensors.torch
import torch
from safetensors.torch import load_file

from specframe.engine import checkpoint as ckpt
from specframe.engine.loop import Trainer
from specframe.targets import load_target
from tests.unit.test_engine import config
from tests.train_fixtures import build

FILES = ("model.safetensors", "drafter.json", "config.json", "optimizer.safetensors", "optimizer.json",
         "scheduler.json", "rng.safetensors", "state.json")


class Killed(BaseException):
    """The process died here (not an exception anything may catch and clean up after)."""


class Injector:
    """Counts the filesystem operations of ``checkpoint.save`` and kills the save at the ``kill_at``-th one."""

    def __init__(self, monkeypatch) -> None:
        self.kill_at: int | None = None
        self.count = 0
        self.log: list[str] = []
        self.active = False
        real_open = builtins.open

        def counted(name, real):
            def op(*args, **kwargs):
                if self.active:
                    self.count += 1
                    self.log.append(f"{name} {args[0] if args else ''}")
                    if self.count == self.kill_at:
                        raise Killed(self.log[-1])
                return real(*args, **kwargs)

            return op

        def ckpt_open(file, mode="r", *args, **kwargs):  # atomic_write_text's temporary file
            if "w" in mode or "a" in mode:
                return counted("open", real_open)(file, mode, *args, **kwargs)
            return real_open(file, mode, *args, **kwargs)

        monkeypatch.setattr(os, "replace", counted("replace", os.replace))
        monkeypatch.setattr(os, "fsync", counted("fsync", os.fsync))
        monkeypatch.setattr(shutil, "rmtree", counted("rmtree", shutil.rmtree))
        monkeypatch.setattr(pathlib.Path, "mkdir", counted("mkdir", pathlib.Path.mkdir))
        monkeypatch.setattr(pathlib.Path, "write_text", counted("write_text", pathlib.Path.write_text))
        monkeypatch.setattr(safetensors.torch, "save_file", counted("save_file", safetensors.torch.save_file))
        monkeypatch.setattr(ckpt, "save_file", counted("save_file", ckpt.save_file))
        monkeypatch.setattr(ckpt, "open", ckpt_open, raising=False)

    def save(self, out, trainer: Trainer, kill_at: int | None):
        self.kill_at, self.count, self.log, self.active = kill_at, 0, [], True
        try:
            return ckpt.save(out, trainer.step, trainer.drafter, trainer.optimizer, trainer.scheduler,
                             trainer.config_dict(), {"data_position": trainer.step * trainer.cfg.batch_size,
                                                     "tokens_seen": trainer.tokens_seen})
        finally:
            self.active = False


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    # one tiny target for the session's tests that share this folder (build() is idempotent)
    target_dir, chat = build(tmp_path_factory.getbasetemp() / "shared-train-assets")
    return (target_dir, chat), load_target(target_dir)


def trainer(assets, out, resume=None, **kw) -> Trainer:
    paths, target = assets
    return Trainer(config(paths, out, max_steps=3, max_examples=6, val_examples=1, **kw), resume=resume,
                   target=target, log=lambda *a: None)


def model_weights(t: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.drafter.module().state_dict().items()}


def assert_equal_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def assert_complete(out) -> tuple[int, dict[str, torch.Tensor]]:
    """``out`` resolves to a checkpoint with every file, loadable: its step and weights."""
    directory = ckpt.resolve(out)
    assert all((directory / f).is_file() for f in FILES), sorted(p.name for p in directory.iterdir())
    ckpt.check_files(directory)
    for name in FILES:
        if name.endswith(".json"):
            json.loads((directory / name).read_text())
        else:
            load_file(str(directory / name))
    step = int(json.loads((directory / "state.json").read_text())["step"])
    # the name is the step's, or its staging copy's while a save replacing the same step points `latest` at it
    assert directory.name in (ckpt.step_name(step), f".{ckpt.step_name(step)}.tmp")
    return step, load_file(str(directory / "model.safetensors"))


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):
    """A run saved at step 2, its trainer advanced to step 3 in memory, and the uninterrupted step-3 weights."""
    root = tmp_path_factory.mktemp("runs")
    base = root / "base"
    t = trainer(assets, base)
    t.train_step()
    t.train_step()
    t.save()
    step2 = model_weights(t)
    t.train_step()
    step3 = model_weights(t)
    t.close()
    return t, base, step2, step3


def test_a_kill_after_any_filesystem_operation_of_a_save_keeps_a_complete_checkpoint(assets, runs, tmp_path,
                                                                                     monkeypatch):
    t, base, step2, step3 = runs
    inject = Injector(monkeypatch)
    clean = tmp_path / "clean"
    shutil.copytree(base, clean)
    inject.save(clean, t, None)
    ops = list(inject.log)
    assert any(o.startswith("replace") for o in ops) and any(o.startswith("rmtree") for o in ops), ops
    outcomes = {}
    for n in range(1, len(ops) + 1):
        out = tmp_path / f"kill{n}"
        shutil.copytree(base, out)
        with pytest.raises(Killed):
            inject.save(out, t, n)
        step, saved = assert_complete(out)
        assert step in (2, 3), (n, ops[n - 1])
        assert_equal_tensors(saved, step2 if step == 2 else step3)
        outcomes.setdefault(step, out)
    assert set(outcomes) == {2, 3}, "the kills never fell on both sides of the `latest` switch"
    # resuming from what a kill left gives the uninterrupted weights (and writes a complete step 3)
    for out in outcomes.values():
        resumed = trainer(assets, out, resume=str(out))
        try:
            resumed.run(progress=False)
            assert_equal_tensors(model_weights(resumed), step3)
        finally:
            resumed.close()
        step, saved = assert_complete(out)
        assert step == 3
        assert_equal_tensors(saved, step3)
        if out == outcomes[2]:  # the resumed run's own save removed the checkpoint it replaced
            assert sorted(p.name for p in out.iterdir() if p.name.startswith("step-")) == [ckpt.step_name(3)]


def test_a_kill_while_replacing_a_checkpoint_of_the_same_step_keeps_one(assets, runs, tmp_path, monkeypatch):
    """Resuming an older checkpoint into a folder whose `latest` already has the step being saved: the save must
    replace that folder without a window in which `latest` names nothing."""
    t, base, step2, step3 = runs
    inject = Injector(monkeypatch)
    seeded = tmp_path / "seeded"
    shutil.copytree(base, seeded)
    inject.save(seeded, t, None)  # `latest` is step 3 now
    inject.save(seeded, t, None)  # the same step again, over the latest
    ops = list(inject.log)
    for n in range(1, len(ops) + 1):
        out = tmp_path / f"again{n}"
        shutil.copytree(seeded, out)
        with pytest.raises(Killed):
            inject.save(out, t, n)
        step, saved = assert_complete(out)
        assert step == 3, (n, ops[n - 1])
        assert_equal_tensors(saved, step3)
    # a completed re-save leaves one checkpoint and no staging folders
    assert sorted(p.name for p in seeded.iterdir() if p.name.startswith(("step-", "."))) == [ckpt.step_name(3)]


def test_resume_restores_optimizer_scheduler_and_rng_exactly(assets, tmp_path):
    out = tmp_path / "o"
    original = trainer(assets, out)
    try:
        original.train_step()
        original.train_step()
        torch.manual_seed(1234)  # an RNG state no fresh start reproduces
        torch.rand(3)
        rng = torch.get_rng_state()
        original.save()
        optimizer, scheduler = original.optimizer.state_dict(), original.scheduler.state_dict()
        lr = original.scheduler.get_last_lr()
    finally:
        original.close()
    torch.manual_seed(0)
    resumed = trainer(assets, out, resume=str(out))
    try:
        assert resumed.step == 2
        assert torch.equal(torch.get_rng_state(), rng), "the torch RNG state was not restored"
        assert resumed.scheduler.state_dict() == scheduler
        assert resumed.scheduler.get_last_lr() == lr
        got = resumed.optimizer.state_dict()
        assert json.loads(json.dumps(got["param_groups"])) == json.loads(json.dumps(optimizer["param_groups"]))
        assert got["state"].keys() == optimizer["state"].keys() and optimizer["state"]
        for pid, state in optimizer["state"].items():
            assert got["state"][pid].keys() == state.keys()
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(got["state"][pid][key], value), (pid, key)
                else:
                    assert got["state"][pid][key] == value, (pid, key)
    finally:
        resumed.close()
    saved = load_file(str(ckpt.resolve(out) / "rng.safetensors"))
    assert saved["torch"].dtype == torch.uint8
    if torch.cuda.is_available():
        assert any(k.startswith("cuda") for k in saved)


def test_resume_after_a_kill_mid_way_through_a_metrics_line(assets, runs, tmp_path):
    """A kill while ``metrics.jsonl`` gets a line leaves it cut short; resume drops it (the step is logged again)."""
    _, base, _, _ = runs
    out = tmp_path / "o"
    shutil.copytree(base, out)
    metrics = out / "metrics.jsonl"
    metrics.write_text('{"time": 1.0, "step": 1, "train_loss": 5.0}\n{"time": 2.0, "step": 2, "train_lo')
    resumed = trainer(assets, out, resume=str(out))
    resumed.close()
    lines = metrics.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1]
