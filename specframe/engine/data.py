"""Training sequences with target features, online (target in the loop) or from the shared feature cache.

Both sources give the same thing: ``len(source)`` sequences, ``source.tokens(i)`` (a ``TrainingExample`` without
features, for vocabulary and mask-token choices) and ``source.example(i)`` (with the features the drafter declared:
``aux_hidden`` [L, n_aux * H], ``final_hidden`` [L, H], float32). Sequences longer than ``--seq-len`` are truncated.

Online: conversations come from ``specframe.data`` (``--data``: a built-in name, a file or a hub id), are rendered
through the target's chat template with assistant-only loss masks, and the target computes features on first use
(``specframe.features.capture_features``); they are kept in memory, so each sequence costs one target forward per run.
Cache: ``specframe.cache.FeatureCache`` written by ``specframe prepare`` for the same target and aux layers.
"""

from __future__ import annotations

from typing import Any

import torch

from specframe import api
from specframe.errors import SpecframeError


def _usable(ids: torch.Tensor, mask: torch.Tensor) -> bool:
    # a shifted (EAGLE-style) drafter is charged with x_{i+2}: something from the third token on must be supervised
    return ids.numel() >= 3 and bool(mask[2:].any())


class OnlineSource:
    def __init__(self, spec: str, target: Any, feature_spec: Any, seq_len: int, limit: int | None) -> None:
        from specframe.data.chat import EncodeStats, encode_dataset
        from specframe.data.sources import load_data

        self.target = target
        self.feature_spec = feature_spec
        self.stats = EncodeStats()
        self._tokens: list[api.TrainingExample] = []
        for enc in encode_dataset(target.tokenizer, load_data(spec, limit=limit), stats=self.stats):
            ids = torch.tensor(enc.input_ids[:seq_len], dtype=torch.long)
            mask = torch.tensor(enc.loss_mask[:seq_len], dtype=torch.bool)
            if _usable(ids, mask):
                self._tokens.append(api.TrainingExample(ids, mask, torch.zeros_like(ids)))
        if not self._tokens:
            raise SpecframeError(f"data '{spec}' has no conversation with assistant tokens within --seq-len {seq_len}")
        self._memo: dict[int, dict[str, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self._tokens)

    def tokens(self, i: int) -> api.TrainingExample:
        return self._tokens[i]

    def example(self, i: int) -> api.TrainingExample:
        from specframe.features import capture_features

        ex = self._tokens[i]
        if i not in self._memo:
            f = capture_features(self.target, ex.input_ids[None], self.feature_spec, dtype=torch.float32)
            feats = {}
            if f.aux is not None:
                feats["aux_hidden"] = f.aux[0]
            if f.final is not None:
                feats["final_hidden"] = f.final[0]
            self._memo[i] = feats
        return api.TrainingExample(ex.input_ids, ex.loss_mask, ex.doc, self._memo[i])


class CacheSource:
    def __init__(self, path: str, target: Any, feature_spec: Any, seq_len: int, limit: int | None) -> None:
        from specframe.cache import FeatureCache

        self.cache = FeatureCache(path, target=target)
        want = tuple(getattr(feature_spec, "aux_layers", None) or ())
        if want and self.cache.aux_layers != want:
            raise SpecframeError(
                f"feature cache {path} holds aux layers {list(self.cache.aux_layers)} but the drafter needs "
                f"{list(want)}; prepare a cache with those layers or set the drafter's aux_layer_ids"
            )
        self.seq_len = seq_len
        n = len(self.cache) if limit is None else min(limit, len(self.cache))
        self._index = []
        self._tokens: list[api.TrainingExample] = []
        for i in range(n):
            e = self.cache[i]
            ids, mask = e.tokens[:seq_len].long(), e.loss_mask[:seq_len].bool()
            if _usable(ids, mask):
                self._index.append(i)
                self._tokens.append(api.TrainingExample(ids, mask, torch.zeros_like(ids)))
        if not self._tokens:
            raise SpecframeError(f"feature cache {path} has no sequence with assistant tokens within --seq-len")

    def __len__(self) -> int:
        return len(self._tokens)

    def tokens(self, i: int) -> api.TrainingExample:
        return self._tokens[i]

    def example(self, i: int) -> api.TrainingExample:
        e = self.cache[self._index[i]]
        ex = self._tokens[i]
        feats = {}
        if e.aux_hidden is not None:
            feats["aux_hidden"] = e.aux_hidden[: self.seq_len].float()
        if e.final_hidden is not None:
            feats["final_hidden"] = e.final_hidden[: self.seq_len].float()
        return api.TrainingExample(ex.input_ids, ex.loss_mask, ex.doc, feats)
