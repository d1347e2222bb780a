"""The options of a training run that ``specframe train`` and ``specframe memory`` share: the run's shape (depth,
mask builder, partitioner, partitions, memory budget: ``shape_options``) and the plugin option tables of a
``--config`` run file (``read_config``).

A component named here takes its options inline, ``--mask-builder chunked:chunk_size=256`` as ``--drafter
peagle:layers=4``: the one syntax every command reads (``specframe.compose.named``). Each command keeps its own help
for an option: ``memory`` describes what a value costs, ``train`` what it does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

def read_config(path: Path) -> dict[str, dict[str, Any]]:
    """The plugin option tables of a run file (``specframe memory --config``): ``drafter_options``,
    ``mask_builder_options``, ``partitioner_options`` (older tables ``[drafter]``, ... included); the file's other
    keys are checked but not returned."""
    from specframe.engine import run_config

    values = run_config.check_plugin_tables(run_config.load(path))
    return {table: values[table] for table in run_config.PLUGIN_TABLES if table in values}


def shape_options(*, depth: str, mask_builder: str, partitioner: str, partitions: str, memory_budget: str):
    """``--depth``, ``--mask-builder``, ``--partitioner``, ``--partitions`` and ``--memory-budget`` (names, types and
    defaults shared; each argument is the command's help for that option), in that order."""
    options = [
        click.option("--depth", type=int, default=None, help=depth),
        click.option("--mask-builder", default=None, help=mask_builder),
        click.option("--partitioner", default="none", show_default=True, help=partitioner),
        click.option("--partitions", type=int, default=1, show_default=True, help=partitions),
        click.option("--memory-budget", default=None, help=memory_budget),
    ]

    def decorate(fn):
        for option in reversed(options):
            fn = option(fn)
        return fn

    return decorate
