"""The compact top-k teacher (issue #17, item 1): with k = V it is the dense teacher (loss, gradients, hits, masked
rows); with a small k it is the top-k entries inside the draft vocabulary, renormalised; the feature cache stores the
target's own top-k, and training from it equals training from the target's head."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from specframe.drafting import modeling
from specframe.api import eagle
from specframe.cache import FeatureCache, prepare_cache
from specframe.data.specs import load_data
from specframe.engine import TrainConfig, train
from specframe.engine import checkpoint as ckpt
from specframe.errors import SpecframeError
from specframe.features import FeatureSpec
from specframe.targets import load_target
from tests.train_fixtures import build

V, H, P, N = 40, 8, 12, 30


def case(seed: int, k: int):
    g = torch.Generator().manual_seed(seed)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V, generator=g)[:15]] = True
    target_head = 3.0 * torch.randn(V, H, generator=g)
    final = torch.randn(P, H, generator=g)
    hidden = torch.randn(N, H, generator=g).requires_grad_()
    head = (2.0 * torch.randn(int(t2d.sum()), H, generator=g)).requires_grad_()
    index = torch.randint(0, P, (N,), generator=g)
    top = torch.log_softmax(final @ target_head.T, -1).topk(k, -1)
    dense = {"final_hidden": final}
    sparse = {"final_hidden": final, eagle.TEACHER_IDS: top.indices.to(torch.int32), eagle.TEACHER_LOGP: top.values}
    return t2d, target_head, hidden, head, index, dense, sparse


def kl(features, t2d, target_head, hidden, head, index, mask, evaluating):
    teacher = eagle.kl_teacher(features, t2d, target_head, device=torch.device("cpu"), dtype=torch.float32,
                               mask=mask, evaluating=evaluating)
    result = modeling.chunked_forward_kl(hidden, head, **teacher, chunk=5, target_index=index)
    return result, torch.autograd.grad(result.loss_sum, (hidden, head))


@pytest.mark.parametrize("mask", [False, True])
@pytest.mark.parametrize("evaluating", [False, True])
def test_a_full_top_k_is_the_dense_teacher(mask, evaluating):
    t2d, target_head, hidden, head, index, dense, sparse = case(seed=1, k=V)
    want, want_grads = kl(dense, t2d, target_head, hidden, head, index, mask, evaluating)
    got, got_grads = kl(sparse, t2d, target_head, hidden, head, index, mask, evaluating)
    torch.testing.assert_close(got.loss_sum, want.loss_sum, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.correct, want.correct) and got.dropped == want.dropped
    if mask:
        assert want.dropped > 0  # some positions' top-1 lies outside the draft vocabulary
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_a_small_k_is_the_renormalised_top_k_inside_the_draft_vocabulary():
    k = 6
    t2d, target_head, hidden, head, index, _, sparse = case(seed=2, k=k)
    got, _ = kl(sparse, t2d, target_head, hidden, head, index, mask=False, evaluating=False)
    # by hand: the teacher over the draft vocabulary keeps the top-k ids that are draft tokens, renormalised
    draft_of = torch.cumsum(t2d.long(), 0) - 1
    logq = torch.log_softmax(hidden @ head.T, -1)
    total = torch.zeros(())
    for row in range(N):
        ids, logp = sparse[eagle.TEACHER_IDS][index[row]].long(), sparse[eagle.TEACHER_LOGP][index[row]]
        inside = t2d[ids]
        if not inside.any():
            continue  # teaches nothing
        p = logp[inside].exp() / logp[inside].exp().sum()
        total = total + (p * (p.log() - logq[row, draft_of[ids[inside]]])).sum()
    torch.testing.assert_close(got.loss_sum, total.detach(), rtol=1e-5, atol=1e-5)


def test_a_position_with_no_top_k_token_in_the_draft_vocabulary_teaches_nothing():
    t2d, target_head, hidden, head, _, _, sparse = case(seed=3, k=2)
    outside = (~t2d).nonzero().squeeze(1)
    sparse[eagle.TEACHER_IDS][0] = outside[:2].to(torch.int32)
    index = torch.zeros(4, dtype=torch.long)  # four rows, all taught by position 0
    result = modeling.chunked_forward_kl(hidden[:4], head, **eagle.kl_teacher(
        sparse, t2d, target_head, device=torch.device("cpu"), dtype=torch.float32, mask=False, evaluating=False),
        target_index=index)
    grad_h, grad_head = torch.autograd.grad(result.loss_sum, (hidden, head))
    assert float(result.loss_sum.detach()) == 0.0 and not grad_h.any() and not grad_head.any()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build(tmp_path_factory.mktemp("topk"))


def test_the_cache_stores_the_targets_top_k_and_training_from_it_equals_the_head(assets, tmp_path, monkeypatch):
    target_dir, chat = assets
    target = load_target(target_dir)
    spec = FeatureSpec.eagle(target.num_layers)
    vocab = target.vocab_size
    rep = prepare_cache(target, load_data(str(chat)), tmp_path / "topk", spec=spec, dtype="float32",
                        draft_vocab=None, teacher_top_k=vocab)
    assert rep.teacher_top_k == vocab and rep.teacher_mass == pytest.approx(1.0, abs=1e-4)
    cache = FeatureCache(tmp_path / "topk")
    assert cache.config["teacher_top_k"] == vocab
    e = cache[3]
    head = target.model.get_output_embeddings().weight
    want = torch.log_softmax((e.final_hidden.float() @ head.T.float()), -1).topk(5, -1)
    assert e.teacher_ids.dtype == torch.int32 and e.teacher_ids.shape == (e.tokens.shape[0], vocab)
    assert torch.equal(e.teacher_ids[:, :5].long(), want.indices)
    torch.testing.assert_close(e.teacher_logp[:, :5], want.values, rtol=1e-5, atol=1e-5)
    # a cache without the teacher, same data: the drafters train to the same weights from either
    prepare_cache(target, load_data(str(chat)), tmp_path / "plain", spec=spec, dtype="float32", draft_vocab=None)
    sparse_blocks = []
    block = modeling._PositionTeacher._top_k_block
    monkeypatch.setattr(modeling._PositionTeacher, "_top_k_block",
                        lambda self, t: sparse_blocks.append(t.ids.shape[0]) or block(self, t))
    weights, used = {}, {}
    for name in ("topk", "plain"):
        cfg = TrainConfig(drafter="eagle3", output=str(tmp_path / f"out-{name}"), target=str(target_dir), data=None,
                          cache=str(tmp_path / name), seq_len=48, max_steps=2, batch_size=2, lr=3e-3,
                          val_examples=2, mask_builder="dense",
                          drafter_options={"draft_vocab_size": 128, "ttt_steps": 3})
        result = train(cfg, progress=False)
        weights[name] = load_file(str(ckpt.resolve(result.checkpoint) / "model.safetensors"))
        used[name], sparse_blocks[:] = len(sparse_blocks), []
    assert used["topk"] > 0 and used["plain"] == 0  # the teacher came from the cache's top-k, not the head
    a, b = weights["topk"], weights["plain"]
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)


def test_teacher_top_k_is_checked(assets, tmp_path):
    target = load_target(assets[0])
    for bad in (-1, target.vocab_size + 1):
        with pytest.raises(SpecframeError, match="--teacher-top-k"):
            prepare_cache(target, load_data(str(assets[1])), tmp_path / f"bad{bad}", teacher_top_k=bad)
        assert not (tmp_path / f"bad{bad}").exists()  # refused before anything is written
