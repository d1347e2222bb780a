"""Decoder layers a run did not load (``specframe.targets.keep_layers``): the module that stands in their place.

A leaf, so the target's head check (``specframe.target_head``) can recognise a dropped layer without importing the
loader.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from specframe.errors import SpecframeError


class AbsentLayer(torch.nn.Module):
    """Stands where ``keep_layers`` dropped decoder layer ``index`` of ``target``: it holds no weights, and running it
    or reading any of its parts raises ``SpecframeError`` naming the layer, so code that needs a layer the run did not
    load fails at once instead of reading nothing (a state dict simply lacks the layer's tensors)."""

    def __init__(self, index: int, target: str) -> None:
        super().__init__()
        self.index, self.target = index, target

    def _refuse(self, what: str) -> SpecframeError:
        return SpecframeError(f"target '{self.target}': {what} decoder layer {self.index}, which was not loaded (a run "
                              "from a feature cache loads only the layers its drafter names in Drafter.target_layers)")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse("ran")

    def __getattr__(self, name: str) -> Any:  # reached only for names the module does not hold
        if name.startswith("_"):
            return super().__getattr__(name)
        raise self._refuse(f"read '{name}' of")


def is_absent(module: Any) -> bool:
    """Whether ``module`` is a layer ``keep_layers`` dropped."""
    return isinstance(module, AbsentLayer)


@contextlib.contextmanager
def loaded_layers_only(base: Any) -> Iterator[None]:
    """Within it, ``base`` (a decoder with ``.layers``) runs through the layers it holds, the dropped ones left out:
    for ``specframe.target_head``'s start-up check, which compares what follows the last layer (the final norm and
    the head), so any layers do."""
    layers = base.layers
    if not any(is_absent(layer) for layer in layers):
        yield
        return
    base.layers = torch.nn.ModuleList([layer for layer in layers if not is_absent(layer)])
    try:
        yield
    finally:
        base.layers = layers
