"""A tiny random target and tiny chat data for engine, drafter and CLI tests (shared, built once per session)."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = "the quick brown fox jumps over lazy dog add clips sold april may half many".split()


def write_chat(path: Path, n: int = 12, seed: int = 0) -> Path:
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        q = " ".join(rng.choice(WORDS) for _ in range(6))
        a = " ".join(rng.choice(WORDS) for _ in range(20))
        msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        lines.append(json.dumps({"id": str(i), "messages": msgs}))
    path.write_text("\n".join(lines) + "\n")
    return path


def build(root: Path) -> tuple[Path, Path]:
    """(target folder, chat jsonl) under ``root``; idempotent."""
    from specframe.targets import tiny_target

    target = root / "tiny-target"
    if not (target / "config.json").exists():
        tiny_target(target, vocab=320, layers=4, hidden=32, heads=4, kv_heads=2, seed=0)
    chat = root / "chat.jsonl"
    if not chat.exists():
        write_chat(chat)
    return target, chat


def small_options(**extra):
    return {"layers": 2, "draft_vocab_size": 128, **extra}


def trained_peagle(root: Path, drafter_toml: str) -> tuple[Path, Path, list[str]]:
    """(target folder, run folder, the train argv) of a one-step P-EAGLE run through the real CLI under ``root``, its
    ``[drafter]`` table ``drafter_toml``: a real run folder (config, `latest`, one checkpoint) for tests to open."""
    from click.testing import CliRunner

    from specframe.cli import main

    target, chat = build(root)
    cfg = root / "small.toml"
    cfg.write_text(f"[drafter]\n{drafter_toml}\n")
    out = root / "run"
    args = [str(a) for a in ("train", "--drafter", "peagle", "--target", target, "--data", chat, "--seq-len", 48,
                             "--output", out, "--config", cfg, "--mask-builder", "dense", "--max-steps", 1,
                             "--max-examples", 4)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return target, out, args
