"""Throughput changes of issue #17 item 1 that are not the loss: the attention path chosen by size and the phase
timer (the loss kernels are tests/unit/test_teacher.py)."""

from __future__ import annotations

import pytest
import torch

from specframe import api, plugins
from specframe.drafting.elements import full_grid
from specframe.engine.attention import SizedMaskBuilder
from specframe.engine.profile import PhaseTimer


def test_sized_builder_takes_dense_below_the_limit_and_the_default_above():
    dense, chunked = plugins.get("mask builder", "dense")(), plugins.get("mask builder", "chunked")()
    small, large = full_grid(6, 2), full_grid(40, 3)
    # a limit between the two sizes: 12 x 12 elements fit, 120 x 120 do not (2 heads: 9 bytes per pair)
    builder = SizedMaskBuilder(dense, chunked, heads=2, limit=9 * 12 * 12)
    assert builder.fits(12, 12) and not builder.fits(12, 13)
    assert type(builder.build(small, small)) is type(dense.build(small, small))
    assert type(builder.build(large, large)) is type(chunked.build(large, large))
    # through SegmentAttention, a pass over part of the segment (EAGLE-3) is sized by its own query and key counts
    seg = api.SegmentAttention.build(builder, large)
    part = large.subset(torch.arange(10))
    # (the subset comes wrapped like the segment's own attention, so it too gets q, k, v in one dtype)
    assert type(seg.subset(part, part).attention) is type(dense.build(part, part))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, len(large), 8, generator=g) for _ in range(3))
    torch.testing.assert_close(seg(q, k, v), dense.build(large, large)(q, k, v), rtol=1e-5, atol=1e-5)


def test_engine_sizes_attention_only_when_no_builder_is_named(tmp_path):
    from specframe.engine.config import TrainConfig
    from specframe.engine.loop import Trainer
    from tests.train_fixtures import build

    target, chat = build(tmp_path)
    opts = {"layers": 1, "draft_vocab_size": 100, "k_train": 2}
    made = {}
    for named in (None, "chunked"):
        cfg = TrainConfig(drafter="peagle", output=str(tmp_path / f"run-{named}"), target=str(target), data=str(chat),
                          seq_len=32, max_steps=1, mask_builder=named, device="cpu", drafter_options=opts)
        trainer = Trainer(cfg, log=lambda *a: None)
        try:
            made[named] = trainer.attention_builder
            assert trainer.resolved.mask_builder == "chunked"  # the record (and the memory estimate) is the default's
        finally:
            trainer.close()
    assert isinstance(made[None], SizedMaskBuilder)
    assert made["chunked"].name == "chunked" and not isinstance(made["chunked"], SizedMaskBuilder)


class _Clock:
    """perf_counter that moves only when told: the timer's arithmetic, not the machine's speed or load, is tested."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self):
        return self.now


def test_phase_timer_subtracts_nested_phases(monkeypatch):
    from specframe.engine import profile

    clock = _Clock()
    monkeypatch.setattr(profile, "time", clock)
    timer = PhaseTimer(torch.device("cpu"))
    with timer("forward"):
        clock.now += 0.02
        with timer("loss"):
            clock.now += 0.05
        clock.now += 0.01
    assert timer.seconds["loss"] == pytest.approx(0.05)
    assert timer.seconds["forward"] == pytest.approx(0.03)  # the nested loss is not counted twice
    off = PhaseTimer(torch.device("cpu"), enabled=False)
    with off("forward"):
        clock.now += 0.01
    assert sum(off.seconds.values()) == 0.0
