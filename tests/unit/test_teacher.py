"""The teacher computed once per position (issue #17, item 1): the KL loss with ``target_index`` / ``row_weight`` and
the cross-entropy with gradients formed in the forward give the loss, gradients and hits of the plain per-row
autograd computation (the pre-change path), for the loss kernels and for every drafter's ``loss``."""

from __future__ import annotations

import sys

import pytest
import torch

from specframe import api, plugins

from specframe.drafting import modeling
from specframe.drafting.elements import full_grid
from specframe.target_head import as_target_head
from tests.drafter_helpers import DRAFTERS, features, make, sharp_tiny_target


def per_row_kl(hidden, head, target_hidden, target_head, reference_top1=None, chunk=256, position_mask=None,
               target_index=None, row_weight=None):
    """The pre-change loss by plain autograd: every row gathers its own teacher row and recomputes its distribution."""
    th = target_hidden if target_index is None else target_hidden[target_index]
    t_logp = torch.log_softmax(as_target_head(target_head).logits(th).float(), dim=-1)  # a TargetHead or a weight
    logq = torch.log_softmax((hidden @ head.T).float(), dim=-1)
    rows = (t_logp.exp() * (t_logp - logq)).sum(-1)
    keep = position_mask(th).to(torch.bool) if position_mask is not None else torch.ones_like(rows, dtype=torch.bool)
    weight = keep.to(rows.dtype) * (row_weight.to(rows.dtype) if row_weight is not None else 1.0)
    ref = reference_top1(th) if reference_top1 is not None else t_logp.argmax(-1)
    return modeling.KLResult((rows * weight).sum(), logq.argmax(-1) == ref, int((~keep).sum()))


def per_row_ce(hidden, head, labels, chunk):
    logits = (hidden @ head.T).float()
    return torch.nn.functional.cross_entropy(logits, labels, reduction="sum"), logits.argmax(-1) == labels


def kl_inputs(n, positions, h, v, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    head = (3.0 * torch.randn(v, h, generator=g)).requires_grad_()
    target_hidden = torch.randn(positions, h, generator=g)
    target_head = 3.0 * torch.randn(v, h, generator=g)
    # several rows per position, in no order, some positions unused: what a drafter's charged elements look like
    index = torch.randint(0, positions, (n,), generator=g)
    weight = torch.rand(n, generator=g)
    return hidden, head, target_hidden, target_head, index, weight


@pytest.mark.parametrize("chunk", [1, 4, 64])
@pytest.mark.parametrize("masked", [False, True])
def test_shared_teacher_equals_a_teacher_per_row(chunk, masked):
    hidden, head, th, t_head, index, weight = kl_inputs(40, 15, 8, 30, seed=chunk)
    seen = []

    def keep(rows):  # the position mask sees each teacher row once: it counts how many the loss computed
        seen.append(rows.shape[0])
        return rows[:, 0] > -0.3

    mask = keep if masked else None
    ref = per_row_kl(hidden, head, th, t_head, position_mask=mask, target_index=index, row_weight=weight)
    want = torch.autograd.grad(ref.loss_sum, (hidden, head))
    seen.clear()
    got = modeling.chunked_forward_kl(hidden, head, th, t_head, chunk=chunk, position_mask=mask, target_index=index,
                                      row_weight=weight)
    grads = torch.autograd.grad(got.loss_sum, (hidden, head))
    torch.testing.assert_close(got.loss_sum, ref.loss_sum, rtol=1e-5, atol=1e-5)
    for g, w in zip(grads, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    assert torch.equal(got.correct, ref.correct) and got.dropped == ref.dropped
    if masked:  # once per distinct position, not once per row (40 rows over at most 15 positions)
        assert sum(seen) == int(index.unique().numel())
        assert ref.dropped > 0  # the mask must drop something for the case to mean anything


def test_reference_top1_and_no_grad_evaluation():
    hidden, head, th, t_head, index, _ = kl_inputs(23, 9, 8, 30, seed=5)
    reference = lambda rows: (rows @ t_head.T).argmin(-1)  # any per-row rule: it must be applied per teacher row
    with torch.no_grad():
        got = modeling.chunked_forward_kl(hidden, head, th, t_head, reference_top1=reference, chunk=4,
                                          target_index=index)
        ref = per_row_kl(hidden, head, th, t_head, reference_top1=reference, target_index=index)
    assert not got.loss_sum.requires_grad
    torch.testing.assert_close(got.loss_sum, ref.loss_sum, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.correct, ref.correct)


def test_bf16_autocast_stays_close_to_the_per_row_loss():
    hidden, head, th, t_head, index, weight = kl_inputs(32, 12, 16, 40, seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = per_row_kl(hidden, head, th, t_head, target_index=index, row_weight=weight)
        want = torch.autograd.grad(ref.loss_sum, (hidden, head))
        got = modeling.chunked_forward_kl(hidden, head, th, t_head, chunk=8, target_index=index, row_weight=weight)
        grads = torch.autograd.grad(got.loss_sum, (hidden, head))
    assert grads[0].dtype == hidden.dtype and grads[1].dtype == head.dtype
    torch.testing.assert_close(got.loss_sum, ref.loss_sum, rtol=2e-2, atol=1e-2)
    for g, w in zip(grads, want, strict=True):
        torch.testing.assert_close(g, w, rtol=5e-2, atol=2e-2)


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_cross_entropy_equals_plain_autograd(chunk):
    g = torch.Generator().manual_seed(chunk)
    hidden = torch.randn(17, 8, generator=g).requires_grad_()
    head = (4.0 * torch.randn(50, 8, generator=g)).requires_grad_()
    labels = torch.randint(0, 50, (17,), generator=g)
    loss, hits = modeling.chunked_cross_entropy(hidden, head, labels, chunk)
    got = torch.autograd.grad(2.5 * loss, (hidden, head))  # the incoming gradient scales both
    want_loss, want_hits = per_row_ce(hidden, head, labels, chunk)
    want = torch.autograd.grad(2.5 * want_loss, (hidden, head))
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    assert torch.equal(hits, want_hits)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_weighted_cross_entropy_equals_plain_autograd_in_float64(chunk):
    """Row weights scale each row's loss and gradient (DFlash's depth decay), and float64 inputs are not rounded
    through float32 on the way (the drafters' exactness tests run in float64)."""
    g = torch.Generator().manual_seed(chunk)
    hidden = torch.randn(17, 8, generator=g, dtype=torch.float64).requires_grad_()
    head = (4.0 * torch.randn(50, 8, generator=g, dtype=torch.float64)).requires_grad_()
    labels = torch.randint(0, 50, (17,), generator=g)
    weight = torch.rand(17, generator=g, dtype=torch.float64)
    loss, hits = modeling.chunked_cross_entropy(hidden, head, labels, chunk, row_weight=weight)
    assert loss.dtype == torch.float64
    got = torch.autograd.grad(loss, (hidden, head))
    per = torch.nn.functional.cross_entropy(hidden @ head.T, labels, reduction="none")
    want = torch.autograd.grad((per * weight).sum(), (hidden, head))
    torch.testing.assert_close(loss, (per * weight).sum(), rtol=1e-12, atol=1e-12)
    assert torch.equal(hits, (hidden @ head.T).argmax(-1) == labels)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    torch.set_num_threads(1)
    return sharp_tiny_target(tmp_path_factory.mktemp("teacher"))


OPTIONS = {
    # the position mask on (the default): it is part of what is now computed per position
    "peagle": {"layers": 2, "draft_vocab_size": 128, "k_train": 4, "cod_ratio": 1.0},
    "eagle3": {"draft_vocab_size": 128, "ttt_steps": 4},
    "pard": {"layers": 1, "k_train": 4},
    "parallelspec": {"draft_vocab_size": 128, "k_train": 4},
}


def _loss_and_grads(name, target, builder="chunked"):
    torch.manual_seed(0)
    cls = plugins.get("drafter", name)
    drafter = cls(target.config, cls.Options(**OPTIONS[name]))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(7, target.config.vocab_size, (30,), generator=g)
    mask = torch.ones(30, dtype=torch.bool)
    mask[:4] = False
    doc = (torch.arange(30) >= 17).long()  # two documents
    drafter.prepare(target, [api.TrainingExample(ids, mask, doc)])
    example = api.TrainingExample(ids, mask, doc, features(target, ids, drafter))
    sup = drafter.supervision(example)
    elems = full_grid(sup.shape[0], 4, doc[1:] if name != "pard" else doc)
    segment = api.Segment(torch.arange(len(elems)), torch.ones(len(elems), dtype=torch.bool))
    attention = api.SegmentAttention.build(plugins.get("mask builder", builder)(), elems)
    terms = drafter.loss(example, elems, segment, attention)
    terms.loss_sum.backward()
    grads = {n: p.grad.clone() for n, p in drafter.module().named_parameters() if p.grad is not None}
    return terms, grads, elems, sup


@pytest.mark.parametrize("name", DRAFTERS)
def test_every_drafter_trains_as_with_a_teacher_per_element(name, target, monkeypatch):
    new, new_grads, elems, sup = _loss_and_grads(name, target)
    calls = []
    module = sys.modules[plugins.get("drafter", name).__module__]
    if name == "pard":
        monkeypatch.setattr(module, "chunked_cross_entropy", per_row_ce)
    else:
        def spy(*args, **kwargs):
            calls.append(kwargs)
            return per_row_kl(*args, **kwargs)

        monkeypatch.setattr(modeling, "chunked_forward_kl", spy)
    old, old_grads, _, _ = _loss_and_grads(name, target)
    torch.testing.assert_close(new.loss_sum, old.loss_sum, rtol=1e-5, atol=1e-4)
    assert new.count == old.count and torch.equal(new.hit, old.hit)
    assert new.masked == old.masked
    assert new_grads.keys() == old_grads.keys() and new_grads
    for key in old_grads:
        # float32 sums in another order: entries far below the gradient's scale differ by ~1e-6 of that scale
        scale = float(old_grads[key].abs().max())
        torch.testing.assert_close(new_grads[key], old_grads[key], rtol=1e-4, atol=1e-4 * scale,
                                   msg=lambda m: f"{key}: {m}")
    if name == "pard":
        return
    if name != "eagle3":
        assert old.masked > 0  # the position mask took part
    # the convention: element (a, d) is taught by the target's distribution at a + d + 1, one call for all depths
    (kwargs,) = calls
    charged = sup[elems.position]
    if name == "eagle3":  # queued pass by pass, depth 0 first, each with its depth's weight 0.8 ** d
        order = torch.cat([((elems.depth == d) & charged).nonzero().squeeze(1) for d in range(4)])
        torch.testing.assert_close(kwargs["row_weight"].cpu(), 0.8 ** elems.depth[order].float())
    else:
        order = charged.nonzero().squeeze(1)
    assert torch.equal(kwargs["target_index"].cpu(), elems.position[order] + 1)


@pytest.mark.parametrize("loss", ["kl", "ce"])
def test_fp16_autocast_keeps_the_logits_gradient_below_fp16s_smallest_normal(loss):
    """GPU-path review item 2: under fp16 autocast the logits' gradient, formed in the forward before the GradScaler's
    scale reaches it, must not be cast to fp16: over a 32K draft vocabulary a near-uniform drafter's q is ~3e-5, below
    fp16's smallest normal (6.1e-5), and flushing it leaves the hidden state's gradient at -E_p[head] in place of
    E_q[head] - E_p[head]. Compared with float64 autograd; the head's rows share a mean direction (as real heads do),
    which only the push-down mass cancels."""
    g = torch.Generator().manual_seed(0)
    n, h, v = 32, 64, 32768
    hidden = torch.randn(n, h, generator=g)
    head = 1e-3 * (torch.randn(v, h, generator=g) + 4 * torch.randn(h, generator=g))
    target_hidden, target_head = torch.randn(n, h, generator=g), 0.3 * torch.randn(v, h, generator=g)
    labels = torch.randint(0, v, (n,), generator=g)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        assert (hidden @ head.T).softmax(-1).max() < 6.1e-5  # the case the review describes
    x, w = hidden.clone().requires_grad_(), head.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.float16):
        if loss == "kl":
            got_loss = modeling.chunked_forward_kl(x, w, target_hidden, target_head, chunk=8).loss_sum
        else:
            got_loss, _ = modeling.chunked_cross_entropy(x, w, labels, 8)
    got = torch.autograd.grad(got_loss, (x, w))
    x64, w64 = hidden.double().requires_grad_(), head.double().requires_grad_()
    logq = torch.log_softmax(x64 @ w64.T, dim=-1)
    if loss == "kl":
        t_logp = torch.log_softmax(target_hidden.double() @ target_head.double().T, dim=-1)
        want_loss = (t_logp.exp() * (t_logp - logq)).sum()
    else:
        want_loss = -logq.gather(1, labels[:, None]).sum()
    want = torch.autograd.grad(want_loss, (x64, w64))
    # the KL's teacher and both losses' logits are fp16 products (autocast); the gradient's own matmuls are not
    tolerance = {"kl": 1e-2, "ce": 1e-4}[loss]
    for a, b in zip(got, want, strict=True):
        assert (a.double() - b).norm() / b.norm() < tolerance


@pytest.mark.parametrize("name", [d for d in DRAFTERS if d != "pard"])
def test_the_dense_teacher_never_copies_the_whole_target_head(name, target):
    """GPU-path review item 4: the dense teacher cast the target's whole lm_head [V, H] to the drafter's fp32 (2.1 GB
    for a 128K x 4096 head, every segment, across GPUs under --device-map) to slice its draft rows. With a bf16
    target head, no [V, H] float32 tensor is made: the draft rows are sliced on the head's side and cast alone, and
    the full-vocabulary top-1 (position mask, evaluation reference) runs in the head's own dtype, as the target's
    own greedy pick does. Training and evaluation give what the fp32 copy of that head gives."""
    from torch.utils._python_dispatch import TorchDispatchMode

    shape = (target.config.vocab_size, target.config.hidden_size)
    copies = []

    class Census(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and tuple(out.shape) == shape and out.dtype == torch.float32:
                copies.append(func)
            return out

    drafter, ex = make(name, target, length=24, vocab_position_mask=True)
    head = drafter._target_head.to(torch.bfloat16)
    elems = full_grid(drafter.supervision(ex).shape[0], 4, ex.doc[1:])
    seg = api.Segment(torch.arange(len(elems)), torch.ones(len(elems), dtype=torch.bool))
    attention = api.SegmentAttention.build(plugins.get("mask builder", "dense")(), elems)
    for training in (True, False):
        drafter.module().train(training)
        with torch.no_grad():
            drafter._target_head = head.float()  # the old path's copy, made here once
            want = drafter.loss(ex, elems, seg, attention)
            drafter._target_head = head
            with Census():
                got = drafter.loss(ex, elems, seg, attention)
        assert not copies, copies
        torch.testing.assert_close(got.loss_sum, want.loss_sum)
        assert got.masked == want.masked and torch.equal(got.hit, want.hit)
