"""The table of layouts: one ``Layout`` record per checkpoint layout specframe writes for vLLM, which every dispatch
on a layout reads (the manifest reader and its limits, the speculators envelope and its inverse, the export check,
the vLLM pre-start check), as vLLM keeps one reader per speculators type behind ``register_speculator``.

A layout is one module (``eagle3``, ``block``, ``pard``, ``parallelspec``) that builds its records and calls
``register_layout`` once per layout; ``specframe.layouts`` imports the built-in ones, in the order their names are
listed (``names``). Nothing here knows a layout by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

#: a layout's draft-token limits read from its config.json: (most, fewest, block size), None where there is none
Limits = tuple[int | None, int | None, int | None]


def no_limits(cfg: Mapping[str, Any], provenance: Mapping[str, Any]) -> Limits:
    """A layout that serves any number of draft tokens per step."""
    return None, None, None


@attrs.frozen
class Layout:
    """One checkpoint layout: how vLLM serves it, how a ``config.json`` is recognised as it, its limits, and how an
    export of it is checked (and, speculators layouts, enveloped and un-flattened)."""

    #: the layout's name: the ``speculators_model_type`` of a speculators layout
    name: str
    #: vLLM's speculative method for it
    method: str
    #: whether vLLM's ``speculative_config`` sets ``parallel_drafting``
    parallel_drafting: bool
    #: ``check(tensors, config, target_num_layers) -> (tensors, flat)``: an export's tensors and config.json checked
    #: against each other (one ``SpecframeError`` naming the problem), its tensors under the layout's names and its
    #: flat config; what ``check_layout`` runs, and what the foreign readers of the layout's own folders run
    check: Callable[[dict, Mapping[str, Any], int | None], tuple[dict, dict]]
    #: the architecture name the speculators library gives a speculators layout (vLLM serves the folder alone);
    #: None: not a speculators layout (vLLM needs the target and an explicit ``speculative_config``)
    speculators: str | None = None
    #: speculators layouts: ``config(flat, *, verifier, speculative_tokens, drafter, verifier_architectures)``, the
    #: whole ``config.json`` of a flat config
    config: Callable[..., dict[str, Any]] | None = None
    #: speculators layouts: ``flat(config)``, the flat config of a ``config.json`` (``config``'s inverse)
    flat: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    #: other layouts: whether a ``config.json`` (without ``speculators_model_type``) is this layout
    recognise: Callable[[Mapping[str, Any]], bool] | None = None
    #: recognised only when no other layout claims the config (PARD: any causal LM with ``pard_token``, which
    #: ParallelSpec's config carries too)
    fallback: bool = False
    #: ``limits(config, provenance)``: the most and fewest draft tokens per step vLLM serves an export at, and its block
    limits: Callable[[Mapping[str, Any], Mapping[str, Any]], Limits] = no_limits
    #: why the most draft tokens are what they are (``Manifest.refusal``), e.g. "its block size - 1"
    over_limit: str = ""
    #: the slots vLLM's block proposer runs for K draft tokens (``Manifest.refusal`` of a block layout)
    block_slots: str = "K + 1 slots"
    #: whether the drafter reads the target's aux hidden states (vLLM's target must implement ``SupportsEagle3``)
    aux_hidden_states: bool = True
    #: whether vLLM serves it with its Llama-based EAGLE-3 drafter model (``llama_eagle3``), whose MLP is silu only
    silu_only: bool = False
    #: the flat config key of the token id the drafter's mask slots read (``Imported.mask_token_id``)
    mask_token_key: str = "mask_token_id"
    #: whether a folder may leave out ``embed_tokens`` / ``lm_head``, which an import then reads from the target's files
    #: (vLLM shares the target's)
    fills_target_weights: bool = False
    #: whether its flat config carries the EAGLE layer architecture (``qk_norm``, the EAGLE 3.1 norm flags,
    #: ``sliding_window``: ``Imported.architecture``)
    eagle_architecture: bool = False


_TABLE: dict[str, Layout] = {}


def register_layout(layout: Layout) -> Layout:
    """Add ``layout`` to the table (its module calls this once, at import) and return it; a name is registered once."""
    if layout.name in _TABLE and _TABLE[layout.name] is not layout:
        raise ValueError(f"layout {layout.name!r} is registered twice")
    _TABLE[layout.name] = layout
    return layout


def get(name: Any) -> Layout | None:
    """The layout named ``name``, or None."""
    return _TABLE.get(name) if isinstance(name, str) else None


def names() -> tuple[str, ...]:
    """Every layout's name, in the order they were registered."""
    return tuple(_TABLE)


def layouts() -> tuple[Layout, ...]:
    """Every layout, in the order they were registered."""
    return tuple(_TABLE.values())


def speculators() -> dict[str, str]:
    """The speculators layouts (``speculators_model_type``) and the architecture name the speculators library gives
    them."""
    return {layout.name: layout.speculators for layout in _TABLE.values() if layout.speculators is not None}


def unregister_layout(name: str) -> None:
    """Take the layout ``name`` out of the table again (a test's fixture layout)."""
    _TABLE.pop(name, None)
