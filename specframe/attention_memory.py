"""What a mask builder's attention holds in memory during a training step: the two cost models the estimator is
calibrated with (``benchmarks/mask_memory.py`` and ``benchmarks/memory_context.py`` measure them), which mask
builders declare theirs with (``MaskBuilder.attention_bytes``, API 6, exposed as ``specframe.api``).

A leaf module: ``specframe.memory`` and ``specframe.api`` both import it, so neither imports the other.
"""

from __future__ import annotations

import attrs

#: a full (queries x keys) mask: bytes per mask entry alive at once besides the per-layer copies: the bool mask and its
#: build temporaries (SDPA also saves a float32 copy of the mask for backward in every layer: 4 bytes per layer)
DENSE_BYTES_PER_ENTRY = 6.0
#: query blocks: score-sized fp32 blocks alive at once in backward (p, dS, dO V^T)
CHUNK_SCORE_BLOCKS = 3


@attrs.frozen
class AttentionShape:
    """One training segment's attention as the memory estimate charges it (``MaskBuilder.attention_bytes``)."""

    #: rows the drafter's layers run for the segment (queries and keys: a segment attends over its own rows)
    rows: int
    #: the training depth (a query's band of keys beyond its context is at most this long)
    depth: int
    #: the training sequence length (a builder that caches the whole sequence's grid mask holds (seq_len x depth)^2)
    seq_len: int
    #: query heads of the drafter's attention
    heads: int
    #: layers whose attention the backward keeps a copy of (1 under activation checkpointing, else every layer)
    saved_copies: int


def full_mask_bytes(shape: AttentionShape) -> int:
    """A builder that materialises the (rows x rows) mask and hands it to one fused attention call per layer."""
    return int((DENSE_BYTES_PER_ENTRY + 4 * shape.saved_copies) * shape.rows**2)


def query_block_bytes(shape: AttentionShape, block: int) -> int:
    """A builder that evaluates the mask ``block`` queries at a time: one block's band of keys (the block plus the
    depth beyond its anchors' context), its scores in fp32 for every head and the blocks its backward holds."""
    queries = min(block, shape.rows)
    band = min(shape.rows, block + shape.depth)
    return int(CHUNK_SCORE_BLOCKS * shape.heads * queries * band * 4 + 4 * queries * band)
