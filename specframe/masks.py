"""Choosing a mask builder for a device (docs/design.md sections 3 and 8)."""

from __future__ import annotations

import torch

from specframe import plugins
from specframe.errors import SpecframeError

def _device_kind(device: torch.device | str | None) -> str:
    if device in (None, "", "auto"):
        from specframe.devices import resolve_device

        device = resolve_device("auto")
    return torch.device(device).type


def ranked_mask_builders(device: torch.device | str | None) -> list[str]:
    """The registered mask builders that train on ``device``, most preferred first (``MaskBuilder.preference``, API
    6; ties keep registration order). The built-ins rank flex (fused block-sparse kernels, CUDA only for training)
    over chunked (query chunks recomputed in backward: O(chunk x L) memory anywhere) over precomputed and dense
    (a full mask)."""
    kind = _device_kind(device)
    registry = plugins.load()
    names = [n for n in registry.names("mask builder") if kind in registry.get("mask builder", n).devices]
    return sorted(names, key=lambda n: -registry.get("mask builder", n).preference)


def default_mask_builder(device: torch.device | str | None) -> str:
    """The registry name of the most preferred registered mask builder that trains on ``device`` (flex on CUDA,
    chunked on CPU among the built-ins), because both avoid the (elements)^2 mask and flex fuses the masked
    attention into one kernel."""
    ranked = ranked_mask_builders(device)
    if ranked:
        return ranked[0]
    available = plugins.load().names("mask builder")
    raise SpecframeError(f"no registered mask builder supports device '{_device_kind(device)}'; "
                         f"registered: {', '.join(available) or 'none'}")


def small_call_builder(device: torch.device | str | None) -> str | None:
    """The most preferred registered builder that declares itself fastest for small calls (``small_calls``: dense
    among the built-ins), if one trains on ``device``."""
    registry = plugins.load()
    return next((n for n in ranked_mask_builders(device) if registry.get("mask builder", n).small_calls), None)
