"""The drafter contract (``specframe.testing.DrafterContract``, the pytest plugin plugin authors run) on every
drafter that ships here: the four built-ins, DFlash's package and the example package's skipgram, each at the
comparison's depth set through its own ``comparison_options``. vocab_position_mask off for the EAGLE family: with a
128-token draft vocabulary of the random tiny target many elements' target top-1 lies outside it, and the gradient
checks want every element's loss (the mask itself: tests/unit/test_vocab_mask.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from specframe.testing import DrafterContract


def _example_module():
    """The example package's module, loaded from its file under a private name: no install needed, and its folder
    stays off sys.path (whatever metadata a build left there would register it as an installed plugin for every
    later test)."""
    source = Path(__file__).resolve().parents[2] / "examples" / "specframe-example-drafter"
    spec = importlib.util.spec_from_file_location("_contract_example_drafter",
                                                  source / "specframe_example_drafter" / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SkipgramDrafter = _example_module().SkipgramDrafter


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
