"""``specframe train``: train a drafter on the shared engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from specframe.errors import UsageError

CONFIG_SECTIONS = {"drafter": "drafter_options", "mask_builder": "mask_builder_options", "partitioner": "partitioner_options"}


def read_config(path: Path) -> dict[str, dict[str, Any]]:
    """Plugin options from a TOML or YAML file with tables ``[drafter]``, ``[mask_builder]``, ``[partitioner]``."""
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix.lower() == ".toml":
            import tomllib

            data = tomllib.loads(text)
        elif path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            raise UsageError(f"--config {path}: use a .toml, .yaml or .yml file")
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - tomllib and yaml raise their own error types
        raise UsageError(f"--config {path} is not valid: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"--config {path} must hold tables, got {type(data).__name__}")
    out: dict[str, dict[str, Any]] = {}
    for key, value in data.items():
        section = key.replace("-", "_")
        if section not in CONFIG_SECTIONS:
            raise UsageError(
                f"--config {path}: unknown table '{key}' (known: {', '.join(sorted(CONFIG_SECTIONS))})"
            )
        if not isinstance(value, dict):
            raise UsageError(f"--config {path}: '{key}' must be a table of options")
        out[CONFIG_SECTIONS[section]] = value
    return out


@click.command("train")
@click.option("--drafter", required=True, help="Drafter plugin to train (see `specframe plugins`), e.g. peagle.")
@click.option("--target", default="default", show_default=True,
              help="Target model: 'default' (embedded SmolLM2-135M-Instruct), a local folder or a hub id.")
@click.option("--data", default=None,
              help="Training conversations: a built-in name (default, sharegpt, gsm8k, ...), a JSON/JSONL file or a "
                   "hub dataset id. Default: 'default' unless --cache is given.")
@click.option("--cache", default=None,
              help="A feature cache written by `specframe prepare` for the same target: features are read, not "
                   "recomputed, so every drafter trains on identical inputs.")
@click.option("--seq-len", type=int, default=256, show_default=True, help="Tokens per training sequence (longer "
              "conversations are truncated).")
@click.option("--depth", type=int, default=None, help="Training depth K (elements per anchor). Default: the "
              "drafter's own (peagle: k_train = 8).")
@click.option("--mask-builder", default=None, help="Mask builder plugin. Default: the fastest that trains on the "
              "device (chunked on CPU, flex on CUDA, else dense).")
@click.option("--partitioner", default="none", show_default=True, help="Sequence partitioner plugin (none, peagle).")
@click.option("--partitions", type=int, default=1, show_default=True,
              help="Segments per sequence (gradient accumulation within a sequence; exact).")
@click.option("--memory-budget", default=None, help="Memory budget (8GiB, 8G, 512MiB, 1.5GB or bytes). Enforced: "
              "a configuration whose estimated peak (see `specframe memory`) exceeds it is refused before training, "
              "and a run whose measured peak goes over it stops after that step, keeping the last checkpoint "
              "(exit code 3).")
@click.option("--max-steps", type=int, default=30, show_default=True, help="Optimizer steps to train.")
@click.option("--batch-size", type=int, default=2, show_default=True,
              help="Sequences per optimizer step, over all ranks.")
@click.option("--lr", type=float, default=3e-4, show_default=True, help="Peak AdamW learning rate (linear warmup "
              "over 10% of the steps, then cosine decay to 0).")
@click.option("--max-examples", type=int, default=200, show_default=True,
              help="Conversations read from --data (the last --val-examples are held out for validation).")
@click.option("--val-examples", type=int, default=4, show_default=True, help="Held-out validation sequences.")
@click.option("--save-every", type=int, default=0, show_default=True,
              help="Write a checkpoint every N steps (0: only at the end). The previous one is kept until the new "
                   "one is complete.")
@click.option("--eval-every", type=int, default=0, show_default=True,
              help="Validate every N steps (0: only at the end): loss, per-depth top-1 accuracy, expected AL.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of initialisation, data order and COD.")
@click.option("--output", "-o", required=True, type=click.Path(file_okay=False),
              help="Output directory (locked while a run writes it; a finished run refuses to be overwritten).")
@click.option("--resume", default=None, type=click.Path(exists=True, file_okay=False),
              help="Continue exactly from a checkpoint or an output directory (its latest checkpoint).")
@click.option("--config", "config_file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="TOML or YAML with plugin option tables [drafter], [mask_builder], [partitioner].")
@click.option("--device", default="cpu", show_default=True, help="Torch device (cpu, cuda).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (and no progress bar).")
def train(
    drafter: str, target: str, data: str | None, cache: str | None, seq_len: int, depth: int | None,
    mask_builder: str | None, partitioner: str, partitions: int, memory_budget: str | None, max_steps: int,
    batch_size: int, lr: float, max_examples: int, val_examples: int, save_every: int, eval_every: int, seed: int,
    output: str, resume: str | None, config_file: str | None, device: str, as_json: bool,
) -> None:
    """Train a drafter on the shared long-context engine.

    Every run writes OUTPUT/config.json (the resolved config), OUTPUT/metrics.jsonl and checkpoints
    OUTPUT/step-N (drafter weights in safetensors + JSON, optimizer/scheduler/RNG state, data position).
    """
    from specframe.engine import TrainConfig, train as run_training

    options = read_config(Path(config_file)) if config_file else {}
    if data is None and cache is None:
        data = "default"
    cfg = TrainConfig(
        drafter=drafter, output=output, target=target, data=data, cache=cache, seq_len=seq_len, depth=depth,
        mask_builder=mask_builder, partitioner=partitioner, partitions=partitions, memory_budget=memory_budget,
        max_steps=max_steps, batch_size=batch_size, lr=lr, max_examples=max_examples, val_examples=val_examples,
        save_every=save_every, eval_every=eval_every, seed=seed, device=device, **options,
    )
    result = run_training(cfg, resume=resume, progress=not as_json)
    summary = {
        "steps": result.steps,
        "checkpoint": str(result.checkpoint),
        "final_train_loss": result.final_train_loss,
        "eval": result.last_eval,
    }
    if as_json:
        click.echo(json.dumps(summary, indent=1))
    else:
        click.echo(f"trained {result.steps} steps; checkpoint {result.checkpoint}")
        if result.last_eval:
            ev = result.last_eval
            accs = " ".join(f"{a:.3f}" for a in ev["val_accuracy"])
            click.echo(f"validation loss {ev['val_loss']:.4f}; top-1 by depth {accs}; "
                       f"expected AL {ev['val_expected_al']:.3f}")
