"""The chunked forward-KL loss every EAGLE-family drafter trains with, against the plain one-shot computation."""

from __future__ import annotations

import pytest
import torch

from specframe.drafting import modeling


def plain_kl(hidden, head, target_hidden, target_head):
    t_logp = torch.log_softmax(target_hidden @ target_head.T, dim=-1)
    logq = torch.log_softmax(hidden @ head.T, dim=-1)
    return (t_logp.exp() * (t_logp - logq)).sum(), logq.argmax(-1) == t_logp.argmax(-1)


def inputs(n, h, v, scale, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=dtype).requires_grad_()
    head = (scale * torch.randn(v, h, generator=g, dtype=dtype)).requires_grad_()
    target_hidden = torch.randn(n, h, generator=g, dtype=dtype)
    target_head = scale * torch.randn(v, h, generator=g, dtype=dtype)
    return hidden, head, target_hidden, target_head


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
@pytest.mark.parametrize("scale", [0.3, 3.0])
def test_chunked_kl_equals_the_plain_loss_and_gradients(chunk, scale):
    hidden, head, th, t_head = inputs(13, 8, 50, scale)
    want, want_hits = plain_kl(hidden, head, th, t_head)
    want_grads = torch.autograd.grad(want, (hidden, head))
    result = modeling.chunked_forward_kl(hidden, head, th, t_head, chunk=chunk)
    got_grads = torch.autograd.grad(result.loss_sum, (hidden, head))
    # the chunked loss computes in float32 whatever the input dtype
    torch.testing.assert_close(result.loss_sum.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(result.correct, want_hits)
    for got, ref in zip(got_grads, want_grads):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_peaked_distributions_give_exact_gradients_without_subnormals(monkeypatch):
    # a logit gap of hundreds of nats: most probabilities underflow float32's normal range
    hidden, head, th, t_head = inputs(16, 8, 200, 60.0, dtype=torch.float32, seed=1)
    seen = []
    original = modeling.flush_subnormal

    def spy(x):
        out = original(x)
        seen.append((x, out))
        return out

    monkeypatch.setattr(modeling, "flush_subnormal", spy)
    result = modeling.chunked_forward_kl(hidden, head, th, t_head, chunk=8)
    got = torch.autograd.grad(result.loss_sum, (hidden, head))
    assert len(seen) == 2  # one logits gradient per chunk
    tiny = torch.finfo(torch.float32).tiny
    raw = torch.cat([x for x, _ in seen])
    flushed = torch.cat([out for _, out in seen])
    assert ((raw != 0) & (raw.abs() < tiny)).any(), "the case must produce subnormal gradients to be meaningful"
    assert not ((flushed != 0) & (flushed.abs() < tiny)).any()
    # against the same float32 computation with the subnormals kept: zeroing them changes nothing a float can hold
    monkeypatch.setattr(modeling, "flush_subnormal", lambda x: x)
    kept = modeling.chunked_forward_kl(hidden, head, th, t_head, chunk=8)
    want = torch.autograd.grad(kept.loss_sum, (hidden, head))
    assert torch.equal(result.loss_sum, kept.loss_sum)
    for g, ref in zip(got, want):
        torch.testing.assert_close(g, ref, rtol=1e-6, atol=100 * tiny)  # rows fed only by subnormals: ~1e-38


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_flush_subnormal_zeroes_only_subnormals(dtype):
    tiny = torch.finfo(dtype).tiny
    x = torch.tensor([0.0, tiny / 4, -tiny / 4, tiny * 2, -tiny * 2, 1.0, -3.5], dtype=dtype)
    out = modeling.flush_subnormal(x)
    assert out.dtype == dtype
    assert torch.equal(out, torch.tensor([0.0, 0.0, 0.0, tiny * 2, -tiny * 2, 1.0, -3.5], dtype=dtype))
    assert torch.equal(x[1], torch.tensor(tiny / 4, dtype=dtype))  # the input is left alone


@pytest.mark.parametrize("loss", ["kl", "ce"])
def test_the_draft_head_is_cast_once_per_call_not_per_chunk(loss):
    """Under bf16 the logits' gradient is bf16 and the fp32 draft head is cast to it for the hidden state's gradient:
    once for the whole call (``modeling.CastOnce``), not again for each row chunk (GPU-path review, item b)."""
    from torch.overrides import TorchFunctionMode

    hidden, head, th, t_head = inputs(40, 8, 50, 1.0, dtype=torch.float32)
    casts = []

    class CountHeadCasts(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.to and args and args[0] is head:
                casts.append(args[1:])
            return func(*args, **(kwargs or {}))

    with CountHeadCasts(), torch.autocast("cpu", dtype=torch.bfloat16):  # the logits (and their gradient) in bf16
        if loss == "kl":
            result = modeling.chunked_forward_kl(hidden, head, th, t_head, chunk=4).loss_sum
        else:
            result, _ = modeling.chunked_cross_entropy(hidden, head, torch.arange(40) % 50, chunk=4)
    torch.autograd.grad(result, (hidden, head))
    assert len(casts) == 1 and casts[0] == (torch.bfloat16,)
