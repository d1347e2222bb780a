"""The attention path chosen by size when the run names no mask builder (issue #17).

The chunked builder bounds memory on long sequences but pays for it in small matmuls, masked fills and a hand-written
softmax backward per chunk; at the sizes of a short sequence one fused scaled-dot-product call over the dense mask is
faster (benchmarks/throughput.py measures it per drafter). Every builder is tested equal to dense, so the choice
changes time and memory, not the loss.
"""

from __future__ import annotations

from typing import Any

from specframe import api

#: the most bytes a dense attention call may hold for its mask and scores (bool mask + one float32 score per head);
#: above it the run's default builder (chunked on CPU) takes the call. Small next to a training step's other memory,
#: so the memory estimate made for the default builder stays the bound.
DENSE_ATTENTION_BYTES = 64 * 2**20


class SizedMaskBuilder:
    """``dense`` for a (query, key) pair whose mask and scores fit ``limit`` bytes, ``large`` otherwise."""

    def __init__(self, dense: Any, large: Any, heads: int, limit: int = DENSE_ATTENTION_BYTES) -> None:
        self.dense, self.large, self.heads, self.limit = dense, large, heads, limit
        self.name = large.name
        self.options = large.options
        self.visibilities = frozenset(getattr(dense, "visibilities", {"chain"})) & frozenset(
            getattr(large, "visibilities", {"chain"}))
        self.windows = bool(getattr(dense, "windows", False)) and bool(getattr(large, "windows", False))

    def fits(self, queries: int, keys: int) -> bool:
        return queries * keys * (1 + 4 * self.heads) <= self.limit

    def build(self, query: api.ElementSet, key: api.ElementSet) -> Any:
        builder = self.dense if self.fits(len(query), len(key)) else self.large
        return builder.build(query, key)
