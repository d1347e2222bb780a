"""The mask-builder interface (``specframe.api.MaskBuilder``): what turns a segment's element sets into an attention
function that applies their visibility rule, and the ``SegmentAttention`` a drafter's loss receives from it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Protocol

import attrs
import torch

from specframe.attention_memory import AttentionShape, full_mask_bytes, query_block_bytes
from specframe.drafting.elements import ElementSet
from specframe.errors import UsageError
from specframe.interfaces.component import Component


class Attention(Protocol):
    """Masked attention for one segment: ``q`` [B, heads, Nq, D], ``k`` / ``v`` [B, heads, Nk, D] -> [B, heads, Nq, D].

    Query i may attend key j iff ``visible(query, key)[i, j]`` (under the rule the element sets carry, chain or
    block); scores are scaled by 1/sqrt(D). Heads are already
    expanded (grouped-query attention repeats k / v before the call), unless the callable has a true ``grouped_kv``
    attribute: then k / v come with their own head count (``heads`` a multiple of it, query head h reading k / v head
    ``h // (heads // kv_heads)``), which saves the repeated copies at long context.
    """

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class MaskBuilder(Component, ABC):
    """Turns the element sets of a segment into an attention function that applies their visibility rule
    (``ElementSet.visibility``: the drafter's declared ``chain`` or ``block``, see ``specframe.drafting.elements``)."""

    #: devices (``torch.device.type``) the builder supports for training (forward and backward)
    devices: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})
    #: the visibility rules the builder applies (``VISIBILITY_RULES``); a builder that predates API 2 applies only
    #: the chain rule, so that is the default, and ``SegmentAttention.build`` refuses it a block drafter's elements
    visibilities: ClassVar[frozenset[str]] = frozenset({"chain"})
    #: API 13: True when the builder applies an element set's sliding ``window`` (``rule_matrix``'s window clause);
    #: False (a builder written before it) has windowed sets refused by ``SegmentAttention``, never attended unwindowed
    windows: ClassVar[bool] = False
    #: API 6: the order a run that names no builder tries the registered ones in (``specframe.masks``): the highest
    #: that trains on the run's device is chosen (ties: registration order). 0, the default, ranks below every
    #: built-in, so installing a builder never changes another run's default unless it says it should.
    preference: ClassVar[int] = 0
    #: API 6: True when one fused call over the full (queries x keys) mask is the fastest way to run a small
    #: attention call; a run that names no builder sends calls below ``engine.attention.DENSE_ATTENTION_BYTES`` to
    #: the most preferred such builder (dense), the rest to its default builder.
    small_calls: ClassVar[bool] = False
    #: API 6: True when the builder evaluates the mask in blocks of queries and never holds the whole (queries x
    #: keys) mask: the memory advice proposes such a builder (the most preferred one) to a run whose builder does.
    query_blocks: ClassVar[bool] = False
    #: API 6: True when the builder's attention takes k / v with their own grouped-query head count
    #: (``Attention.grouped_kv``), so the memory estimate charges k / v at that count rather than repeated.
    grouped_kv: ClassVar[bool] = False

    @abstractmethod
    def build(self, query: ElementSet, key: ElementSet) -> Attention:
        """Return the attention function for queries ``query`` over keys ``key`` (reused by every layer). Queries
        and keys may be any subsets of one sequence's elements, in any order."""

    def attention_bytes(self, shape: AttentionShape) -> int:
        """API 6: the bytes this builder's attention holds for one training segment of ``shape`` while its backward
        runs, what ``specframe.memory``'s estimate charges (and its in-run guard checks against the measured peak).
        Two calibrated models are at hand: ``full_mask_bytes(shape)`` and ``query_block_bytes(shape, block)``.
        Default: a builder declaring ``query_blocks`` is charged as blocks of 256 queries, any other as a full mask
        (the safe side: an estimate that is too low proposes a context length that runs out of memory)."""
        return query_block_bytes(shape, 256) if self.query_blocks else full_mask_bytes(shape)


@attrs.frozen
class SegmentAttention:
    """What ``Drafter.loss`` receives: the mask builder's attention over the segment's elements (call it like an
    ``Attention``), plus ``subset(query, key)``, the same builder's attention for other subsets of the segment's
    elements. A drafter that runs several passes over parts of a segment (EAGLE-3's training-time test forwards only
    the depth each pass changes, reading the shallower depths' keys from earlier passes) builds those with it, so it
    keeps the configured builder's memory behaviour and the shared visibility rule."""

    builder: MaskBuilder
    attention: Attention

    @classmethod
    def build(cls, builder: MaskBuilder, elements: ElementSet) -> SegmentAttention:
        check_builder_visibility(builder, elements.visibility, elements.window)
        return cls(builder, builder.build(elements, elements))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.attention(*one_dtype(q, k, v))

    @property
    def grouped_kv(self) -> bool:
        return bool(getattr(self.attention, "grouped_kv", False))

    def subset(self, query: ElementSet, key: ElementSet) -> Attention:
        check_builder_visibility(self.builder, query.visibility, query.window)
        return SegmentAttention(self.builder, self.builder.build(query, key))


def one_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v in one floating dtype, as a mask builder receives them through ``SegmentAttention``: autocast's where
    autocast is on (as torch's own SDPA does), else the promoted one. Under bf16 / fp16 autocast a drafter's q and k
    leave RMSNorms with fp32 weights in fp32 while v leaves a projection in the autocast dtype, and the builders'
    fused kernels take one dtype (the chunked builder's CPU flash kernel raised "expected scalar type Float but
    found BFloat16" on DFlash's bf16 step)."""
    if q.dtype == k.dtype == v.dtype:
        return q, k, v
    device = q.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def check_builder_visibility(builder: MaskBuilder, rule: str, window: int | None = None) -> None:
    """Refuse (``UsageError``) a mask builder that does not declare ``rule`` in its ``visibilities``, or a
    ``window`` without ``windows``: it would otherwise attend by another rule than the drafter's, which trains
    silently on the wrong masks."""
    if window is not None and not getattr(builder, "windows", False):
        raise UsageError(
            f"mask builder '{getattr(builder, 'name', type(builder).__name__)}' does not apply a sliding window, and "
            f"the drafter attends within {window} positions; choose a builder that does (dense, precomputed, chunked "
            "or flex)")
    rules = getattr(builder, "visibilities", frozenset({"chain"}))
    if rule not in rules:
        raise UsageError(
            f"mask builder '{getattr(builder, 'name', type(builder).__name__)}' applies the "
            f"{', '.join(sorted(rules))} visibility rule(s), not the drafter's '{rule}' rule; choose a builder "
            f"that declares it (dense, precomputed, chunked and flex apply every rule)"
        )
