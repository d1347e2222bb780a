"""``specframe export``: write a trained drafter in a checkpoint layout a serving engine loads (vLLM today)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click


def target_source(target: str) -> str:
    """A loadable target folder or hub id; 'default' is the packaged SmolLM2, converted once."""
    if target == "default":
        from specframe.targets import ensure_default_target

        return str(ensure_default_target())
    return target


def export_checkpoint(checkpoint: str | Path, output: str | Path, target: str | None = None) -> dict[str, Any]:
    """Export the drafter of ``checkpoint`` (a checkpoint or a run's output folder) to ``output`` for vLLM; the
    target defaults to the one the run trained against. Returns the manifest plus ``output`` and ``target``."""
    from transformers import AutoConfig, AutoTokenizer

    from specframe.engine import checkpoint as ckpt
    from specframe.errors import SpecframeError

    directory = ckpt.resolve(checkpoint)
    if target is None:
        config_path = directory / "config.json"
        run_config = json.loads(config_path.read_text()) if config_path.exists() else {}
        target = run_config.get("target")
        if not target:
            raise SpecframeError(f"{directory} does not record its target; pass --target")
    source = target_source(target)
    try:
        target_config = AutoConfig.from_pretrained(source)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise SpecframeError(f"cannot load target '{target}': {exc}") from exc
    drafter = ckpt.load_drafter(directory, target_config)
    manifest = drafter.export_vllm(Path(output), tokenizer)
    if not isinstance(manifest, dict) or "method" not in manifest:
        raise SpecframeError(f"drafter '{drafter.name}' export_vllm returned {manifest!r}, not a layout manifest")
    return {**manifest, "output": str(Path(output).resolve()), "target": source, "checkpoint": str(directory)}


@click.command("export")
@click.option("--checkpoint", required=True, type=click.Path(exists=True, file_okay=False),
              help="A training checkpoint, or a run's output folder (its latest checkpoint).")
@click.option("--format", "fmt", type=click.Choice(["vllm"]), default="vllm", show_default=True,
              help="Checkpoint layout to write.")
@click.option("--output", required=True, type=click.Path(file_okay=False), help="Folder to write (replaced atomically).")
@click.option("--target", default=None, help="Target the drafter serves (folder, hub id or 'default'). "
              "Default: the target recorded in the run's config.")
@click.option("--k", "k", type=int, default=5, show_default=True,
              help="Draft tokens per step in the printed vLLM speculative config.")
@click.option("--json", "as_json", is_flag=True, help="Print the export's manifest and speculative config as JSON.")
def export(checkpoint: str, fmt: str, output: str, target: str | None, k: int, as_json: bool) -> None:
    """Export a trained drafter for serving (vLLM: EAGLE-3, P-EAGLE or PARD layout, by drafter)."""
    from specframe.vllm.export import speculative_config

    result = export_checkpoint(checkpoint, output, target)
    result["speculative_config"] = speculative_config(output, k)
    if as_json:
        click.echo(json.dumps(result, indent=1))
        return
    click.echo(f"wrote {result['layout']} drafter to {result['output']}")
    click.echo(f"serve it: specframe serve --target {result['target']} --drafter {result['output']} --k {k}")
    click.echo(f"vLLM speculative_config: {json.dumps(result['speculative_config'])}")
