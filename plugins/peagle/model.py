"""The P-EAGLE network: an EAGLE-3 first layer, further Llama layers, a learned mask token and mask hidden state.

Parameter names follow vLLM's ``llama_eagle3`` layout (``embed_tokens``, ``fc``, ``layers.N.*``, ``norm``,
``lm_head``, ``mask_hidden`` [1, 1, 3H], ``d2t`` / ``t2d``), so export copies tensors without renaming.
``d2t`` holds offsets as EAGLE-3 checkpoints do: target id = draft id + d2t[draft id].
"""

from __future__ import annotations

import torch
from torch import nn

from specframe.api import modeling


class PEagleModel(nn.Module):
    def __init__(
        self, shape: modeling.LayerShape, vocab_size: int, draft_vocab_size: int, num_aux: int, layers: int
    ) -> None:
        super().__init__()
        self.shape = shape
        h = shape.hidden
        self.embed_tokens = nn.Embedding(vocab_size, h)
        self.fc = nn.Linear(num_aux * h, h, bias=False)
        self.layers = nn.ModuleList([modeling.DecoderLayer(shape, eagle_input=(i == 0)) for i in range(layers)])
        self.norm = modeling.RMSNorm(h, shape.eps)
        self.lm_head = nn.Linear(h, draft_vocab_size, bias=False)
        self.mask_hidden = nn.Parameter(torch.zeros(1, 1, num_aux * h))
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(vocab_size, dtype=torch.bool))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
        nn.init.normal_(self.mask_hidden, std=0.02)

    def set_draft_vocab(self, draft_ids: torch.Tensor) -> None:
        """Install the draft vocabulary (target ids, strictly increasing)."""
        draft_ids = draft_ids.to(torch.long)
        self.d2t.copy_(draft_ids - torch.arange(draft_ids.numel()))
        self.t2d.zero_()
        self.t2d[draft_ids] = True

    def draft_ids(self) -> torch.Tensor:
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

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
        embeds = self.embed_tokens(tokens)[None]
        fused = self.fc(aux) if aux_index is None else self.fc(aux)[aux_index]
        mask_fused = self.fc(self.mask_hidden.view(1, -1))
        hidden = torch.where(is_mask[:, None], mask_fused, fused)[None]
        out, kvs = modeling.run_layers(
            self.layers, hidden, embeds, position, self.shape, attention, past=past, checkpointing=checkpointing
        )
        return self.norm(out[0]), kvs
