"""The run's length and its learning-rate schedule: how many optimizer steps a run takes (``resolve_steps``) and the
factor each step's learning rate is multiplied by (``lr_lambda``: linear warmup, then cosine decay to zero)."""

from __future__ import annotations

import math
from collections.abc import Callable

from specframe.engine.config import TrainConfig


def lr_lambda(warmup: int, total: int) -> Callable[[int], float]:
    """Linear warmup to 1, then cosine decay to 0 at ``total`` steps."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return f


def resolve_steps(cfg: TrainConfig, train_sequences: int) -> int:
    """The run's optimizer steps: ``max_steps``, else ceil(epochs * train sequences / batch size), epochs 1 when
    neither is set (``TrainConfig`` refuses both)."""
    if cfg.max_steps is not None:
        return cfg.max_steps
    epochs = cfg.epochs if cfg.epochs is not None else 1.0
    # the epsilon keeps a float product such as 0.1 * 30 = 3.0000000000000004 from adding a step
    return max(1, math.ceil(epochs * train_sequences / cfg.batch_size - 1e-9))
