"""``specframe export``: write a trained drafter in a checkpoint layout a serving engine loads (vLLM today).

The drafter picks its layout (``specframe.layouts.table``; the command's help lists them, and a test keeps that list
equal to the table). EAGLE-3, P-EAGLE, DFlash and DSpark are written in the speculators format, which vLLM serves
from the folder alone (``vllm serve EXPORT``): the folder names the verifier (``--verifier``, else the target: a
local folder's absolute path, the converted folder for ``default``, or the hub id) and the number of draft tokens
(``--k``, else the drafter's ``k_infer``). PARD is written as a plain causal LM with ``pard_token``, ParallelSpec as
its EAGLE backbone with mask embeddings; both are served beside the target. ``--checkpoint`` may also be a foreign
drafter folder ``specframe.layouts.imports`` reads (its formats, listed in the help likewise): it is imported and
written again. The verifier and ``--k`` reach the drafter's writer (``api.Serving``), which writes ``config.json``
once; the speculative config printed is built from the manifest it returns.
"""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command("export")
@click.option("--checkpoint", required=True, type=click.Path(exists=True, file_okay=False),
              help="A training checkpoint, a run's output folder (its latest checkpoint), or a drafter folder to "
                   "import and write again (formats: speculators, eagle3-flat, peagle-flat, deepspec, "
                   "specforge-dspark, parallelspec, pard).")
@click.option("--format", "fmt", type=click.Choice(["vllm"]), default="vllm", show_default=True,
              help="Checkpoint layout to write.")
@click.option("--output", required=True, type=click.Path(file_okay=False), help="Folder to write (replaced atomically).")
@click.option("--target", default=None, help="Target the drafter serves (folder, hub id or 'default'). "
              "Default: the target recorded in the run's config (or the verifier a speculators folder names).")
@click.option("--verifier", default=None,
              help="The verifier a speculators export names (what `vllm serve EXPORT` starts). Default: the target "
                   "(a local folder as its absolute path, 'default' as its converted folder, else the hub id).")
@click.option("--k", "k", type=int, default=None,
              help="Draft tokens per step written into a speculators export and used in the printed vLLM "
                   "speculative config. Default: the drafter's k_infer.")
@click.option("--json", "as_json", is_flag=True, help="Print the export's manifest and speculative config as JSON.")
def export(checkpoint: str, fmt: str, output: str, target: str | None, verifier: str | None, k: int | None,
           as_json: bool) -> None:
    """Export a trained drafter for serving in vLLM, in its drafter's layout: eagle3, peagle, dflash or dspark (the
    speculators format, served from the folder alone), pard or parallelspec (served beside the target)."""
    from specframe.drafter_folders import export_checkpoint
    from specframe.layouts.export import DEFAULT_SPECULATIVE_TOKENS

    exported = export_checkpoint(checkpoint, output, target, verifier=verifier, k=k)
    manifest = exported.manifest  # the writer's, for what it wrote: the folder is not read back
    result = exported.as_dict()
    tokens = k or manifest.speculative_tokens or DEFAULT_SPECULATIVE_TOKENS
    result["speculative_config"] = manifest.speculative_config(output, tokens)
    if as_json:  # for a program: the verifier's path is in the document
        click.echo(json.dumps(result, indent=1))
        return
    local = result.get("verifier")
    if local and Path(local).is_absolute():  # how verifier_name writes a local folder: valid on this machine only
        click.echo(f"note: the export names its verifier by this machine's path {local}; to serve it elsewhere, "
                   "export with --verifier set to a hub id or that machine's path", err=True)
    click.echo(f"wrote {result['layout']} drafter to {result['output']}")
    if result.get("verifier"):
        click.echo(f"serve it: vllm serve {result['output']}   (verifier {result['verifier']}, {tokens} draft tokens)")
        click.echo(f"      or: specframe serve --drafter {result['output']}")
    else:
        click.echo(f"serve it: specframe serve --target {result['target']} --drafter {result['output']} --k {tokens}")
    click.echo(f"explicit vLLM speculative_config (with the target as model): {json.dumps(result['speculative_config'])}")
