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

    @abstractmethod
    def partition(self, elements: ElementSet, num_segments: int) -> list[Segment]:
        """Cut ``elements`` into at most ``num_segments`` segments (the loss is normalised by the core, not here).

        A segment may be empty (say, more segments asked for than the sequence has positions); the engine skips it.
        """
