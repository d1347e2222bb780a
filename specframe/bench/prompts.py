"""The prompts a comparison decodes: the named evaluation sets or a chat file, a category-spread subset, and each
prompt through the target's chat template (docs/design.md section 8: every user turn is a prompt; a later turn is
asked after the target's own answer to the earlier ones)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from specframe.errors import SpecframeError, UsageError, unknown_name


@attrs.frozen
class BenchPrompt:
    """One evaluation item: ``turns`` are user messages; turn i > 0 follows the target's answer to turn i - 1."""

    source: str
    id: str
    turns: tuple[str, ...]
    category: str | None = None


def spread_over_categories(prompts: Sequence[BenchPrompt], n: int) -> list[BenchPrompt]:
    """``n`` prompts taken in turn from each category (in the set's order of categories, each category's prompts in
    the set's order), so a timed subset is not one category's: MT-Bench's first ten questions are all "writing".
    Prompts without a category count as one category."""
    groups: dict[str | None, list[BenchPrompt]] = {}
    for p in prompts:
        groups.setdefault(p.category, []).append(p)
    queues = list(groups.values())
    chosen: list[BenchPrompt] = []
    depth = 0
    while len(chosen) < n and any(depth < len(q) for q in queues):
        chosen += [q[depth] for q in queues if depth < len(q)][: n - len(chosen)]
        depth += 1
    return chosen


def load_prompts(dataset: str, limit: int | None = None) -> list[BenchPrompt]:
    """The first ``limit`` items of a named evaluation set (``mt-bench``, ``humaneval``, ``gsm8k``) or of a JSON /
    JSONL file of records with ``messages`` (only the user messages are used; answers come from the target)."""
    from specframe.data.evalsets import EVAL_SETS, eval_prompts

    if limit is not None and limit < 1:
        raise UsageError(f"--num-prompts must be positive, got {limit}")
    if dataset in EVAL_SETS:
        return [BenchPrompt(p.source, p.id, p.turns, p.category) for p in eval_prompts(dataset, limit=limit)]
    path = Path(dataset).expanduser()
    if not path.is_file():
        err = unknown_name("dataset", dataset, EVAL_SETS)
        raise type(err)(f"{err} (or the path of a JSON/JSONL file of records with 'messages')")
    from specframe.data.sources import load_chat_file

    prompts = []
    for record in load_chat_file(path, limit=limit):
        turns = tuple(m["content"] for m in record["messages"] if m["role"] == "user")
        if not turns:
            raise SpecframeError(f"{path}: record {record['id']} has no user message")
        prompts.append(BenchPrompt(record["source"], record["id"], turns))
    if not prompts:
        raise SpecframeError(f"{path} holds no prompts")
    return prompts


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> torch.Tensor:
    """Prompt token ids: ``messages`` through the target's chat template, with the generation prompt."""
    from specframe.data.chat import encode_prompt

    return torch.tensor(encode_prompt(tokenizer, messages), dtype=torch.long)
