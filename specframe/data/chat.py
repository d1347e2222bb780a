"""Conversations -> token ids + loss mask through the target's chat template.

The loss mask covers assistant tokens only (their content and the end-of-turn token the template puts after it).
It works with any template, with or without ``{% generation %}`` markers: each assistant turn's character span is
found by rendering prefixes of the conversation (``messages[:i]`` with the generation prompt, then
``messages[:i+1]``) and diffing their lengths; the full text is tokenized once with offsets and a token is
supervised when it starts inside an assistant span.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any

import attrs

from specframe.errors import SpecframeError
from specframe.values import is_int


@attrs.define
class Encoded:
    """One tokenized conversation: ``input_ids`` and ``loss_mask`` (same length, 1 = assistant token)."""

    source: str
    id: str
    input_ids: list[int]
    loss_mask: list[int]


@attrs.define
class EncodeStats:
    """What ``encode_dataset`` kept and skipped (reported in summaries)."""

    kept: int = 0
    empty: int = 0
    too_long: int = 0
    no_assistant: int = 0
    skipped_ids: list[str] = attrs.Factory(list)

    @property
    def skipped(self) -> int:
        return self.empty + self.too_long + self.no_assistant

    def summary(self) -> str:
        return (
            f"{self.kept} kept, {self.skipped} skipped ({self.empty} empty, {self.too_long} over max length, "
            f"{self.no_assistant} without assistant turn)"
        )


def check_chat_template(tokenizer: Any) -> None:
    """``SpecframeError`` if the tokenizer has no chat template (we never guess one)."""
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or "the target"
        raise SpecframeError(
            f"tokenizer of {name} has no chat template; conversations cannot be rendered "
            "(use an instruct/chat model or add a chat_template to its tokenizer_config.json)"
        )


def render(tokenizer: Any, messages: list[dict], *, add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def encode_prompt(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` rendered with the generation prompt (what the target answers)."""
    check_chat_template(tokenizer)
    text = render(tokenizer, messages, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_conversation(tokenizer: Any, messages: list[dict], *, record: str = "") -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a conversation; ``loss_mask[t] = 1`` iff token t belongs to an assistant turn."""
    check_chat_template(tokenizer)
    if not messages:
        raise SpecframeError(f"record {record}: empty conversation")
    full = render(tokenizer, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        upto = render(tokenizer, messages[: i + 1])
        if not full.startswith(upto) or not upto.startswith(before):
            raise SpecframeError(
                f"record {record}: the chat template does not render conversations prefix-consistently, "
                "so assistant tokens cannot be located"
            )
        spans.append((len(before), len(upto)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    mask = [0] * len(ids)
    for t, (start, end) in enumerate(enc["offset_mapping"]):
        for s, e in spans:
            if s <= start < e:
                mask[t] = 1
                break
    return ids, mask


#: below this many records a conversation set is encoded in-process: starting workers would cost more than it saves
PARALLEL_MIN_RECORDS = 2048


def encode_workers(requested: int | None, records: int) -> int:
    """Processes that encode ``records`` conversations: ``requested`` when given, else one for a small set and up
    to 8 (the CPUs there are) for a large one."""
    if requested is not None:
        if not is_int(requested, 1):
            raise SpecframeError(f"--data-workers must be a positive number of processes, got {requested!r}")
        return requested
    return 1 if records < PARALLEL_MIN_RECORDS else max(1, min(8, os.cpu_count() or 1))


def encode_dataset(
    tokenizer: Any, records: Iterable[dict], *, max_length: int | None = None, stats: EncodeStats | None = None,
    workers: int | None = 1,
) -> Iterator[Encoded]:
    """Encode records (``source``, ``id``, ``messages``) in order. Empty conversations, conversations over
    ``max_length`` tokens and conversations without any assistant token are skipped and counted in ``stats``.

    ``workers`` > 1 (None: ``encode_workers``' choice) encodes a ``datasets.Dataset`` in that many processes with
    ``Dataset.map(num_proc=...)``; the result, its order and the first error are the same as in-process."""
    check_chat_template(tokenizer)
    stats = stats if stats is not None else EncodeStats()
    n = len(records) if hasattr(records, "__len__") else 0
    procs = encode_workers(workers, n)
    rows = _encode_in_processes(tokenizer, records, procs) if procs > 1 and hasattr(records, "map") and n > 1 \
        else (_encode_record(tokenizer, r["source"] if "source" in r else "", r["id"], r.get("messages"))
              for r in records)
    for row in rows:
        rid = f"{row['source']}:{row['id']}"
        if row["error"]:
            raise SpecframeError(row["error"])
        if row["empty"]:
            stats.empty += 1
            stats.skipped_ids.append(rid)
            continue
        ids, mask = row["input_ids"], row["loss_mask"]
        if max_length is not None and len(ids) > max_length:
            stats.too_long += 1
            stats.skipped_ids.append(rid)
            continue
        if not any(mask):
            stats.no_assistant += 1
            stats.skipped_ids.append(rid)
            continue
        stats.kept += 1
        yield Encoded(source=str(row["source"]), id=str(row["id"]), input_ids=list(ids), loss_mask=list(mask))


def _encode_record(tokenizer: Any, source: Any, rid: Any, messages: Any) -> dict[str, Any]:
    source = "" if source is None else str(source)
    msgs = [{"role": m["role"], "content": m["content"]} for m in (messages or [])]
    row: dict[str, Any] = {"source": source, "id": str(rid), "input_ids": [], "loss_mask": [], "empty": False,
                           "error": ""}
    if not msgs or all(not m["content"].strip() for m in msgs):
        row["empty"] = True
        return row
    try:
        row["input_ids"], row["loss_mask"] = encode_conversation(tokenizer, msgs, record=f"{source}:{rid}")
    except SpecframeError as exc:  # carried as data out of a worker process; raised in order by the caller
        row["error"] = str(exc)
    return row


def _encode_batch(batch: dict[str, list], tokenizer: Any) -> dict[str, list]:
    rows = [_encode_record(tokenizer, s, i, m) for s, i, m in zip(batch["source"], batch["id"], batch["messages"])]
    return {key: [r[key] for r in rows] for key in ("source", "id", "input_ids", "loss_mask", "empty", "error")}


def _encode_in_processes(tokenizer: Any, ds: Any, procs: int) -> Iterator[dict[str, Any]]:
    import datasets

    # the parent's tokenizer may have used its Rust threads already; forked workers must not (it would deadlock or warn)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        out = ds.map(_encode_batch, batched=True, batch_size=64, num_proc=min(procs, len(ds)),
                     fn_kwargs={"tokenizer": tokenizer}, remove_columns=ds.column_names, keep_in_memory=True,
                     load_from_cache_file=False)
    finally:
        if bars:
            datasets.enable_progress_bars()
    yield from out
