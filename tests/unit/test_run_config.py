"""One file holds a whole run (``specframe train --config`` / ``--print-config``) and every plugin option is
discoverable (``specframe plugins --options``). No model is loaded except in the one end-to-end check."""

from __future__ import annotations

import json

import attrs
import click
import pytest
import yaml
from click.testing import CliRunner

from specframe import plugin_options, plugins
from specframe.engine import run_config
from specframe.cli import main
from specframe.engine.config import TrainConfig


def run(*args):
    result = CliRunner().invoke(main, list(map(str, args)), catch_exceptions=False)
    return result.exit_code, result.output


def printed(*args) -> dict:
    code, text = run("train", *args, "--print-config", "--json")
    assert code == 0, text
    return json.loads(text)


RUN_YAML = """\
drafter: peagle
target: some/target
seq-len: 64
max_steps: 5
batch-size: 3
lr: 3e-4
warmup_steps: 2
weight-decay: 0.01
grad_clip: 0.5
memory_budget: 2GiB
mask_builder: dense
partitioner: peagle
partitions: 2
drafter_options:
  layers: 2
  k_train: 3
"""

RUN_TOML = """\
drafter = "peagle"
target = "some/target"
seq-len = 64
max_steps = 5
batch-size = 3
lr = 3e-4
warmup_steps = 2
weight-decay = 0.01
grad_clip = 0.5
memory_budget = "2GiB"
mask_builder = "dense"
partitioner = "peagle"
partitions = 2

[drafter_options]
layers = 2
k_train = 3
"""


@pytest.mark.parametrize("name,text", [("run.yaml", RUN_YAML), ("run.toml", RUN_TOML)])
def test_a_file_holds_every_option_and_resolves(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    cfg = printed("--config", path)
    assert cfg["seq_len"] == 64 and cfg["max_steps"] == 5 and cfg["batch_size"] == 3 and cfg["lr"] == 3e-4
    assert cfg["warmup_steps"] == 2 and cfg["weight_decay"] == 0.01 and cfg["grad_clip"] == 0.5
    assert cfg["memory_budget"] == "2GiB" and cfg["partitioner"] == "peagle" and cfg["partitions"] == 2
    assert cfg["target"] == "some/target" and "output" not in cfg  # no output given: none printed
    # resolved from the plugin classes alone: the depth is the drafter's k_train, every option has its default
    assert cfg["depth"] == 3 and cfg["mask_builder"] == "dense"
    assert cfg["drafter_options"]["layers"] == 2 and cfg["drafter_options"]["loss_chunk"] == 256
    assert cfg["mask_builder_options"] == {} and cfg["partitioner_options"] == {}
    assert set(cfg) | {"output"} == {a.name for a in attrs.fields(TrainConfig)}


def test_print_config_round_trips(tmp_path):
    code, text = run("train", "--drafter", "eagle3", "--seq-len", 80, "--depth", 4, "-o", tmp_path / "out",
                     "--device", "cpu", "--print-config")
    assert code == 0, text
    assert text.startswith("# ") and not (tmp_path / "out").exists()  # nothing written
    first = yaml.safe_load(text)
    assert first["depth"] == 4 and first["mask_builder"] == "chunked" and first["output"] == str(tmp_path / "out")
    assert first["drafter_options"]["ttt_steps"] == 7
    (tmp_path / "printed.yaml").write_text(text)
    assert printed("--config", tmp_path / "printed.yaml") == first
    # the JSON form loads back too
    (tmp_path / "printed.json").write_text(json.dumps(first))
    assert printed("--config", tmp_path / "printed.json") == first


def test_typed_flags_override_the_file_and_defaults_do_not(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(RUN_YAML)
    cfg = printed("--config", path, "--seq-len", 128, "--lr", 0.001, "--drafter", "pard")
    assert cfg["seq_len"] == 128 and cfg["lr"] == 0.001 and cfg["drafter"] == "pard"
    # flags left at their defaults (--partitions 1, --target default, ...) do not reset the file's values
    assert cfg["partitions"] == 2 and cfg["target"] == "some/target" and cfg["batch_size"] == 3
    # a flag typed with its default value still overrides
    assert printed("--config", path, "--partitions", 1)["partitions"] == 1


def test_cache_flag_displaces_the_files_data(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("drafter: peagle\ndata: gsm8k\n")
    cfg = printed("--config", path, "--cache", tmp_path)
    assert cfg["cache"] == str(tmp_path) and cfg["data"] is None
    assert printed("--config", path)["data"] == "gsm8k"
    if "epochs" in attrs.fields_dict(TrainConfig):  # the run length's alternatives behave the same way
        path.write_text("drafter: peagle\nmax_steps: 9\n")
        cfg = printed("--config", path, "--epochs", 2)
        assert cfg["epochs"] == 2 and cfg["max_steps"] is None


@pytest.mark.parametrize("text,needles", [
    ("drafter: peagle\nseq_lenn: 64\n", ["unknown key 'seq_lenn'", "did you mean 'seq_len'"]),
    ("drafter: peagle\ndrafter_options:\n  layerz: 2\n", ["unknown key 'layerz'", "did you mean 'layers'",
                                                        "drafter 'peagle' options"]),
    ("drafter: peagle\nmask_builder: chunked\nmask_builder_options:\n  chunk: 8\n",
     ["unknown key 'chunk'", "did you mean 'chunk_size'", "mask builder 'chunked'"]),
    ("drafter: peagle\nseq_len: long\n", ["seq_len must be an integer, got 'long'"]),
    ("drafter: peagle\nseq_len: 2.5\n", ["seq_len must be an integer, got 2.5"]),
    ("drafter: peagle\ndrafter_options:\n  layers: two\n", ["layers must be an integer, got 'two'"]),
    ("drafter: peagle\ndrafter_options:\n  activation_checkpointing: 1\n",
     ["activation_checkpointing must be true or false"]),
    ("drafter: peagle\ndrafter_options: 3\n", ["'drafter_options' must be a table"]),
    ("- a list\n", ["must hold keys and tables"]),
    ("seq_len: 64\n", ["missing --drafter"]),
    ("drafter: peagle\nworld_size: 1\n", ["unknown key 'world_size'"]),  # a record key only in a run's config.json
    ("drafter: peagle\nseq_len: 0\n", ["--seq-len must be positive, got 0"]),  # the field's own check, unwrapped
])
def test_bad_files_are_one_clear_error_naming_the_key(tmp_path, text, needles):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    code, out = run("train", "--config", path, "--print-config")
    assert code == 2, out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out
    for needle in needles:
        assert needle in out, out


def test_bad_toml_names_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("seq_len = \n")
    code, out = run("train", "--config", path, "--print-config")
    assert code == 2 and "bad.toml is not valid" in out
    # the older [drafter] table cannot sit next to a drafter name in TOML: the error says what to write
    path.write_text('drafter = "peagle"\n[drafter]\nlayers = 2\n')
    code, out = run("train", "--config", path, "--print-config")
    assert code == 2 and "[drafter_options]" in out


def test_older_plugin_tables_still_work(tmp_path):
    path = tmp_path / "old.toml"
    path.write_text("[drafter]\nlayers = 2\n[mask-builder]\nchunk_size = 64\n")
    cfg = printed("--drafter", "peagle", "--mask-builder", "chunked", "--config", path)
    assert cfg["drafter_options"]["layers"] == 2 and cfg["mask_builder_options"] == {"chunk_size": 64}


def test_train_flags_show_the_engines_defaults():
    """Only typed flags reach the config, so a flag's shown default must be TrainConfig's."""
    from specframe.cli.train_cmd import train

    defaults = attrs.fields_dict(TrainConfig)
    ctx = click.Context(train)
    for param in train.params:
        shown = param.get_default(ctx)
        if param.name in defaults and shown is not None and param.name != "output":
            assert shown == defaults[param.name].default, param.name
    for flag in ("--warmup-steps", "--weight-decay", "--grad-clip", "--print-config"):
        assert flag in run("train", "--help")[1]


def test_memory_reads_the_plugin_tables_of_a_run_file(tmp_path):
    from specframe.cli.run_options import read_config

    path = tmp_path / "run.yaml"
    path.write_text(RUN_YAML)
    assert read_config(path) == {"drafter_options": {"layers": 2, "k_train": 3}}


# ------------------------------------------------------------------------------------------ options inline
def test_an_inline_name_parses_into_the_name_and_texts():
    """``NAME:KEY=VALUE,..`` (issue 55, item 2): one parser for every kind; a JSON list's commas stay in its value;
    each value is the text typed until the component's ``Options`` types it."""
    from specframe.errors import UsageError
    from specframe.structuring import Text, inline

    name, given = inline(" peagle: layers=4, aux_layer_ids=[1, 2],k_infer = 3", "drafter", "peagle:layers=4")
    assert name == "peagle" and given == {"layers": "4", "aux_layer_ids": "[1, 2]", "k_infer": "3"}
    assert all(isinstance(v, Text) for v in given.values())
    assert inline("dense", "mask builder", "x") == ("dense", {})
    with pytest.raises(UsageError, match="is not KEY=VALUE"):
        inline("peagle:layers", "drafter", "peagle:layers=4")


def test_inline_values_are_typed_by_the_options_field():
    """The field decides: a str field keeps the text (``8`` stays '8'), ``null`` is None where None is allowed,
    anything else is read as JSON and checked strictly."""
    from specframe.errors import UsageError
    from specframe.structuring import inline, structure

    @attrs.frozen
    class Options:
        layers: int = 1
        ratio: float = 0.5
        label: str = "x"
        maybe: str | None = "y"
        ids: list[int] | None = None
        flag: bool = False

    typed = structure(inline("p:layers=4,ratio=1,label=8,maybe=null,ids=[1,2],flag=true", "drafter", "")[1],
                      Options, "drafter 'p' options")
    assert typed == Options(layers=4, ratio=1.0, label="8", maybe=None, ids=[1, 2], flag=True)
    with pytest.raises(UsageError, match="drafter 'p' options: layers must be an integer, got 'four'"):
        structure(inline("p:layers=four", "drafter", "")[1], Options, "drafter 'p' options")


def test_every_kind_takes_options_inline_over_the_files_table(tmp_path):
    """``--drafter``, ``--mask-builder`` and ``--partitioner`` NAME:KEY=VALUE: typed, written into the resolved
    config as the file's tables would be, over the file's values (a flag over the file); the other keys of the
    file's table stay. A config without inline options resolves as before."""
    path = tmp_path / "run.yaml"
    path.write_text("drafter_options:\n  layers: 2\n  k_train: 3\nmask_builder_options:\n  chunk_size: 32\n")
    plain = printed("--drafter", "peagle", "--mask-builder", "chunked", "--config", path)
    cfg = printed("--drafter", "peagle:layers=1,cod_ratio=0.5", "--mask-builder", "chunked:chunk_size=64",
                  "--partitioner", "peagle", "--config", path)
    assert cfg["drafter"] == "peagle" and cfg["mask_builder"] == "chunked" and cfg["partitioner"] == "peagle"
    assert (cfg["drafter_options"]["layers"], cfg["drafter_options"]["k_train"]) == (1, 3)
    assert cfg["drafter_options"]["cod_ratio"] == 0.5 and cfg["mask_builder_options"] == {"chunk_size": 64}
    assert {k: v for k, v in cfg.items() if k not in ("drafter_options", "mask_builder_options", "partitioner")} \
        == {k: v for k, v in plain.items() if k not in ("drafter_options", "mask_builder_options", "partitioner")}
    assert plain["drafter_options"]["layers"] == 2 and plain["mask_builder_options"] == {"chunk_size": 32}


@pytest.mark.parametrize("flag, value, says", [
    ("--drafter", "peagle:layerz=1", "drafter 'peagle' options: unknown key 'layerz' (did you mean 'layers'?)"),
    ("--drafter", "peagle:layers=1.5", "drafter 'peagle' options: layers must be an integer, got 1.5 (float)"),
    ("--mask-builder", "chunked:chunk_size=big", "mask builder 'chunked' options: chunk_size must be an integer"),
    ("--partitioner", "none:x=1", "partitioner 'none' options: unknown key 'x'"),
    ("--drafter", "peagle:layers", "drafter option 'layers' in 'peagle:layers' is not KEY=VALUE (e.g. peagle:"),
])
def test_a_bad_inline_option_is_one_line_naming_the_component_and_key(flag, value, says):
    args = ["train", "--drafter", "peagle", flag, value, "--print-config"]
    code, text = run(*args)
    assert code == 2 and says in text, text


def test_memory_takes_options_inline_too(tmp_path):
    """``specframe memory --drafter peagle:layers=1`` costs what a run file's layers 1 costs."""
    path = tmp_path / "one.yaml"
    path.write_text("drafter_options:\n  layers: 1\n")
    costs = []
    for args in (["--drafter", "peagle:layers=1"], ["--drafter", "peagle", "--config", path],
                 ["--drafter", "peagle:layers=3"]):
        code, text = run("memory", *args, "--seq-len", 256, "--features", "synthetic", "--json")
        assert code == 0, text
        costs.append(json.loads(text)["peak_bytes"])
    assert costs[0] == costs[1] < costs[2]


@pytest.mark.slow  # trains one step on the tiny target (~20 s on a busy 2-core machine)
def test_config_json_of_a_run_is_the_resolved_config_and_loads_back(tmp_path):
    from tests.train_fixtures import build

    target, chat = build(tmp_path)
    path = tmp_path / "run.toml"
    path.write_text(f'drafter = "peagle"\ntarget = "{target}"\ndata = "{chat}"\nseq_len = 48\nmax_steps = 1\n'
                    'mask_builder = "dense"\nmax_examples = 4\nval_examples = 1\nbatch_size = 1\n[drafter_options]\nlayers = 1\ndraft_vocab_size = 64\nk_train = 2\n')
    expected = printed("--config", path, "-o", tmp_path / "out")
    code, text = run("train", "--config", path, "-o", tmp_path / "out", "--json")
    assert code == 0, text
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: saved[k] for k in expected} == expected
    assert saved["mask_builder_options"] == {} and saved["drafter_options"]["cod_ratio"] == 0.7
    assert printed("--config", tmp_path / "out" / "config.json") == expected


# ------------------------------------------------------------------------------------------ plugins --options
def test_plugins_options_shows_type_default_and_help():
    code, text = run("plugins", "--options", "peagle", "--kind", "drafter")
    assert code == 0, text
    for name, type_, default in (("layers", "int", "4"), ("draft_vocab_size", "int | None", "null"),
                                 ("k_train", "int", "8")):
        row = next(line for line in text.splitlines() if f" {name} " in line)
        assert type_ in row and default in row, row
    assert "decoder layers" in text and "depths trained" in text


def test_plugins_options_json_and_ambiguous_names():
    code, text = run("plugins", "--options", "peagle", "--json")
    assert code == 0, text
    doc = json.loads(text)
    kinds = {c["kind"]: c for c in doc["components"]}
    assert set(kinds) == {"drafter", "partitioner"}  # 'peagle' names a drafter and a partitioner: both listed
    options = {o["name"]: o for o in kinds["drafter"]["options"]}
    assert options["layers"] == {"name": "layers", "type": "int", "default": 4, "required": False,
                                 "help": options["layers"]["help"]} and options["layers"]["help"]
    assert options["aux_layer_ids"]["default"] is None and "list[int]" in options["aux_layer_ids"]["type"]
    assert kinds["partitioner"]["options"] == []


def test_plugins_options_unknown_name():
    code, text = run("plugins", "--options", "peagel")
    assert code == 2 and "did you mean 'peagle'" in text and text.startswith("error: ")
    code, text = run("plugins", "--options", "dense", "--kind", "drafter")
    assert code == 2 and "unknown drafter 'dense'" in text


def test_every_builtin_option_has_a_help_line():
    registry = plugins.load()
    missing = []
    for kind in plugins.KINDS:
        for name in registry.names(kind):
            cls = registry.get(kind, name)
            if not cls.__module__.startswith("specframe_plugins"):
                continue
            for doc in plugin_options.describe(cls.Options):
                if not doc.help or "\n" in doc.help:
                    missing.append(f"{kind} {name}: {doc.name}")
    assert not missing, missing


def test_fair_comparison_defaults_are_equal_or_explained():
    registry = plugins.load()
    drafters = {n: registry.get("drafter", n).Options() for n in ("peagle", "eagle3", "parallelspec", "pard")}
    vocab = {n: o.draft_vocab_size for n, o in drafters.items() if hasattr(o, "draft_vocab_size")}
    assert len(set(vocab.values())) == 1 and "full target vocabulary" in plugin_options.summary(
        registry.get("drafter", "pard").Options)
    depth = {n: o.k_train for n, o in drafters.items()}
    for name, value in depth.items():
        if value != depth["peagle"]:  # a different default training depth says so in its help
            field = "ttt_steps" if name == "eagle3" else "k_train"
            help_text = attrs.fields_dict(type(drafters[name]))[field].metadata["help"]
            assert "--depth" in help_text and "equal-depth" in help_text, name


def test_structure_accepts_yaml_exponents_but_not_guesses():
    cfg = run_config.build({"drafter": "peagle", "output": "o", "lr": "3e-4"})
    assert cfg.lr == 3e-4
    with pytest.raises(Exception, match="lr must be a number"):
        run_config.build({"drafter": "peagle", "output": "o", "lr": "fast"})


def test_example_plugin_follows_the_help_convention(monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "examples" / "specframe-example-drafter"))
    import sys

    try:
        from specframe_example_drafter import SkipgramOptions

        docs = plugin_options.describe(SkipgramOptions)
    finally:  # the plugin tests install the package for real: leave no copy imported from the source folder
        sys.modules.pop("specframe_example_drafter", None)
    assert [d.name for d in docs] == ["dim", "max_depth"] and all(d.help for d in docs)
