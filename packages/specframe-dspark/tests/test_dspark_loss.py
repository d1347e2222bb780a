"""DSpark's fused chunked loss (``specframe_dspark.loss.chunked_terms``) against its definition under autograd
(``chunk_terms`` on all rows at once): the loss, the per-row outputs and the gradient of every input that takes one,
with the draft head trained or frozen, with and without the confidence head, in float64 exactly and under bf16 to
bf16's precision. The drafter-level oracle (test_dspark.py) checks the same path through ``DSparkDrafter.loss``."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

from specframe import api

try:
    importlib.metadata.distribution("specframe-dspark")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - depends on the environment
    pytest.skip("the specframe-dspark distribution is not installed", allow_module_level=True)

from specframe_dspark.loss import chunk_terms, chunked_terms  # noqa: E402

N, H, V, R = 23, 12, 40, 4
WEIGHTS = (0.3, 0.9, 0.5)  # ce, l1, confidence


def _inputs(dtype, confidence, train_head, seed=0):
    g = torch.Generator().manual_seed(seed)

    def leaf(*shape, grad=True, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype).requires_grad_(grad)

    hidden, latent = leaf(N, H), leaf(N, R)
    lm_w, w2 = leaf(V, H, grad=train_head, scale=0.5), leaf(V, R, scale=0.5)
    conf_feats = leaf(N, H + R) if confidence else None
    conf_w, conf_b = (leaf(1, H + R, scale=0.3), leaf(1)) if confidence else (None, None)
    target_hidden = torch.randn(N, H, generator=g, dtype=torch.float64).to(dtype)
    head = api.eagle.TargetHead(weight=torch.randn(V, H, generator=g, dtype=torch.float64).to(dtype))
    labels = torch.randint(0, V, (N,), generator=g)
    # some rows weigh nothing (elements the reference does not train), the others a depth decay
    weight = torch.rand(N, generator=g, dtype=torch.float64).to(dtype) * (torch.arange(N) % 5 != 0)
    return dict(hidden=hidden, latent=latent, conf_feats=conf_feats, target_hidden=target_hidden, labels=labels,
                weight=weight, lm_w=lm_w, w2=w2, conf_w=conf_w, conf_b=conf_b, target_head=head)


def _grads(loss, args):
    names = [k for k, v in args.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    return dict(zip(names, torch.autograd.grad(loss, [args[k] for k in names])))


def _positional(args):
    return (args["hidden"], args["latent"], args["conf_feats"], args["target_hidden"], args["labels"], args["weight"],
            args["lm_w"], args["w2"], args["conf_w"], args["conf_b"], args["target_head"], *WEIGHTS)


@pytest.mark.parametrize("chunk", [1, 7, 64])
@pytest.mark.parametrize("confidence,train_head", [(True, False), (True, True), (False, False), (False, True)])
def test_the_fused_chunks_equal_the_definition_under_autograd(chunk, confidence, train_head):
    args = _inputs(torch.float64, confidence, train_head)
    want = chunk_terms(*_positional(args))
    want_grads = _grads(want[0], args)
    got = chunked_terms(*_positional(args), chunk)
    got_grads = _grads(got[0], args)
    assert float(got[0].detach()) == pytest.approx(float(want[0].detach()), rel=1e-12)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert torch.allclose(got[3], want[3], rtol=0, atol=1e-12)
    assert torch.equal(got[4].isnan(), want[4].isnan())
    assert torch.allclose(got[4].nan_to_num(), want[4].nan_to_num(), rtol=0, atol=1e-12)
    assert set(got_grads) == set(want_grads) and ("lm_w" in got_grads) == train_head
    for name in want_grads:
        assert torch.allclose(got_grads[name], want_grads[name], rtol=1e-10, atol=1e-12), name
        assert got_grads[name].dtype == args[name].dtype


def test_the_incoming_gradient_scales_every_input_gradient():
    """The engine divides the step's sum by its normaliser after ``loss``: the precomputed gradients carry it."""
    args = _inputs(torch.float64, True, True)
    base = _grads(chunked_terms(*_positional(args), 8)[0], args)
    scaled = _grads(chunked_terms(*_positional(args), 8)[0] * -2.5, args)
    for name in base:
        assert torch.allclose(scaled[name], -2.5 * base[name], rtol=1e-12, atol=0), name


def test_under_bf16_the_gradients_agree_to_bf16_precision():
    args = _inputs(torch.bfloat16, True, True, seed=3)
    want_grads = _grads(chunk_terms(*_positional(args))[0], args)
    got = chunked_terms(*_positional(args), 8)
    got_grads = _grads(got[0], args)
    for name, want in want_grads.items():
        err = (got_grads[name].double() - want.double()).norm() / want.double().norm()
        assert got_grads[name].dtype == torch.bfloat16 and err < 2e-2, (name, float(err))


def test_without_grad_mode_nothing_is_formed_and_the_loss_is_a_plain_tensor():
    args = _inputs(torch.float64, True, True)
    with torch.no_grad():
        loss, *_ = chunked_terms(*_positional(args), 8)
    assert loss.grad_fn is None and not loss.requires_grad
