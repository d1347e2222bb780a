"""The mask builder contract, ``MaskBuilderContract``: what the core relies on from every mask builder, as pytest
tests a builder's author subclasses (tests/contract/test_mask_builder_contract.py runs it on every registered one):

    from specframe.testing import MaskBuilderContract

    class TestMyBuilder(MaskBuilderContract):
        builder = "mine"                # a registered name, or the class itself
        options = {"block": 4}          # small options, so the small sets below cross its internal boundaries

The core hands a builder element sets and trains through the attention it returns, so a builder must attend exactly
the keys the sets' visibility rule lets each query see (``specframe.drafting.elements.visible``, docs/design.md section 3),
under every rule and window it declares, for queries and keys that are any subsets of a sequence in any order, and
give the reference's outputs and gradients: a builder that drifts from the rule trains on other masks than the
drafter declared, and nothing downstream notices.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from specframe import api
from specframe.drafting.elements import VISIBILITY_RULES, ElementSet, visible
from specframe.testing.components import build_component, component_class
from specframe.testing.element_model import (RuleAttention, RuleMaskBuilder, TinyElementModel, accumulated_gradients,
                                             sample_element_sets)
from specframe.values import is_int

# float64 everywhere: a builder's kernel may sum in another order than the reference, never lose precision
TOLERANCE = {"atol": 1e-10, "rtol": 1e-9}


def _describe(elements: ElementSet, i: int) -> str:
    return f"(anchor {int(elements.anchor[i])}, depth {int(elements.depth[i])}, doc {int(elements.doc[i])})"


class MaskBuilderContract:
    """What every mask builder must do, as pytest tests (collected from a subclass named Test*). ``builder``: the
    registered name or the class; ``options``: option values; ``device``: where the checks run (a builder that does
    not train there, by its ``devices``, is checked forward only); ``heads``: query heads of the attention calls."""

    builder: ClassVar[Any] = None
    options: ClassVar[dict[str, Any]] = {}
    device: ClassVar[str] = "cpu"
    heads: ClassVar[int] = 2

    # -- helpers
    def build(self) -> api.MaskBuilder:
        if torch.device(self.device).type == "cuda" and not torch.cuda.is_available():
            pytest.skip(f"no CUDA device here for the contract's device '{self.device}'")
        return build_component("mask builder", self.builder, self.options)

    def trains_here(self) -> bool:
        return torch.device(self.device).type in component_class("mask builder", self.builder).devices

    def cases(self) -> list[tuple[str, ElementSet, ElementSet]]:
        """(label, queries, keys): each sample set over itself, then a shuffled half of its elements as queries over
        all of them shuffled, under every rule the builder declares (with a sliding window when it declares
        ``windows``). Every query sees at least itself."""
        cls = component_class("mask builder", self.builder)
        rules = [rule for rule in VISIBILITY_RULES if rule in cls.visibilities]
        out = []
        for label, elements in sample_element_sets(rules, window=bool(cls.windows)):
            out.append((label, elements, elements))
            n = len(elements)
            g = torch.Generator().manual_seed(len(out))
            keys = elements.subset(torch.randperm(n, generator=g))
            queries = keys.subset(torch.randperm(n, generator=g)[: max(1, n // 2)])
            out.append((f"{label}, a shuffled half of its queries over its keys shuffled", queries, keys))
        return out

    def kv_heads(self, attention: Any) -> int:
        """k / v heads the attention is called with: fewer than the queries' when it declares ``grouped_kv``."""
        return self.heads // 2 if getattr(attention, "grouped_kv", False) else self.heads

    # -- the contract
    def test_declares_what_the_core_reads(self):
        """The class attributes the core reads to choose, refuse and cost a builder (``api.MaskBuilder``)."""
        cls = component_class("mask builder", self.builder)
        assert isinstance(cls.name, str) and cls.name, "a mask builder has a registry name"
        assert cls.visibilities and set(cls.visibilities) <= set(VISIBILITY_RULES), (
            f"visibilities {set(cls.visibilities)} must be a non-empty subset of {VISIBILITY_RULES}")
        assert cls.devices and all(isinstance(d, str) for d in cls.devices), "devices: torch device types"
        for flag in ("windows", "small_calls", "query_blocks", "grouped_kv"):
            assert isinstance(getattr(cls, flag), bool), f"{flag} must be a bool"
        assert is_int(cls.preference), "preference: an int"

    def test_attends_exactly_the_visible_keys(self):
        """With q = 0 every score is equal, so a query's output is the mean of v over the keys it attends; with v
        the identity, output[i, j] > 0 iff query i attends key j. That set must be ``visible(queries, keys)``."""
        builder = self.build()
        for label, query, key in self.cases():
            attention = builder.build(query, key)
            n, width = len(key), -(-len(key) // 16) * 16
            kv = self.kv_heads(attention)
            q = torch.zeros(1, self.heads, len(query), width, dtype=torch.float64, device=self.device)
            g = torch.Generator().manual_seed(0)
            k = torch.randn(1, kv, n, width, dtype=torch.float64, generator=g).to(self.device)
            v = torch.eye(n, width, dtype=torch.float64, device=self.device).expand(1, kv, n, width).contiguous()
            with torch.no_grad():
                seen = attention(q, k, v)[0, :, :, :n].cpu() > 0
            want = visible(query, key)
            for h in range(self.heads):
                wrong = (seen[h] != want).nonzero()
                if len(wrong):
                    i, j = (int(x) for x in wrong[0])
                    verb = "attends" if bool(seen[h, i, j]) else "does not attend"
                    raise AssertionError(
                        f"{label}: query {_describe(query, i)} {verb} key {_describe(key, j)} (head {h}), against "
                        f"the {query.visibility} rule{'' if query.window is None else f', window {query.window}'}; "
                        f"{len(wrong)} (query, key) pairs differ")

    def test_outputs_and_gradients_equal_the_reference(self):
        """Random q, k, v: the output equals ``RuleAttention``'s, and so do dq, dk and dv where the builder trains."""
        builder = self.build()
        backward = self.trains_here()
        for index, (label, query, key) in enumerate(self.cases()):
            attention = builder.build(query, key)
            kv = self.kv_heads(attention)
            g = torch.Generator().manual_seed(index)
            q = torch.randn(1, self.heads, len(query), 8, generator=g, dtype=torch.float64)
            k, v = (torch.randn(1, kv, len(key), 8, generator=g, dtype=torch.float64) for _ in range(2))
            grad_out = torch.randn(1, self.heads, len(query), 8, generator=g, dtype=torch.float64)
            got = _attend(attention, q, k, v, grad_out, backward, self.device)
            want = _attend(RuleAttention(query, key), q, k, v, grad_out, backward, "cpu")
            for what, x, y in zip(("output", "dq", "dk", "dv"), got, want):
                torch.testing.assert_close(x.cpu(), y, **TOLERANCE, msg=lambda m, what=what: f"{label}: {what}: {m}")

    def test_trains_the_tiny_model_as_the_reference_does(self):
        """A one-segment step of ``TinyElementModel`` through this builder gives the reference's gradients, on every
        sample set (the attention is called by every layer, forward and backward, as in training)."""
        if not self.trains_here():
            pytest.skip(f"the builder does not train on '{torch.device(self.device).type}' (its devices)")
        builder = self.build()
        for index, (label, elements) in enumerate(sample_element_sets(
                [r for r in VISIBILITY_RULES if r in builder.visibilities], window=bool(builder.windows))):
            g = torch.Generator().manual_seed(index)
            input_ids = torch.randint(0, 32, (elements.seq_len,), generator=g)
            targets = torch.randint(0, 32, (elements.seq_len, elements.max_depth), generator=g)
            supervised = torch.rand(elements.seq_len, generator=g) < 0.8
            supervised[0] = True
            torch.manual_seed(0)
            model = TinyElementModel(vocab=32, hidden=16, heads=self.heads, layers=2, max_len=64).double()
            whole = [api.Segment(torch.arange(len(elements)), torch.ones(len(elements), dtype=torch.bool))]
            want = accumulated_gradients(model, input_ids, targets, supervised, elements, whole, RuleMaskBuilder())
            got = accumulated_gradients(model.to(self.device), input_ids.to(self.device), targets.to(self.device),
                                        supervised.to(self.device), _on(elements, self.device), whole, builder)
            assert got.keys() == want.keys()
            for name in want:
                torch.testing.assert_close(got[name].cpu(), want[name], **TOLERANCE,
                                           msg=lambda m, name=name: f"{label}: {name}: {m}")

    def test_costs_its_attention(self):
        """``attention_bytes`` (what the memory estimate charges) is a positive number of bytes."""
        shape = api.AttentionShape(rows=96, depth=4, seq_len=32, heads=self.heads, saved_copies=2)
        cost = self.build().attention_bytes(shape)
        assert is_int(cost, 1), f"attention_bytes gave {cost!r}"


def _on(elements: ElementSet, device: str) -> ElementSet:
    if torch.device(device).type == "cpu":
        return elements
    return ElementSet(elements.anchor.to(device), elements.depth.to(device), elements.doc.to(device), elements.seq_len,
                      elements.max_depth, visibility=elements.visibility, window=elements.window)


def _attend(attention, q, k, v, grad_out, backward: bool, device: str):
    """(output, dq, dk, dv) of one call on ``device``; forward only: (output,)."""
    q, k, v, grad_out = (t.to(device) for t in (q, k, v, grad_out))
    if not backward:
        with torch.no_grad():
            return (attention(q, k, v),)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attention(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), grad_out))
