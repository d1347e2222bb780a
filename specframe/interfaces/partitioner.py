"""The partitioner interface (``specframe.api.Partitioner``): how one sequence's element set is cut into segments
for gradient accumulation within the sequence."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import attrs
import torch

from specframe.drafting.elements import ElementSet
from specframe.interfaces.component import Component


@attrs.frozen
class Segment:
    """One forward/backward unit of a sequence.

    ``elements`` indexes the sequence's element set (sorted); the segment forwards exactly these elements, which must
    be causally complete (every key an element may see is in the segment). ``loss_mask`` [len(elements)] marks the
    elements whose loss this segment is charged with; every element is charged in exactly one segment.
    """

    elements: torch.Tensor
    loss_mask: torch.Tensor


class Partitioner(Component, ABC):
    """Splits one sequence's element set into segments for gradient accumulation within the sequence."""

    #: API 6: True when the partitioner cuts one sequence's elements into several segments (``--partitions``), so
    #: a long sequence's step holds one segment's activations at a time: the memory advice proposes it (the first
    #: registered such partitioner) when a sequence does not fit whole.
    splits_sequences: ClassVar[bool] = False

    #: API 14: the rule the memory estimate may count this partitioner's segments by, without running it on a long
    #: sequence (``specframe.memory.counts.closed_segments``): ``"whole"`` (one segment holding every element) or
    #: ``"balanced_ranges"`` (contiguous position ranges cut where the owned element count crosses each equal share,
    #: P-EAGLE's; a segment forwards what it owns plus the earlier context its visibility rule needs). None: the
    #: estimate runs the partitioner, up to ``RUN_MAX_LEN`` tokens. Read only from the class that defines
    #: ``partition`` (``counting_rule``), so a subclass that cuts otherwise does not inherit a rule it breaks.
    counted_as: ClassVar[str | None] = None

    @abstractmethod
    def partition(self, elements: ElementSet, num_segments: int) -> list[Segment]:
        """Cut ``elements`` into at most ``num_segments`` segments (the loss is normalised by the core, not here).

        A segment may be empty (say, more segments asked for than the sequence has positions); the engine skips it.
        """


#: the rules ``Partitioner.counted_as`` may name
COUNTING_RULES = ("whole", "balanced_ranges")


def counting_rule(cls: type[Partitioner]) -> str | None:
    """``cls.counted_as`` as declared by the class in its MRO that defines ``partition`` (None if that class declares
    none); ``ValueError`` for a rule other than ``COUNTING_RULES``."""
    owner = next((c for c in cls.__mro__ if "partition" in vars(c)), cls)
    rule = vars(owner).get("counted_as")
    if rule is not None and rule not in COUNTING_RULES:
        raise ValueError(f"{cls.__qualname__}.counted_as must be one of {', '.join(COUNTING_RULES)} or None, "
                         f"got {rule!r}")
    return rule
