"""The composition root (``specframe.compose``): one place where a run config's names become components, one
converter (``specframe.structuring``) and one error format, whether the config is checked (``run_config.resolve``),
trained (``Trainer``), costed (``memory``) or reopened from a checkpoint (``drafter_folders``); one ``train`` resolves
its names once and hands the plan on (issue 55)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import attrs
import pytest
import torch
from transformers import AutoConfig

from specframe import compose, memory, plugins
from specframe.engine import run_config
from specframe.engine import TrainConfig, assembly, train
from specframe.errors import UsageError
from tests.train_fixtures import build, small_options

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build(tmp_path_factory.mktemp("compose"))


def config(assets, out, **kw):
    target, chat = assets
    base = dict(drafter="peagle", output=str(out), target=str(target), data=str(chat), seq_len=48, max_steps=2,
                batch_size=2, lr=3e-3, val_examples=2, mask_builder="dense", drafter_options=small_options(k_train=4))
    base.update(kw)
    return TrainConfig(**base)


def _message(call) -> str:
    with pytest.raises(UsageError) as info:
        call()
    return str(info.value)


@pytest.mark.parametrize("options, says", [
    ({**small_options(), "layerz": 2}, "drafter 'peagle' options: unknown key 'layerz' (did you mean 'layers'?)"),
    # the strict converter: a string is not an integer anywhere (a lax cattrs would read int("2"))
    ({**small_options(), "layers": "2"}, "drafter 'peagle' options: layers must be an integer, got '2' (str)"),
])
def test_a_bad_drafter_option_reads_the_same_checked_trained_or_costed(assets, tmp_path, options, says):
    cfg = config(assets, tmp_path / "run", drafter_options=options)
    checked = _message(lambda: run_config.resolve(cfg))
    trained = _message(lambda: train(cfg, progress=False))
    target_config = AutoConfig.from_pretrained(assets[0])
    costed = _message(lambda: memory.estimate(memory.MemoryConfig(
        drafter="peagle", target_config=target_config, seq_len=48, depth=4, mask_builder="dense",
        drafter_options=options)))
    assert says in checked
    assert checked == trained == costed
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").glob("step-*"))  # nothing trained


def test_a_bad_builder_or_partitioner_option_names_its_plugin(assets, tmp_path):
    bad_builder = config(assets, tmp_path / "a", mask_builder="chunked", mask_builder_options={"chunk": 8})
    assert "mask builder 'chunked' options: unknown key 'chunk' (did you mean 'chunk_size'?)" in _message(
        lambda: train(bad_builder, progress=False))
    bad_part = config(assets, tmp_path / "b", partitioner="peagle", partitioner_options={"nope": 1})
    assert "partitioner 'peagle' options: unknown key 'nope'" in _message(lambda: train(bad_part, progress=False))


def test_the_trainer_records_what_the_plan_resolves(assets, tmp_path):
    """What ``--print-config`` shows (``run_config.resolve``) is what the run records in OUTPUT/config.json: the
    same depth, builder and every option's default."""

    cfg = config(assets, tmp_path / "run", mask_builder=None, device="cpu")
    printed = run_config.as_dict(run_config.resolve(cfg))
    train(cfg, progress=False)
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())
    for key, value in printed.items():
        assert recorded[key] == value, key
    assert recorded["mask_builder"] is not None and recorded["depth"] == 4


def test_build_gives_the_named_parts_with_their_defaults(assets):
    cfg = config(assets, "unused", mask_builder=None, device="cpu", partitioner="peagle",
                 partitioner_options={})
    target_config = AutoConfig.from_pretrained(assets[0])
    run = compose.ResolvedRun.of(cfg, torch.device("cpu"))
    plan = run.plan
    parts = assembly.build(run, target_config, torch.device("cpu"))
    assert parts.depth == plan.depth == 4  # k_train=4 in the options: the drafter's declared depth
    assert type(parts.drafter) is plan.drafter_cls and parts.drafter.options == plan.drafter_options
    assert type(parts.builder) is plan.builder_cls and parts.run.config.mask_builder == plan.builder_name
    assert parts.partitioner.name == "peagle"
    assert parts.run.config.drafter_options == run_config.resolve(cfg).drafter_options
    # no builder named, on the CPU: small calls go to the builder declared fastest for them, in front of the
    # default; a run that names its builder, or turns sized_attention off, gives the builder every call
    assert plan.sized_attention and run.config.sized_attention is True
    assert parts.attention_builder is not parts.builder
    for changed in ({"mask_builder": "chunked"}, {"sized_attention": False}):
        other = compose.ResolvedRun.of(attrs.evolve(cfg, **changed), torch.device("cpu"))
        plain = assembly.build(other, target_config, torch.device("cpu"))
        assert plain.attention_builder is plain.builder and other.config.sized_attention is False, changed
    named = compose.ResolvedRun.of(attrs.evolve(cfg, mask_builder="chunked", sized_attention=True), "cpu")
    sized = assembly.build(named, target_config, torch.device("cpu"))
    assert named.plan.sized_attention and sized.attention_builder is not sized.builder


def test_a_run_the_cli_resolved_sizes_attention_as_a_python_callers(assets, tmp_path):
    """`specframe train` resolves its run before the engine starts (the builder's name written in): a run that
    named no builder still sends its small attention calls to the small-call builder, as a Python caller's does
    (before, a handed-over run never did), and records the choice."""
    from specframe.engine.attention import SizedMaskBuilder
    from specframe.engine.loop import Trainer

    cfg = config(assets, tmp_path / "run", mask_builder=None, device="cpu", max_steps=1)
    run = run_config.resolve_run(cfg)
    assert run.config.mask_builder is not None and run.config.sized_attention is True
    for given in (run, cfg):
        trainer = Trainer(given, log=lambda *a: None)
        try:
            assert isinstance(trainer.attention_builder, SizedMaskBuilder), type(given).__name__
        finally:
            trainer.close()
    named = run_config.resolve_run(attrs.evolve(cfg, mask_builder="chunked"))
    trainer = Trainer(named, log=lambda *a: None)
    try:
        assert trainer.attention_builder is trainer.builder and named.config.sized_attention is False
    finally:
        trainer.close()


def test_one_resolved_run_from_the_cli_to_the_estimate(assets, tmp_path, monkeypatch):
    """The CLI resolves a run once and hands that one record on: the engine builds its parts and costs its memory
    with the plan it was handed, and never resolves the names again."""
    from specframe.engine import loop

    cfg = config(assets, tmp_path / "run", mask_builder="dense", device="cpu", max_steps=1)
    run = run_config.resolve_run(cfg)
    built, costed = [], []
    real_build, real_guard = assembly.build, assembly.memory_guard
    monkeypatch.setattr(assembly, "build", lambda r, *a, **k: built.append(r) or real_build(r, *a, **k))
    monkeypatch.setattr(assembly, "memory_guard", lambda r, *a, **k: costed.append(r) or real_guard(r, *a, **k))
    monkeypatch.setattr(compose, "plan", lambda *a, **k: pytest.fail("a handed-over run resolved its names again"))
    trainer = loop.Trainer(run, log=lambda *a: None)
    try:
        assert built == [run] and costed[0].plan is run.plan and costed[0].config.device == "cpu"
        assert trainer.resolved_run.plan is run.plan and trainer.resolved == run.config
    finally:
        trainer.close()


def test_device_auto_leaves_the_builder_to_the_machine(assets):
    plan = compose.plan(config(assets, "unused", mask_builder=None, device="auto"))
    assert plan.builder_name is None and plan.builder_cls is None
    assert run_config.resolve(config(assets, "unused", mask_builder=None, device="auto")).mask_builder is None


def test_device_auto_plan_is_decided_once_on_the_device(assets):
    plan = compose.plan(config(assets, "unused", mask_builder=None, device="auto"))
    decided = plan.for_device("cpu")
    assert decided.builder_name == compose.mask_builder_name(None, "cpu") and decided.builder_cls is not None
    assert decided.for_device("cpu") is decided and decided.drafter_options is plan.drafter_options


def test_one_train_resolves_each_name_once(assets, tmp_path, monkeypatch):
    """``specframe train`` (the CLI's own path, with the memory estimate on and a partitioner) looks each component's
    name up in the registry once: the CLI's plan goes to the engine, which builds the parts and costs the run from it
    (before issue 55 the drafter's name was resolved three times: run_config, compose.build, memory.engine_guard). A
    resume resolves them once too (its settings check reuses the plan)."""
    from collections import Counter

    from click.testing import CliRunner

    from specframe.cli import main

    monkeypatch.delenv("SPECFRAME_SKIP_MEMORY_CHECK", raising=False)
    lookups: Counter = Counter()
    plain_get = plugins.get

    def counting(kind: str, name: str) -> type:
        lookups[kind, name] += 1
        return plain_get(kind, name)

    monkeypatch.setattr(plugins, "get", counting)
    target, chat = assets
    out = tmp_path / "run"
    args = ["train", "--drafter", "peagle", "--target", target, "--data", chat, "--seq-len", 48, "--output", out,
            "--max-steps", 2, "--batch-size", 2, "--val-examples", 2, "--device", "cpu", "--partitioner", "peagle",
            "--partitions", 2, "--memory-budget", "64GiB", "--json"]
    for extra in ([], ["--resume", out]):
        lookups.clear()
        result = CliRunner().invoke(main, [str(a) for a in [*args, *extra]], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        assert lookups["drafter", "peagle"] == 1, lookups
        assert lookups["partitioner", "peagle"] == 1 and set(lookups.values()) == {1}, lookups
        assert json.loads((out / "config.json").read_text())["memory_budget_enforced"] is True


def _calls(tree: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == name
               for n in ast.walk(tree))


def test_names_become_components_only_in_the_composition_root():
    """Structuring a plugin's options is what makes a name a component: only ``compose`` does it in the core
    (``structuring`` defines it; ``Drafter.from_checkpoint`` builds a class it is handed; the test kit goes through
    ``compose``), and only ``structuring`` makes a cattrs converter or calls cattrs' global one."""
    offenders, converters = [], []
    for path in [*sorted((ROOT / "specframe").rglob("*.py")), *sorted((ROOT / "benchmarks").glob("*.py"))]:
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text())
        # Drafter.from_checkpoint (interfaces/checkpoint, once api) builds a class it was handed, never a name
        if _calls(tree, "structure_options") and rel not in (
                "specframe/compose.py", "specframe/structuring.py", "specframe/interfaces/checkpoint.py"):
            offenders.append(rel)
        cattrs_calls = any(isinstance(n, ast.Attribute) and getattr(n.value, "id", None) == "cattrs"
                           and n.attr in ("structure", "unstructure", "Converter") for n in ast.walk(tree))
        if (_calls(tree, "Converter") or cattrs_calls) and rel != "specframe/structuring.py":
            converters.append(rel)
    assert offenders == [] and converters == []


def _looked_up(node: ast.AST) -> bool:
    """``plugins.get(...)`` / ``registry.get(...)``: a registered class looked up by name."""
    return (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "get"
            and getattr(node.func.value, "id", None) in ("plugins", "registry"))


def _builds_components(tree: ast.AST) -> list[int]:
    """Lines where a registered component is built past ``compose.component``: a looked-up class called
    (``plugins.get(kind, name)(...)``, or through the name it was bound to) or an ``Options`` made from a table
    (``cls.Options(**table)``, past the converter and its error format)."""
    bound = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and _looked_up(n.value)
             for t in n.targets if isinstance(t, ast.Name)}
    lines = []
    for n in ast.walk(tree):
        if not isinstance(n, ast.Call):
            continue
        if _looked_up(n.func) or (isinstance(n.func, ast.Name) and n.func.id in bound):
            lines.append(n.lineno)
        elif getattr(n.func, "attr", None) == "Options" and any(k.arg is None for k in n.keywords):
            lines.append(n.lineno)
    return lines


def test_components_are_built_only_by_compose_component():
    """One constructor (issue 55, item 2): the core and the benchmark scripts build a registered component from a
    name and options only through ``compose.component``, the test kit (``specframe.testing``) included: a contract
    checks a component built as a run builds it (``compose.component`` takes the class a test hands it too)."""
    allowed = {"specframe/compose.py"}
    offenders = {}
    for path in [*sorted((ROOT / "specframe").rglob("*.py")), *sorted((ROOT / "benchmarks").glob("*.py"))]:
        rel = path.relative_to(ROOT).as_posix()
        if rel in allowed:
            continue
        lines = _builds_components(ast.parse(path.read_text()))
        if lines:
            offenders[rel] = lines
    assert offenders == {}


def test_the_check_sees_a_component_built_past_compose():
    planted = """
cls = plugins.get("verifier", name)
verifier = cls(options)
builder = registry.get("mask builder", "dense")()
options = cls.Options(**table)
"""
    assert _builds_components(ast.parse(planted)) == [3, 4, 5]


def test_a_class_is_built_as_its_registered_name_is():
    """The test kit hands ``compose.component`` a class (a plugin checked before it is installed): the same typed
    options and the same message as its registered name."""
    cls = plugins.get("mask builder", "chunked")
    by_name = compose.component("mask builder", "chunked", {"chunk_size": 64})
    by_class = compose.component("mask builder", cls, {"chunk_size": 64})
    assert type(by_class) is type(by_name) and by_class.options == by_name.options
    messages = []
    for spelled in ("chunked", cls):
        with pytest.raises(Exception) as caught:
            compose.component("mask builder", spelled, {"chunk_size": 64, "nope": 1})
        messages.append(str(caught.value))
    assert messages[0] == messages[1]
