"""The loss kernels' phase timer travels through a context variable the engine enters (``modeling.timing``), not a
module global another module assigns: a run that raises leaves no timer installed."""

from __future__ import annotations

import ast
import contextlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specframe.drafting import modeling
from specframe.engine.loop import Trainer
from specframe.engine.profile import PhaseTimer

ROOT = Path(__file__).resolve().parents[2]


def _installed() -> bool:
    return not isinstance(modeling._phase("loss"), contextlib.nullcontext)


def test_a_run_that_raises_leaves_no_timer_installed():
    closed = []
    timer = PhaseTimer(torch.device("cpu"), enabled=True)
    seen = []

    def step(progress, log_lines):
        seen.append(_installed())
        raise RuntimeError("a step failed")

    trainer = SimpleNamespace(timer=timer, _run=step, source=SimpleNamespace(close=lambda: closed.append(True)))
    with pytest.raises(RuntimeError, match="a step failed"):
        Trainer.run(trainer)
    assert seen == [True]  # the loss kernels saw the run's timer during the step
    assert not _installed() and closed == [True]


def test_timing_restores_the_outer_timer():
    outer, inner = PhaseTimer(torch.device("cpu")), PhaseTimer(torch.device("cpu"))
    with modeling.timing(outer):
        with pytest.raises(ValueError):
            with modeling.timing(inner):
                assert modeling._phase_timer.get() is inner
                raise ValueError
        assert modeling._phase_timer.get() is outer
    assert modeling._phase_timer.get() is None


def test_no_module_assigns_the_modeling_globals():
    """A hidden channel is a module global another module sets: none does (``modeling.X = ...``)."""
    offenders = []
    for path in sorted((ROOT / "specframe").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if any(isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "modeling" for t in targets):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []
