"""The large self-distilled training set: the default target's greedy answers to about 12,000 prompts.

The prompts are every GSM8K training question (the evaluation slice excluded) and the first user turn of the first
``LARGE_SHAREGPT`` ShareGPT conversations, less any prompt that overlaps an evaluation prompt (MT-Bench, HumanEval,
the GSM8K evaluation slice: ``overlaps_eval``). It is stored as the default set is: ``answers.jsonl.gz`` holds
the answers with references to their prompts (``source`` + ``id``), ``provenance.json`` says how it was made, and
``load_large()`` joins them with the prompts of the installed packages. ``--data large`` names it.

Its answers were generated with vLLM's offline engine (``specframe regenerate --engine vllm``), which answers many
prompts at once; ``make data-large`` regenerates it (resumable) into ``$SPECFRAME_HOME/data/large``.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ANSWERS = HERE / "answers.jsonl.gz"
PROVENANCE = HERE / "provenance.json"
LARGE_SHAREGPT = 5500
# shorter texts ("hi", "continue") say nothing about overlap; an evaluation prompt is at least a sentence
_MIN_OVERLAP_CHARS = 32


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


@lru_cache(maxsize=1)
def evaluation_texts() -> tuple[str, ...]:
    """Every user turn of every evaluation set, normalised (case and whitespace)."""
    from specframe.data.evalsets import EVAL_SETS, eval_prompts

    return tuple(sorted({_norm(t) for name in EVAL_SETS for p in eval_prompts(name) for t in p.turns}))


def overlaps_eval(text: str) -> bool:
    """Whether a prompt holds an evaluation prompt or is held by one (after normalising case and whitespace)."""
    t = _norm(text)
    if len(t) < _MIN_OVERLAP_CHARS:
        return t in evaluation_texts()
    return any(e in t or (len(e) >= _MIN_OVERLAP_CHARS and t in e) for e in evaluation_texts())


def large_prompt_records(n_sharegpt: int = LARGE_SHAREGPT) -> list[dict]:
    """The prompt records (first user turn) of the large set, evaluation overlaps removed."""
    from specframe.data.regenerate import prompt_messages
    from specframe.data.sources import load_gsm8k, load_sharegpt

    out = []
    for r in load_sharegpt(limit=n_sharegpt):
        out.append({"source": "sharegpt", "id": r["id"], "messages": prompt_messages(r["messages"])})
    for r in load_gsm8k(split="train"):
        out.append({"source": "gsm8k", "id": r["id"], "messages": r["messages"][:1]})
    return [r for r in out if r["messages"] and not overlaps_eval(r["messages"][-1]["content"])]


def load_large(limit: int | None = None, *, path: str | Path = ANSWERS) -> Any:
    """The large set as a ``datasets.Dataset`` (source, id, messages = [prompt..., answer]), sources interleaved."""
    from specframe.data.default import load_default

    return load_default(limit, path=path)
