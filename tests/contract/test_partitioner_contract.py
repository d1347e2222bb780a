"""The partitioner contract (``specframe.testing.PartitionerContract``) on every registered partitioner, and
partitioners with one planted slip each, which it must fail."""

from __future__ import annotations

import pytest

from specframe import api, plugins
from specframe.testing import PartitionerContract

REGISTERED = plugins.load().names("partitioner")
for _name in REGISTERED:
    _cls = f"TestPartitioner_{_name}"
    globals()[_cls] = type(_cls, (PartitionerContract,), {"partitioner": _name})


def test_every_registered_partitioner_is_under_the_contract():
    assert REGISTERED and all(f"TestPartitioner_{name}" in globals() for name in REGISTERED)


class _DropsContext(plugins.get("partitioner", "peagle")):
    """Planted: each segment forwards only the elements it is charged with, not the earlier context they see."""

    name = "drops-context"

    def partition(self, elements, num_segments):
        return [api.Segment(s.elements[s.loss_mask], s.loss_mask[s.loss_mask])
                for s in super().partition(elements, num_segments)]


class _ChargesTwice(plugins.get("partitioner", "peagle")):
    """Planted: the last segment is charged with its context too, so those elements count twice."""

    name = "charges-twice"

    def partition(self, elements, num_segments):
        segments = super().partition(elements, num_segments)
        last = segments[-1]
        return segments[:-1] + [api.Segment(last.elements, last.loss_mask | True)]


class _DropsContextContract(PartitionerContract):  # not collected: its tests are expected to fail, below
    partitioner = _DropsContext


class _ChargesTwiceContract(PartitionerContract):
    partitioner = _ChargesTwice


def test_the_contract_fails_a_partition_that_drops_context():
    contract = _DropsContextContract()
    with pytest.raises(AssertionError, match="not causally complete"):
        contract.test_charges_every_element_once_in_causally_complete_segments()
    with pytest.raises(AssertionError):  # the gradients alone see it too
        contract.test_accumulated_gradients_equal_the_unpartitioned_pass()


def test_the_contract_fails_a_partition_that_charges_an_element_twice():
    contract = _ChargesTwiceContract()
    with pytest.raises(AssertionError, match="charged"):
        contract.test_charges_every_element_once_in_causally_complete_segments()
    with pytest.raises(AssertionError):
        contract.test_accumulated_gradients_equal_the_unpartitioned_pass()
