"""The training engine: loss falls, exact partitioning, exact resume after SIGKILL, safety checks (many ranks: see
tests/e2e/test_distributed.py)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import attrs
import pytest
import torch
from safetensors.torch import load_file

from specframe.engine import TrainConfig, train
from specframe.engine import checkpoint as ckpt
from specframe.metrics import expected_acceptance_length
from specframe.errors import SpecframeError, UsageError
from tests.train_fixtures import build, small_options

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build(tmp_path_factory.mktemp("engine"))


def config(assets, out, **kw):
    target, chat = assets
    base = dict(
        drafter="peagle", output=str(out), target=str(target), data=str(chat), seq_len=48, max_steps=4,
        batch_size=2, lr=3e-3, val_examples=2, mask_builder="dense",
        drafter_options=small_options(k_train=4) if kw.get("drafter", "peagle") == "peagle" else {},
    )
    base.update(kw)
    return TrainConfig(**base)


def weights(directory):
    return load_file(str(ckpt.resolve(directory) / "model.safetensors"))


@pytest.mark.slow
def test_loss_falls_when_overfitting_a_tiny_batch(assets, tmp_path):
    r = train(config(assets, tmp_path / "o", max_steps=25, max_examples=4, val_examples=1, lr=1e-2,
                     drafter_options=small_options(k_train=3, cod_ratio=1.0)), progress=False)
    losses = [m["train_loss"] for m in r.metrics]
    assert losses[-1] < 0.6 * losses[0], losses
    lines = [json.loads(x) for x in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["val_product_al"] == expected_acceptance_length(lines[-1]["val_accuracy"])
    assert lines[-1]["val_expected_al_method"] == "chain" and 1.0 <= lines[-1]["val_expected_al"] <= 4.0
    assert 0.0 <= lines[-1]["val_vocab_masked"] <= 1.0  # peagle masks by default and reports the share


def test_partitions_give_the_same_weights(assets, tmp_path):
    one = train(config(assets, tmp_path / "s1", max_steps=2), progress=False)
    four = train(config(assets, tmp_path / "s4", max_steps=2, partitioner="peagle", partitions=4), progress=False)
    a, b = weights(one.checkpoint), weights(four.checkpoint)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5, rtol=1e-4), k


def test_an_empty_segment_from_a_partitioner_is_skipped(assets, tmp_path, site):
    site.add(
        "specframe-padded",
        "padded",
        """
        import torch
        from specframe import api
        class Padded(api.Partitioner):
            name = "padded"
            def partition(self, elements, num_segments):
                n = len(elements)
                empty = api.Segment(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.bool))
                return [empty, api.Segment(torch.arange(n), torch.ones(n, dtype=torch.bool)), empty]
        @api.hookimpl
        def register_partitioners(register):
            register(Padded)
        """,
    )
    one = train(config(assets, tmp_path / "s1", max_steps=2), progress=False)
    padded = train(config(assets, tmp_path / "sp", max_steps=2, partitioner="padded", partitions=3), progress=False)
    a, b = weights(one.checkpoint), weights(padded.checkpoint)
    for k in a:
        assert torch.equal(a[k], b[k]), k


CHILD = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {root!r})
    import torch
    torch.set_num_threads(1)
    from specframe.engine import TrainConfig, loop
    cfg = TrainConfig(**{cfg!r})
    kill_at = int(sys.argv[1])
    original = loop.Trainer.train_step
    def step(self):
        if self.step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self)
    loop.Trainer.train_step = step
    resume = sys.argv[2] if len(sys.argv) > 2 else None
    loop.train(cfg, resume=resume, progress=False)
    """
)


@pytest.mark.slow
def test_resume_after_sigkill_is_exact(assets, tmp_path):
    full = train(config(assets, tmp_path / "full", max_steps=6, save_every=2), progress=False)
    cfg = attrs.asdict(config(assets, tmp_path / "killed", max_steps=6, save_every=2))
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(root=str(ROOT), cfg=cfg))
    proc = subprocess.run([sys.executable, str(script), "3"], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert (tmp_path / "killed" / "latest").read_text() == "step-00000002"
    proc = subprocess.run([sys.executable, str(script), "-1", str(tmp_path / "killed")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    a, b = weights(full.checkpoint), weights(tmp_path / "killed")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    steps = [json.loads(x)["step"] for x in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()
             if "train_loss" in x]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_refuses_to_overwrite_and_checks_resume_drafter(assets, tmp_path):
    out = tmp_path / "o"
    train(config(assets, out, max_steps=1), progress=False)
    before = weights(out)
    with pytest.raises(SpecframeError, match="already holds a checkpoint"):
        train(config(assets, out, max_steps=2), progress=False)
    other = tmp_path / "other"
    shutil.copytree(ckpt.resolve(out), other)
    saved = json.loads((other / "config.json").read_text())
    saved["drafter"] = "eagle3"
    (other / "config.json").write_text(json.dumps(saved))
    with pytest.raises(SpecframeError, match="drafter 'eagle3'"):
        train(config(assets, out, max_steps=2), resume=str(other), progress=False)
    after = weights(out)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_lock_blocks_a_second_writer(tmp_path):
    lock = ckpt.OutputLock(tmp_path)
    with pytest.raises(SpecframeError, match="another training run"):
        ckpt.OutputLock(tmp_path)
    lock.release()
    ckpt.OutputLock(tmp_path).release()


def test_bad_values_are_usage_errors(assets, tmp_path):
    for bad in ({"max_steps": 0}, {"partitions": -1}, {"lr": 0.0}, {"batch_size": 0}):
        with pytest.raises(UsageError):
            config(assets, tmp_path, **bad)
    with pytest.raises(UsageError, match="drafter 'peagle' options: unknown key 'nope'"):
        train(config(assets, tmp_path / "x", drafter_options={"nope": 1}), progress=False)


def test_checkpoint_keeps_only_the_latest_complete_one(assets, tmp_path):
    out = tmp_path / "o"
    train(config(assets, out, max_steps=4, save_every=1), progress=False)
    assert sorted(p.name for p in out.glob("step-*")) == ["step-00000004"]
    assert not list(out.glob(".*tmp*"))
    state = json.loads((out / "step-00000004" / "state.json").read_text())
    assert state == {"step": 4, "data_position": 8, "tokens_seen": 384}  # 8 sequences, 48 tokens each


def test_expected_acceptance_length():
    assert expected_acceptance_length([]) == 1.0
    assert expected_acceptance_length([1.0, 1.0]) == 3.0
    assert expected_acceptance_length([0.5, 0.5]) == pytest.approx(1.75)


def test_cache_and_online_features_train_alike(assets, tmp_path):
    from specframe.cache import prepare_cache
    from specframe.data.specs import load_data
    from specframe.features import FeatureSpec
    from specframe.targets import load_target

    target = load_target(assets[0])
    spec = FeatureSpec.eagle(target.num_layers)  # the aux ids every EAGLE-family drafter defaults to
    prepare_cache(target, load_data(str(assets[1])), tmp_path / "cache", spec=spec, dtype="float32", draft_vocab=None)
    online = train(config(assets, tmp_path / "online", max_steps=2), progress=False)
    cached = train(config(assets, tmp_path / "cached", max_steps=2, data=None, cache=str(tmp_path / "cache")),
                   progress=False)
    a, b = weights(online.checkpoint), weights(cached.checkpoint)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-4, rtol=1e-3), k


@pytest.mark.slow
def test_every_registered_drafter_trains_through_the_engine(assets, tmp_path):
    from specframe import plugins

    names = plugins.load().names("drafter")
    assert "peagle" in names
    for name in names:
        cfg = config(assets, tmp_path / name, drafter=name, max_steps=2, depth=3, partitioner="peagle",
                     partitions=2, drafter_options={})
        try:
            result = train(cfg, progress=False)
        except UsageError as exc:  # drafters without weights (n-gram lookup) are refused, clearly
            assert "no trainable parameters" in str(exc), (name, exc)
            continue
        assert result.steps == 2 and result.final_train_loss is not None and result.last_eval is not None, name


def test_fp16_resume_restores_the_gradient_scaler(assets, tmp_path):
    """fp16's scaler (scale, growth tracker) is saved with every checkpoint and restored on resume, so the resumed
    run's scaler is the uninterrupted run's (a fresh one would restart its growth count and scale)."""
    whole = train(config(assets, tmp_path / "whole", dtype="fp16", max_steps=4), progress=False)
    from specframe.engine.loop import Trainer

    cut = Trainer(config(assets, tmp_path / "cut", dtype="fp16", max_steps=4))  # stopped after step 2
    try:
        cut.guarded_step()
        cut.guarded_step()
        cut.save()
    finally:
        cut.close()
    saved = json.loads((ckpt.resolve(tmp_path / "cut") / "scaler.json").read_text())
    assert saved["_growth_tracker"] + int(saved["scale"] < 65536.0) > 0  # two steps moved the scaler's state
    resumed = train(config(assets, tmp_path / "cut", dtype="fp16", max_steps=4), resume=str(tmp_path / "cut"),
                    progress=False)
    want = json.loads((whole.checkpoint / "scaler.json").read_text())
    assert json.loads((resumed.checkpoint / "scaler.json").read_text()) == want
    a, b = weights(whole.checkpoint), weights(resumed.checkpoint)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    fp32 = train(config(assets, tmp_path / "fp32", max_steps=1), progress=False)
    assert not (fp32.checkpoint / "scaler.json").exists()  # no scaler, no file


def test_fp16_step_with_nothing_supervised_leaves_the_scaler_ready(assets, tmp_path, monkeypatch):
    """GPU-path review item 7: a step whose sequences supervise nothing (global count 0) does not step, and must not
    unscale either: GradScaler forgets an ``unscale_`` only in ``update()``, so the next step's ``unscale_`` raised
    "unscale_() has already been called on this optimizer since the last update()"."""
    from specframe import api
    from specframe.engine.loop import Trainer

    trainer = Trainer(config(assets, tmp_path / "o", dtype="fp16", max_steps=2))
    original = trainer.source.example

    def example(i):
        ex = original(i)
        if trainer.step > 0:
            return ex
        # step 0's sequences have no assistant token: the drafter supervises nothing
        return api.TrainingExample(ex.input_ids, torch.zeros_like(ex.loss_mask), ex.doc, ex.features)

    monkeypatch.setattr(trainer.source, "example", example)
    try:
        before = {k: v.detach().clone() for k, v in trainer.drafter.module().state_dict().items()}
        scaler = trainer.precision.scaler.state_dict()
        skipped = trainer.guarded_step()
        assert skipped["elements"] == 0 and skipped["train_loss"] is None
        after = trainer.drafter.module().state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)  # nothing stepped
        assert trainer.precision.scaler.state_dict() == scaler
        stepped = trainer.guarded_step()
        assert stepped["elements"] > 0 and stepped["train_loss"] is not None
        after = trainer.drafter.module().state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before)
        assert trainer.precision.scaler.state_dict()["_growth_tracker"] == 1  # one finite, stepped update
    finally:
        trainer.close()


def test_plugins_are_checked_until_the_first_optimizer_step_and_not_after(assets, tmp_path, monkeypatch):
    """engine.validate checks every plugin's output (mask builder, drafter) on each segment until the first optimizer
    step, then never again (its cost is paid once)."""
    from specframe.engine import segments
    from specframe.engine.loop import Trainer

    seen = []
    original = segments.segment_loss

    def recording(*args, check=None, **kw):
        seen.append((trainer.step, check is not None))
        return original(*args, check=check, **kw)

    monkeypatch.setattr(segments, "segment_loss", recording)
    trainer = Trainer(config(assets, tmp_path / "o", max_steps=2))
    try:
        assert not trainer.plugins_checked
        trainer.guarded_step()
        trainer.guarded_step()
    finally:
        trainer.close()
    first = [checked for step, checked in seen if step == 0]
    second = [checked for step, checked in seen if step == 1]
    assert first and all(first) and second and not any(second)
