"""Draft vocabulary (the N most frequent target tokens) and mask-token ids.

Draft vocabulary, EAGLE-3 convention: ``ids`` = the chosen target ids sorted ascending (draft id i <-> target id
``ids[i]``); ``d2t[i] = ids[i] - i`` (so target = draft + d2t[draft]); ``t2d`` = bool mask over the target vocabulary.
Token frequencies count loss-masked (assistant) tokens only; ties break towards the lower target id; if fewer than
N distinct tokens occur, the lowest unseen ids fill the rest, so the size is always exactly N.
Saved as safetensors (``ids``, ``d2t``, ``t2d``, ``counts``) with the N, coverage and target vocab size in metadata.

The EAGLE family's drafters default to the target's whole vocabulary (``draft_vocab_size`` null, as the reference
trainers; docs/training/deviations.md row 6); N = 16384 is the size ``specframe prepare`` saves with a cache and was
the drafters' default before. For SmolLM2 (vocab 49,152), measured with ``examples/draft_vocab_coverage.py`` on the assistant
tokens of the first 1,000 ShareGPT conversations + 1,000 GSM8K training answers (1.19 M tokens, 25,896 distinct;
vocabulary built on one half, coverage on the other, held-out): N = 4096: 86.7 %, 8192: 92.6 %, 16384: 96.8 %,
32000: 99.0 %. A token outside the draft vocabulary can never be accepted, so 8192 would cap per-token acceptance
near 0.93; 16384 costs a 576 x 16384 draft lm_head (9.4 M parameters, a third of the full 28 M) for +4 points.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs

from specframe.errors import SpecframeError

DEFAULT_DRAFT_VOCAB = 16384


@attrs.define(eq=False)
class DraftVocab:
    ids: Any  # int64 [N], ascending target ids
    d2t: Any  # int64 [N], ids[i] - i
    t2d: Any  # bool [V]
    counts: Any  # int64 [V], masked-token counts the vocabulary was built from
    coverage: float  # share of counted tokens that fall inside the vocabulary

    @property
    def size(self) -> int:
        return int(self.ids.numel())

    @property
    def target_vocab_size(self) -> int:
        return int(self.t2d.numel())

    def to_draft(self, target_ids: Any) -> Any:
        """Map target ids to draft ids (-1 where a token is outside the draft vocabulary)."""
        import torch

        lut = torch.full((self.target_vocab_size,), -1, dtype=torch.long)
        lut[self.ids] = torch.arange(self.size)
        return lut[torch.as_tensor(target_ids, dtype=torch.long)]

    def to_target(self, draft_ids: Any) -> Any:
        import torch

        d = torch.as_tensor(draft_ids, dtype=torch.long)
        return d + self.d2t[d]

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        meta = vocab_metadata(self.size, self.target_vocab_size, self.coverage)
        p = Path(path)
        tmp = p.with_name(f".{p.name}.tmp")
        save_file({"ids": self.ids, "d2t": self.d2t, "t2d": self.t2d, "counts": self.counts}, str(tmp), metadata=meta)
        tmp.replace(p)

    @classmethod
    def load(cls, path: str | Path) -> DraftVocab:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            t = {k: f.get_tensor(k) for k in ("ids", "d2t", "t2d", "counts")}
        info = json.loads(meta.get("draft_vocab", "{}"))
        return cls(coverage=float(info.get("coverage", "nan")), **t)


def vocab_metadata(size: int, target_vocab_size: int, coverage: float) -> dict[str, str]:
    """safetensors metadata for a vocabulary file: one key (safetensors does not keep the order of several keys,
    which would make files differ byte-wise between runs)."""
    return {"draft_vocab": json.dumps({"coverage": coverage, "size": size, "target_vocab_size": target_vocab_size}, sort_keys=True)}


def count_tokens(examples: Iterable[Any], vocab_size: int, *, masked_only: bool = True) -> Any:
    """Token counts [vocab_size] over examples with ``input_ids`` and ``loss_mask`` (attributes or keys)."""
    import torch

    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ex in examples:
        ids = ex["input_ids"] if isinstance(ex, dict) else ex.input_ids
        mask = ex["loss_mask"] if isinstance(ex, dict) else ex.loss_mask
        ids = torch.as_tensor(ids, dtype=torch.long)
        if masked_only:
            ids = ids[torch.as_tensor(mask, dtype=torch.bool)]
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise SpecframeError(f"token id {int(ids.max())} outside the target vocabulary ({vocab_size}): wrong tokenizer?")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def build_draft_vocab(counts: Any, n: int = DEFAULT_DRAFT_VOCAB) -> DraftVocab:
    """The ``n`` most frequent ids of ``counts`` (see module doc for order and tie rules)."""
    import torch

    counts = torch.as_tensor(counts, dtype=torch.long)
    v = counts.numel()
    if not 0 < n <= v:
        raise SpecframeError(f"draft vocabulary size {n} must be in 1..{v} (the target vocabulary)")
    # stable sort on -count keeps ascending id order among equal counts
    order = torch.sort(-counts, stable=True).indices
    ids = torch.sort(order[:n]).values
    total = int(counts.sum())
    coverage = float(counts[ids].sum()) / total if total else 0.0
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    d2t = ids - torch.arange(n)
    return DraftVocab(ids=ids, d2t=d2t, t2d=t2d, counts=counts, coverage=coverage)


def coverage(vocab: DraftVocab, counts: Any) -> float:
    """Share of the tokens counted in ``counts`` (e.g. held-out data) inside the draft vocabulary."""
    import torch

    counts = torch.as_tensor(counts, dtype=torch.long)
    total = int(counts.sum())
    return float(counts[vocab.t2d].sum()) / total if total else 0.0


def mask_token_ids(tokenizer: Any, k: int, *, data_counts: Any = None, embedding_rows: int | None = None) -> list[int]:
    """``k`` distinct mask-token ids by docs/design.md section 8's rule. Deterministic.

    Rule: candidates are the embedding rows beyond the tokenizer (``len(tokenizer)..embedding_rows-1``: reserved ids
    that exist in the embedding vLLM uses and no text can produce), then the tokenizer's special / added tokens
    (``added_tokens_decoder``), each in ascending id order. The reserved rows come first because that is the
    references' choice where a target has them: Qwen3's 151669, the first row past its tokenizer, in SpecForge's and
    DeepSpec's DFlash configs and z-lab's drafters (docs/training/deviations.md, D8). Excluded: bos / eos / pad / unk, every token the chat template emits (found by
    rendering a two-turn conversation), and every id with a nonzero count in ``data_counts`` (counts over *all*
    training tokens, not only masked ones). The first ``k`` survivors are returned. ``SpecframeError`` if fewer than
    ``k`` exist. For SmolLM2 this yields ``<repo_name>`` (3), ``<reponame>`` (4), ... .
    """
    import torch

    if k < 1:
        raise SpecframeError("need at least one mask token (k >= 1)")
    rows = embedding_rows if embedding_rows is not None else len(tokenizer)
    banned = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    if getattr(tokenizer, "chat_template", None):
        probe = [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "v"},
        ]
        for msgs in (probe, probe[1:]):
            text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            banned.update(tokenizer(text, add_special_tokens=False)["input_ids"])
    special = sorted(i for i in getattr(tokenizer, "added_tokens_decoder", {}) if i < rows)
    candidates = list(range(len(tokenizer), rows)) + special
    if data_counts is not None:
        data_counts = torch.as_tensor(data_counts)
    out = []
    for i in candidates:
        if i in banned:
            continue
        if data_counts is not None and i < data_counts.numel() and int(data_counts[i]) > 0:
            continue
        out.append(i)
        if len(out) == k:
            return out
    raise SpecframeError(
        f"only {len(out)} token ids qualify as mask tokens (special/reserved, unused by the chat template and absent "
        f"from the training data), {k} needed; add special tokens to the tokenizer and resize the embedding"
    )

