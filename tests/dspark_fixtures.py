"""Shared pieces of DSpark's tests (packages/specframe-dspark/tests): its small options, a prepared drafter with one
example (the Markov head started away from zero), the per-block forward and Markov biases written out as the oracles
read them, the ``scheduled`` verifier, and a drafter with random heads on the tiny target whose exact law
tests/unit/test_sampling_distribution.py enumerates."""

from __future__ import annotations

import torch

from specframe import plugins
from specframe.drafting.elements import position_docs
from tests.block_fixtures import SDPA, make_block


SMALL = {"layers": 2, "block_size": 4, "aux_layer_ids": [1, 3], "markov_rank": 8}


def _markov_away_from_zero(drafter, g):
    # the heads start away from zero so that a wrong previous token or a dropped bias shows in the loss
    with torch.no_grad():
        for p in drafter.module().markov_head.parameters():
            p.normal_(0.0, 0.5, generator=g)


def make(target, length: int = 18, docs: int = 1, seed: int = 0, mask=None, **options):
    return make_block("dspark", SMALL, target, length, docs, seed, mask, init=_markov_away_from_zero, **options)


def block_forward(drafter, ex, a):
    """Slot hidden states [B, H] of block a, written per block: context = same-document positions <= a."""
    model = drafter.model
    docs = position_docs(ex.doc, ex.input_ids.shape[0] - 1)
    ctx = [c for c in range(a + 1) if docs[c] == docs[a]]
    kv = model.context_kv(model.context_states(ex.features["aux_hidden"][ctx]), torch.tensor(ctx))
    B = drafter.options.block_size
    tokens = torch.full((B,), drafter.mask_token_id)
    tokens[0] = ex.input_ids[a + 1]
    return model(tokens, torch.arange(a + 1, a + 1 + B), kv, SDPA)


def markov_biases(drafter, hidden, prev):
    """The sequential stage's bias [S, V] for slots following tokens ``prev`` [S], written out per head type."""
    head = drafter.model.markov_head
    w1, w2 = head.markov_w1.weight, head.markov_w2.weight
    if drafter.options.markov_head_type == "vanilla":
        return w1[prev] @ w2.T
    r = drafter.options.markov_rank
    W, c = head.joint_proj.weight, head.joint_proj.bias
    state, out = torch.zeros(r, dtype=hidden.dtype), []
    for s in range(prev.shape[0]):
        z = W @ torch.cat([state, w1[prev[s]], hidden[s]]) + c
        g, cand, o = torch.sigmoid(z[:r]), torch.tanh(z[r : 2 * r]), torch.tanh(z[2 * r :])
        state = g * state + (1 - g) * cand
        out.append(w2 @ o)
    return torch.stack(out)


def scheduled(**options):
    cls = plugins.get("verifier", "scheduled")
    return cls(cls.Options(**options))


def sampling_drafter():
    """A DSpark drafter (sampled drafts, random heads, so q is far from p) on test_sampling_distribution's tiny
    target, whose exact joint law of the first tokens is known."""
    from tests.unit.test_sampling_distribution import target_model

    model = target_model()
    torch.manual_seed(2)
    cls = plugins.get("drafter", "dspark")
    drafter = cls(model.config, cls.Options(layers=1, block_size=3, aux_layer_ids=[1], markov_rank=4,
                                            draft_temperature=1.0))
    with torch.no_grad():
        drafter.model.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
        drafter.model.lm_head.weight.copy_(model.get_output_embeddings().weight)
        # random heads: q far from p, and confidences spread over (0, 1) so a schedule cuts at varying lengths (the
        # backbone starts at N(0, 0.02), so its states vary little: the confidence head's weights carry the spread)
        for p in drafter.model.markov_head.parameters():
            p.normal_(0.0, 1.0)
        for p in drafter.model.confidence_head.parameters():
            p.normal_(0.0, 1.0)
    drafter.mask_token_id = 0
    drafter.module().eval()
    return model, drafter
