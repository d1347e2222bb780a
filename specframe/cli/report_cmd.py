"""``specframe report``: results directory -> markdown report with tables and plots."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command()
@click.argument("results_dir", type=click.Path(path_type=Path))
@click.option("--compare", "other", type=click.Path(path_type=Path), default=None,
              help="A second results directory: write a page comparing every figure the two have in common.")
@click.option("--output", type=click.Path(path_type=Path), default=None,
              help="Where to write the markdown (default: RESULTS_DIR/report.md, or OTHER/compare-<name>.md).")
@click.option("--summary", is_flag=True,
              help="Print the answer (the page's first section: rankings, fastest method, verdicts) to the terminal "
                   "instead of writing the page.")
@click.option("--json", "as_json", is_flag=True, help="Print the written path as JSON.")
def report(results_dir: Path, other: Path | None, output: Path | None, summary: bool, as_json: bool) -> None:
    """Turn RESULTS_DIR's results files into a markdown page with tables and PNG plots.

    Results files without provenance (commit, command, target hash, token budget) are refused.
    """
    from specframe import report as reporting
    from specframe.errors import UsageError

    if summary:
        if other or output or as_json:
            raise UsageError("--summary prints the answer only: drop --compare, --output and --json")
        click.echo("\n".join(reporting.summary(results_dir)).rstrip())
        return
    path = reporting.render_comparison(results_dir, other, output) if other else reporting.render(results_dir, output)
    click.echo(json.dumps({"report": str(path)}) if as_json else f"wrote {path}")
