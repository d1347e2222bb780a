"""The mask builder contract (``specframe.testing.MaskBuilderContract``) on every registered mask builder, and a
builder with one planted slip, which it must fail. Small options make the sample sets cross the builders' internal
boundaries (precomputed's cache growth, chunked's chunks); flex is checked forward only here (it trains on CUDA
only), uncompiled."""

from __future__ import annotations

import pytest

from specframe import plugins
from specframe.testing import MaskBuilderContract

OPTIONS = {"precomputed": {"max_len": 4}, "chunked": {"chunk_size": 5}, "flex": {"compile": False}}

REGISTERED = plugins.load().names("mask builder")
for _name in REGISTERED:
    _cls = f"TestMaskBuilder_{_name}"
    globals()[_cls] = type(_cls, (MaskBuilderContract,), {"builder": _name, "options": OPTIONS.get(_name, {})})


def test_every_registered_builder_is_under_the_contract():
    assert REGISTERED and all(f"TestMaskBuilder_{name}" in globals() for name in REGISTERED)


class _HidesOneKey(plugins.get("mask builder", "dense")):
    """Planted: the dense builder with one visible key hidden from the query that sees the most."""

    name = "hides-one-key"

    def build(self, query, key):
        attention = super().build(query, key)
        mask = attention.mask.clone()
        i = int(mask.sum(1).argmax())
        mask[i, int(mask[i].nonzero()[0])] = False
        return type(attention)(mask)


class _HidesOneKeyContract(MaskBuilderContract):  # not collected: its tests are expected to fail, below
    builder = _HidesOneKey


def test_the_contract_fails_a_builder_that_hides_one_visible_key():
    contract = _HidesOneKeyContract()
    with pytest.raises(AssertionError, match=r"chain grid: query \(anchor \d+, depth \d+, doc 0\) does not attend key"):
        contract.test_attends_exactly_the_visible_keys()
    with pytest.raises(AssertionError, match="output"):
        contract.test_outputs_and_gradients_equal_the_reference()
    with pytest.raises(AssertionError):
        contract.test_trains_the_tiny_model_as_the_reference_does()
