"""The CLI's contract for user errors: one clear line, a non-zero exit, a traceback only with --debug."""

from __future__ import annotations

import sys
import types

import click
import pytest
from click.testing import CliRunner

import specframe
from specframe import cli
from specframe.errors import UsageError


@pytest.fixture
def failing_command(monkeypatch):
    module = types.ModuleType("specframe_test_failing")

    @click.command()
    def fail():
        raise UsageError("--depth must be positive, got 0")

    module.fail = fail
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(cli.COMMANDS, "fail", f"{module.__name__}:fail")


def test_version():
    result = CliRunner().invoke(cli.main, ["--version"])
    assert result.exit_code == 0 and result.stdout.strip() == f"specframe, version {specframe.__version__}"


def test_user_error_is_one_line_without_traceback(failing_command):
    result = CliRunner().invoke(cli.main, ["fail"])
    assert result.exit_code == 2
    assert result.stderr == "error: --depth must be positive, got 0\n"
    assert "Traceback" not in result.output


def test_debug_shows_the_traceback(failing_command):
    result = CliRunner().invoke(cli.main, ["--debug", "fail"])
    assert result.exit_code == 2
    assert "Traceback" in result.stderr and result.stderr.endswith("error: --depth must be positive, got 0\n")


def test_misspelled_command_suggests_the_closest():
    result = CliRunner().invoke(cli.main, ["plugin"])
    assert result.exit_code == 2
    assert "Error: unknown command 'plugin' (did you mean 'plugins'?); available: " in result.stderr


def test_the_target_engine_choices_are_one_list():
    """prepare --engine, regenerate --engine and train --feature-engine offer the engines the core knows
    (``specframe.devices.TARGET_ENGINES``, which the run config checks), spelt once."""
    from specframe.cli import prepare_cmd, regenerate_cmd, train_cmd
    from specframe.devices import TARGET_ENGINES
    from specframe.engine.config import FEATURE_ENGINES

    assert FEATURE_ENGINES == TARGET_ENGINES
    for command, flag in ((prepare_cmd.prepare, "engine"), (regenerate_cmd.regenerate, "engine"),
                          (train_cmd.train, "feature_engine")):
        option = next(p for p in command.params if p.name == flag)
        assert tuple(option.type.choices) == TARGET_ENGINES, f"{command.name} --{flag.replace('_', '-')}"


def test_the_vllm_engine_options_are_one_group():
    """prepare and regenerate take the vLLM engine's sizes from one decorator (``cli/vllm_options``), received as one
    ``VllmFlags`` whose ``answer_options`` fills what was not typed with the command's default (issue 55, item 5)."""
    from specframe.cli import prepare_cmd, regenerate_cmd
    from specframe.cli.vllm_options import VllmFlags, engine_options

    names = ["max_num_seqs", "tensor_parallel_size", "pipeline_parallel_size", "gpu_memory_utilization",
             "distributed_executor_backend", "kv_cache_gib"]
    for command in (prepare_cmd.prepare, regenerate_cmd.regenerate):
        params = [p.name for p in command.params]
        assert params[params.index(names[0]):params.index(names[0]) + len(names)] == names, command.name
    seen = {}

    @click.command()
    @engine_options(max_num_seqs="help")
    def probe(vllm):
        seen["flags"] = vllm

    CliRunner().invoke(probe, ["--tensor-parallel-size", "2", "--kv-cache-gib", "3"], catch_exceptions=False)
    assert seen["flags"] == VllmFlags(tensor_parallel_size=2, kv_cache_gib=3)
    options = seen["flags"].answer_options(dtype="fp32", max_model_len=64, max_num_seqs=16, threads=None)
    assert (options.max_num_seqs, options.tensor_parallel_size, options.kv_cache_gib) == (16, 2, 3)


def test_commands_share_helpers_through_option_modules_not_each_other():
    """No command module imports another (issue 55, item 5): what two commands share lives in a cli/ option module
    (run_options, vllm_options, decoding_options, feature_options, target_options)."""
    import ast
    from pathlib import Path

    folder = Path(cli.__file__).parent
    commands = {p.stem for p in folder.glob("*_cmd.py")}
    crossing = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[-1], *(f"{a.name}" for a in node.names if node.module == "specframe.cli")]
                crossing += [f"{path.name} -> {name}" for name in names if name in commands]
    assert crossing == []


def test_help_imports_neither_torch_nor_the_api():
    """``specframe --help`` and every command's ``--help`` start without torch, the API or the engine (the lazy CLI):
    a command module that imports them at its top (a default read from the engine, the plugin registry) fails this."""
    import subprocess

    script = (
        "import runpy, sys\n"
        "from specframe.cli import COMMANDS\n"
        "for args in [['--help']] + [[name, '--help'] for name in sorted(COMMANDS)]:\n"
        "    sys.argv = ['specframe', *args]\n"
        "    try:\n"
        "        runpy.run_module('specframe', run_name='__main__')\n"
        "    except SystemExit:\n"
        "        pass\n"
        "    heavy = [m for m in ('torch', 'specframe.api', 'specframe.engine') if m in sys.modules]\n"
        "    assert not heavy, f'specframe {\" \".join(args)} imported {heavy}'\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
