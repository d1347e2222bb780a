"""``none``: no partitioning; the whole sequence is one segment."""

from __future__ import annotations

import torch

from specframe import api


class NoPartitioner(api.Partitioner):
    name = "none"
    counted_as = "whole"

    def partition(self, elements: api.ElementSet, num_segments: int) -> list[api.Segment]:
        n = len(elements)
        return [api.Segment(torch.arange(n, dtype=torch.long), torch.ones(n, dtype=torch.bool))]


@api.hookimpl
def register_partitioners(register):
    register(NoPartitioner)
