"""What components declare to the core instead of being known by name (API 6, exposed as ``specframe.api``).

A leaf module: ``specframe.api`` and the shared EAGLE family (``specframe.drafting.eagle``) both import it.
"""

from __future__ import annotations

from typing import Any

import attrs

from specframe.errors import UsageError
from specframe.values import is_int, is_number


def positive_int(owner: str) -> Any:
    """An attrs validator for options that must be a positive integer; errors name ``owner``'s option."""

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not is_int(value, 1):
            raise UsageError(f"{owner} option '{attribute.name}' must be a positive integer, got {value!r}")

    return check


def positive_int_or_null(owner: str) -> Any:
    """An attrs validator for options that are a positive integer or None (a bound that can be switched off)."""

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and not is_int(value, 1):
            raise UsageError(f"{owner} option '{attribute.name}' must be a positive integer or null, got {value!r}")

    return check


def non_negative(owner: str) -> Any:
    """An attrs validator for options that must be a number >= 0 (not a bool, not NaN); errors name ``owner``'s
    option (API 15: the check three plugins wrote by hand)."""

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not is_number(value) or not value >= 0:
            raise UsageError(f"{owner} option '{attribute.name}' must be a non-negative number, got {value!r}")

    return check


def unit_interval(owner: str) -> Any:
    """An attrs validator for options that must be a number in [0, 1] (ratios); errors name ``owner``'s option."""

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not is_number(value) or not 0.0 <= value <= 1.0:
            raise UsageError(f"{owner} option '{attribute.name}' must be in [0, 1], got {value!r}")

    return check


@attrs.frozen
class Training:
    """How a drafter trains and drafts unless a run says otherwise, as it declares it (``Drafter.training``, API 6).
    The engine, the memory estimator, ``run_config``, ``bench`` and the benchmark presets read this, never an
    option's name, so a drafter may call its settings what its paper calls them."""

    #: the training depth when the run gives no ``--depth`` (None: the run must give one)
    depth: int | None = None
    #: tokens drafted per round when a run gives no K (None: the caller's default)
    k: int | None = None
    #: COD (docs/design.md section 8): depth d keeps a share max(cod_ratio**d, cod_min_ratio) of the positions;
    #: 1 trains the full grid
    cod_ratio: float = 1.0
    cod_min_ratio: float = 0.0
    #: whether the drafter's layers recompute their activations in backward (what the memory estimate charges)
    activation_checkpointing: bool = False
    #: the drafter's option that turns activation checkpointing on (the memory advice proposes it); None: it has none
    checkpointing_option: str | None = None
    #: rows per chunk of the chunked KL loss (``api.modeling.chunked_forward_kl``)
    loss_chunk: int = 256
    #: API 14: at most this many anchors of a sequence are charged in a training step, a uniform sample drawn with the
    #: step's generator among the anchors whose depth-0 element is charged (the block drafters' references sample 512);
    #: the others' deeper elements are left out and their depth-0 elements stay as context, charged nothing. None:
    #: every anchor (validation always charges every anchor; the memory estimate charges every anchor, the safe side)
    max_anchors: int | None = None


# The option names the built-in drafters used for these settings up to API 5: what ``Drafter.training`` and
# ``Drafter.comparison_options`` read for a plugin that does not declare them, so it keeps the defaults it had.
_LEGACY_DEPTH, _LEGACY_K, _LEGACY_VOCAB, _LEGACY_CHECKPOINTING = (
    "k_train", "k_infer", "draft_vocab_size", "activation_checkpointing")


def legacy_training(options: Any) -> Training:
    """``Drafter.training``'s default: the settings under the option names the built-ins used up to API 5."""
    def get(name: str, default: Any) -> Any:
        value = getattr(options, name, None)
        return default if value is None else value

    return Training(
        depth=get(_LEGACY_DEPTH, None), k=get(_LEGACY_K, None), cod_ratio=float(get("cod_ratio", 1.0)),
        cod_min_ratio=float(get("cod_min_ratio", 0.0)),
        activation_checkpointing=bool(get(_LEGACY_CHECKPOINTING, False)),
        checkpointing_option=_LEGACY_CHECKPOINTING if hasattr(options, _LEGACY_CHECKPOINTING) else None,
        loss_chunk=int(get("loss_chunk", 256)),
    )


def legacy_comparison_options(options_cls: type, depth: int, draft_vocab_size: int, k: int) -> dict[str, Any]:
    """``Drafter.comparison_options``'s default: the API-5 option names that ``options_cls`` has."""
    fields = attrs.fields_dict(options_cls) if attrs.has(options_cls) else {}
    wanted = {_LEGACY_VOCAB: draft_vocab_size, _LEGACY_DEPTH: depth, _LEGACY_K: k}
    return {name: value for name, value in wanted.items() if name in fields}


def legacy_greedy(options: Any) -> bool:
    """``Verifier.greedy``'s default: a ``temperature`` option of 0 (the built-ins' name up to API 5), or none."""
    return getattr(options, "temperature", 0.0) == 0.0


def legacy_import_options(options_cls: type, imported: Any) -> dict[str, Any]:
    """``Drafter.import_options``'s default: a foreign folder's shape under the option names the built-ins used."""
    names = set(attrs.fields_dict(options_cls)) if attrs.has(options_cls) else set()
    read = {"layers": lambda: imported.num_layers, "aux_layer_ids": lambda: imported.aux_layer_ids,
            "draft_vocab_size": lambda: imported.draft_vocab_size, "init_from_target": lambda: False}
    values = {name: get() for name, get in read.items() if name in names}
    if _LEGACY_K in names and imported.speculative_tokens is not None:
        values[_LEGACY_K] = int(imported.speculative_tokens)
    return values
