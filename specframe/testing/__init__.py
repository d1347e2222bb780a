"""specframe's test kit for plugin authors: one contract per component kind, each a class of pytest tests an author
subclasses in a test module of their package, naming their component (a registered name, or the class itself):

- ``DrafterContract`` (``specframe.testing.drafters``): declarations, layer costing, gradients equal under every
  builder and partitioner, overfitting, greedy losslessness, accepts without a propose between, save and load; its
  tests use the fixture ``specframe_tiny_target`` of the pytest plugin (``specframe.pytest_plugin``).
- ``MaskBuilderContract`` (``specframe.testing.mask_builders``): attends exactly the keys the visibility rule lets
  each query see, outputs and gradients equal to the rule's reference attention, trains the tiny model as it does.
- ``PartitionerContract`` (``specframe.testing.partitioners``): every element charged once in causally complete
  segments, accumulated gradients equal to the unpartitioned pass.
- ``VerifierContract`` (``specframe.testing.verifiers``): a greedy verifier's output is plain greedy decoding's, a
  sampling one's follows the target's law, a seeded run repeats.

The pytest plugin imports nothing of this package at start-up: a test module importing a contract is what imports
torch. The helpers the contracts are built from (``TinyElementModel``, the tiny target, examples with target
features, the engine's per-segment accumulation) are exported too, for a component's own tests.
"""

from __future__ import annotations

from specframe.testing.drafters import (DrafterContract, accumulate_loss, element_set, gradients, target_features,
                                        tiny_test_target, training_example)
from specframe.testing.element_model import (RuleAttention, RuleMaskBuilder, TinyElementModel, accumulated_gradients,
                                             sample_element_sets, segment_loss)
from specframe.testing.mask_builders import MaskBuilderContract
from specframe.testing.partitioners import PartitionerContract
from specframe.testing.verifiers import VerifierContract

__all__ = [
    "DrafterContract",
    "MaskBuilderContract",
    "PartitionerContract",
    "RuleAttention",
    "RuleMaskBuilder",
    "TinyElementModel",
    "VerifierContract",
    "accumulate_loss",
    "accumulated_gradients",
    "element_set",
    "gradients",
    "sample_element_sets",
    "segment_loss",
    "target_features",
    "tiny_test_target",
    "training_example",
]
