"""Choosing a mask builder for a device (docs/design.md sections 3 and 8)."""

from __future__ import annotations

import torch

from specframe import plugins
from specframe.errors import SpecframeError

#: fastest first: flex runs fused block-sparse kernels (CUDA only for training); chunked evaluates the mask in query
#: chunks and recomputes them in backward (O(chunk x L) memory anywhere); precomputed and dense hold a full mask.
PREFERENCE = ("flex", "chunked", "precomputed", "dense")


def default_mask_builder(device: torch.device | str) -> str:
    """The registry name of the fastest registered mask builder that trains on ``device`` (flex on CUDA, chunked on
    CPU), because both avoid the (elements)^2 mask and flex fuses the masked attention into one kernel."""
    if device in (None, "", "auto"):
        from specframe.devices import resolve_device

        device = resolve_device("auto")
    kind = torch.device(device).type
    registry = plugins.load()
    available = registry.names("mask builder")
    for name in PREFERENCE:
        if name in available and kind in registry.get("mask builder", name).devices:
            return name
    for name in available:
        if kind in registry.get("mask builder", name).devices:
            return name
    raise SpecframeError(f"no registered mask builder supports device '{kind}'; registered: {', '.join(available) or 'none'}")
