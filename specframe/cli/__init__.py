"""The ``specframe`` command line.

Each command lives in its own module under ``specframe.cli`` and is listed in ``COMMANDS``; modules are imported
only when their command runs (or for ``--help``), and a command module imports torch, the API and the engine only
inside the command, so ``specframe --help`` and every command's ``--help`` start without them
(``tests/e2e/test_cli.py`` checks it). ``specframe plugins`` loads the plugins, which import the API and torch.
"""

from __future__ import annotations

import importlib
import sys
import traceback

import click

from specframe import __version__
from specframe.errors import SpecframeError

# command name -> "module:attribute" of a click.Command
COMMANDS: dict[str, str] = {
    "plugins": "specframe.cli.plugins_cmd:plugins",
    "report": "specframe.cli.report_cmd:report",
    "prepare": "specframe.cli.prepare_cmd:prepare",
    "regenerate": "specframe.cli.regenerate_cmd:regenerate",
    "train": "specframe.cli.train_cmd:train",
    "memory": "specframe.cli.memory_cmd:memory",
    "export": "specframe.cli.export_cmd:export",
    "serve": "specframe.cli.serve_cmd:serve",
    "generate": "specframe.cli.generate_cmd:generate",
    "bench": "specframe.cli.bench_cmd:bench",
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)

    def resolve_command(self, ctx, args):
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as exc:
            from specframe.errors import did_you_mean

            if args and args[0] not in COMMANDS and not args[0].startswith("-"):
                raise click.UsageError(
                    f"unknown command '{args[0]}'{did_you_mean(args[0], COMMANDS)}; "
                    f"available: {', '.join(sorted(COMMANDS))}"
                ) from exc
            raise

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except SpecframeError as exc:
            if ctx.obj and ctx.obj.get("debug"):
                traceback.print_exc()
            click.echo(f"error: {exc}", err=True)
            ctx.exit(exc.exit_code)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="specframe")
@click.option("--debug", is_flag=True, help="Show full tracebacks for errors.")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """Train, serve and compare speculative-decoding drafters."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


def run() -> None:  # console-script entry point
    sys.exit(main())
