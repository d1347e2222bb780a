"""``flex``: FlexAttention with a block mask built from the (anchor, depth, doc) vectors (docs/design.md section 3).

``create_block_mask`` evaluates the element sets' visibility rule (chain or block) block by block, so fully masked blocks (most of the
context beyond a chunk's anchors, and almost every deeper key) are skipped by the fused kernel, and no element^2 mask
exists. Training needs CUDA: torch's CPU FlexAttention has no backward ("FlexAttention does not support backward on
CPU"); its CPU forward works and is tested against ``dense``.
"""

from __future__ import annotations

import attrs
import torch

from specframe import api


@attrs.define
class FlexOptions:
    compile: bool = attrs.field(default=True, metadata={
        "help": "compile flex_attention on CUDA (eager FlexAttention materialises the scores: for debugging only)"})


def _mask_mod(query: api.ElementSet, key: api.ElementSet):
    qa, qd, qdoc, ka, kd, kdoc = query.anchor, query.depth, query.doc, key.anchor, key.depth, key.doc
    rule, window = api.shared_visibility(query, key), api.shared_window(query, key)

    def mask_mod(b, h, q_idx, kv_idx):
        return (qdoc[q_idx] == kdoc[kv_idx]) & api.rule_matrix(rule, qa[q_idx], qd[q_idx], ka[kv_idx], kd[kv_idx],
                                                               window)

    return mask_mod


def _on(elements: api.ElementSet, device: torch.device) -> api.ElementSet:
    return api.ElementSet(
        elements.anchor.to(device), elements.depth.to(device), elements.doc.to(device), elements.seq_len,
        elements.max_depth, visibility=elements.visibility, window=elements.window,
    )


_compiled = None


def _flex_attention(compile: bool):
    global _compiled
    from torch.nn.attention.flex_attention import flex_attention

    if not compile:
        return flex_attention
    if _compiled is None:
        _compiled = torch.compile(flex_attention)
    return _compiled


class FlexAttention:
    def __init__(self, query: api.ElementSet, key: api.ElementSet, compile: bool) -> None:
        self.query, self.key, self.compile = query, key, compile
        self._masks: dict[torch.device, object] = {}

    def block_mask(self, device: torch.device):
        """The block mask on ``device``, built on first use (the element vectors must live where the kernel runs)."""
        if device not in self._masks:
            from torch.nn.attention.flex_attention import create_block_mask

            mask_mod = _mask_mod(_on(self.query, device), _on(self.key, device))
            # Uncompiled block-mask creation evaluates the rule on the whole [queries, keys] grid at once, which is
            # the element^2 memory this builder exists to avoid; compiled creation works block by block.
            compiled = self.compile and torch.device(device).type == "cuda"
            self._masks[device] = create_block_mask(
                mask_mod, None, None, len(self.query), len(self.key), device=device, _compile=compiled
            )
        return self._masks[device]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        attend = _flex_attention(self.compile and q.device.type == "cuda")
        return attend(q, k, v, block_mask=self.block_mask(q.device))


class FlexMaskBuilder(api.MaskBuilder):
    name = "flex"
    Options = FlexOptions
    devices = frozenset({"cuda"})
    visibilities = frozenset(api.VISIBILITY_RULES)
    windows = True
    # fused block-sparse kernels: the fastest wherever it trains (CUDA); costed as query blocks (the default)
    preference = 40
    query_blocks = True

    def build(self, query: api.ElementSet, key: api.ElementSet) -> FlexAttention:
        return FlexAttention(query, key, self.options.compile)


@api.hookimpl
def register_mask_builders(register):
    register(FlexMaskBuilder)
