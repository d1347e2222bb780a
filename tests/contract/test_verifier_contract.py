"""The verifier contract (``specframe.testing.VerifierContract``) on every registered verifier at its defaults, the
built-ins also in their other mode (sampling at temperature 0 is greedy, tree at temperature 1 samples), and
verifiers with one planted slip each, which it must fail."""

from __future__ import annotations

import pytest

from specframe import api, plugins
from specframe.testing import VerifierContract

# the built-ins' other mode; a verifier from a package runs here at its defaults, its other modes in its own tests
OTHER_MODES = {"sampling": {"temperature": 0.0}, "tree": {"temperature": 1.0}}

REGISTERED = plugins.load().names("verifier")
for _name in REGISTERED:
    for _suffix, _options in [("", {})] + ([("_other_mode", OTHER_MODES[_name])] if _name in OTHER_MODES else []):
        _cls = f"TestVerifier_{_name}{_suffix}"
        globals()[_cls] = type(_cls, (VerifierContract,), {"verifier": _name, "options": _options})


def test_every_registered_verifier_is_under_the_contract():
    assert REGISTERED and all(f"TestVerifier_{name}" in globals() for name in REGISTERED)


class _AcceptsTheRunnerUp(plugins.get("verifier", "greedy")):
    """Planted: a chain's draft token is accepted when it is the target's first or second choice."""

    name = "accepts-the-runner-up"

    def verify(self, logits, draft, generator=None):
        if draft.branched:
            return super().verify(logits, draft, generator)
        tokens, n = draft.tokens.tolist(), 0
        while n < len(tokens) and tokens[n] in logits[n].topk(2).indices.tolist():
            n += 1
        return api.chain_verification(list(range(n)), tokens, int(logits[n].argmax()))


class _ResamplesFromTheTarget(plugins.get("verifier", "sampling")):
    """Planted: after a rejection the token is drawn from p instead of the residual max(0, p - q)."""

    name = "resamples-from-the-target"

    @staticmethod
    def residual(p, q):
        return p


class _AcceptsTheRunnerUpContract(VerifierContract):  # not collected: its tests are expected to fail, below
    verifier = _AcceptsTheRunnerUp


class _ResamplesFromTheTargetContract(VerifierContract):
    verifier = _ResamplesFromTheTarget


def test_the_contract_fails_a_greedy_verifier_that_accepts_the_runner_up():
    with pytest.raises(AssertionError, match="plain greedy decoding"):
        _AcceptsTheRunnerUpContract().test_greedy_decoding_is_plain_greedy_decoding()


def test_the_contract_fails_a_sampling_verifier_that_resamples_from_the_target():
    with pytest.raises(AssertionError, match="chains of sampled drafts: the first 3 tokens do not follow the target"):
        _ResamplesFromTheTargetContract().test_sampling_emits_the_targets_law()
