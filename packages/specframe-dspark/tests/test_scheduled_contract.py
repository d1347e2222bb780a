"""The verifier contract (``specframe.testing.VerifierContract``) on DSpark's ``scheduled`` verifier, as a plugin
package runs the kit on its own component: greedy and sampling rules, a linear cost model (a measured curve would
make the schedule depend on this machine's timings) steep enough that the schedule cuts the drafts at varying lengths,
and skipping drafting after a draft that did not pay. Skipped when the distribution is not installed."""

from __future__ import annotations

import importlib.metadata

import pytest

from specframe.testing import VerifierContract

try:
    importlib.metadata.distribution("specframe-dspark")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - depends on the environment
    pytest.skip("the specframe-dspark distribution is not installed (pip install --no-deps -e "
                "packages/specframe-dspark)", allow_module_level=True)

SCHEDULE = {"measure": False, "cost_per_token": 0.9}


class TestScheduledGreedy(VerifierContract):
    verifier = "scheduled"
    options = {**SCHEDULE, "rule": "greedy"}


class TestScheduledSampling(VerifierContract):
    verifier = "scheduled"
    options = {**SCHEDULE, "rule": "sampling"}


class TestScheduledSamplingSkippingDrafts(VerifierContract):
    verifier = "scheduled"
    options = {**SCHEDULE, "rule": "sampling", "skip_drafting": True, "draft_cost": 0.4, "max_skip": 2}
