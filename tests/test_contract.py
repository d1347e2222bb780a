"""The drafter contract (``specframe.testing.DrafterContract``, the pytest plugin plugin authors run) on every
drafter that ships here: the four built-ins, DFlash's package and the example package's skipgram, each at the
comparison's depth set through its own ``comparison_options``. vocab_position_mask off for the EAGLE family: with a
128-token draft vocabulary of the random tiny target many elements' target top-1 lies outside it, and the gradient
checks want every element's loss (the mask itself: tests/test_vocab_mask.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from specframe.testing import DrafterContract

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "specframe-example-drafter"))
from specframe_example_drafter import SkipgramDrafter  # noqa: E402  (the class itself: no install needed)


class TestPEagle(DrafterContract):
    drafter = "peagle"
    options = {"layers": 2, "vocab_position_mask": False}


class TestEagle3(DrafterContract):
    drafter = "eagle3"
    options = {"vocab_position_mask": False}


class TestPard(DrafterContract):
    drafter = "pard"
    options = {"layers": 1}


class TestParallelSpec(DrafterContract):
    drafter = "parallelspec"
    options = {"vocab_position_mask": False}


class TestDFlash(DrafterContract):
    drafter = "dflash"
    options = {"layers": 1, "aux_layer_ids": [1, 2]}


class TestSkipgram(DrafterContract):
    drafter = SkipgramDrafter
    options = {"dim": 16}
    overfit_steps = 60


class TestDSpark(DrafterContract):
    drafter = "dspark"
    options = {"layers": 1, "aux_layer_ids": [1, 2], "markov_rank": 8}
