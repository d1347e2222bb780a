"""One peer job (issue 54, item 1): a (trainer, drafter, settings) trained on the peer data, then measured by the one
harness every row shares. See ``test_peer.py`` for the order and the files.

Settings: ``defaults`` (each trainer's own, on the same conversations, one epoch; speculators' aux layers stated only
where its default repeats a layer) and ``matched`` (the architecture both build, the preset's draft vocabulary,
sequence length, depth, peak lr, fp32, one epoch, seed 0, and specframe's optimiser and schedule: AdamW without weight
decay, 10% warmup then cosine to 0; speculators packs as many tokens a step as specframe's batches average, so both
take about as many steps; EAGLE-3's depths weighted 0.8^d on both sides; P-EAGLE's anchors uncapped on both).
What still differs at matched is listed in ``MATCHED_REMAINING`` and in every results file.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path
from typing import Any

import attrs

from harness import last_error, run_cli, run_module, training_metrics
from presets import Preset

TRAINERS = ("specframe", "speculators")
SETTINGS = ("defaults", "matched")
#: what a peer job measures: part of every key, so a change here reruns every job
SCHEMA = 2  # 2: the training record keeps the speculators settings its command was built from
#: the learning rate of the evaluation run: one step that changes nothing (specframe's evaluator reads the final
#: validation of `specframe train --init-from FOLDER --max-steps 1`)
EVAL_LR = 1e-12


def cases(preset: Preset) -> list[tuple[str, str, str]]:
    """(drafter, settings, trainer) in run order: the two trainers back to back for each drafter and settings, so
    their throughputs are measured under the same load."""
    return [(d, s, t) for d in preset.drafters for s in SETTINGS for t in TRAINERS]


def aux_layers(preset: Preset, drafter: str) -> list[int] | None:
    return preset.drafters[drafter].get("aux_layer_ids")


# ------------------------------------------------------------------------------------------------ specframe
def specframe_train_args(p: Preset, drafter: str, settings: str, target: str, cache: Path, config: Path,
                         out: Path) -> list[str]:
    """`specframe train` on the cache's first examples, one conversation per sequence, one epoch."""
    args = ["train", "--drafter", drafter, "--target", target, "--cache", str(cache), "--seq-len", str(p.seq_len),
            "--no-pack", "--epochs", "1", "--max-examples", str(p.train_examples + p.val_examples),
            "--val-examples", str(p.val_examples), "--memory-budget", p.memory_budget, "--device", p.device,
            "--eval-every", "0", "--save-every", "25", "--seed", "0", "--output", str(out), "--json"]
    options = p.train_options(drafter) if settings == "matched" else {
        k: v for k, v in p.drafters[drafter].items() if k == "aux_layer_ids"}
    if settings == "matched":
        args += ["--depth", str(p.depth), "--batch-size", str(p.batch_size), "--lr", str(p.lr)]
    _write_options(config, options)
    return [*args, "--config", str(config)]


def _write_options(path: Path, options: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("[drafter]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in sorted(options.items())))


# ------------------------------------------------------------------------------------------------ speculators
SPECULATOR_TYPE = {"peagle": "peagle", "eagle3": "eagle3"}


#: what still differs between the two trainers at matched settings (speculators 0.9.0 has no flag for these), recorded
#: in every results file beside the settings
MATCHED_REMAINING = (
    "AdamW betas: specframe (0.9, 0.95), speculators torch's default (0.9, 0.999)",
    "P-EAGLE's shared hidden state starts at N(0, 0.02) in specframe (until issue 54's ablation decides), N(0, 1) in "
    "speculators",
    "steps: specframe batches 4 conversations (one a sequence, no packing), speculators packs rows up to the matched "
    "token count; the step counts agree to within packing's rounding",
    "weights: speculators saves its checkpoint in bf16 (the drafter measured is the bf16-rounded one), specframe fp32",
)


def speculators_settings(p: Preset, drafter: str, settings: str,
                         tokens_per_step: int) -> list[tuple[str, list[str], str]]:
    """Every setting the peer job gives ``speculators train`` beyond its data, output and CPU flags, as (flag,
    values, why): the command is built from this list and the results record it, so no setting goes unlisted."""
    rows: list[tuple[str, list[str], str]] = [
        ("--epochs", ["1"], "one epoch over the training conversations, as specframe's run (its default is 20)")]
    layers = aux_layers(p, drafter)
    if layers:
        rows.append(("--target-layer-ids", list(map(str, layers)), "its default [2, L // 2, L - 3] repeats a layer "
                     "of this target, which it refuses"))
    if settings == "defaults":
        # its default 8,192 tokens a step: the full vocabulary's logits over them (P-EAGLE: about 3x that in COD
        # elements) outgrow a 23 GiB CPU machine
        rows.append(("--total-seq-len", [str(p.batch_size * p.seq_len)], "batch x seq_len tokens a packed step, not "
                     "its default 8,192, which outgrows this machine's memory at its full vocabulary"))
        return rows
    n = int(p.drafters[drafter].get("layers", 1))
    rows += [
        ("--total-seq-len", [str(tokens_per_step)], "the tokens a step of specframe's run averages, so both take "
         "about as many steps over the same epoch"),
        ("--num-layers", [str(n)], "the matched architecture"), ("--draft-arch", ["llama"], "specframe's layer"),
        ("--no-norm-before-residual", [], "specframe's layer"),
        ("--full-attention-indices", [str(i) for i in range(n)], "full attention, as specframe's layer"),
        ("--draft-vocab-size", [str(p.draft_vocab)], "the preset's draft vocabulary"),
        ("--lr", [str(p.lr)], "the preset's peak lr"), ("--seed", ["0"], "specframe's seed"),
        ("--optimizer", ["adamw"], "specframe's optimiser (its default is Muon + AdamW)"),
        ("--weight-decay", ["0"], "specframe's (0.0)"),
        ("--scheduler-type", ["cosine"], "specframe's schedule: warmup, then cosine to 0"),
        ("--scheduler-warmup-ratio", ["0.1"], "specframe's default warmup, 10% of the steps"),
    ]
    if drafter == "peagle":
        rows += [("--num-depths", [str(p.depth)], "the preset's depth"),
                 ("--max-anchors", [str(tokens_per_step)], "no cap that binds: specframe's P-EAGLE samples no "
                  "anchors (its default 512 would keep about a third of a packed step's positions)")]
    else:
        rows += [("--ttt-steps", [str(p.depth)], "the preset's depth"),
                 ("--ttt-step-loss-decay", ["0.8"], "specframe's EAGLE-3 weights depth d by 0.8^d (its default 1.0)"),
                 ("--no-norm-before-fc", [], "specframe's layer"), ("--no-norm-output", [], "specframe's layer")]
    return rows


def packed_steps(lengths: list[int], capacity: int) -> int:
    """The packed steps of rows of ``lengths`` taken in order, each step as many whole rows as fit in ``capacity``
    tokens (speculators' multipack sampler on one rank: consecutive rows of its shuffled order)."""
    steps, used = 0, capacity
    for n in lengths:
        if used + n > capacity:
            steps, used = steps + 1, 0
        used += n
    return steps


def matched_tokens_per_step(p: Preset, row_lengths: list[int]) -> int:
    """speculators' ``--total-seq-len`` at matched settings: the smallest step size (at least one whole sequence) at
    which packing the training rows takes no more steps than specframe's run (one conversation a sequence,
    ``batch_size`` a step, one epoch). The mean tokens of specframe's steps would leave packing about half a row short
    each step, and so more steps with a different schedule."""
    steps = -(-len(row_lengths) // p.batch_size)
    low, high = max(p.seq_len, -(-sum(row_lengths) // steps)), max(p.seq_len, sum(row_lengths))
    while low < high:  # packed_steps falls as the capacity grows
        mid = (low + high) // 2
        if packed_steps(row_lengths, mid) <= steps:
            high = mid
        else:
            low = mid + 1
    return low


def speculators_train_args(p: Preset, drafter: str, settings: str, target: str, data: Path, ratio: float,
                           out: Path, tokens_per_step: int) -> list[str]:
    """`speculators train` on the peer data folder, the CPU flags and ``speculators_settings``."""
    from peer_speculators import CPU_FLAGS

    args = ["train", "--speculator-type", SPECULATOR_TYPE[drafter], "--verifier-name-or-path", target,
            "--data-path", str(data), "--save-path", str(out / "ckpt"), "--train-data-ratio", repr(ratio)]
    for flag, (value, _why) in CPU_FLAGS.items():
        args += [flag, value]
    for flag, values, _why in speculators_settings(p, drafter, settings, tokens_per_step):
        args += [flag, *values]
    return args


_NUMBER = r"([0-9.]+(?:e[+-]?[0-9]+)?)"


def speculators_throughput(log: str, epoch_tokens: int | None = None) -> dict[str, Any]:
    """Training tokens and step time from speculators' per-step profile (``profile/step_ms``, ``tokens_per_s``),
    validation and checkpoint time left out, as specframe's figures leave them out. The tokens are ``epoch_tokens``
    where given (one epoch reads every training row once: exact), else rate x step time (the log's rounding)."""
    steps = [float(v) for v in re.findall(r"profile/step_ms=" + _NUMBER, log)]
    rates = [float(v) for v in re.findall(r"profile/tokens_per_s=" + _NUMBER, log)]
    if not steps or len(steps) != len(rates):
        raise RuntimeError(f"speculators' log holds {len(steps)} step times and {len(rates)} token rates: its "
                           "per-step profile could not be read, so its throughput is unknown")
    seconds = sum(steps) / 1000.0
    logged = round(sum(s / 1000.0 * r for s, r in zip(steps, rates, strict=True)))
    tokens = logged if epoch_tokens is None else epoch_tokens
    return {"steps": len(steps), "train_tokens": tokens, "profile_tokens": logged, "train_seconds": seconds,
            "tokens_per_second": tokens / seconds if seconds else None}


def run_speculators(args: list[str], *, pythonpath: Path, threads: int, log: Path) -> dict[str, Any]:
    """``python -m speculators ARGS`` against the patched copy, with its wall time and the load beside it."""
    child = run_module("speculators", args, threads=threads, log=log, shown=f"PYTHONPATH={pythonpath} ",
                       env={"PYTHONPATH": str(pythonpath), "HF_HUB_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"})
    return attrs.asdict(child)


def speculators_folder(run: Path) -> Path:
    """The last epoch's checkpoint folder of a speculators run (``ckpt/<epoch>/``)."""
    epochs = sorted((int(d.name), d) for d in (run / "ckpt").iterdir() if d.name.isdigit() and d.is_dir())
    if not epochs:
        raise RuntimeError(f"speculators wrote no checkpoint under {run / 'ckpt'}")
    return epochs[-1][1]


def import_folder(checkpoint: Path, dest: Path) -> Path:
    """The drafter of a speculators checkpoint as specframe's importer reads it: its config and weights (the pickled
    optimizer and scheduler states left behind, as speculators' own ``--from-pretrained`` reads the folder)."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(checkpoint / name, dest / name)
    return dest


def eval_options(p: Preset, drafter: str, trainer: str, settings: str, folder: Path,
                 target: str | None = None) -> dict[str, Any]:
    """The drafter options the evaluation run builds: the shape of the folder it imports (layers, vocabulary, aux
    layers, and the layer architecture where the importer reads one: ``Imported.architecture``) at the preset's
    evaluation depth."""
    if trainer == "speculators":
        cfg = json.loads((folder / "config.json").read_text())
        layer = cfg.get("transformer_layer_config") or {}
        options: dict[str, Any] = {"layers": int(layer.get("num_hidden_layers", 1)),
                                   "draft_vocab_size": int(cfg.get("draft_vocab_size")),
                                   "aux_layer_ids": list(cfg.get("eagle_aux_hidden_state_layer_ids") or [])}
        options.update(_architecture(folder, target))
    elif settings == "matched":
        options = dict(p.train_options(drafter))
    else:
        options = {k: v for k, v in p.drafters[drafter].items() if k == "aux_layer_ids"}
    for key in ("k_train", "ttt_steps", "k_infer"):
        options.pop(key, None)
    if not options.get("aux_layer_ids"):
        options.pop("aux_layer_ids", None)
    return options


def _architecture(folder: Path, target: str | None) -> dict[str, Any]:
    """The layer variants the importer reads from a speculators folder (Qwen3 q/k norms, norm placements, sliding
    window), those that differ from specframe's layer only; {} where this specframe has no such reading (its
    importer then refuses the folder, and the refusal is what the row records)."""
    from specframe.errors import SpecframeError
    from specframe.layouts import imports

    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(target) if target else None
        architecture = getattr(imports.read(folder, config), "architecture", None)
    except (SpecframeError, OSError, ValueError):
        return {}
    if not isinstance(architecture, dict):
        return {}
    return {k: v for k, v in architecture.items() if v not in (False, None)}


def evaluate(p: Preset, drafter: str, options: dict, folder: Path, target: str, cache: Path, out: Path,
             threads: int) -> dict[str, Any]:
    """specframe's validation of the drafter in ``folder`` on the held-out examples: the final evaluation of a
    one-step run at ``EVAL_LR`` warm-started from it. ``refused``: the importer's one line when it cannot read it."""
    config = out.with_suffix(".toml")
    _write_options(config, options)
    args = ["train", "--drafter", drafter, "--target", target, "--cache", str(cache), "--seq-len", str(p.seq_len),
            "--no-pack", "--max-steps", "1", "--lr", repr(EVAL_LR), "--depth", str(p.depth),
            "--max-examples", str(p.train_examples + p.val_examples), "--val-examples", str(p.val_examples),
            "--memory-budget", p.memory_budget, "--device", p.device, "--seed", "0", "--init-from", str(folder),
            "--config", str(config), "--output", str(out), "--json"]
    shutil.rmtree(out, ignore_errors=True)
    log = out.with_suffix(".log")
    child = run_cli(args, threads=threads, log=log)
    if child.exit != 0:
        return {"refused": last_error(log).removeprefix("error: "), "command": shlex.join(["specframe", *args])}
    metrics = training_metrics(out)
    final = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "val_loss" in line][-1]
    return {"run": str(out), "command": shlex.join(["specframe", *args]),
            "val_expected_al": metrics["val_expected_al"], "val_expected_al_method": metrics["val_expected_al_method"],
            "val_accuracy": metrics["val_accuracy"], "val_chain_per_sequence": final.get("val_chain_per_sequence"),
            "val_sequences": len(final.get("val_chain_per_sequence") or [])}


@attrs.frozen
class JobPaths:
    root: Path

    def run(self, drafter: str, settings: str, trainer: str) -> Path:
        return self.root / "runs" / f"{drafter}-{settings}-{trainer}"
