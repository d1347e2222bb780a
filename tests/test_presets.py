"""The comparison suites' presets (benchmarks/presets.py) stay runnable: CI runs only ``ci``, so this checks the
others' settings against the registered plugins and the drafters' own limits without training anything."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from presets import PRESETS  # noqa: E402

from specframe import plugins  # noqa: E402
from specframe.data.evalsets import EVAL_SETS  # noqa: E402
from specframe.engine.config import structure_options  # noqa: E402


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_settings_are_valid(name):
    p = PRESETS[name]
    registry = plugins.load()
    assert set(p.drafters) <= set(registry.names("drafter"))
    assert set(p.memory_builders) <= set(registry.names("mask builder"))
    assert set(p.memory_partitioners) | {p.partitioner} <= set(registry.names("partitioner"))
    assert p.mask_builder in registry.names("mask builder")
    assert set(p.datasets) <= set(EVAL_SETS) and "mt-bench" in EVAL_SETS  # the speed and vLLM suites use MT-Bench
    if p.device == "cpu":
        assert "flex" not in p.memory_builders and p.mask_builder != "flex"  # no FlexAttention backward on CPU
    deepest = max(*p.ks, p.tree[0], p.speed_k)
    for drafter in p.drafters:
        cls = plugins.get("drafter", drafter)
        options = structure_options(p.train_options(drafter), cls.Options, f"preset {name} drafter {drafter}")
        if hasattr(options, "masks"):  # parallelspec drafts at most one token per mask, plus the real one
            assert options.masks + 1 >= deepest, (name, drafter)
    assert p.steps * p.batch_size <= p.train_examples * 4  # at most a few epochs over the shared sequences
