"""Self-distillation: answer prompts with the target (batched greedy generation, resumable).

Two engines answer a batch: ``TransformersAnswerer`` (the reference: ``model.generate`` on one left-padded batch)
and ``specframe.vllm.answer.VllmAnswerer`` (vLLM's offline engine, every prompt of the batch in flight at once:
continuous batching). Both are greedy and stop on the same token ids; everything else here (prompt selection,
batches, resume, the part file) is shared, so the two engines' files differ only where their answers do.

Output is a JSONL "part file" of answers only: ``{"source", "id", "answer", "prompt_tokens", "answer_tokens",
"finished"}`` (``finished`` = the target stopped on its own before ``max_new_tokens``). Prompt text is not stored:
``specframe.data.default`` joins answers with the prompts from their source dataset.

Determinism: prompts are sorted by (token length, source, id) and cut into fixed batches *before* skipping answered
ids, and each batch is appended (one flush) only when finished, so a resumed run computes exactly the batches an
uninterrupted run would, and greedy decoding gives the same answers. A torn last line from a kill is dropped.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import attrs

from specframe.data.chat import check_chat_template, encode_prompt
from specframe.errors import SpecframeError


@attrs.define
class RegenerateReport:
    total: int = 0
    already_done: int = 0
    generated: int = 0
    skipped_long: int = 0
    skipped_empty: int = 0
    answer_tokens: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        d = attrs.asdict(self)
        d["tokens_per_second"] = self.answer_tokens / self.seconds if self.seconds else 0.0
        return d


def prompt_messages(messages: list[dict]) -> list[dict]:
    """The prompt of a conversation: leading system messages and the first user turn."""
    out = []
    for m in messages:
        out.append({"role": m["role"], "content": m["content"]})
        if m["role"] == "user":
            return out
    return []


def read_done(part: Path, *, truncate: bool = True) -> set[tuple[str, str]]:
    """(source, id) pairs already answered in ``part``; a torn trailing line (killed mid-write) is cut off
    (with ``truncate``)."""
    done: set[tuple[str, str]] = set()
    if not part.exists():
        return done
    good = 0
    with open(part, "rb") as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:
                break
            done.add((r["source"], r["id"]))
            good += len(line)
    if truncate and good != part.stat().st_size:
        with open(part, "r+b") as f:
            f.truncate(good)
    return done


def stop_token_ids(target: Any) -> list[int]:
    """The ids that end an answer: the target's generation config's ``eos_token_id`` (one or several), else the
    tokenizer's eos. Both engines stop on exactly these."""
    gen = getattr(target.model, "generation_config", None) if target.model is not None else None
    if gen is None and target.path is not None:
        from transformers import GenerationConfig

        try:
            gen = GenerationConfig.from_pretrained(target.path)
        except OSError:  # no generation_config.json: the tokenizer's eos below
            gen = None
    eos = getattr(gen, "eos_token_id", None)
    ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [target.tokenizer.eos_token_id])
    return sorted({int(i) for i in ids if i is not None})


class TransformersAnswerer:
    """The reference engine: one ``model.generate`` call per batch, left-padded, greedy."""

    name = "transformers"

    def __init__(self, target: Any) -> None:
        self.target = target
        tok = target.tokenizer
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def describe(self) -> dict:
        return {"engine": self.name, "padding": "left"}

    def answer(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int]) -> list[tuple[list[int], bool]]:
        import torch

        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        attn = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, ids in enumerate(prompts):
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attn[row, width - len(ids):] = 1
        device = self.target.model.get_input_embeddings().weight.device
        with torch.inference_mode():
            gen = self.target.model.generate(
                input_ids=input_ids.to(device), attention_mask=attn.to(device), max_new_tokens=max_new_tokens,
                do_sample=False, pad_token_id=self.pad, eos_token_id=stop_ids,
            )
        return [(gen[row, width:].tolist(), False) for row in range(len(prompts))]


def regenerate(
    target: Any,
    records: Iterable[dict],
    output: str | os.PathLike,
    *,
    batch_size: int = 16,
    max_new_tokens: int = 256,
    max_prompt_tokens: int = 512,
    progress: Callable[[int, int], None] | None = None,
    shard: tuple[int, int] = (0, 1),
    also_done: Iterable[str | os.PathLike] = (),
    answerer: Any = None,
    on_batch: Callable[[list[dict]], None] | None = None,
) -> RegenerateReport:
    """Answer the first user turn of every record greedily with ``target``; append to ``output`` (resumable).

    ``answerer`` generates a batch (default ``TransformersAnswerer(target)``; ``VllmAnswerer`` for vLLM): its
    ``answer(prompts, max_new_tokens, stop_ids)`` returns each prompt's new tokens and whether the engine stopped on
    a stop id. ``shard=(k, w)`` takes only batches ``k, k+w, k+2w, ...`` (w processes in parallel, each with its own
    output); ids answered in any ``also_done`` file (the other workers' outputs) are skipped as well. ``on_batch``
    gets each finished batch's new conversations (``source``, ``id``, ``messages``: the prompt, then the answer)
    before the batch is appended, so what it keeps for them (``--capture``'s states) exists for every answer a
    resumed run finds."""
    tok = target.tokenizer
    records = list(records)
    check_chat_template(tok)
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    rep = RegenerateReport()
    items = plan_prompts(tok, records, max_prompt_tokens, rep)
    batches = [items[i : i + batch_size] for i in range(0, len(items), batch_size)]
    done = read_done(out)
    log = out.with_name(out.name + ".log")  # one line per finished batch: how long generation really took
    for other in also_done:
        if Path(other) != out and Path(other).exists():
            done |= read_done(Path(other), truncate=False)
    k, w = shard
    if not 0 <= k < w:
        raise SpecframeError(f"shard {k}/{w}: need 0 <= k < w")
    todo = [b for bi, b in enumerate(batches) if bi % w == k and not all((s, i) in done for _, s, i, _ in b)]
    rep.already_done = sum(1 for _, s, i, _ in items if (s, i) in done)
    stop_ids = stop_token_ids(target)
    answerer = answerer if answerer is not None else TransformersAnswerer(target)
    prompts = {(str(r["source"]), str(r["id"])): prompt_messages(list(r["messages"])) for r in records} \
        if on_batch else {}
    t0 = time.perf_counter()
    with open(out, "a", encoding="utf-8") as f:
        for bi, batch in enumerate(todo):
            tb = time.perf_counter()
            generated = answerer.answer([ids for *_, ids in batch], max_new_tokens, stop_ids)
            lines = []
            for (n, src, rid, _), (new, stopped) in zip(batch, generated, strict=True):
                cut = next((j for j, t in enumerate(new) if t in stop_ids), None)
                body = new if cut is None else new[:cut]
                rep.answer_tokens += len(body)
                if (src, rid) in done:
                    continue
                rec = {
                    "source": src,
                    "id": rid,
                    "answer": tok.decode(body, skip_special_tokens=True),
                    "prompt_tokens": n,
                    "answer_tokens": len(body),
                    "finished": cut is not None or stopped,
                }
                lines.append(json.dumps(rec, ensure_ascii=False) + "\n")
                rep.generated += 1
            if on_batch:
                on_batch([conversation(prompts[(r["source"], r["id"])], r) for r in map(json.loads, lines)])
            f.write("".join(lines))
            f.flush()
            os.fsync(f.fileno())
            with open(log, "a", encoding="utf-8") as lf:
                lf.write(json.dumps({"records": len(lines), "answer_tokens": sum(json.loads(x)["answer_tokens"] for x in lines),
                                     "seconds": round(time.perf_counter() - tb, 2), "shard": list(shard),
                                     "engine": answerer.name}) + "\n")
            if progress:
                progress(bi + 1, len(todo))
    rep.seconds = time.perf_counter() - t0
    if rep.total and not items:
        raise SpecframeError("no prompt left to answer (all empty or over --max-prompt-tokens)")
    return rep


def conversation(prompt: list[dict], answer: dict) -> dict:
    """The training conversation of an answer record: its prompt's messages, then the answer as the assistant's turn
    (as ``specframe.data.default.load_default`` joins them)."""
    return {"source": answer["source"], "id": answer["id"],
            "messages": [*prompt, {"role": "assistant", "content": answer["answer"]}]}


def plan_prompts(tok: Any, records: Iterable[dict], max_prompt_tokens: int,
                 rep: RegenerateReport) -> list[tuple[int, str, str, list[int]]]:
    """The prompts to answer, as (length, source, id, token ids), sorted by (length, source, id): the order fixes
    the batches, whatever the engine, the batch size or how often the run was resumed."""
    items = []
    for r in records:
        rep.total += 1
        msgs = prompt_messages(list(r["messages"]))
        if not msgs or not msgs[-1]["content"].strip():
            rep.skipped_empty += 1
            continue
        ids = encode_prompt(tok, msgs)
        if len(ids) > max_prompt_tokens:
            rep.skipped_long += 1
            continue
        items.append((len(ids), str(r["source"]), str(r["id"]), ids))
    items.sort(key=lambda x: (x[0], x[1], x[2]))
    return items
