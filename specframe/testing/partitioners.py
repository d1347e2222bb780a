"""The partitioner contract, ``PartitionerContract``: what the core relies on from every partitioner, as pytest tests a
partitioner's author subclasses (tests/contract/test_partitioner_contract.py runs it on every registered one):

    from specframe.testing import PartitionerContract

    class TestMyPartitioner(PartitionerContract):
        partitioner = "mine"            # a registered name, or the class itself

The engine forwards and backpropagates one segment at a time and normalises by the whole sequence's count, so the
partition must charge every element in exactly one segment and forward, with each segment, every key its elements
may see (causal completeness, ``specframe.drafting.elements.check_partition``, docs/design.md section 3); then the accumulated
gradients are the unpartitioned pass's. Both are checked on element sets of every shape the engine makes, under
both visibility rules and a sliding window, for several segment counts.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from specframe import api
from specframe.drafting.elements import ElementSet, check_partition
from specframe.testing.components import build_component, component_class
from specframe.testing.element_model import (RuleMaskBuilder, TinyElementModel, accumulated_gradients,
                                             sample_element_sets)


class PartitionerContract:
    """What every partitioner must do, as pytest tests (collected from a subclass named Test*). ``partitioner``: the
    registered name or the class; ``options``: option values; ``segment_counts``: the ``num_segments`` it is asked
    for (more than a sample set has positions included)."""

    partitioner: ClassVar[Any] = None
    options: ClassVar[dict[str, Any]] = {}
    segment_counts: ClassVar[tuple[int, ...]] = (1, 2, 3, 40)

    # -- helpers
    def build(self) -> api.Partitioner:
        return build_component("partitioner", self.partitioner, self.options)

    def element_sets(self) -> list[tuple[str, ElementSet]]:
        """Every sample set (both rules, a window too) and a set of one element."""
        grid = sample_element_sets(("chain",), window=False)[0][1]
        return sample_element_sets() + [("one element", grid.subset(torch.tensor([0])))]

    def cases(self) -> list[tuple[str, ElementSet, int]]:
        """(label, elements, num_segments) for every set and segment count."""
        return [(f"{label}, {n} segment(s)", elements, n) for label, elements in self.element_sets()
                for n in self.segment_counts]

    # -- the contract
    def test_declares_what_the_core_reads(self):
        cls = component_class("partitioner", self.partitioner)
        assert isinstance(cls.name, str) and cls.name, "a partitioner has a registry name"
        assert isinstance(cls.splits_sequences, bool), "splits_sequences must be a bool"

    def test_charges_every_element_once_in_causally_complete_segments(self):
        """At most ``num_segments`` segments (at least one), each a strictly increasing int64 index with a bool
        ``loss_mask``, every element charged exactly once, every segment forwarding every key its elements see."""
        partitioner = self.build()
        name = component_class("partitioner", self.partitioner).name
        for label, elements, n in self.cases():
            segments = partitioner.partition(elements, n)
            assert 1 <= len(segments) <= n, f"{label}: {len(segments)} segments"
            try:
                check_partition(elements, segments, name)
            except api.PluginError as exc:
                raise AssertionError(f"{label}: {exc}") from None

    def test_accumulated_gradients_equal_the_unpartitioned_pass(self):
        """``TinyElementModel`` trained segment by segment (the engine's accumulation: each segment's charged loss
        over the whole sequence's count) gives the single pass's gradients, to float64 precision. Checked without
        ``check_partition``, so a partition that drops context fails here on its own."""
        partitioner = self.build()
        builder = RuleMaskBuilder()
        for index, (label, elements) in enumerate(self.element_sets()):
            g = torch.Generator().manual_seed(index)
            input_ids = torch.randint(0, 32, (elements.seq_len,), generator=g)
            targets = torch.randint(0, 32, (elements.seq_len, elements.max_depth), generator=g)
            supervised = torch.rand(elements.seq_len, generator=g) < 0.8
            supervised[0] = True  # the loss is normalised by the supervised count
            torch.manual_seed(0)
            model = TinyElementModel(vocab=32, hidden=16, heads=2, layers=2, max_len=64).double()
            whole = [api.Segment(torch.arange(len(elements)), torch.ones(len(elements), dtype=torch.bool))]
            want = accumulated_gradients(model, input_ids, targets, supervised, elements, whole, builder)
            for n in self.segment_counts:
                got = accumulated_gradients(model, input_ids, targets, supervised, elements,
                                            partitioner.partition(elements, n), builder)
                assert got.keys() == want.keys(), (f"{label}, {n} segment(s): gradients reach {sorted(got)}, not "
                                                   f"{sorted(want)}")
                for key in want:
                    torch.testing.assert_close(got[key], want[key], atol=1e-12, rtol=1e-10,
                                               msg=lambda m, key=key, n=n: f"{label}, {n} segment(s): {key}: {m}")
