"""``specframe export``: write a trained drafter in a checkpoint layout a serving engine loads (vLLM today).

EAGLE-3 and P-EAGLE are written in the speculators format, which vLLM serves from the folder alone
(``vllm serve EXPORT``): the folder names the verifier (``--verifier``, else the target: a local folder's absolute
path, the converted folder for ``default``, or the hub id) and the number of draft tokens (``--k``, else the
drafter's ``k_infer``). PARD is written as a plain causal LM with ``pard_token``. ``--checkpoint`` may also be a
foreign drafter folder ``specframe.vllm.imports`` reads (speculators, SafeAILab / SpecForge EAGLE-3, PARD): it is
imported and written again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import click


def target_source(target: str) -> str:
    """A loadable target folder or hub id; 'default' is the packaged SmolLM2, converted once."""
    if target == "default":
        from specframe.targets import ensure_default_target

        return str(ensure_default_target())
    return target


def load_drafter(checkpoint: str | Path, target: str | None) -> tuple[Any, Path, str, Any]:
    """The drafter of ``checkpoint`` (a training checkpoint, a run folder or an importable foreign folder) for
    ``target`` (default: the target the run recorded, or the verifier a speculators folder names): returns the
    drafter, the folder it came from, the target source and the target's tokenizer."""
    from transformers import AutoConfig, AutoTokenizer

    from specframe.engine import checkpoint as ckpt
    from specframe.errors import SpecframeError
    from specframe.vllm import imports

    foreign = imports.is_importable(checkpoint)
    directory = Path(checkpoint) if foreign else ckpt.resolve(checkpoint)
    if target is None:
        target = recorded_target(directory)
        if not target:
            raise SpecframeError(f"{directory} does not record its target; pass --target")
    source = target_source(target)
    try:
        target_config = AutoConfig.from_pretrained(source)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise SpecframeError(f"cannot load target '{target}': {exc}") from exc
    if foreign:
        drafter = imports.load_drafter(directory, target_config, tokenizer)
    else:
        drafter = ckpt.load_drafter(directory, target_config)
    return drafter, directory, source, tokenizer


def recorded_target(directory: str | Path) -> str | None:
    """The target a run's checkpoint recorded, or the verifier a speculators folder names."""
    from specframe.vllm import imports

    directory = Path(directory)
    if imports.is_importable(directory):
        return imports.named_target(directory)
    config_path = directory / "config.json"
    if not config_path.exists():
        return None
    from specframe.errors import read_json

    return read_json(config_path, "the checkpoint's run config").get("target")


def export_checkpoint(
    checkpoint: str | Path,
    output: str | Path,
    target: str | None = None,
    *,
    verifier: str | None = None,
    k: int | None = None,
) -> dict[str, Any]:
    """Export the drafter of ``checkpoint`` (a checkpoint, a run's output folder or an importable foreign folder) to
    ``output`` for vLLM; the target defaults to the one the run trained against. A speculators export names
    ``verifier`` (default: the target) and drafts ``k`` tokens (default: the drafter's). Returns the manifest plus
    ``output``, ``target`` and ``checkpoint``."""
    from specframe.errors import SpecframeError
    from specframe.vllm import export

    if k is not None and k < 1:
        raise SpecframeError(f"--k must be positive, got {k}")
    drafter, directory, source, tokenizer = load_drafter(checkpoint, target)
    manifest = drafter.export_vllm(Path(output), tokenizer)
    if not isinstance(manifest, dict) or "method" not in manifest:
        raise SpecframeError(f"drafter '{drafter.name}' export_vllm returned {manifest!r}, not a layout manifest")
    if manifest.get("layout") in export.SPECULATORS:
        manifest = export.set_serving(output, verifier=verifier or export.verifier_name(source), speculative_tokens=k)
        manifest = attrs.asdict(manifest)
    elif verifier is not None:
        raise SpecframeError(f"--verifier applies to speculators exports (EAGLE-3, P-EAGLE), not {manifest.get('layout')}")
    return {**manifest, "output": str(Path(output).resolve()), "target": source, "checkpoint": str(directory)}


@click.command("export")
@click.option("--checkpoint", required=True, type=click.Path(exists=True, file_okay=False),
              help="A training checkpoint, a run's output folder (its latest checkpoint), or a speculators / "
                   "SafeAILab / SpecForge EAGLE-3 or PARD folder to import and write again.")
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
    """Export a trained drafter for serving (vLLM: speculators EAGLE-3 / P-EAGLE, or a PARD causal LM)."""
    from specframe.vllm.export import DEFAULT_SPECULATIVE_TOKENS, speculative_config

    result = export_checkpoint(checkpoint, output, target, verifier=verifier, k=k)
    tokens = k or result.get("speculative_tokens") or DEFAULT_SPECULATIVE_TOKENS
    result["speculative_config"] = speculative_config(output, tokens)
    if as_json:
        click.echo(json.dumps(result, indent=1))
        return
    click.echo(f"wrote {result['layout']} drafter to {result['output']}")
    if result.get("verifier"):
        click.echo(f"serve it: vllm serve {result['output']}   (verifier {result['verifier']}, {tokens} draft tokens)")
        click.echo(f"      or: specframe serve --drafter {result['output']}")
    else:
        click.echo(f"serve it: specframe serve --target {result['target']} --drafter {result['output']} --k {tokens}")
    click.echo(f"explicit vLLM speculative_config (with the target as model): {json.dumps(result['speculative_config'])}")
