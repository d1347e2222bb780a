"""Greedy acceptance over whole evaluation sets in vLLM, many requests in flight.

Greedy acceptance does not depend on batching: what a drafter proposes and the target accepts at a position depends
only on the tokens before it. So a whole set (all 80 MT-Bench questions with both turns, all 164 HumanEval problems,
the GSM8K evaluation slice) is handed to each engine at once (``VllmEngine.generate(..., together=True)``) and
read back per request from vLLM's per-request spec-decode counters. Timings here measure a batch and are not
reported; speed is measured at batch 1 and at a few concurrent requests elsewhere (``specframe.bench``).

A later turn is asked after plain vLLM's own answer to the turns before it, so every engine answers the same
conversation. Whether an engine's output equals plain vLLM's is counted per request: batched decoding may take a
different reduction order at a near tie, so this share is reported beside the figures, and losslessness is asserted
on the batch-1 runs, where each request runs alone.

Intervals: a percentile bootstrap over prompts (``specframe.metrics.bootstrap_al``) of the pooled acceptance length
(all emitted tokens over all decode forwards), the figure the point estimate is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from specframe.errors import SpecframeError
from specframe.metrics import PromptMetrics, aggregate, bootstrap_al
from specframe.vllm.counters import VllmGeneration
from specframe.vllm.engine import EngineOptions
from specframe.vllm.interleaved import Conversation
from specframe.vllm.jobs import Job, process_groups, run_jobs

PLAIN = "plain"


@attrs.frozen
class SetAcceptance:
    """One engine over one set: a ``VllmGeneration`` per prompt turn (keys ``id#turn``, in the set's order)."""

    label: str
    k: int
    generations: dict[str, VllmGeneration]

    def prompt_metrics(self) -> list[PromptMetrics]:
        return [g.prompt_metrics() for g in self.generations.values()]


def prompt_contexts(
    source: str, conversations: Sequence[Conversation], *, max_new_tokens: int, options: EngineOptions,
    chat_template: str | None = None, timeout: float = 7200,
) -> tuple[dict[str, list[int]], dict[str, VllmGeneration]]:
    """Every prompt turn's ids (``id#turn``) and plain vLLM's answers to them: turn 0 of every conversation at
    once, then each later turn after plain's answer to the turns before it."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from specframe.data.chat import encode_prompt

    tok = AutoTokenizer.from_pretrained(source)
    if chat_template:
        tok.chat_template = Path(chat_template).read_text(encoding="utf-8")
    history: dict[str, list[dict[str, str]]] = {c.id: [] for c in conversations}
    contexts: dict[str, list[int]] = {}
    plain: dict[str, VllmGeneration] = {}
    for turn in range(max((len(c.turns) for c in conversations), default=0)):
        asked = [c for c in conversations if turn < len(c.turns)]
        ids = [encode_prompt(tok, [*history[c.id], {"role": "user", "content": c.turns[turn]}]) for c in asked]
        (run,) = run_jobs([Job(source)], ids, max_new_tokens=max_new_tokens, options=options, together=True,
                          timeout=timeout)
        for c, prompt, g in zip(asked, ids, run.generations, strict=True):
            key = f"{c.id}#{turn}"
            contexts[key], plain[key] = prompt, g
            answer = tok.decode(list(g.tokens), skip_special_tokens=True).strip()
            history[c.id] += [{"role": "user", "content": c.turns[turn]}, {"role": "assistant", "content": answer}]
    return contexts, plain


def measure(
    source: str, contexts: Mapping[str, Sequence[int]], jobs: Mapping[str, tuple[Job, int]], *, max_new_tokens: int,
    options: EngineOptions, timeout: float = 7200,
) -> dict[str, SetAcceptance]:
    """Each job (label -> (job, K)) over every prompt turn of ``contexts``, all in flight at once, one engine after
    the other in one child process."""
    if PLAIN in jobs:
        raise SpecframeError(f"'{PLAIN}' is the baseline's label; name the drafted jobs otherwise")
    keys = list(contexts)
    prompts = [contexts[k] for k in keys]
    out: dict[str, SetAcceptance] = {}
    # what can share a child process does; an n-gram engine gets one of its own (vLLM 0.32 cannot start another
    # engine in a process that has loaded numba's llvmlite: ``engine.process_groups``)
    for group in process_groups({label: job for label, (job, _) in jobs.items()}):
        runs = run_jobs(list(group.values()), prompts, max_new_tokens=max_new_tokens, options=options, together=True,
                        timeout=timeout)
        for label, run in zip(group, runs, strict=True):
            out[label] = SetAcceptance(label, jobs[label][1], dict(zip(keys, run.generations, strict=True)))
    return {label: out[label] for label in jobs}


def summary(result: SetAcceptance, plain: Mapping[str, VllmGeneration]) -> dict[str, Any]:
    """Pooled AL with its bootstrap interval, per-slot and conditional acceptance, the share of prompt turns whose
    output equals plain vLLM's, and each turn's own AL (for a later bootstrap or another pooling)."""
    prompts = result.prompt_metrics()
    pooled = aggregate(prompts, result.k)
    lo, hi = bootstrap_al(prompts)
    same = [result.generations[key].tokens == plain[key].tokens for key in result.generations if key in plain]
    return {
        "k": result.k,
        "prompt_turns": len(prompts),
        "acceptance_length": pooled.acceptance_length,
        "acceptance_length_interval": {"low": lo, "high": hi, "level": 0.95, "method": "bootstrap over prompt turns"},
        "per_slot": list(pooled.per_slot),
        "conditional": list(pooled.conditional),
        "emitted": pooled.emitted,
        "forwards": pooled.forwards,
        "equal_to_plain": sum(same) / len(same) if same else None,
        "per_prompt": {key: {"emitted": m.emitted, "forwards": m.forwards}
                       for key, m in zip(result.generations, prompts, strict=True)},
    }
