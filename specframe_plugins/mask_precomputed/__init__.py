"""``precomputed``: P-EAGLE's mask pre-computation (docs/design.md section 3).

The visibility mask of the complete (anchor, depth) grid is built once for ``max_len`` positions, in the
position-major layout (element (a, d) at index a*K + d), and cached; it grows on demand when a longer sequence
arrives. Within one document visibility depends only on the two elements' (anchor, depth) and the drafter's rule (chain or
block, ``specframe.drafting.elements``; the cache is built for one rule and rebuilt if the rule changes), never on the sequence
length, so the mask of a length-L sequence is the top-left (L*K) x (L*K) block of the cached one and the mask of any
element subset (a COD sample, a segment) is a row/column gather of that block.

Packed sequences: the cached mask assumes one document. The shared rule is "same document AND (context OR chain)",
and the cached entry is exactly the "(context OR chain)" part, so AND-ing the gathered block with the block-diagonal
document mask (query doc == key doc) gives the exact packed mask.

It still hands SDPA a dense [queries, keys] mask per call, so its memory grows like ``dense``'s; what it saves is the
per-batch mask construction.
"""

from __future__ import annotations

import math

import attrs
import torch
import torch.nn.functional as F

from specframe import api

# Growth is rounded up so slightly longer sequences do not each trigger a rebuild.
_GROW_MULTIPLE = 128
# Row block used while building the cached mask, to bound the temporaries of the comparison.
_BUILD_ROWS = 4096


@attrs.define
class PrecomputedOptions:
    max_len: int = attrs.field(default=512, validator=attrs.validators.gt(0), metadata={
        "help": "positions the cached mask covers at first; longer sequences grow it"})


class PrecomputedAttention:
    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask
        self._on: dict[torch.device, torch.Tensor] = {}

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # Every layer calls with the same mask: copy it to the accelerator once, not once per layer.
        if q.device not in self._on:
            self._on[q.device] = self.mask.to(q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self._on[q.device])


def grid_mask(max_len: int, max_depth: int, rule: str = "chain") -> torch.Tensor:
    """Single-document visibility of the complete grid under ``rule``, bool [max_len*K, max_len*K], index a*K + d."""
    n = max_len * max_depth
    anchor = torch.arange(max_len).repeat_interleave(max_depth)
    depth = torch.arange(max_depth).repeat(max_len)
    mask = torch.empty(n, n, dtype=torch.bool)
    for start in range(0, n, _BUILD_ROWS):
        qa = anchor[start : start + _BUILD_ROWS, None]
        qd = depth[start : start + _BUILD_ROWS, None]
        mask[start : start + _BUILD_ROWS] = api.rule_matrix(rule, qa, qd, anchor[None, :], depth[None, :])
    return mask


class PrecomputedMaskBuilder(api.MaskBuilder):
    name = "precomputed"
    Options = PrecomputedOptions

    visibilities = frozenset(api.VISIBILITY_RULES)
    windows = True
    # a full mask like dense's, built once: preferred to dense when a run must hold a full mask anyway
    preference = 20

    def __init__(self, options: PrecomputedOptions | None = None) -> None:
        super().__init__(options)
        self._mask: torch.Tensor | None = None
        self._len = 0
        self._depth = 0
        self._rule = "chain"

    def attention_bytes(self, shape: api.AttentionShape) -> int:
        # the per-call mask, plus the cached grid mask of the whole sequence, alive for the whole run
        return api.full_mask_bytes(shape) + (shape.seq_len * shape.depth) ** 2

    def cached_mask(self, seq_len: int, max_depth: int, rule: str = "chain") -> torch.Tensor:
        """The cached grid mask covering at least ``seq_len`` positions at depth ``max_depth`` under ``rule`` (built
        if needed; a builder serves one drafter, so a change of depth or rule rebuilds rather than keeping both)."""
        same = max_depth == self._depth and rule == self._rule
        if self._mask is None or not same or seq_len > self._len:
            length = max(self.options.max_len, self._len if same else 0, seq_len)
            length = math.ceil(length / _GROW_MULTIPLE) * _GROW_MULTIPLE if length > self.options.max_len else length
            self._mask, self._len, self._depth, self._rule = grid_mask(length, max_depth, rule), length, max_depth, rule
        return self._mask

    def build(self, query: api.ElementSet, key: api.ElementSet) -> PrecomputedAttention:
        if query.max_depth != key.max_depth or query.seq_len != key.seq_len:
            raise api.UsageError(
                f"query and key elements come from different grids: seq_len {query.seq_len} vs {key.seq_len}, "
                f"max_depth {query.max_depth} vs {key.max_depth}"
            )
        depth = query.max_depth
        width = query.seq_len * depth
        block = self.cached_mask(query.seq_len, depth, api.shared_visibility(query, key))[:width, :width]
        qi = query.anchor * depth + query.depth
        ki = key.anchor * depth + key.depth
        mask = block[qi[:, None], ki[None, :]]
        mask &= query.doc[:, None] == key.doc[None, :]
        window = api.shared_window(query, key)
        if window is not None:  # the cached grid is unwindowed: the windowed rule is a subset of it
            mask &= api.rule_matrix(api.shared_visibility(query, key), query.anchor[:, None],
                                    query.depth[:, None], key.anchor[None, :], key.depth[None, :], window)
        return PrecomputedAttention(mask)


@api.hookimpl
def register_mask_builders(register):
    register(PrecomputedMaskBuilder)
