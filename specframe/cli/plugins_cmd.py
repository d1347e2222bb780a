"""``specframe plugins``: what is installed and what each plugin registers."""

from __future__ import annotations

import json

import click
from rich.console import Console
from rich.table import Table

from specframe import plugins as plugin_manager

_KEYS = {"drafter": "drafters", "mask builder": "mask_builders", "partitioner": "partitioners", "verifier": "verifiers"}


def plugins_report() -> dict:
    """The ``--json`` document: plugin entries plus the names in each catalogue."""
    registry = plugin_manager.load()
    report: dict = {
        "plugins": [
            {
                "name": p.name,
                "distribution": p.distribution,
                "version": p.version,
                "builtin": p.builtin,
                "registers": {_KEYS[kind]: names for kind, names in p.registers.items()},
                "error": p.error,
            }
            for p in registry.plugins
        ]
    }
    for kind, key in _KEYS.items():
        report[key] = registry.names(kind)
    report["errors"] = registry.errors
    return report


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def plugins(as_json: bool) -> None:
    """List installed plugins, their distributions and what each registers.

    Plugins come from the ``specframe`` entry-point group. SPECFRAME_LOAD_PLUGINS (an allow-list of third-party
    entry-point names), SPECFRAME_DISABLE_PLUGINS (a block-list, built-ins included) and SPECFRAME_TRACE_PLUGINS=1
    change what loads.
    """
    report = plugins_report()
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        table = Table(title="specframe plugins")
        for column in ("plugin", "distribution", "version", "registers"):
            table.add_column(column)
        for p in report["plugins"]:
            registers = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in p["registers"].items())
            table.add_row(p["name"], p["distribution"], p["version"], registers or "[red]failed[/red]")
        Console().print(table)
    stderr = Console(stderr=True, highlight=False, soft_wrap=True)
    for message in report["errors"]:
        stderr.print(f"[yellow]warning:[/yellow] {message}", markup=True)
