"""Conversations -> token ids + loss mask through the target's chat template.

The loss mask covers assistant tokens only (their content and the end-of-turn token the template puts after it).
It works with any template, with or without ``{% generation %}`` markers: each assistant turn's character span is
found by rendering prefixes of the conversation (``messages[:i]`` with the generation prompt, then
``messages[:i+1]``) and diffing their lengths; the full text is tokenized once with offsets and a token is
supervised when it starts inside an assistant span.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import attrs

from specframe.errors import SpecframeError


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


def encode_dataset(
    tokenizer: Any, records: Iterable[dict], *, max_length: int | None = None, stats: EncodeStats | None = None
) -> Iterator[Encoded]:
    """Encode records (``source``, ``id``, ``messages``). Empty conversations, conversations over ``max_length``
    tokens and conversations without any assistant token are skipped and counted in ``stats``."""
    check_chat_template(tokenizer)
    stats = stats if stats is not None else EncodeStats()
    for r in records:
        rid = f"{r.get('source', '')}:{r['id']}"
        msgs = [{"role": m["role"], "content": m["content"]} for m in (r.get("messages") or [])]
        if not msgs or all(not m["content"].strip() for m in msgs):
            stats.empty += 1
            stats.skipped_ids.append(rid)
            continue
        ids, mask = encode_conversation(tokenizer, msgs, record=rid)
        if max_length is not None and len(ids) > max_length:
            stats.too_long += 1
            stats.skipped_ids.append(rid)
            continue
        if not any(mask):
            stats.no_assistant += 1
            stats.skipped_ids.append(rid)
            continue
        stats.kept += 1
        yield Encoded(source=str(r.get("source", "")), id=str(r["id"]), input_ids=ids, loss_mask=mask)
