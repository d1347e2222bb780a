"""``specframe train``: train a drafter on the shared engine."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from specframe.cli.run_options import shape_options
from specframe.cli.vllm_options import feature_engine_options
from specframe.devices import TARGET_ENGINES
from specframe.errors import UsageError


def _steps(value: str | None) -> tuple[int, ...] | None:
    """``--keep-drafter-at 180,360``: the step numbers, in order, each once."""
    if value is None:
        return None
    try:
        steps = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"--keep-drafter-at takes a comma list of step numbers, not {value!r}") from None
    return tuple(sorted(set(steps)))


@click.command("train")
@click.option("--drafter", default=None, help="Drafter plugin to train (see `specframe plugins`), e.g. peagle, its "
              "options inline as NAME:KEY=VALUE,... (peagle:layers=4,k_infer=3; over --config's drafter_options). "
              "Required, here or as `drafter` in --config.")
@click.option("--target", default="default", show_default=True,
              help="Target model: 'default' (embedded SmolLM2-135M-Instruct), a local folder or a hub id.")
@click.option("--data", default=None,
              help="Training conversations: a built-in name (default, sharegpt, gsm8k, ...), a JSON/JSONL file or a "
                   "hub dataset id. Default: 'default' unless --cache is given.")
@click.option("--cache", default=None,
              help="A feature cache written by `specframe prepare` for the same target: features are read, not "
                   "recomputed, so every drafter trains on identical inputs.")
@click.option("--seq-len", type=int, default=256, show_default=True, help="Tokens per training sequence (longer "
              "conversations are truncated; shorter ones are packed, see --pack).")
@click.option("--pack/--no-pack", default=True, show_default=True,
              help="Pack short conversations into --seq-len sequences, greedily in data order (each conversation "
                   "stays a document of its own: no attention across documents, target features computed per "
                   "conversation). --no-pack: one conversation per sequence.")
@click.option("--fsdp", is_flag=True, default=None,
              help="Under torchrun: shard the drafter's weights and AdamW state across the processes with torch's "
                   "FSDP2 instead of a full copy per process under DDP (a drafter whose optimizer state does not fit "
                   "one device). Checkpoints keep the one-process format: resume with any world size.")
@click.option("--data-workers", type=int, default=None,
              help="Processes that tokenise --data through the chat template (datasets' map, same order and result "
                   "as one). Default: 1 below 2,048 conversations, else up to 8.")
@click.option("--prefetch/--no-prefetch", default=None,
              help="Compute the next step's target features (online: the target's forward; --cache: the read) in a "
                   "background thread while this step trains. Default: on for CUDA (a side stream overlaps the "
                   "drafter's kernels), off on CPU (both would share the same cores).")
@click.option("--feature-engine", type=click.Choice(TARGET_ENGINES), default=None,
              help="Where online features (--data) come from: the target's transformers forward (default), or vLLM's "
                   "hidden-state extraction, an engine in this process whose states must first pass a parity gate "
                   "against transformers (--gate-sequences). With --cache: fill the cache with `specframe prepare "
                   "--engine vllm` instead.")
@click.option("--gate-sequences", type=int, default=None,
              help="--feature-engine vllm: conversations checked against transformers before training (default 4).")
@feature_engine_options
@shape_options(
    depth="Training depth K (elements per anchor). Default: the drafter's own k_train (`specframe plugins --options "
          "DRAFTER`; peagle and pard 8, eagle3 7, parallelspec 5).",
    mask_builder="Mask builder plugin, its options inline as NAME:KEY=VALUE,... (chunked:chunk_size=256). Default: "
                 "the fastest that trains on the device (chunked on CPU, flex on CUDA, else dense); on the CPU "
                 "its small calls then go to dense (sized_attention in --print-config).",
    partitioner="Sequence partitioner plugin (none, peagle), its options inline as NAME:KEY=VALUE,...",
    partitions="Segments per sequence (gradient accumulation within a sequence; exact).",
    memory_budget="Memory budget (8GiB, 8G, 512MiB, 1.5GB or bytes). Enforced: a configuration whose estimated peak "
                  "(see `specframe memory`) exceeds it is refused before training, and a run whose measured peak goes "
                  "over it stops after that step, keeping the last checkpoint (exit code 3).",
)
@click.option("--max-steps", type=int, default=None, help="Optimizer steps to train. Give at most one of "
              "--max-steps and --epochs; with neither, one epoch.")
@click.option("--epochs", type=float, default=None, help="Passes over the training sequences (fractions allowed): "
              "ceil(EPOCHS x train sequences / --batch-size) steps, train sequences counted after packing. "
              "Default: 1 unless --max-steps is given.")
@click.option("--batch-size", type=int, default=2, show_default=True,
              help="Sequences per optimizer step, over all ranks.")
@click.option("--lr", type=float, default=3e-4, show_default=True, help="Peak AdamW learning rate (linear warmup "
              "over --warmup-steps, then cosine decay to 0).")
@click.option("--warmup-steps", type=int, default=None,
              help="Steps of linear learning-rate warmup. Default: 10% of the steps (at least 1).")
@click.option("--warmup-ratio", type=float, default=None,
              help="Linear learning-rate warmup as a share of the run's steps (e.g. 0.04), rounded to whole steps; "
                   "give at most one of --warmup-steps and --warmup-ratio.")
@click.option("--weight-decay", type=float, default=0.0, show_default=True, help="AdamW weight decay.")
@click.option("--grad-clip", type=float, default=1.0, show_default=True,
              help="Clip the gradient's global norm to this value before each step.")
@click.option("--max-examples", type=int, default=None,
              help="Conversations read from --data or --cache. Default: all of them.")
@click.option("--val-examples", type=int, default=4, show_default=True,
              help="Held-out validation sequences: the last ones (after packing).")
@click.option("--save-every", type=int, default=0, show_default=True,
              help="Write a checkpoint every N steps (0: only at the end). The previous one is kept until the new "
                   "one is complete.")
@click.option("--keep-drafter-at", callback=lambda ctx, param, value: _steps(value), default=None,
              help="Comma list of steps whose checkpoint is also kept whole in OUTPUT/kept/step-N (the rolling "
                   "checkpoint removes earlier ones), e.g. 180,360 to measure served acceptance along the run later.")
@click.option("--eval-every", type=int, default=0, show_default=True,
              help="Validate every N steps (0: only at the end): loss, per-depth top-1 accuracy, expected AL.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of initialisation, data order and COD.")
@click.option("--log-every", type=int, default=None,
              help="Without a progress bar (stdout not a terminal, or --json: then on stderr), print a progress line "
                   "(step, loss, tokens/s, ETA) every N steps. Default: about 20 lines per run.")
@click.option("--report-to", default="none", show_default=True,
              help="Experiment trackers, a comma list: none, tensorboard (OUTPUT/tensorboard), wandb (OUTPUT/wandb; "
                   "WANDB_MODE=offline works without a network). A tracker whose library is missing is an error "
                   "before anything is written (pip install 'specframe[tensorboard]' / 'specframe[wandb]').")
@click.option("--output", "-o", default=None, type=click.Path(file_okay=False),
              help="Output directory (locked while a run writes it; a finished run refuses to be overwritten). "
                   "Required, here or as `output` in --config.")
@click.option("--init-from", default=None, type=click.Path(exists=True, file_okay=False),
              help="Warm start from a drafter folder of the ecosystem, in any format `specframe export` imports "
                   "(speculators, eagle3-flat, peagle-flat, deepspec, specforge-dspark, parallelspec, pard): a "
                   "speculators EAGLE-3 / P-EAGLE / DFlash / DSpark folder (what `specframe export` writes), a SafeAILab "
                   "or SpecForge EAGLE-3 / P-EAGLE folder, a DeepSpec or SpecForge DSpark folder, a ParallelSpec export "
                   "or a PARD causal LM of the target's tokenizer; checked against the target and the drafter's "
                   "options, loaded before step 1.")
@click.option("--resume", default=None, type=click.Path(exists=True, file_okay=False),
              help="Continue exactly from a checkpoint or an output directory (its latest checkpoint). Give the "
                   "settings the run was started with (--config OUTPUT/config.json loads them): a change in what "
                   "the steps compute (learning rate, run length, batch, data, seed, precision, the drafter's "
                   "options, ...) is refused, naming each setting; output, logging, saving, the device and the mask "
                   "builder may change.")
@click.option("--allow-changed-settings", is_flag=True,
              help="With --resume: continue under settings that differ from the run's recorded ones (each change "
                   "is printed and kept in OUTPUT/config.json as changed_on_resume). For a new run that starts from "
                   "a trained drafter's weights use --init-from.")
@click.option("--config", "config_file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="A whole run in one TOML, YAML or JSON file: every option above by its name (seq_len or "
                   "seq-len), plus the plugin option tables drafter_options, mask_builder_options and "
                   "partitioner_options (older names: [drafter], [mask_builder], [partitioner]). Flags you type "
                   "override the file. A run's OUTPUT/config.json and --print-config's output load back as is.")
@click.option("--print-config", is_flag=True,
              help="Print the resolved configuration (YAML; JSON with --json) and exit without training or writing "
                   "anything. Resolved without loading the target: the depth, mask builder and every plugin option; "
                   "null values (warmup_steps, target-dependent plugin options such as aux_layer_ids) are decided "
                   "when the run starts.")
@click.option("--device", default="auto", show_default=True,
              help="Torch device: auto (CUDA when available, else cpu), cpu, cuda, cuda:N. Under torchrun 'cuda' "
                   "is each process's LOCAL_RANK GPU.")
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16"]), default="fp32", show_default=True,
              help="Precision of training (autocast over fp32 master weights and AdamW state, fp32 log-softmax in "
                   "the loss; fp16 with a gradient scaler) and of the target's weights.")
@click.option("--trust-remote-code", is_flag=True,
              help="Run the target repository's own Python code (off unless given).")
@click.option("--device-map", default=None,
              help="Spread the target over every visible GPU (transformers' device_map: auto, balanced, "
                   "sequential) instead of --device; one process only. For many processes prepare a cache this way "
                   "and train from it.")
@click.option("--chat-template", default=None, type=click.Path(exists=True, dir_okay=False),
              help="A Jinja chat template file replacing the target tokenizer's.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (and no progress bar).")
@click.option("--profile", is_flag=True, help="Time every phase of training (data, forward, loss, backward, "
              "optimizer, eval, checkpoint) and print the table at the end (under --json: as 'profile', and the "
              "unrounded seconds per phase as 'profile_seconds').")
@click.pass_context
def train(ctx: click.Context, resume: str | None, allow_changed_settings: bool, config_file: str | None,
          print_config: bool, as_json: bool, profile: bool, **flags: Any) -> None:
    """Train a drafter on the shared long-context engine.

    Every run writes OUTPUT/config.json (the resolved config), OUTPUT/metrics.jsonl and checkpoints
    OUTPUT/step-N (drafter weights in safetensors + JSON, optimizer/scheduler/RNG state, data position).
    """
    from click.core import ParameterSource

    from specframe.engine import run_config

    known = run_config.fields()
    unknown = sorted(name for name in flags if name not in known)
    if unknown:  # every flag other than --resume / --allow-changed-settings / --config / --print-config / --json
        # / --profile is a TrainConfig field
        raise UsageError(f"internal: train flags without a TrainConfig field: {', '.join(unknown)}")
    typed = {name: value for name, value in flags.items()
             if ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)}
    file_values = run_config.load(config_file) if config_file else {}
    values = run_config.merge(file_values, typed)
    where = f"--config {config_file}" if config_file else "train options"
    placeholder = print_config and values.get("output") is None
    if placeholder:  # --print-config needs no output directory; the printed file then has none
        values["output"] = ""
    # the run's names are resolved here, once: the resolved run goes on to the engine, and from it to the memory
    # estimate
    run = run_config.resolve_run(run_config.build(values, where), f"--config {config_file}" if config_file else None)
    cfg = run.config
    if print_config:
        data = run_config.as_dict(cfg)
        if placeholder:
            del data["output"]
        click.echo(run_config.dump(data, "json" if as_json else "yaml"), nl=False)
        if as_json:
            click.echo()
        return
    if allow_changed_settings and resume is None:
        raise UsageError(f"{run_config.ALLOW_CHANGED} continues a run under new settings: give it with --resume")
    if resume is not None:
        # refused here, before the cache or the target is opened; the engine checks again (its Python callers)
        _, _, changes = run_config.check_resume(resume, run, allow_changed_settings)
        if changes:
            click.echo(f"warning: --resume {resume} continues under changed settings (kept in config.json as "
                       f"{run_config.CHANGED_RECORD}): {run_config.describe_changes(changes)}", err=True)
    from specframe.engine import train as run_training

    # a progress bar on a terminal; otherwise plain lines, so a log file or a pipe shows progress too (stderr under
    # --json, whose stdout is the result alone)
    bar = not as_json and sys.stdout.isatty()
    lines = None if bar else (lambda line: click.echo(line, err=as_json))
    engine_record = None
    if cfg.cache:  # a cache filled by another engine says so, with the parity gate it passed
        from specframe.cache import FeatureCache
        from specframe.feature_gate import describe_engine

        engine_record = FeatureCache(cfg.cache).engine
        if engine_record is not None:
            click.echo(f"cache {cfg.cache}: {describe_engine(engine_record)}", err=as_json)
    result = run_training(run, resume=resume, progress=bar, log_lines=lines, profile=profile,
                          allow_changed=allow_changed_settings)
    summary = {
        "steps": result.steps,
        "checkpoint": str(result.checkpoint),
        "final_train_loss": result.final_train_loss,
        "eval": result.last_eval,
    }
    if engine_record is not None:
        summary["cache_engine"] = engine_record
    if result.profile is not None:
        summary["profile"] = result.profile
        summary["profile_seconds"] = result.profile_seconds
    if as_json:
        click.echo(json.dumps(summary, indent=1))
    else:
        click.echo(f"trained {result.steps} steps; checkpoint {result.checkpoint}")
        if result.last_eval:
            ev = result.last_eval
            accs = " ".join(f"{a:.3f}" for a in ev["val_accuracy"])
            click.echo(f"validation loss {ev['val_loss']:.4f}; top-1 by depth {accs}; "
                       f"expected AL {ev['val_expected_al']:.3f}")
        if result.profile is not None:
            click.echo(result.profile)
