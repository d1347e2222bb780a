"""What a comparison's results file records beside its figures: JSON-safe values, the target the checkpoints were
trained against, and the provenance of the methods compared (``specframe.results.provenance``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specframe.bench.methods import Method


def json_safe(value: Any) -> Any:
    """JSON has no NaN: undefined figures (no drafting rounds, say) become null; tuples become lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def first_recorded_target(checkpoints: Sequence[str | Path]) -> str | None:
    """The target the first checkpoint that names one was trained against (or the verifier its speculators config
    names): ``drafter_folders.recorded_target``, which reads one folder, asked of each in turn."""
    from specframe import drafter_folders

    for path in checkpoints:
        target = drafter_folders.recorded_target(path)
        if target:
            return target
    return None


def results_provenance(target: Any, methods: Sequence[Method], command: list[str] | None = None) -> dict[str, Any]:
    """``specframe.results.provenance`` for a comparison. With one trained checkpoint (at any number of K / tree
    settings) its hash and token budget are scalars; with several they map drafter name (or method label, where two
    checkpoints share a drafter) to value."""
    from specframe.results import provenance

    trained = list({m.checkpoint: m for m in methods if m.checkpoint_hash is not None}.values())
    if len(trained) == 1:
        ckpt_hash, budget = trained[0].checkpoint_hash, trained[0].token_budget
    elif trained:
        names = [m.drafter.name for m in trained]
        keys = names if len(set(names)) == len(names) else [m.label for m in trained]
        ckpt_hash = {key: m.checkpoint_hash for key, m in zip(keys, trained)}
        budget = {key: m.token_budget for key, m in zip(keys, trained)}
    else:
        ckpt_hash = budget = None
    return provenance(
        target={"id": target.id, "weights_hash": target.weights_hash}, drafter_checkpoint_hash=ckpt_hash,
        token_budget=budget, command=command,
    )
