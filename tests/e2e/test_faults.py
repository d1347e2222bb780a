"""Faults the engine must survive: misbehaving plugins, a NaN loss mid-run, a full disk while checkpointing.

Bad plugins subclass the real ones and are swapped in through ``specframe.plugins.get``; every fault must end in one
``error:`` line naming the culprit, a non-zero exit, and the last good checkpoint untouched.
"""

from __future__ import annotations

import errno
import hashlib
from pathlib import Path

import pytest
from click.testing import CliRunner

from specframe import api, plugins
from specframe.cli import main
from tests.train_fixtures import build


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    target, chat = build(root)
    cfg = root / "small.toml"
    cfg.write_text("[drafter]\nlayers = 2\ndraft_vocab_size = 100\nk_train = 3\n")
    return target, chat, cfg


def train_cli(assets, out, *extra, drafter="peagle", mask="dense"):
    target, chat, cfg = assets
    args = ["train", "--drafter", drafter, "--target", target, "--data", chat, "--seq-len", 48, "--output", out,
            "--config", cfg, "--mask-builder", mask, "--max-examples", 6, "--batch-size", 1, *extra]
    result = CliRunner().invoke(main, list(map(str, args)))
    return result.exit_code, result.stdout, error_line(result.stderr), result.exception


def error_line(stderr: str) -> str:
    """The one ``error:`` line (transformers' loading bars share stderr); everything if there is not exactly one."""
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    return lines[0] if len(lines) == 1 and "Traceback" not in stderr else stderr


def swap_in(monkeypatch, **extra):
    """Make ``plugins.get`` return ``extra[(kind, name)]`` for the given names, the real registry otherwise."""
    real = plugins.get
    table = {(cls.kind, cls.name): cls for cls in extra.values()}

    def get(kind, name):
        return table.get((kind, name)) or real(kind, name)

    monkeypatch.setattr(plugins, "get", get)


def tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != "metrics.jsonl" and "tensorboard" not in p.parts:
            h.update(str(p.relative_to(root)).encode() + p.read_bytes())
    return h.hexdigest()


def peagle_variant(name: str, loss):
    base = plugins.get("drafter", "peagle")
    return type(f"Drafter_{name}", (base,), {"name": name, "kind": "drafter", "loss": loss})


def _detached(self, example, elements, segment, attention):
    t = type(self).__mro__[1].loss(self, example, elements, segment, attention)
    return api.LossTerms(t.loss_sum.detach(), t.count, t.correct, t.total)


def _wrong_count(self, example, elements, segment, attention):
    t = type(self).__mro__[1].loss(self, example, elements, segment, attention)
    return api.LossTerms(t.loss_sum, t.count + 1, t.correct, t.total)


def _short_correct(self, example, elements, segment, attention):
    t = type(self).__mro__[1].loss(self, example, elements, segment, attention)
    return api.LossTerms(t.loss_sum, t.count, t.correct[:-1], t.total)


def _tuple(self, example, elements, segment, attention):
    t = type(self).__mro__[1].loss(self, example, elements, segment, attention)
    return t.loss_sum, t.count


def _vector(self, example, elements, segment, attention):
    t = type(self).__mro__[1].loss(self, example, elements, segment, attention)
    return api.LossTerms(t.loss_sum.reshape(1).repeat(2), t.count, t.correct, t.total)


def _inf_at_once(self, example, elements, segment, attention):
    t = type(self).__mro__[1].loss(self, example, elements, segment, attention)
    return api.LossTerms(t.loss_sum * float("inf"), t.count, t.correct, t.total)


def _one_confidence(self, example, elements, segment, attention):
    t = type(self).__mro__[1].loss(self, example, elements, segment, attention)
    return api.LossTerms(t.loss_sum, t.count, t.correct, t.total, t.hit, confidence=t.loss_sum.detach().reshape(1))


def _acceptance_above_one(self, example, elements, segment, attention):
    t = type(self).__mro__[1].loss(self, example, elements, segment, attention)
    return api.LossTerms(t.loss_sum, t.count, t.correct, t.total, t.hit, acceptance=t.hit.float() + 1.0)


BAD_LOSSES = [
    (_tuple, "loss() returned tuple, not an api.LossTerms"),
    (_vector, "loss() returned loss_sum (2,), not a scalar tensor"),
    (_detached, "loss_sum that does not require grad"),
    (_wrong_count, "but the segment charges"),
    (_short_correct, "loss() returned correct (2,), expected shape (3,)"),
    (_inf_at_once, "non-finite loss_sum (inf)"),
    (_one_confidence, "loss() returned confidence (1,), expected shape ("),
    (_acceptance_above_one, "loss() returned acceptance outside [0, 1]"),
]


@pytest.mark.parametrize(("loss", "message"), BAD_LOSSES, ids=[f.__name__ for f, _ in BAD_LOSSES])
def test_a_bad_loss_is_named_at_the_first_step(assets, tmp_path, monkeypatch, loss, message):
    swap_in(monkeypatch, bad=peagle_variant("badloss", loss))
    code, _, err, exc = train_cli(assets, tmp_path / "o", "--max-steps", 1, drafter="badloss")
    assert code != 0, exc
    assert err.startswith("error: drafter 'badloss': ") and message in err, err
    assert "Traceback" not in err
    assert not list((tmp_path / "o").glob("step-*"))


def test_a_mask_builder_with_the_wrong_output_shape_is_named(assets, tmp_path, monkeypatch):
    dense = plugins.get("mask builder", "dense")

    def build(self, query, key):
        inner = dense.build(self, query, key)
        return lambda q, k, v: inner(q, k, v)[..., :-1, :]

    bad = type("Squash", (dense,), {"name": "squash", "kind": "mask builder", "build": build})
    swap_in(monkeypatch, bad=bad)
    code, _, err, exc = train_cli(assets, tmp_path / "o", "--max-steps", 1, mask="squash")
    assert code != 0, exc
    assert err.startswith("error: mask builder 'squash': attention returned (1, "), err
    assert "(expected the query's shape)" in err


def test_a_nan_loss_mid_run_stops_before_the_next_checkpoint(assets, tmp_path, monkeypatch):
    calls = {"train": 0}

    def nan_from_step_3(self, example, elements, segment, attention):
        t = type(self).__mro__[1].loss(self, example, elements, segment, attention)
        if self.module().training:
            calls["train"] += 1
            if calls["train"] >= 3:  # batch 1, one segment: the third training call is step 3
                return api.LossTerms(t.loss_sum * float("nan"), t.count, t.correct, t.total)
        return t

    swap_in(monkeypatch, bad=peagle_variant("nanpe", nan_from_step_3))
    out = tmp_path / "o"
    code, _, err, exc = train_cli(assets, out, "--max-steps", 6, "--save-every", 2, drafter="nanpe")
    assert code != 0, exc
    assert err.startswith("error: training stopped at step 3: the loss is nan"), err
    assert sorted(p.name for p in out.glob("step-*")) == ["step-00000002"]
    assert not list(out.glob(".*tmp*"))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="the CPU ceiling is an RLIMIT_DATA on Linux")
def test_a_single_step_that_blows_past_the_budget_is_stopped_inside_the_step(assets, tmp_path, monkeypatch):
    """A check after the step would come too late for one huge allocation (the OOM killer would take the run):
    the ceiling makes the allocation itself fail, and the run stops cleanly with the last checkpoint kept."""
    import resource

    import torch

    calls = {"train": 0}

    def huge_at_step_3(self, example, elements, segment, attention):
        if self.module().training:
            calls["train"] += 1
            if calls["train"] == 3:
                # 12 GiB of address space, never touched: without the ceiling this would "succeed" and go unseen
                torch.empty(3 * 2**30, dtype=torch.float32)
        return type(self).__mro__[1].loss(self, example, elements, segment, attention)

    swap_in(monkeypatch, bad=peagle_variant("hugepe", huge_at_step_3))
    out = tmp_path / "o"
    before = resource.getrlimit(resource.RLIMIT_DATA)
    code, _, err, exc = train_cli(assets, out, "--max-steps", 6, "--save-every", 2, "--memory-budget", "3GiB",
                                  drafter="hugepe")
    assert code == 3, exc
    assert err.startswith("error: memory budget exceeded during step 3: an allocation of 12"), err
    assert err.endswith("failed under the ceiling set for --memory-budget 3.00 GiB; training stopped, the last "
                        "checkpoint is kept"), err
    assert sorted(p.name for p in out.glob("step-*")) == ["step-00000002"]
    assert resource.getrlimit(resource.RLIMIT_DATA) == before  # the ceiling does not outlive the step
    assert calls["train"] == 3


def test_a_full_disk_while_checkpointing_keeps_the_last_checkpoint(assets, tmp_path, monkeypatch):
    import safetensors.torch

    out = tmp_path / "o"
    code, _, err, _ = train_cli(assets, out, "--max-steps", 1)
    assert code == 0, err
    before = tree_hash(out / "step-00000001")
    saves = {"n": 0}
    real_save = safetensors.torch.save_file

    def full_disk(tensors, filename, *args, **kwargs):
        saves["n"] += 1
        raise OSError(errno.ENOSPC, "No space left on device", str(filename))

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    code, _, err, exc = train_cli(assets, out, "--max-steps", 2, "--resume", out, "--allow-changed-settings")
    monkeypatch.setattr(safetensors.torch, "save_file", real_save)
    assert saves["n"] >= 1, "the fault was never injected"
    assert code != 0, exc
    assert err.startswith("error: could not write checkpoint step-00000002"), err
    assert "No space left on device" in err and "Traceback" not in err
    assert sorted(p.name for p in out.glob("step-*")) == ["step-00000001"]
    assert not [p for p in out.iterdir() if "tmp" in p.name]
    assert tree_hash(out / "step-00000001") == before
    # the checkpoint left behind still resumes
    code, _, err, _ = train_cli(assets, out, "--max-steps", 2, "--resume", out, "--allow-changed-settings")
    assert code == 0, err
