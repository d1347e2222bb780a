"""``dense``: the reference mask builder.

It materialises the full visibility matrix (docs/design.md section 3) and hands it to scaled-dot-product attention.
Memory grows with (elements)^2, so it is for tests, paper parity and short contexts; every faster builder is tested
against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specframe import api


class DenseAttention:
    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask.to(q.device))


class DenseMaskBuilder(api.MaskBuilder):
    name = "dense"
    visibilities = frozenset(api.VISIBILITY_RULES)  # api.visible applies whichever rule the sets carry
    windows = True  # and the sets' sliding window
    # the reference every builder is tested against: chosen by default only for calls small enough that one fused
    # SDPA call over the whole mask beats evaluating it in chunks (specframe.engine.attention)
    preference = 10
    small_calls = True

    def build(self, query: api.ElementSet, key: api.ElementSet) -> DenseAttention:
        return DenseAttention(api.visible(query, key))


@api.hookimpl
def register_mask_builders(register):
    register(DenseMaskBuilder)
