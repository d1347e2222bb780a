"""``specframe memory``: the estimated peak memory of a training step, and whether it fits a budget."""

from __future__ import annotations

import json
from pathlib import Path

import click

from specframe.cli.run_options import read_config, shape_options


def _target_config(target: str):
    from transformers import AutoConfig

    from specframe.errors import SpecframeError

    if target == "default":
        from specframe.targets import ensure_default_target

        source = str(ensure_default_target())
    else:
        source = target
    try:
        return AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise SpecframeError(f"cannot read the config of target '{target}': {exc}") from exc


@click.command("memory")
@click.option("--drafter", required=True, help="Drafter plugin (see `specframe plugins`), e.g. peagle, its options "
              "inline as NAME:KEY=VALUE,... (peagle:layers=4; over --config's drafter_options).")
@click.option("--seq-len", type=int, required=True, help="Tokens per training sequence (L).")
@shape_options(
    depth="Training depth K. Default: the drafter's own (peagle: 8).",
    mask_builder="Mask builder (dense, precomputed, chunked, flex), its options inline as NAME:KEY=VALUE,... Default: "
                 "the one `specframe train` would pick for --device (chunked on CPU).",
    partitioner="Sequence partitioner (none, peagle), its options inline as NAME:KEY=VALUE,...",
    partitions="Segments per sequence (S).",
    memory_budget="Budget to check against (8GiB, 8G, 512MiB, 1.5GB or bytes); adds `fits` and, when it does not "
                  "fit, what would (largest --seq-len, partitions, mask builder).",
)
@click.option("--target", default="default", show_default=True,
              help="Target whose shapes size the drafter: 'default' (SmolLM2-135M-Instruct), a folder or a hub id "
                   "(only its config is read).")
@click.option("--features", type=click.Choice(["online", "cache", "synthetic"]), default="online", show_default=True,
              help="Where features come from: online (target in memory, features of every sequence memoised), "
                   "cache (--cache: target in memory, features read per step) or synthetic (target lm_head only).")
@click.option("--sequences", type=click.IntRange(min=1), default=1, show_default=True,
              help="Training sequences whose features stay in memory (online memoises every one it has seen).")
@click.option("--config", "config_file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="A `specframe train --config` run file (TOML, YAML or JSON); only its plugin option tables "
                   "drafter_options and mask_builder_options are read (e.g. activation_checkpointing, "
                   "draft_vocab_size, chunk_size: `specframe plugins --options NAME` lists them).")
@click.option("--device", default="cpu", show_default=True,
              help="Torch device the run would use (cpu, cuda, or auto: this machine's). On CUDA the estimate has no "
                   "CPU process baseline and the guard reads torch.cuda.max_memory_allocated.")
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16"]), default="fp32", show_default=True,
              help="The run's --dtype: activations and target weights in it, drafter weights and AdamW state fp32.")
@click.option("--fsdp-ranks", type=int, default=1, show_default=True,
              help="The ranks a `train --fsdp` run shards the drafter over: AdamW's moments split among them, each "
                   "keeping a weight shard beside the whole copy a forward gathers. 1: unsharded (one process, DDP).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON: peak_bytes, breakdown, and fits / advice.")
def memory(
    drafter: str, seq_len: int, depth: int | None, mask_builder: str | None, partitioner: str, partitions: int,
    memory_budget: str | None, target: str, features: str, sequences: int, config_file: str | None, device: str,
    dtype: str, fsdp_ranks: int, as_json: bool,
) -> None:
    """Estimate the peak memory of one training step before training.

    The estimate adds the process baseline, target and drafter weights, gradients and AdamW state, features held in
    memory, and the largest segment's activations, attention scratch and loss, with element counts from the real
    COD sampler and partitioner up to 8,192 tokens and in closed form beyond, so any length answers at once (see
    specframe.memory). `specframe train --memory-budget` applies the same check.
    """
    from specframe import memory as mem
    from specframe.engine import run_config
    from specframe.errors import UsageError

    if seq_len < 2:
        raise UsageError(f"--seq-len must be at least 2, got {seq_len}")
    if partitions < 1:
        raise UsageError(f"--partitions must be positive, got {partitions}")
    if fsdp_ranks < 1:
        raise UsageError(f"--fsdp-ranks must be positive, got {fsdp_ranks}")
    limit = mem.parse_size(memory_budget) if memory_budget is not None else None
    if device == "auto":
        from specframe.devices import resolve_device

        device = resolve_device(device).type
    # a component named with its options inline: those go over the file's table
    named = run_config.inline_options({"drafter": drafter, "mask_builder": mask_builder, "partitioner": partitioner,
                                       **(read_config(Path(config_file)) if config_file else {})})
    drafter, mask_builder, partitioner = named["drafter"], named["mask_builder"], named["partitioner"]
    options = {table: named[table] for table in run_config.PLUGIN_TABLES if table in named}
    if mask_builder is None:
        from specframe.masks import default_mask_builder

        mask_builder = default_mask_builder(device)
    cfg = mem.MemoryConfig(
        drafter=drafter, target_config=_target_config(target), seq_len=seq_len, depth=depth,
        mask_builder=mask_builder, partitioner=partitioner, partitions=partitions,
        drafter_options=options.get("drafter_options", {}),
        mask_builder_options=options.get("mask_builder_options", {}), features=features, sequences=sequences,
        device=device, dtype=dtype, shards=fsdp_ranks, partitioner_options=options.get("partitioner_options", {}),
    )
    est = mem.estimate(cfg)
    result = {"peak_bytes": est.peak_bytes, "peak": mem.format_size(est.peak_bytes), **est.to_dict()}
    if limit is not None:
        result["budget_bytes"] = limit
        result["fits"] = est.peak_bytes <= limit
        result["advice"] = [] if result["fits"] else mem.advice(cfg, limit)
    if as_json:
        click.echo(json.dumps(result, indent=1))
        return
    click.echo(f"estimated peak {mem.format_size(est.peak_bytes)} ({est.elements} elements, {est.segments} "
               f"segment(s), largest forwards {est.largest_segment['forwarded']})")
    for key, value in est.breakdown.items():
        click.echo(f"  {key:<26}{mem.format_size(value):>12}")
    for note in est.notes:
        click.echo(f"note: {note}")
    if limit is not None:
        verdict = "fits" if result["fits"] else "does NOT fit"
        click.echo(f"{verdict} in {mem.format_size(limit)}")
        for line in result["advice"]:
            click.echo(f"  {line}")
