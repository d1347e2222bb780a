"""Train every drafter under one budget and print them side by side.

    .venv/bin/python benchmarks/train_compare.py                       # tiny random target, about 2 minutes on CPU
    .venv/bin/python benchmarks/train_compare.py --target default \\
        --seq-len 256 --steps 40 --max-examples 48 --json benchmarks/results/train_compare_smollm2.json

Each drafter trains in its own child process (so its peak RSS, read with ``os.wait4``, is its own) through the
shared engine with the same target, the same conversations (``--data``), the same sequence length, depth K, seed,
steps, batch size, learning rate, mask builder and partitioner. Target features are computed once per sequence
before the clock starts (every drafter then reads memoised features, as from a cache), so tokens per second measure
the drafter's training alone. Validation (held-out sequences, full element grid) gives loss, per-depth top-1
accuracy and the expected acceptance length those accuracies imply (1 + sum_k prod_{i<=k} acc_i).

Validation losses are not comparable across objectives: eagle3, peagle and parallelspec report forward KL to the
target over their draft vocabulary, pard hard cross-entropy on the data tokens over the full vocabulary. Accuracy is
comparable: every drafter's hit is its top-1 equal to the next token the target would accept (for pard, the data
token; on self-generated data the two coincide).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DRAFTERS = ("peagle", "eagle3", "pard", "parallelspec")


def drafter_options(name: str, draft_vocab: int, depth: int) -> dict:
    """Each method's released architecture (layers), one shared draft-vocabulary size and depth."""
    return {
        "peagle": {"layers": 4, "draft_vocab_size": draft_vocab, "k_train": depth, "k_infer": depth},
        "eagle3": {"layers": 1, "draft_vocab_size": draft_vocab, "ttt_steps": depth, "k_infer": depth},
        "pard": {"layers": 2, "k_train": depth, "k_infer": depth},
        "parallelspec": {"layers": 1, "draft_vocab_size": draft_vocab, "k_train": depth, "k_infer": depth},
    }[name]


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from specframe.engine import TrainConfig
    from specframe.engine.loop import Trainer

    cfg = TrainConfig(
        drafter=args.child, output=args.output, target=args.target, data=args.data, seq_len=args.seq_len,
        depth=args.depth, mask_builder=args.mask_builder, partitioner=args.partitioner, partitions=args.partitions,
        max_steps=args.steps, batch_size=args.batch_size, lr=args.lr, max_examples=args.max_examples,
        val_examples=args.val_examples, seed=args.seed,
        drafter_options=drafter_options(args.child, args.draft_vocab, args.depth),
    )
    trainer = Trainer(cfg)
    try:
        for i in list(trainer.train_ids) + list(trainer.val_ids):
            trainer.source.example(i)  # memoise the target features before the clock starts
        tokens = 0
        losses = []
        start = time.perf_counter()
        while trainer.step < cfg.max_steps:
            tokens += sum(int(trainer.source.tokens(i).input_ids.numel()) for i in trainer.batch_indices(trainer.step))
            losses.append(trainer.train_step()["train_loss"])
        seconds = time.perf_counter() - start
        ev = trainer.evaluate() or {}
        params = sum(p.numel() for p in trainer.drafter.module().parameters() if p.requires_grad)
    finally:
        trainer.close()
    Path(args.report).write_text(json.dumps({
        "drafter": args.child, "train_tokens": tokens, "train_seconds": seconds, "tokens_per_second": tokens / seconds,
        "first_train_loss": losses[0], "last_train_loss": losses[-1], "trainable_parameters": params,
        "val_loss": ev.get("val_loss"), "val_accuracy": ev.get("val_accuracy"), "val_expected_al": ev.get("val_expected_al"),
        "val_elements": ev.get("val_elements"), "options": drafter_options(args.child, args.draft_vocab, args.depth),
    }))


def run_one(name: str, args: argparse.Namespace, work: Path) -> dict:
    report = work / f"{name}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--report", str(report),
           "--output", str(work / name)] + passthrough(args)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed (exit {proc.returncode}):\n{err[-3000:]}")
    result = json.loads(report.read_text())
    result["peak_rss_mib"] = usage.ru_maxrss / 1024  # Linux reports KiB
    return result


def passthrough(args: argparse.Namespace) -> list[str]:
    out = []
    for key in ("target", "data", "seq_len", "depth", "steps", "batch_size", "lr", "max_examples", "val_examples",
                "seed", "mask_builder", "partitioner", "partitions", "draft_vocab", "threads"):
        out += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return out


def table(rows: list[dict], depth: int) -> str:
    head = ["drafter", "val loss", *[f"acc@{d}" for d in range(depth)], "exp. AL", "peak RSS MiB", "train tok/s",
            "params"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        acc = r["val_accuracy"] or [float("nan")] * depth
        cells = [r["drafter"], f"{r['val_loss']:.4f}", *[f"{a:.3f}" for a in acc], f"{r['val_expected_al']:.3f}",
                 f"{r['peak_rss_mib']:.0f}", f"{r['tokens_per_second']:.0f}", f"{r['trainable_parameters'] / 1e6:.2f}M"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="tiny", help="'tiny' (built here, random weights), 'default' (SmolLM2) or a path")
    p.add_argument("--data", default="gsm8k", help="conversations (built-in name, file or hub id); gsm8k excludes the evaluation slice")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-examples", type=int, default=40)
    p.add_argument("--val-examples", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mask-builder", default="chunked")
    p.add_argument("--partitioner", default="none")
    p.add_argument("--partitions", type=int, default=1)
    p.add_argument("--draft-vocab", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--drafters", default=",".join(DRAFTERS))
    p.add_argument("--json", default=None, help="also write the rows and settings to this JSON file")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--report", default=None, help=argparse.SUPPRESS)
    p.add_argument("--output", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    with tempfile.TemporaryDirectory(prefix="train_compare_") as tmp:
        work = Path(tmp)
        if args.target == "tiny":
            from specframe.targets import tiny_target

            args.target = str(tiny_target(work / "tiny-target", vocab=320, layers=4, hidden=64, heads=4, kv_heads=2,
                                          intermediate=128, seed=0))
        rows = []
        for name in args.drafters.split(","):
            started = time.perf_counter()
            rows.append(run_one(name, args, work))
            print(f"{name}: done in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    settings = {k: v for k, v in vars(args).items() if k not in ("child", "report", "output", "json")}
    print(f"settings: {json.dumps(settings)}")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch threads {args.threads}")
    print(table(rows, args.depth))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"settings": settings, "rows": rows, "command": sys.argv,
                                               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1))


if __name__ == "__main__":
    main()
