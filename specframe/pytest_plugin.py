"""specframe's pytest plugin: the ``pytest11`` entry point ``specframe``, which pytest loads in every session of an
environment where specframe is installed, whether or not the session tests a drafter. So it imports nothing heavy:
its one fixture imports torch and the targets only when a test asks for it (datasette's pytest plugin is lazy for the
same reason). ``-p no:specframe`` leaves it out.

The contracts are in ``specframe.testing``: ``DrafterContract`` (whose tests use the fixture below),
``MaskBuilderContract``, ``PartitionerContract`` and ``VerifierContract``. A plugin author's test module imports one
from there (which is when torch is imported) and subclasses it.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def specframe_tiny_target(tmp_path_factory):
    """A tiny random Llama target (320 tokens, 4 layers, width 32, grouped-query attention), its lm_head sharpened so
    its next-token distribution is peaked (a random target is near uniform: a distillation loss would start near
    zero and a draft would be accepted by chance)."""
    from specframe.testing import tiny_test_target

    return tiny_test_target(tmp_path_factory.mktemp("specframe-tiny-target") / "target")
