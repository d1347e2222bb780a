"""The target side of decoding: one KV cache, verification forwards over chains and trees, and cache roll-back.

The cache holds every committed token except the newest one (the *pending* token, which the target has not read
yet). A verification forward reads [pending, draft nodes...] at positions base + depth, so the target's row 0
predicts the first draft level and row i + 1 the child of draft node i. Chains use the model's own causal mask; trees
get an explicit 4-D additive ancestor mask and depth-based ``position_ids`` in the same single forward. Afterwards
``keep`` leaves the pending token plus the accepted path in the cache: a crop for a chain, a gather of the accepted
rows into place (the "KV path copy") for a tree.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from specframe.errors import SpecframeError
from specframe.features import FeatureSpec
from specframe.drafting.draft_tree import ancestor_mask, node_depths


@attrs.frozen
class Forward:
    """What one target forward returned: ``logits`` [n, V] and ``features`` (name -> [n, ...]) for its n rows."""

    logits: torch.Tensor
    features: dict[str, torch.Tensor]

    def rows(self, index: list[int]) -> dict[str, torch.Tensor]:
        return {name: value[index] for name, value in self.features.items()}


class TargetSession:
    """A causal-LM target decoding one sequence (batch size 1) with a ``DynamicCache``; counts its forwards."""

    def __init__(self, model: Any, features: FeatureSpec | None = None) -> None:
        self.model = model
        spec = features or FeatureSpec()
        spec.validate(int(model.config.num_hidden_layers))
        self.aux_layers = tuple(int(i) for i in spec.aux_layers or ())
        self.final_hidden = bool(spec.final_hidden)
        self.cache = DynamicCache(config=model.config)
        self.forwards = 0
        self._pending_rows = 0

    @property
    def length(self) -> int:
        """Tokens in the KV cache."""
        return self.cache.get_seq_length()

    @torch.no_grad()
    def _run(self, ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None) -> Forward:
        device = self.model.device
        out = self.model(
            input_ids=ids.view(1, -1).to(device),
            position_ids=position_ids.view(1, -1).to(device),
            attention_mask=mask,
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=bool(self.aux_layers) or self.final_hidden,
        )
        self.forwards += 1
        features: dict[str, torch.Tensor] = {}
        if self.aux_layers:
            # hidden_states[i] is the input of decoder layer i (0 = embeddings): the aux layer id convention.
            features["aux_hidden"] = torch.cat([out.hidden_states[i][0] for i in self.aux_layers], dim=-1).cpu()
        if self.final_hidden:
            # transformers' last hidden state is taken after the final norm (checked in tests/unit/test_decoding.py).
            features["final_hidden"] = out.hidden_states[-1][0].cpu()
        # the target may run on a GPU (--device); drafting and verification stay on the CPU, where the reference
        # engine's bookkeeping lives (it judges acceptance and losslessness; vLLM is where speed is measured)
        return Forward(out.logits[0].float().cpu(), features)

    def prefill(self, prompt_ids: torch.Tensor) -> Forward:
        """Read the whole prompt; row i of the result belongs to prompt position i."""
        if self.length:
            raise SpecframeError("prefill on a session that already holds a sequence")
        n = int(prompt_ids.numel())
        if n == 0:
            raise SpecframeError("the prompt is empty")
        return self._run(prompt_ids, torch.arange(n), None)

    def verify(self, pending: int, tokens: torch.Tensor, parents: torch.Tensor | None) -> Forward:
        """One forward over [pending, tokens...]; ``parents`` None means a chain. Rows follow that order."""
        base = self.length
        ids = torch.cat([torch.tensor([pending], dtype=torch.long), tokens.long().cpu()])
        if parents is None:
            positions = base + torch.arange(ids.numel())
            mask = None
        else:
            positions = base + torch.cat([torch.zeros(1, dtype=torch.long), node_depths(parents)])
            mask = self._tree_mask(base, parents)
        self._pending_rows = int(ids.numel())
        return self._run(ids, positions, mask)

    def _tree_mask(self, base: int, parents: torch.Tensor) -> torch.Tensor:
        tree = ancestor_mask(parents)
        n = tree.shape[0]
        allowed = torch.cat([torch.ones(n, base, dtype=torch.bool), tree], dim=1)
        dtype = self.model.dtype
        # An additive float mask works for both the eager and the SDPA attention paths (a bool mask does not).
        mask = torch.zeros(n, base + n, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
        return mask.view(1, 1, n, base + n).to(self.model.device)

    def keep(self, accepted: list[int]) -> None:
        """After ``verify``: keep the pending token and the accepted draft nodes (root to leaf), drop the rest."""
        read = self._pending_rows
        base = self.length - read
        rows = [0] + [1 + a for a in accepted]
        if rows == list(range(len(rows))):
            if read > len(rows):
                self.cache.crop(-(read - len(rows)))
            return
        if any(type(layer) is not DynamicLayer for layer in self.cache.layers):
            raise SpecframeError("tree verification needs a plain full-attention KV cache (DynamicLayer)")
        # KV path copy: move the accepted nodes' rows right behind the pending token, then crop the rest.
        # the index lives where each cache tensor does: under --device-map every layer's cache is on its own GPU
        kept = torch.tensor([base + r for r in rows[1:]])
        index: dict[torch.device, torch.Tensor] = {}
        for layer in self.cache.layers:
            for full in (layer.keys, layer.values):
                if full.device not in index:
                    index[full.device] = kept.to(full.device)
                full[:, :, base + 1 : base + len(rows)] = full.index_select(2, index[full.device])
        self.cache.crop(-(read - len(rows)))
