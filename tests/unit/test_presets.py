"""The comparison suites' presets (benchmarks/presets.py) stay runnable: CI runs only ``ci``, so this checks the
others' settings against the registered plugins and the drafters' own limits without training anything."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from presets import PRESETS, exportable, installed_drafters, resolve  # noqa: E402

from specframe import plugins  # noqa: E402
from specframe.data.evalsets import EVAL_SETS  # noqa: E402
from specframe.structuring import structure_options  # noqa: E402


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_settings_are_valid(name):
    p = resolve(name)
    registry = plugins.load()
    assert set(p.drafters) <= set(registry.names("drafter"))
    assert set(p.memory_builders) <= set(registry.names("mask builder"))
    assert set(p.memory_partitioners) | {p.partitioner} <= set(registry.names("partitioner"))
    assert p.mask_builder is None or p.mask_builder in registry.names("mask builder")
    assert set(p.datasets) <= set(EVAL_SETS) and "mt-bench" in EVAL_SETS  # the speed and vLLM suites use MT-Bench
    if p.device == "cpu":
        assert "flex" not in p.memory_builders and p.mask_builder != "flex"  # no FlexAttention backward on CPU
    deepest = max(*p.ks, p.tree[0], p.speed_k)
    for drafter in p.drafters:
        cls = plugins.get("drafter", drafter)
        options = structure_options(p.train_options(drafter), cls.Options, f"preset {name} drafter {drafter}")
        if hasattr(options, "masks"):  # parallelspec drafts at most one token per mask, plus the real one
            assert options.masks + 1 >= deepest, (name, drafter)
        if cls.parallel:  # one forward drafts each trained depth: at most the declared depth a round (API 6)
            assert cls.training(options).depth >= max(*p.ks, p.speed_k), (name, drafter)
    assert p.steps * p.batch_size <= p.train_examples * 4  # at most a few epochs over the shared sequences
    # the reference engine's extra verifiers of a drafter vLLM cannot serve: each one a verifier that is installed
    # whenever its drafter is (a bad name would fail a job only after hours of training)
    from specframe.bench import verifier_spec

    for drafter, verifiers in p.reference_verifiers.items():
        if drafter in p.drafters:
            for text in verifiers:
                verifier_spec(text)


@pytest.fixture
def only_plugins(monkeypatch):
    """``only_plugins("a,b")``: the registry with the built-ins and exactly these third-party plugins, whatever else
    is installed (another drafter package, the example plugin), as SPECFRAME_LOAD_PLUGINS lets a user choose."""

    def load(names: str) -> None:
        monkeypatch.delenv("SPECFRAME_DISABLE_PLUGINS", raising=False)
        monkeypatch.setenv("SPECFRAME_LOAD_PLUGINS", names)
        plugins.reset()

    yield load
    monkeypatch.undo()
    plugins.reset()


def test_installed_plugin_drafters_join_every_suite(only_plugins):
    """`make setup` installs specframe-dflash and specframe-dspark: the suites pick them up with no preset edit, at
    their own architecture, with the preset's depth set through DFlash's block size (it has no ``k_train`` and no draft
    vocabulary)."""
    only_plugins("dflash,dspark")
    assert installed_drafters() == ["dflash", "dspark"]  # the built-ins are not "installed" drafters
    p = resolve("cpu")
    assert list(p.drafters) == [*PRESETS["cpu"].drafters, "dflash", "dspark"]
    assert "ngram" not in p.drafters  # a baseline, measured beside the drafters, never trained
    opts = p.train_options("dflash")
    assert opts == {"block_size": p.depth + 1, "k_infer": min(p.speed_k, p.depth)}
    assert p.train_options("dflash", depth=3)["block_size"] == 4  # the memory suite's depth
    assert p.train_options("eagle3")["ttt_steps"] == p.depth and "k_train" not in p.train_options("eagle3")
    assert "draft_vocab_size" not in p.train_options("pard")
    assert p.train_options("peagle", depth=3)["k_train"] == 3
    assert exportable("dflash") and exportable("peagle") and not exportable("ngram")
    # a preset may set an installed plugin's options (ci's 4-layer target needs DFlash's layers named)
    assert resolve("ci").train_options("dflash")["aux_layer_ids"] == [1, 3]


def test_uninstalled_plugin_leaves_the_presets(only_plugins):
    """With no third-party plugin loaded (as after `pip uninstall` of every drafter package: specframe-dflash,
    specframe-dspark, the example plugin, any other) the presets are the built-ins."""
    only_plugins("")
    assert installed_drafters() == []
    assert resolve("cpu") == PRESETS["cpu"]

