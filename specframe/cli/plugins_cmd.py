"""``specframe plugins``: what is installed and what each plugin registers."""

from __future__ import annotations

import json

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

_KEYS = {"drafter": "drafters", "mask builder": "mask_builders", "partitioner": "partitioners", "verifier": "verifiers"}


def plugins_report() -> dict:
    """The ``--json`` document: plugin entries plus the names in each catalogue."""
    # here, not at import: loading the plugins imports the API and torch, which `specframe --help` must not pay for
    from specframe import plugins as plugin_manager

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


def _print_options(name: str, kind: str | None, as_json: bool) -> None:
    from specframe import plugin_options

    entries = plugin_options.report(name, kind)
    if as_json:
        click.echo(json.dumps({"name": name, "components": entries}, indent=2))
        return
    console = Console(highlight=False, soft_wrap=True)
    for entry in entries:
        title = f"{entry['kind']} '{entry['name']}' (plugin {entry['plugin']})"
        if entry["kind"] != "verifier":
            title += f": the [{entry['kind'].replace(' ', '_')}_options] table of `specframe train --config`"
        table = Table(title=escape(title))
        for column in ("option", "type", "default", "help"):
            table.add_column(column, overflow="fold")
        for o in entry["options"]:
            default = "(required)" if o["required"] else json.dumps(o["default"])
            help_text = escape(o["help"]) or "[red](no help)[/red]"
            table.add_row(escape(o["name"]), escape(o["type"]), escape(default), help_text)
        if entry["options"]:
            if entry["description"]:
                console.print(entry["description"], markup=False)
            console.print(table)
        else:
            console.print(f"{title}: no options", markup=False)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.option("--options", "options_of", metavar="NAME", default=None,
              help="List the options of the drafter, mask builder, partitioner or verifier NAME (type, default, "
                   "help) instead of the plugins. A name registered for several kinds lists each.")
@click.option("--kind", type=click.Choice(sorted(_KEYS)), default=None,
              help="With --options: only the component of this kind.")
def plugins(as_json: bool, options_of: str | None, kind: str | None) -> None:
    """List installed plugins, their distributions and what each registers.

    Plugins come from the ``specframe`` entry-point group. SPECFRAME_LOAD_PLUGINS (an allow-list of third-party
    entry-point names), SPECFRAME_DISABLE_PLUGINS (a block-list, built-ins included) and SPECFRAME_TRACE_PLUGINS=1
    change what loads.
    """
    if options_of is not None:
        _print_options(options_of, kind, as_json)
        return
    if kind is not None:
        raise click.UsageError("--kind goes with --options NAME")
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
