"""The P-EAGLE network: the shared ``api.eagle.EagleBackbone`` (an EAGLE-3 first layer, further Llama layers) plus a
learned mask hidden state.

Parameter names follow vLLM's ``llama_eagle3`` layout (``embed_tokens``, ``fc``, ``layers.N.*``, ``norm``,
``lm_head``, ``mask_hidden`` [1, 1, 3H], ``d2t`` / ``t2d``), so export copies tensors without renaming.
``d2t`` holds offsets as EAGLE-3 checkpoints do: target id = draft id + d2t[draft id].
"""

from __future__ import annotations

import torch
from torch import nn

from specframe import api
from specframe.api import modeling


class PEagleModel(api.eagle.EagleBackbone):
    """EAGLE-3's backbone (first layer reads cat(embedding, fused hidden)) plus the one parameter P-EAGLE adds: the
    learned hidden state that stands in for the target's features at every mask slot."""

    def __init__(
        self, shape: modeling.LayerShape, vocab_size: int, draft_vocab_size: int, num_aux: int, layers: int,
        mask_hidden_std: float = 0.02, architecture: api.eagle.Architecture | None = None,
    ) -> None:
        super().__init__(shape, vocab_size, draft_vocab_size, num_aux, layers, architecture=architecture)
        self.mask_hidden = nn.Parameter(torch.zeros(1, 1, num_aux * shape.hidden))
        nn.init.normal_(self.mask_hidden, std=mask_hidden_std)

    def forward(
        self,
        tokens: torch.Tensor,
        aux: torch.Tensor,
        is_mask: torch.Tensor,
        position: torch.Tensor,
        attention: modeling.Attention,
        past: list[modeling.KV] | None = None,
        checkpointing: bool = False,
        aux_index: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[modeling.KV]]:
        """``tokens`` [N], ``aux`` [N, 3H] (rows of mask slots are ignored), ``is_mask`` bool [N], ``position`` [N].
        With ``aux_index`` [N], ``aux`` holds one row per sequence position and element i reads row aux_index[i]:
        fc runs once per position rather than once per element, and no [N, 3H] gather is kept for backward.
        Returns the normalised final states [N, H] and each layer's new (k, v)."""
        embeds = self.embed_tokens(tokens)
        # mask_hidden lives in the raw aux space: input_norm (norm_before_fc) and fc apply to it as to real states
        fused = self.fuse(aux) if aux_index is None else self.fuse(aux)[aux_index]
        mask_fused = self.fuse(self.mask_hidden.view(1, -1))
        hidden = torch.where(is_mask[:, None], mask_fused, fused)
        out, kvs = self.run(embeds, hidden, position, attention, past=past, checkpointing=checkpointing)
        return self.norm(out), kvs
