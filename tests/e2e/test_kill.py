"""SIGKILL at a random step and in the middle of a checkpoint write: the last good checkpoint survives and resuming
gives exactly the weights of an uninterrupted run."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap

import attrs
import pytest
import torch

from specframe.engine import train
from tests.unit.test_engine import ROOT, assets, config, weights  # noqa: F401 - assets is a fixture

CHILD = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {root!r})
    import torch
    torch.set_num_threads(1)
    from specframe.engine import TrainConfig, checkpoint, loop
    cfg = TrainConfig(**{cfg!r})
    mode, at = sys.argv[1], int(sys.argv[2])
    if mode == "step":
        original_step = loop.Trainer.train_step
        def train_step(self):
            if self.step == at:
                os.kill(os.getpid(), signal.SIGKILL)
            return original_step(self)
        loop.Trainer.train_step = train_step
    elif mode == "write":
        # die after the weights of checkpoint `at` are written, before its optimizer state is
        original_save = checkpoint.save_file
        def save_file(tensors, path, *args, **kwargs):
            if checkpoint.step_name(at) in str(path) and "optimizer" in str(path):
                os.kill(os.getpid(), signal.SIGKILL)
            return original_save(tensors, path, *args, **kwargs)
        checkpoint.save_file = save_file
    loop.train(cfg, resume=sys.argv[3] if len(sys.argv) > 3 else None, progress=False)
    """
)


@pytest.fixture(scope="module")
def uninterrupted(assets, tmp_path_factory):  # noqa: F811
    return train(config(assets, tmp_path_factory.mktemp("full") / "run", max_steps=6, save_every=2), progress=False)


def interrupted_then_resumed(assets, tmp_path, mode, at):  # noqa: F811
    out = tmp_path / "run"
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(root=str(ROOT), cfg=attrs.asdict(config(assets, out, max_steps=6, save_every=2))))
    killed = subprocess.run([sys.executable, str(script), mode, str(at)], capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    return out, script


def resume(out, script):
    # Killed before its first checkpoint, a run has nothing to resume: the user starts it again in the same folder.
    again = [str(out)] if (out / "latest").exists() else []
    done = subprocess.run([sys.executable, str(script), "none", "0", *again], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.slow
def test_kill_during_a_checkpoint_write_keeps_the_last_good_one(assets, tmp_path, uninterrupted):  # noqa: F811
    out, script = interrupted_then_resumed(assets, tmp_path, "write", 4)
    assert (out / "latest").read_text() == "step-00000002"
    assert (out / "step-00000002" / "optimizer.safetensors").exists()
    assert not (out / "step-00000004").exists()  # the half-written one never took the name
    resume(out, script)
    assert_same_weights(weights(uninterrupted.checkpoint), weights(out))
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


@pytest.mark.slow
# fixed draws: the same steps on every run, so a failure reproduces
@pytest.mark.parametrize("at", random.Random(20261129).sample(range(1, 6), 2))
def test_kill_at_a_random_step_resumes_exactly(assets, tmp_path, uninterrupted, at):  # noqa: F811
    out, script = interrupted_then_resumed(assets, tmp_path, "step", at)
    resume(out, script)
    assert_same_weights(weights(uninterrupted.checkpoint), weights(out))
