"""The bad-input catalogue (docs/bad-inputs.md), row by row, through the real CLI.

Every row must end in exactly the documented ``error: ...`` line on stderr, a non-zero exit, no traceback, and an
output directory that is byte-for-byte what it was (or still absent). The table in the doc and ``CASES`` here are
compared by a test, so neither can drift from the other. Paths in messages are written as ``{name}`` placeholders.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
from click.testing import CliRunner

from specframe.cli import main
from specframe.engine import checkpoint as ckpt
from tests.train_fixtures import build

DOC = Path(__file__).resolve().parents[2] / "docs" / "bad-inputs.md"


@attrs.frozen
class Case:
    id: str
    what: str
    message: str
    args: Callable[[dict], list]
    prepare: Callable[[dict], None] = lambda ctx: None


def train(ctx, *extra, data="{chat}", drafter="peagle", output="{out}"):
    return ["train", "--drafter", drafter, "--target", "{target}", "--data", data, "--seq-len", 48,
            "--output", output, "--config", "{config}", "--mask-builder", "dense", "--max-steps", 1,
            "--max-examples", 6, *extra]


def lower_line_cap(ctx, name: str, text: str) -> None:
    import specframe.data.sources as sources

    ctx["monkeypatch"].setattr(sources, "MAX_LINE_CHARS", 100)
    write(name, text)(ctx)


def write(name: str, text: str | bytes) -> Callable[[dict], None]:
    def prepare(ctx):
        p = ctx["tmp"] / name
        p.write_bytes(text) if isinstance(text, bytes) else p.write_text(text)

    return prepare


def chat_line(*turns) -> str:
    return json.dumps({"messages": [{"role": r, "content": c} for r, c in turns]}) + "\n"


def truncate_weights(ctx):
    d = ctx["tmp"] / "ckpt"
    shutil.copytree(ctx["checkpoint"], d)
    w = d / "model.safetensors"
    w.write_bytes(w.read_bytes()[:100])


def pickled_weights(ctx):
    import torch

    d = ctx["tmp"] / "ckpt"
    shutil.copytree(ctx["checkpoint"], d)
    torch.save({"w": torch.zeros(2)}, d / "model.safetensors")


def damage(name: str, text: str = '{"drafter": "peagle", "step') -> Callable[[dict], None]:
    """A copy of the test checkpoint ({tmp}/ckpt) whose ``name`` was cut short (a disk that filled, a bad copy)."""

    def prepare(ctx):
        d = ctx["tmp"] / "ckpt"
        shutil.copytree(ctx["checkpoint"], d)
        (d / name).write_text(text)

    return prepare


def damaged_manifest(ctx):
    shutil.copytree(ctx["cache"], ctx["tmp"] / "cache")
    (ctx["tmp"] / "cache" / "manifest.json").write_text('{"complete": true, "shards": [')


def generate(*extra):
    return ["generate", "--checkpoint", "{tmp}/ckpt", "--target", "{target}", "--prompt", "hi",
            "--max-new-tokens", 4, *extra]


def existing_run(ctx):
    shutil.copytree(ctx["run"], ctx["out"])


def truncated_export(ctx):
    shutil.copytree(ctx["export"], ctx["out"])
    w = ctx["out"] / "model.safetensors"
    w.write_bytes(w.read_bytes()[:100])


def serve(*extra):
    return ["serve", "--drafter", "{out}", "--print-command", *extra]


def export_copy(edit: Callable[[Path], None]) -> Callable[[dict], None]:
    """A copy of the test's (speculators-format P-EAGLE) export at {tmp}/imp, changed by ``edit``."""

    def prepare(ctx):
        shutil.copytree(ctx["export"], ctx["tmp"] / "imp")
        edit(ctx["tmp"] / "imp")

    return prepare


def drop_tensor(name: str) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        from safetensors.torch import load_file, save_file

        w = load_file(str(folder / "model.safetensors"))
        del w[name]
        save_file(w, str(folder / "model.safetensors"))

    return edit


def swap_two_tokens(folder: Path) -> None:
    """Another tokenizer of the same size: two ordinary tokens trade ids."""
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = [t for t, i in sorted(vocab.items(), key=lambda x: x[1]) if i >= 20][:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (folder / "tokenizer.json").write_text(json.dumps(data))


def set_config(**values) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(values)
        (folder / "config.json").write_text(json.dumps(cfg))

    return edit


def set_layer_config(**values) -> Callable[[Path], None]:
    """An export whose speculators transformer_layer_config (the drafter's layer fields) has ``values``."""

    def edit(folder: Path) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        cfg["transformer_layer_config"].update(values)
        (folder / "config.json").write_text(json.dumps(cfg))

    return edit


def dflash_folder(**values) -> Callable[[dict], None]:
    """A speculators DFlash folder for the test's target at {tmp}/imp (one layer, zero weights: the refusals below
    come before any weight is used), its config.json then updated with ``values``."""

    def prepare(ctx):
        import torch
        from transformers import AutoConfig

        from specframe.drafting.modeling import LayerShape
        from specframe.layouts import export

        config = AutoConfig.from_pretrained(ctx["target"])
        s = LayerShape.from_config(config)
        h, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
        shapes = {"fc.weight": (h, 2 * h), "hidden_norm.weight": (h,), "norm.weight": (h,),
                  "layers.0.self_attn.q_proj.weight": (q, h), "layers.0.self_attn.k_proj.weight": (kv, h),
                  "layers.0.self_attn.v_proj.weight": (kv, h), "layers.0.self_attn.o_proj.weight": (h, q),
                  "layers.0.self_attn.q_norm.weight": (s.head_dim,), "layers.0.self_attn.k_norm.weight": (s.head_dim,),
                  "layers.0.input_layernorm.weight": (h,), "layers.0.post_attention_layernorm.weight": (h,),
                  "layers.0.mlp.gate_proj.weight": (s.intermediate, h), "layers.0.mlp.up_proj.weight": (s.intermediate, h),
                  "layers.0.mlp.down_proj.weight": (h, s.intermediate)}
        export.write_dflash(ctx["tmp"] / "imp", {k: torch.zeros(v) for k, v in shapes.items()},
                            config=export.llama_config(config, 1, **s.config_fields()), aux_layer_ids=[1, 3],
                            target_hidden_size=h, mask_token_id=3, block_size=4, target_num_layers=4,
                            verifier=str(ctx["target"]))
        set_config(**values)(ctx["tmp"] / "imp")

    return prepare


def add_pickle(name: str) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        import torch

        torch.save({"fc.weight": torch.zeros(2)}, folder / name)

    return edit


def distributed_env(monkeypatch, **values) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, value)


CASES = [
    Case("data-missing", "--data names no file",
         "error: data '{tmp}/nope.jsonl' is neither a built-in name (sharegpt, gsm8k, gsm8k-eval, "
         "mt-bench, humaneval, default, large), a file or datasets folder, nor a hub id (NAME, NAME:CONFIG or "
         "NAME:CONFIG:SPLIT)", lambda c: train(c, data="{tmp}/nope.jsonl")),
    Case("data-empty", "an empty --data file",
         "error: {tmp}/empty.jsonl holds no conversations", lambda c: train(c, data="{tmp}/empty.jsonl"),
         write("empty.jsonl", "")),
    Case("data-not-json", "a --data line that is not JSON",
         "error: {tmp}/bad.jsonl:1: malformed JSON line (Expecting value: line 2 column 1 (char 15))",
         lambda c: train(c, data="{tmp}/bad.jsonl"),
         write("bad.jsonl", "{\"messages\": [\n")),
    Case("data-line-too-long", "a --data line longer than the cap (a file without line breaks; the test lowers the "
         "cap of 67,108,864 characters to 100)",
         "error: {tmp}/long.jsonl:1: a line longer than 100 characters (JSONL holds one record per line; is this a "
         "JSON array or a binary file?)",
         lambda c: train(c, data="{tmp}/long.jsonl"),
         lambda c: lower_line_cap(c, "long.jsonl", "[" + "1," * 200 + "1]")),
    Case("data-binary", "random bytes as --data",
         "error: {tmp}/bin.jsonl: not UTF-8 text (invalid start byte at byte 128 of a line)",
         lambda c: train(c, data="{tmp}/bin.jsonl"),
         write("bin.jsonl", bytes(range(256)) * 4)),
    Case("data-no-messages", "a record without messages",
         "error: {tmp}/nomsg.jsonl:1 (record 1): no 'messages' field", lambda c: train(c, data="{tmp}/nomsg.jsonl"),
         write("nomsg.jsonl", json.dumps({"text": "hello"}) + "\n")),
    Case("data-bad-role", "a chat turn with role 'robot'",
         "error: {tmp}/role.jsonl:1 (record 1): message 1 has unknown role 'robot' or non-string content",
         lambda c: train(c, data="{tmp}/role.jsonl"),
         write("role.jsonl", chat_line(("user", "hi"), ("robot", "beep")))),
    Case("data-no-assistant", "conversations without an assistant turn",
         "error: data '{tmp}/noasst.jsonl' has no conversation with assistant tokens within --seq-len 48",
         lambda c: train(c, data="{tmp}/noasst.jsonl"), write("noasst.jsonl", chat_line(("user", "hi")) * 4)),
    Case("prepare-all-too-long", "prepare --max-length shorter than every conversation",
         "error: no usable conversation in the data (0 kept, 12 skipped (0 empty, 12 over max length, 0 "
         "without assistant turn))",
         lambda c: ["prepare", "--target", "{target}", "--data", "{chat}", "--output", "{out}", "--max-length", 8]),
    Case("prepare-shard-size-zero", "prepare --shard-size 0",
         "error: --shard-size must be a positive number of conversations, got 0",
         lambda c: ["prepare", "--target", "{target}", "--data", "{chat}", "--output", "{out}", "--shard-size", 0]),
    Case("prepare-draft-vocab-over", "prepare --draft-vocab larger than the target's vocabulary",
         "error: draft vocabulary size 100000 must be in 1..320 (the target vocabulary)",
         lambda c: ["prepare", "--target", "{target}", "--data", "{chat}", "--output", "{out}", "--draft-vocab",
                    100000]),
    Case("cache-other-target", "--cache prepared for another target",
         "error: feature cache {cache} was made for target {target} (weights 264c092d79cd), not "
         "{other_target} (17b40d4287e4)",
         lambda c: ["train", "--drafter", "peagle", "--target", "{other_target}", "--cache", "{cache}",
                    "--seq-len", 48, "--output", "{out}", "--config", "{config}", "--mask-builder", "dense",
                    "--max-steps", 1]),
    Case("feature-engine-with-cache", "--feature-engine vllm with --cache",
         "error: --feature-engine vllm computes features online from --data; a --cache already holds them (fill one "
         "from vLLM with 'specframe prepare --engine vllm')",
         lambda c: ["train", "--drafter", "peagle", "--target", "{target}", "--cache", "{cache}", "--seq-len", 48,
                    "--output", "{out}", "--feature-engine", "vllm"]),
    Case("feature-engine-with-budget", "--feature-engine vllm with --memory-budget",
         "error: --memory-budget cannot be kept with --feature-engine vllm: the engine shares the trainer's process "
         "and its memory; prepare a cache ('specframe prepare --engine vllm') and train from it under the budget",
         lambda c: train(c, "--feature-engine", "vllm", "--memory-budget", "3GiB")),
    Case("capture-needs-vllm", "regenerate --capture with the transformers engine",
         "error: --capture takes the states from vLLM's answering pass: use it with --engine vllm (with transformers, "
         "'specframe prepare' computes them)",
         lambda c: ["regenerate", "--target", "{target}", "--data", "{chat}", "--output", "{out}/a.jsonl",
                    "--capture", "{out}/cache"]),
    Case("capture-sharded", "regenerate --capture in one of several processes (--shard 0/2)",
         "error: --capture runs as one process (--shard 0/1): the cache is written from every answer; spread a large "
         "target with --tensor-parallel-size / --pipeline-parallel-size",
         lambda c: ["regenerate", "--target", "{target}", "--data", "{chat}", "--output", "{out}/a.jsonl",
                    "--engine", "vllm", "--shard", "0/2", "--capture", "{out}/cache"]),
    Case("resume-other-drafter", "--resume a peagle checkpoint as eagle3",
         "error: --resume {checkpoint} is a checkpoint of drafter 'peagle', not 'eagle3' (nothing was "
         "overwritten)",
         lambda c: ["train", "--drafter", "eagle3", "--target", "{target}", "--data", "{chat}", "--seq-len", 48,
                    "--output", "{out}", "--mask-builder", "dense", "--max-steps", 2, "--resume", "{checkpoint}"]),
    Case("truncated-weights", "--resume a checkpoint whose model.safetensors is truncated",
         "error: {tmp}/ckpt/model.safetensors is not a complete safetensors file (truncated or corrupt: "
         "100 bytes)",
         lambda c: [*train(c), "--resume", "{tmp}/ckpt"], truncate_weights),
    Case("pickled-weights", "--resume a checkpoint whose model.safetensors is torch.save output",
         "error: {tmp}/ckpt/model.safetensors is a pickle (torch.save) file, not safetensors; specframe "
         "never unpickles weights (re-save them with safetensors)",
         lambda c: [*train(c), "--resume", "{tmp}/ckpt"], pickled_weights),
    Case("resume-config-not-json", "--resume a checkpoint whose config.json is not valid JSON",
         "error: {tmp}/ckpt/config.json is damaged (the checkpoint's run config): not valid JSON (Unterminated string starting at: line 1, column 23)",
         lambda c: [*train(c), "--resume", "{tmp}/ckpt"], damage("config.json")),
    Case("resume-state-not-json", "--resume a checkpoint whose state.json is not valid JSON",
         "error: {tmp}/ckpt/state.json is damaged (the checkpoint's training state): not valid JSON (Unterminated string starting at: line 1, column 23)",
         lambda c: [*train(c), "--resume", "{tmp}/ckpt"], damage("state.json")),
    Case("resume-optimizer-not-json", "--resume a checkpoint whose optimizer.json is not valid JSON",
         "error: {tmp}/ckpt/optimizer.json is damaged (the checkpoint's optimizer state): not valid JSON (Expecting ',' delimiter: line 1, column 6)",
         lambda c: [*train(c), "--resume", "{tmp}/ckpt"], damage("optimizer.json", "[1, 2")),
    Case("generate-config-not-json", "generate --checkpoint a checkpoint whose config.json is not valid JSON",
         "error: {tmp}/ckpt/config.json is damaged (the checkpoint's run config): not valid JSON (Unterminated string starting at: line 1, column 23)",
         lambda c: generate(), damage("config.json")),
    Case("generate-drafter-not-json", "generate --checkpoint a checkpoint whose drafter.json is not valid JSON",
         "error: {tmp}/ckpt/drafter.json is damaged (the peagle drafter's description): not valid JSON (Unterminated string starting at: line 1, column 23)",
         lambda c: generate(), damage("drafter.json")),
    Case("verifier-top-p-zero", "generate --verifier sampling --top-p 0 (a nucleus of no mass)",
         "error: sampling option 'top_p' must be in (0, 1] (1: off), got 0.0",
         lambda c: ["generate", "--target", "{target}", "--prompt", "hi", "--verifier", "sampling", "--top-p", 0]),
    Case("verifier-temperature-negative", "generate --verifier tree:temperature=-1 (inline verifier option)",
         "error: tree option 'temperature' must be a number >= 0 (0: greedy), got -1.0",
         lambda c: ["generate", "--target", "{target}", "--prompt", "hi", "--verifier", "tree:temperature=-1"]),
    Case("export-config-not-json", "export --checkpoint a checkpoint whose config.json is not valid JSON",
         "error: {tmp}/ckpt/config.json is damaged (the checkpoint's run config): not valid JSON (Unterminated string starting at: line 1, column 23)",
         lambda c: ["export", "--checkpoint", "{tmp}/ckpt", "--output", "{out}", "--target", "{target}"],
         damage("config.json")),
    Case("cache-manifest-not-json", "--cache a feature cache whose manifest.json is not valid JSON",
         "error: {tmp}/cache/manifest.json is damaged (the feature cache's manifest): not valid JSON (Expecting value: line 1, column 31)",
         lambda c: ["train", "--drafter", "peagle", "--target", "{target}", "--cache", "{tmp}/cache",
                    "--seq-len", 48, "--output", "{out}", "--config", "{config}", "--mask-builder", "dense",
                    "--max-steps", 1], damaged_manifest),
    Case("results-not-json", "report a folder holding a results file that is not valid JSON",
         "error: {tmp}/results/acceptance.json is damaged (a results file): not valid JSON (Unterminated string starting at: line 1, column 2)",
         lambda c: ["report", "{tmp}/results"],
         lambda c: ((c["tmp"] / "results").mkdir(), (c["tmp"] / "results" / "acceptance.json").write_text('{"schema'))),
    Case("unknown-drafter", "--drafter pegle (misspelt)",
         "error: unknown drafter 'pegle' (did you mean 'peagle'?); available: eagle3, ngram, "
         "parallelspec, pard, peagle", lambda c: train(c, drafter="pegle")),
    Case("unknown-mask-builder", "--mask-builder dens (misspelt)",
         "error: unknown mask builder 'dens' (did you mean 'dense'?); available: chunked, dense, flex, "
         "precomputed", lambda c: [*train(c), "--mask-builder", "dens"]),
    Case("unknown-partitioner", "--partitioner peagel (misspelt)",
         "error: unknown partitioner 'peagel' (did you mean 'peagle'?); available: none, peagle",
         lambda c: [*train(c), "--partitioner", "peagel"]),
    Case("unknown-verifier", "generate --verifier greedi (misspelt)",
         "error: unknown verifier 'greedi' (did you mean 'greedy'?); available: greedy, sampling, tree",
         lambda c: ["generate", "--drafter", "ngram", "--target", "{target}", "--prompt", "hi",
                    "--verifier", "greedi", "--max-new-tokens", 4]),
    Case("depth-zero", "--depth 0",
         "error: --depth must be positive, got 0", lambda c: [*train(c), "--depth", 0]),
    Case("partitions-negative", "--partitions -1",
         "error: --partitions must be positive, got -1", lambda c: [*train(c), "--partitions", -1]),
    Case("max-steps-zero", "--max-steps 0",
         "error: --max-steps must be positive, got 0", lambda c: [*train(c), "--max-steps", 0]),
    Case("steps-and-epochs", "--max-steps and --epochs together",
         "error: give at most one of --max-steps and --epochs (one of them decides the run's length)",
         lambda c: [*train(c), "--epochs", 1]),
    Case("report-to-unknown", "--report-to tensorbord (misspelt)",
         "error: --report-to: unknown tracker 'tensorbord' (did you mean 'tensorboard'?) (known: none, tensorboard, "
         "wandb)", lambda c: [*train(c), "--report-to", "tensorbord"]),
    Case("report-to-not-installed", "--report-to tensorboard without the tensorboard package",
         "error: --report-to tensorboard: not installed; pip install tensorboard (or specframe[tensorboard]), or "
         "drop it from --report-to (nothing was written)", lambda c: [*train(c), "--report-to", "tensorboard"],
         lambda c: c["monkeypatch"].setitem(sys.modules, "tensorboard", None)),
    Case("lr-zero", "--lr 0",
         "error: --lr must be positive, got 0.0", lambda c: [*train(c), "--lr", 0]),
    Case("batch-size-zero", "--batch-size 0",
         "error: --batch-size must be positive, got 0", lambda c: [*train(c), "--batch-size", 0]),
    Case("memory-budget-garbage", "--memory-budget lots",
         "error: invalid memory size 'lots': use a number with an optional unit, e.g. 8GiB, 8G, 512MiB, "
         "1.5GB or plain bytes (KiB/MiB/GiB/TiB are powers of 1024, K/M/G/T and KB/MB/GB/TB powers of "
         "1000)", lambda c: [*train(c), "--memory-budget", "lots"]),
    Case("memory-budget-tiny", "--memory-budget 1MiB (far too small)",
         "error: memory budget 1.00 MiB is too small: peagle at --seq-len 48 with mask builder 'dense', "
         "partitioner 'none' (1 partition) needs about 609.83 MiB (fixed 560.93 MiB + step 48.90 MiB); "
         "even the fixed part (weights, optimizer state, process) needs 560.81 MiB: use a smaller "
         "drafter or a larger budget (nothing was written)",
         lambda c: [*train(c), "--memory-budget", "1MiB"]),
    Case("memory-seq-len-huge", "--seq-len 100000000 --memory-budget 1GiB (10^8 tokens: the estimate once grew with "
         "the length until the kernel killed it at 16.7 GB)",
         "error: memory budget 1.00 GiB is too small: peagle at --seq-len 100000000 with mask builder 'dense', "
         "partitioner 'none' (1 partition) needs about 625341909.46 GiB (fixed 48.23 GiB + step 625341861.23 GiB); "
         "fits with --seq-len 2368 or less (nothing was written)",
         lambda c: [*train(c), "--seq-len", "100000000", "--memory-budget", "1GiB"]),
    Case("resume-changed-settings", "--resume a run with another --lr and --max-steps",
         "error: --resume {checkpoint}: the run was started with other settings: --max-steps 1 -> 2, --lr 0.0003 -> "
         "0.001 (nothing was written); resume it with its own (--config {checkpoint}/config.json gives them), pass "
         "--allow-changed-settings to continue under the new ones, or warm start a new run from an export of it "
         "with --init-from",
         lambda c: [*train(c), "--max-steps", 2, "--lr", "1e-3", "--resume", "{checkpoint}"]),
    Case("allow-changed-without-resume", "--allow-changed-settings without --resume",
         "error: --allow-changed-settings continues a run under new settings: give it with --resume",
         lambda c: [*train(c), "--allow-changed-settings"]),
    Case("resume-nothing", "--resume an empty directory",
         "error: {tmp}/empty is neither a checkpoint nor a training output directory with a checkpoint",
         lambda c: [*train(c), "--resume", "{tmp}/empty"],
         lambda c: (c["tmp"] / "empty").mkdir()),
    Case("output-has-checkpoint", "--output already holds a checkpoint, no --resume",
         "error: {out} already holds a checkpoint; pass --resume {out} to continue it or choose another "
         "--output (nothing was overwritten)",
         lambda c: train(c), existing_run),
    Case("unknown-drafter-option", "an option the drafter does not have in --config",
         "error: --config {tmp}/extra.toml: drafter 'peagle' options: unknown key 'layerz' (did you mean 'layers'?) "
         "(known options: layers, k_train, k_infer, draft_vocab_size, aux_layer_ids, cod_ratio, cod_min_ratio, "
         "activation_checkpointing, loss_chunk, vocab_position_mask, mask_hidden_std, train_head, loss_mask_bit, "
         "loss_normalisation, loss, ce_weight, init_from_target_layers, qk_norm, norm_before_residual, "
         "norm_before_fc, sliding_window)",
         lambda c: [*train(c), "--config", "{tmp}/extra.toml"], write("extra.toml", "[drafter]\nlayerz = 2\n")),
    Case("config-unknown-key", "a --config key that is no training option (misspelt)",
         "error: --config {tmp}/typo.yaml: unknown key 'seq_lenght' (did you mean 'seq_len'?); "
         "'specframe train --print-config' lists every key",
         lambda c: [*train(c), "--config", "{tmp}/typo.yaml"], write("typo.yaml", "seq_lenght: 64\n")),
    Case("config-wrong-type", "a --config value of the wrong type",
         "error: --config {tmp}/type.yaml: lr must be a number, got 'fast' (str)",
         lambda c: [*train(c), "--config", "{tmp}/type.yaml"], write("type.yaml", "lr: fast\n")),
    Case("config-not-toml", "a --config file that is not TOML",
         "error: --config {tmp}/bad.toml is not valid: Expected ']' at the end of a table declaration "
         "(at line 1, column 9)",
         lambda c: [*train(c), "--config", "{tmp}/bad.toml"], write("bad.toml", "[drafter\nlayers = ")),
    Case("chat-template-not-jinja", "a --chat-template file that is not valid Jinja",
         "error: --chat-template {tmp}/bad.jinja: not a valid Jinja template (line 1: Unexpected end of template. "
         "Jinja was looking for the following tags: 'endfor' or 'else'. The innermost block that needs to be closed "
         "is 'for'.)",
         lambda c: [*train(c), "--chat-template", "{tmp}/bad.jinja"],
         write("bad.jinja", "{% for m in messages %}{{ m.content }}\n")),
    Case("distributed-env-incomplete", "WORLD_SIZE=2 in the environment without MASTER_ADDR (not torchrun)",
         "error: WORLD_SIZE=2 asks for a distributed run, but MASTER_ADDR is not set: launch with torchrun "
         "--nproc-per-node N (it sets them all), or unset WORLD_SIZE for one process",
         lambda c: train(c), lambda c: distributed_env(c["monkeypatch"], WORLD_SIZE="2", RANK="0", MASTER_PORT="29500")),
    Case("target-missing", "--target names no folder or model",
         "error: target path {tmp}/no-such-target does not exist",
         lambda c: [*train(c), "--target", "{tmp}/no-such-target"]),
    Case("depth-over-drafter-limit", "--depth deeper than parallelspec's mask tokens",
         "error: parallelspec has 2 mask tokens, so it trains and drafts at most 3 tokens per group; got depth 9 "
         "(raise drafter.num_masks or k_train)", lambda c: [*train(c, drafter="parallelspec"), "--depth", 9]),
    Case("device-unknown", "--device names no torch device",
         "error: --device 'tpu' is not a torch device (cpu, cuda, cuda:N, auto)", lambda c: train(c, "--device", "tpu")),
    Case("serve-target-missing", "serve --target a folder that does not exist",
         "error: target path {tmp}/gone does not exist", lambda c: ["serve", "--target", "{tmp}/gone", "--print-command"]),
    Case("serve-bare-folder", "serve FOLDER: a drafter export named without --drafter",
         "error: serve takes no argument '{tmp}': a drafter export goes after --drafter, a target after --target, and "
         "what follows the options goes to vLLM as its options (e.g. -- --max-num-seqs 4)",
         lambda c: ["serve", "--print-command", "{tmp}"]),
    Case("export-truncated", "serve --drafter an exported folder whose weights are truncated",
         "error: {out}/model.safetensors is not a complete safetensors file (truncated or corrupt: 100 bytes)",
         lambda c: serve("--target", "{target}"), truncated_export),
    Case("export-other-target", "serve --drafter an export made for a target of another width",
         "error: {out} cannot be served by vLLM: target_hidden_size: it reads target hidden states of width 32, the "
         "target's are 48",
         lambda c: serve("--target", "{wide_target}"), lambda c: shutil.copytree(c["export"], c["out"])),
    Case("export-not-an-export", "serve --drafter a training checkpoint instead of an export",
         "error: {out} is not a vLLM drafter export specframe knows (neither speculators_config nor pard_token; "
         "known layouts: eagle3, peagle, pard, parallelspec, dflash, dspark)",
         lambda c: serve("--target", "{target}"), lambda c: shutil.copytree(c["checkpoint"], c["out"])),
    Case("init-from-other-width", "--init-from an export made for a target of another width",
         "error: cannot import {tmp}/imp: target_hidden_size 32 differs from the target's hidden size 48",
         lambda c: [*train(c), "--target", "{wide_target}", "--init-from", "{tmp}/imp"], export_copy(lambda f: None)),
    Case("init-from-missing-tensor", "--init-from an export that lacks a tensor",
         "error: cannot import {tmp}/imp: missing weight 'layers.1.mlp.up_proj.weight' (expected shape [64, 32])",
         lambda c: [*train(c), "--init-from", "{tmp}/imp"], export_copy(drop_tensor("layers.1.mlp.up_proj.weight"))),
    Case("init-from-other-tokenizer", "--init-from a folder saved with another tokenizer",
         "error: cannot import {tmp}/imp: tokenizer: its saved tokenizer is not the target's (320 vs 320 tokens, 4 "
         "token-id pairs differ)", lambda c: [*train(c), "--init-from", "{tmp}/imp"], export_copy(swap_two_tokens)),
    Case("init-from-other-depth", "--init-from a 2-layer export into a 3-layer drafter",
         "error: cannot import {tmp}/imp: its layers is 2, this peagle drafter's is 3 (set drafter.layers to match)",
         lambda c: [*train(c), "--config", "{tmp}/deep.toml", "--init-from", "{tmp}/imp"],
         lambda c: (export_copy(lambda f: None)(c), write("deep.toml", "[drafter]\nlayers = 3\ndraft_vocab_size = 100\n"
                                                                         "k_train = 3\n")(c))),
    Case("init-from-norm-variant", "--init-from a speculators folder with norm_before_residual true",
         "error: cannot import {tmp}/imp: its norm_before_residual is True, this peagle drafter's is False (set "
         "drafter.norm_before_residual to match)", lambda c: [*train(c), "--init-from", "{tmp}/imp"],
         export_copy(set_config(norm_before_residual=True))),
    Case("init-from-other-rope", "--init-from a speculators folder trained with another RoPE theta",
         "error: cannot import {tmp}/imp: rope_parameters differ from the target's: rope_theta is 500000.0 in the "
         "drafter's config and 10000.0 in the target's (drafter: rope_type 'default', rope_theta 500000.0; target: "
         "rope_type 'default', rope_theta 10000.0); specframe's drafters run the target's RoPE, so a drafter trained "
         "with other frequencies cannot be imported", lambda c: [*train(c), "--init-from", "{tmp}/imp"],
         export_copy(set_layer_config(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}))),
    Case("init-from-pickled-weights", "--init-from a folder carrying pickled weights (SafeAILab's pytorch_model.bin)",
         "error: cannot import {tmp}/imp: pytorch_model.bin is a pickle file, and specframe reads weights through "
         "safetensors only (unpickling can run code from the file; nothing was loaded): convert it once, e.g. "
         "safetensors.torch.save_file(torch.load('pytorch_model.bin', weights_only=True), 'model.safetensors'), and "
         "move pytorch_model.bin out of the folder", lambda c: [*train(c), "--init-from", "{tmp}/imp"],
         export_copy(lambda f: (add_pickle("pytorch_model.bin")(f), (f / "model.safetensors").unlink()))),
    Case("init-from-sliding-window", "--init-from a speculators folder whose layers attend through a sliding window "
         "(speculators' default)",
         "error: cannot import {tmp}/imp: its sliding_window is 2048, this peagle drafter's is None (set "
         "drafter.sliding_window to match)",
         lambda c: [*train(c), "--init-from", "{tmp}/imp"],
         export_copy(set_layer_config(sliding_window=2048, layer_types=["sliding_attention"] * 2))),
    Case("init-from-biased-layers", "--init-from a speculators folder whose layers have attention biases",
         "error: cannot import {tmp}/imp: attention_bias is true: vLLM and speculators build biased q/k/v/o "
         "projections from it, and specframe's drafter layers have none (attention_bias = mlp_bias = false)",
         lambda c: [*train(c), "--init-from", "{tmp}/imp"], export_copy(set_layer_config(attention_bias=True))),
    Case("init-from-other-activation", "--init-from a speculators folder trained with another activation",
         "error: cannot import {tmp}/imp: hidden_act 'gelu' differs from the target's 'silu' (specframe's drafters "
         "use the target's activation)",
         lambda c: [*train(c), "--init-from", "{tmp}/imp"], export_copy(set_layer_config(hidden_act="gelu"))),
    Case("init-from-other-norm-eps", "--init-from a speculators folder trained with another RMSNorm epsilon",
         "error: cannot import {tmp}/imp: rms_norm_eps 0.001 differs from the target's 1e-06 (specframe's drafters "
         "use the target's norm epsilon)",
         lambda c: [*train(c), "--init-from", "{tmp}/imp"], export_copy(set_layer_config(rms_norm_eps=0.001))),
    Case("generate-dflash-from-anchor", "generate --checkpoint a speculators DFlash folder that drafts from its "
         "anchor slot (sample_from_anchor true)",
         "error: cannot import {tmp}/imp: sample_from_anchor is true: the drafter also predicts from the anchor slot "
         "(block_size draft tokens); specframe's DFlash drafts from the mask slots only (sample_from_anchor = false, "
         "block_size - 1 tokens)",
         lambda c: ["generate", "--checkpoint", "{tmp}/imp", "--prompt", "hello", "--max-new-tokens", 2],
         dflash_folder(sample_from_anchor=True)),
]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from specframe.targets import tiny_target

    root = tmp_path_factory.mktemp("bad-inputs")
    target, chat = build(root)
    other = root / "other-target"
    tiny_target(other, vocab=320, layers=4, hidden=32, heads=4, kv_heads=2, seed=1)
    config = root / "small.toml"
    config.write_text("[drafter]\nlayers = 2\ndraft_vocab_size = 100\nk_train = 3\n")
    run_dir = root / "run"
    ctx = {"target": target, "chat": chat, "config": config, "other_target": other, "tmp": root, "out": run_dir}
    code, err = invoke([str(a).format(**ctx) for a in train(ctx)])
    assert code == 0, err
    cache = root / "cache"
    code, err = invoke(["prepare", "--target", str(target), "--data", str(chat), "--output", str(cache),
                        "--draft-vocab", "100"])
    assert code == 0, err
    export = root / "export"
    code, err = invoke(["export", "--checkpoint", str(ckpt.resolve(run_dir)), "--output", str(export),
                        "--target", str(target)])
    assert code == 0, err
    wide = root / "wide-target"
    tiny_target(wide, vocab=320, layers=4, hidden=48, heads=4, kv_heads=2, seed=2)
    return {**ctx, "run": run_dir, "checkpoint": ckpt.resolve(run_dir), "cache": cache, "export": export,
            "wide_target": wide}


def invoke(argv: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(main, argv)
    return result.exit_code, result.stderr


def tree_hash(root: Path) -> str | None:
    if not root.exists():
        return None
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file() and p.name != "train.lock":  # the lock file records the pid of whoever tried last
            h.update(p.read_bytes())
    return h.hexdigest()


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


@pytest.fixture
def builtin_plugins_only(monkeypatch):
    """The documented messages list the built-in components; a third-party plugin installed in the environment
    (packages/specframe-dflash) would add its names to them, so only built-ins load here."""
    from specframe import plugins

    monkeypatch.setenv("SPECFRAME_LOAD_PLUGINS", "")
    plugins.reset()
    yield
    monkeypatch.delenv("SPECFRAME_LOAD_PLUGINS")
    plugins.reset()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(assets, tmp_path, monkeypatch, case, builtin_plugins_only):
    ctx = {**assets, "tmp": tmp_path, "out": tmp_path / "out", "monkeypatch": monkeypatch}
    case.prepare(ctx)
    before = tree_hash(ctx["out"])
    argv = [str(a).format(**ctx) for a in case.args(ctx)]
    code, err = invoke(argv)
    expected = case.message.format(**{k: str(v) for k, v in ctx.items()})
    assert code != 0, err
    assert "Traceback" not in err, err
    assert error_lines(err) == [expected], err
    assert tree_hash(ctx["out"]) == before


def doc_rows() -> list[tuple[str, str, str]]:
    rows = []
    for line in DOC.read_text().splitlines():
        m = re.match(r"^\| `([a-z0-9-]+)` \| (.+?) \| `(error: .*)` \|$", line)
        if m:
            rows.append((m.group(1), m.group(2), m.group(3)))
    return rows


def test_the_doc_and_the_cases_agree():
    assert [(c.id, c.what, c.message) for c in CASES] == doc_rows()
    assert len(CASES) >= 20


def test_debug_shows_the_traceback(assets, tmp_path):
    code, err = invoke(["--debug", *[str(a).format(**{**assets, "out": tmp_path / "o"}) for a in train(assets)],
                        "--depth", "0"])
    assert code != 0 and "Traceback" in err
