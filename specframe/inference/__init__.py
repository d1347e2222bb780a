"""The reference decoding engine: plain and speculative decoding over a transformers causal LM (batch size 1).

``generate`` runs one prompt; ``Generation`` records what happened; ``specframe.metrics`` turns records into
acceptance length, per-position acceptance, OTPS and speedup. Names load lazily, so importing the package (or
``specframe.drafting.draft_tree``'s trees, re-exported here) does not load the engine and the API it imports.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "generate": "specframe.inference.engine",
    "Generation": "specframe.inference.engine",
    "Round": "specframe.inference.engine",
    "TreeShape": "specframe.inference.engine",
    "TargetSession": "specframe.inference.target",
    "dynamic_tree": "specframe.drafting.draft_tree",
    "DraftTree": "specframe.drafting.draft_tree",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'specframe.inference' has no attribute '{name}'")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
