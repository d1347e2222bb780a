"""Checks on what plugins hand the engine, so a broken plugin fails at its first step with its name in the message.

A drafter whose ``loss`` returns the wrong thing, or a mask builder whose attention returns the wrong shape, would
otherwise surface as an obscure shape error deep in autograd, or worse, train silently on a wrong normalisation.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from specframe import api
from specframe.errors import PluginError, SpecframeError
from specframe.values import is_int


def check_loss_terms(
    terms: Any, drafter: str, elements: Any, segment: api.Segment, supervision: torch.Tensor, *, training: bool
) -> None:
    """Raise one PluginError naming ``drafter`` unless ``terms`` is what ``api.LossTerms`` promises for ``segment``."""
    who = f"drafter '{drafter}'"
    if not isinstance(terms, api.LossTerms):
        raise PluginError(f"{who}: loss() returned {type(terms).__name__}, not an api.LossTerms")
    loss = terms.loss_sum
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise PluginError(f"{who}: loss() returned loss_sum {shape}, not a scalar tensor")
    if training and not loss.requires_grad:
        raise PluginError(f"{who}: loss() returned a loss_sum that does not require grad (detached from the model)")
    if not bool(torch.isfinite(loss.detach()).all()):
        raise PluginError(f"{who}: loss() returned a non-finite loss_sum ({float(loss.detach().reshape(-1)[0])}) "
                          "at its first step")
    sub = elements.subset(segment.elements)
    charged = segment.loss_mask.to(torch.bool).cpu() & supervision.to(torch.bool).cpu()[sub.position.cpu()]
    expected = int(charged.sum())
    if not is_int(terms.count):
        raise PluginError(f"{who}: loss() returned count of type {type(terms.count).__name__}, not an int")
    if terms.count != expected:
        raise PluginError(
            f"{who}: loss() returned count {terms.count}, but the segment charges {expected} supervised elements"
        )
    k = elements.max_depth
    for field in ("correct", "total"):
        value = getattr(terms, field)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != (k,):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise PluginError(f"{who}: loss() returned {field} {shape}, expected shape ({k},) (one per depth)")
    # one value per charged element, in hit's order: a wrong length would be a shape error in validation, or, of
    # length 1, broadcast silently over every element's verdict (API 8's confidence, API 12's acceptance)
    for field in ("hit", "confidence", "acceptance"):
        value = getattr(terms, field, None)
        if value is None:
            continue
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != (expected,):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise PluginError(f"{who}: loss() returned {field} {shape}, expected shape ({expected},) (one per charged "
                              "element)")
    # (a confidence may be NaN: an element the drafter gives none for, API 8)
    acceptance = getattr(terms, "acceptance", None)
    if acceptance is not None and not bool(((acceptance >= 0) & (acceptance <= 1)).all()):
        raise PluginError(f"{who}: loss() returned acceptance outside [0, 1] (a chance of acceptance per element)")


class CheckedAttention:
    """Wraps a mask builder's attention and checks each output's shape against its query's."""

    def __init__(self, attention: Any, builder: str) -> None:
        self.attention = attention
        self.builder = builder

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = self.attention(q, k, v)
        if not isinstance(out, torch.Tensor) or out.shape != q.shape:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise PluginError(
                f"mask builder '{self.builder}': attention returned {got} for queries {tuple(q.shape)} "
                "(expected the query's shape)"
            )
        return out

    @property
    def grouped_kv(self) -> bool:
        return bool(getattr(self.attention, "grouped_kv", False))

    def subset(self, query: Any, key: Any) -> CheckedAttention:
        return CheckedAttention(self.attention.subset(query, key), self.builder)


def check_target_layers(declared: Any, drafter: str, num_layers: int) -> list[int] | None:
    """``Drafter.target_layers`` (API 15) as a list of layer indices of a ``num_layers``-layer target, or None (all);
    one PluginError naming ``drafter`` for anything else."""
    if declared is None:
        return None
    try:
        layers = list(declared)
    except TypeError:
        layers = None
    if layers is None or not all(is_int(i, 0, num_layers - 1) for i in layers):
        raise PluginError(f"drafter '{drafter}': target_layers({num_layers}) returned {declared!r}, not None or "
                          f"layer indices in 0..{num_layers - 1}")
    return layers


def check_finite(step: int, loss: float, grad_norm: float) -> None:
    """Stop training before a non-finite loss or gradient reaches the weights (and any checkpoint)."""
    for what, value in (("loss", loss), ("gradient norm", grad_norm)):
        if not math.isfinite(value):
            raise SpecframeError(
                f"training stopped at step {step}: the {what} is {value}; no checkpoint was written for this step "
                "(the last one is intact; lower --lr or check the data)"
            )
