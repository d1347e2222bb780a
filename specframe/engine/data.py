"""Training sequences with target features.

Conversations come from ``specframe.data`` (``--data``: a built-in name, a file or a hub id), are rendered through
the target's chat template with assistant-only loss masks, and truncated to ``--seq-len``. Features are computed
online by the target (``output_hidden_states``; aux layer id i is ``hidden_states[i]``, the state entering decoder
layer i; ``final_hidden`` is the last, normalised state, so ``lm_head(final_hidden)`` are the logits) and kept in
memory after first use, so each sequence costs one target forward per run.
"""

from __future__ import annotations

from typing import Any

import torch

from specframe import api
from specframe.errors import SpecframeError


def feature_request(drafter: api.Drafter) -> tuple[tuple[int, ...], bool]:
    spec = drafter.feature_spec()
    if spec is None:
        return (), False
    aux = getattr(spec, "aux_layer_ids", None)
    if aux is None:
        aux = getattr(spec, "aux_layers", ())
    return tuple(int(i) for i in aux), bool(getattr(spec, "final_hidden", False))


def load_sequences(spec: str, tokenizer: Any, seq_len: int, limit: int | None) -> list[api.TrainingExample]:
    """Token-level examples (no features yet) from a conversation data spec."""
    from specframe.data.chat import EncodeStats, encode_dataset
    from specframe.data.sources import load_data

    stats = EncodeStats()
    records = load_data(spec, limit=limit)
    out = []
    for enc in encode_dataset(tokenizer, records, stats=stats):
        ids = torch.tensor(enc.input_ids[:seq_len], dtype=torch.long)
        mask = torch.tensor(enc.loss_mask[:seq_len], dtype=torch.bool)
        if ids.numel() < 3 or not bool(mask[2:].any()):
            continue  # nothing a shifted drafter could be charged with
        out.append(api.TrainingExample(ids, mask, torch.zeros_like(ids)))
    if not out:
        raise SpecframeError(f"data '{spec}' has no conversation with assistant tokens within --seq-len {seq_len}")
    return out


class OnlineFeatures:
    """Target in the loop: features of each sequence computed on first use and memoised."""

    def __init__(self, target_model: Any, aux_layer_ids: tuple[int, ...], final_hidden: bool) -> None:
        self.model = target_model
        self.aux = aux_layer_ids
        self.final = final_hidden
        self._memo: dict[int, dict[str, torch.Tensor]] = {}

    @torch.no_grad()
    def __call__(self, index: int, example: api.TrainingExample) -> api.TrainingExample:
        if index not in self._memo:
            out = self.model(example.input_ids[None], output_hidden_states=True)
            feats: dict[str, torch.Tensor] = {}
            if self.aux:
                feats["aux_hidden"] = torch.cat([out.hidden_states[i][0] for i in self.aux], dim=-1).float()
            if self.final:
                feats["final_hidden"] = out.hidden_states[-1][0].float()
            self._memo[index] = feats
        return api.TrainingExample(example.input_ids, example.loss_mask, example.doc, self._memo[index])
