"""The training engine: one loop for every drafter (docs/design.md sections 3 and 8).

``train(TrainConfig)`` picks the drafter, mask builder and partitioner by name from the plugin registry, feeds
sequences with target features (computed online, target in the loop), builds each sequence's elements (COD when the
drafter's options carry ``cod_ratio`` < 1, else the full grid), partitions them, and accumulates exact gradients
across segments, sequences and ranks before each AdamW step. Checkpoints are atomic and resume is exact.
"""

from specframe.engine.config import TrainConfig
from specframe.engine.loop import TrainResult, train

__all__ = ["TrainConfig", "TrainResult", "train"]
