"""Evaluation prompt sets by name, for benchmark code (docs/design.md section 8, evaluation protocol).

- ``mt-bench``: 80 questions, two user turns each (the second is asked after the target's own first answer);
- ``humaneval``: 164 prompts, each one user message;
- ``gsm8k``: the evaluation slice, the first 200 problems of GSM8K train.jsonl (excluded from training data).

Ids are the sources' own (MT-Bench question_id, HumanEval task_id, GSM8K 0-based line index); order is the
source order, so "the first N prompts by id" is ``eval_prompts(name, limit=N)``.
"""

from __future__ import annotations

import attrs

from specframe.errors import unknown_name

EVAL_SETS = ("mt-bench", "humaneval", "gsm8k")


@attrs.define(frozen=True)
class EvalPrompt:
    """One evaluation prompt: ``turns`` are user messages (render each through the target's chat template)."""

    source: str
    id: str
    turns: tuple[str, ...]
    #: the set's own category (MT-Bench's eight: writing, roleplay, ...), None where the set has none
    category: str | None = None


def eval_prompts(name: str, *, limit: int | None = None) -> list[EvalPrompt]:
    """The named evaluation prompt set (``mt-bench``, ``humaneval`` or ``gsm8k``), first ``limit`` prompts."""
    from specframe.data.sources import load_gsm8k, load_humaneval, load_mtbench, mtbench_categories

    categories: dict[str, str] = {}
    if name == "mt-bench":
        ds = load_mtbench(limit=limit)
        categories = mtbench_categories()
    elif name == "humaneval":
        ds = load_humaneval(limit=limit)
    elif name == "gsm8k":
        ds = load_gsm8k(split="eval", limit=limit)
    else:
        raise unknown_name("evaluation set", name, EVAL_SETS)
    return [EvalPrompt(r["source"], r["id"], tuple(m["content"] for m in r["messages"]), categories.get(r["id"]))
            for r in ds]
