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
