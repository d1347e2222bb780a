"""GPU-path review item 16: every teacher is the target's own next-token distribution, also for targets whose forward
does more after the lm_head matmul than a Llama's: Gemma-2's final-logit soft-capping, Cohere's ``logit_scale``,
Granite's ``logits_scaling`` and an lm_head bias (Phi). Tiny random targets of each are built here (their heads
sharpened, so what the transform does is visible) and the dense KL teacher, the cache's compact top-k teacher,
``target_logits`` and every distilling drafter's teacher are compared with the target model's own forward logits."""

from __future__ import annotations

import shutil

import pytest
import torch

from specframe import api, plugins

from specframe.drafting import modeling
from specframe.cache import FeatureCache, prepare_cache
from specframe.errors import SpecframeError
from specframe.features import FeatureSpec, capture_features, target_logits
from specframe.target_head import TargetHead, target_head
from specframe.targets import load_target, tiny_target
from tests.drafter_helpers import SMALL
from tests.target_fixtures import chat_records

# (config class, model class, what the forward does after the matmul)
FAMILIES = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"final_logit_softcapping": 8.0, "head_dim": 8}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.25}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"logits_scaling": 4.0}),
    "phi": ("PhiConfig", "PhiForCausalLM", {}),  # lm_head has a bias
}
DISTILLING = ("eagle3", "peagle", "parallelspec")


def _build(root, family: str):
    import transformers

    path = root / family
    shutil.copytree(tiny_target(root / "tokenizer", layers=1), path)  # its tokenizer and ChatML template
    tok = transformers.AutoTokenizer.from_pretrained(path)
    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).to(torch.float32)
    with torch.no_grad():  # logits of a few units: soft-capping at 8 and the scales then change the distribution
        model.get_output_embeddings().weight.mul_(40.0)
        if model.get_output_embeddings().bias is not None:
            model.get_output_embeddings().bias.normal_(0.0, 3.0)
    model.save_pretrained(path)
    shutil.rmtree(root / "tokenizer")
    return load_target(path)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("heads")
    return {family: _build(root, family) for family in FAMILIES}


def _forward(target, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the target model's own logits [T, V], the final hidden state [T, H] a feature cache stores) for ``ids``."""
    with torch.no_grad():
        logits = target.model(ids[None]).logits[0].float()
    return logits, capture_features(target, ids[None], FeatureSpec(final_hidden=True)).final[0]


def _ids(target, n: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(7, target.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def test_the_tiny_targets_carry_what_they_test(targets):
    """Each target's forward differs from the plain matmul (else the other tests would pass without the fix)."""
    for family, target in targets.items():
        logits, final = _forward(target, _ids(target))
        plain = final @ target.model.get_output_embeddings().weight.T
        assert not torch.allclose(torch.log_softmax(plain, -1), torch.log_softmax(logits, -1), atol=0.1), family
    assert targets["phi"].model.get_output_embeddings().bias is not None


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_target_logits_are_the_forward_logits(targets, family):
    target = targets[family]
    logits, final = _forward(target, _ids(target))
    torch.testing.assert_close(target_logits(target, final), logits, rtol=1e-5, atol=1e-5)
    sub = [5, 90, 17]
    torch.testing.assert_close(target_logits(target, final, sub), logits[:, sub], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("evaluating", [False, True])
def test_the_dense_teacher_is_the_targets_distribution(targets, family, evaluating):
    """``kl_teacher`` over ``final_hidden`` with the head ``target_head`` returns: the KL loss, the position mask
    (target top-1 inside the draft vocabulary) and the evaluation reference are the ones of the model's own logits."""
    target = targets[family]
    logits, final = _forward(target, _ids(target, 30))
    g = torch.Generator().manual_seed(1)
    vocab = target.vocab_size
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.randperm(vocab, generator=g)[: vocab // 2]] = True
    tops = logits.argmax(-1).unique()  # some positions' top-1 inside the draft vocabulary, the others outside
    t2d[tops[::2]], t2d[tops[1::2]] = True, False
    vd = int(t2d.sum())
    hidden = torch.randn(40, 32, generator=g).requires_grad_()
    head = (3.0 * torch.randn(vd, 32, generator=g)).requires_grad_()
    index = torch.randint(0, final.shape[0], (40,), generator=g)
    teacher = api.eagle.kl_teacher({"final_hidden": final}, t2d, target_head(target), device=torch.device("cpu"),
                                   dtype=torch.float32, mask=True, evaluating=evaluating)
    got = modeling.chunked_forward_kl(hidden, head, **teacher, chunk=7, target_index=index)
    # by hand, from the model's forward: p over the draft vocabulary, the mask and the reference from its argmax
    t_logp = torch.log_softmax(logits[:, t2d], -1)[index]
    logq = torch.log_softmax(hidden @ head.T, -1)
    top1 = logits.argmax(-1)[index]
    keep = t2d[top1]
    want = ((t_logp.exp() * (t_logp - logq)).sum(-1) * keep).sum()
    draft_of = torch.where(t2d, torch.cumsum(t2d.long(), 0) - 1, -1)
    ref = draft_of[top1] if evaluating else t_logp.argmax(-1)
    assert 0 < int(keep.sum()) < len(keep)  # the mask took part
    torch.testing.assert_close(got.loss_sum, want, rtol=1e-5, atol=1e-5)
    assert got.dropped == int((~keep).sum()) and torch.equal(got.correct, logq.argmax(-1) == ref)
    grads = torch.autograd.grad(got.loss_sum, (hidden, head))
    for a, b in zip(grads, torch.autograd.grad(want, (hidden, head)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_compact_teacher_is_the_targets_distribution(targets, family, tmp_path):
    """``prepare --teacher-top-k`` stores the model's own top-k log-probabilities (k = V: all of them), and records
    what the head applies, so a cache made without it is not resumed as if it were the same."""
    target = targets[family]
    vocab = target.vocab_size
    prepare_cache(target, chat_records(4), tmp_path / "cache", spec=FeatureSpec(final_hidden=True),
                  dtype="float32", draft_vocab=None, teacher_top_k=vocab)
    cache = FeatureCache(tmp_path / "cache")
    assert cache.config["teacher_head"] == TargetHead.of(target).describe()
    for i in range(len(cache)):
        e = cache[i]
        logits, _ = _forward(target, e.tokens.long())
        want = torch.log_softmax(logits, -1).sort(-1, descending=True)
        torch.testing.assert_close(e.teacher_logp, want.values, rtol=1e-5, atol=1e-5)
        assert torch.equal(e.teacher_ids[:, 0].long(), logits.argmax(-1))


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("name", DISTILLING)
def test_every_distilling_drafter_is_taught_the_targets_distribution(targets, family, name, monkeypatch):
    """Each drafter's ``prepare`` keeps the target's head as its forward applies it, and its ``loss`` hands the KL
    the teacher of the model's own logits over the draft vocabulary (and the mask of its own top-1)."""
    target = targets[family]
    cls = plugins.get("drafter", name)
    torch.manual_seed(0)
    drafter = cls(target.config, cls.Options(**{**SMALL[name], "draft_vocab_size": 96, "vocab_position_mask": True}))
    ids = _ids(target, 20, seed=2)
    mask, doc = torch.ones(20, dtype=torch.bool), torch.zeros(20, dtype=torch.long)
    drafter.prepare(target, [api.TrainingExample(ids, mask, doc)])
    spec = drafter.feature_spec()
    feats = capture_features(target, ids[None], spec)
    example = api.TrainingExample(ids, mask, doc, {"aux_hidden": feats.aux[0], "final_hidden": feats.final[0]})
    calls = []
    original = modeling.chunked_forward_kl

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(modeling, "chunked_forward_kl", spy)
    elems = api.full_grid(drafter.supervision(example).shape[0], 4, doc[1:])
    segment = api.Segment(torch.arange(len(elems)), torch.ones(len(elems), dtype=torch.bool))
    attention = api.SegmentAttention.build(plugins.get("mask builder", "dense")(), elems)
    drafter.loss(example, elems, segment, attention)
    (kwargs,) = calls
    logits, _ = _forward(target, ids)
    t2d = drafter.module().t2d
    teacher = modeling._PositionTeacher(kwargs["target_hidden"], kwargs["target_head"], None, logits.shape[0],
                                        logits.shape[0], kwargs["reference_top1"], kwargs["position_mask"])
    p, _, _, keep, _ = teacher.block(0)
    torch.testing.assert_close(p, torch.softmax(logits[:, t2d], -1), rtol=1e-5, atol=1e-6)
    assert torch.equal(keep, t2d[logits.argmax(-1)])


def test_a_target_whose_forward_does_something_else_is_refused(targets):
    """A logit transform the head does not know (here a hook on the lm_head) would make every teacher wrong: the
    start-up check against the target's own forward refuses it with one line."""
    target = targets["cohere"]
    hook = target.model.get_output_embeddings().register_forward_hook(lambda module, args, out: out + 0.5 * out ** 2)
    try:
        with pytest.raises(SpecframeError, match="its forward's logits are not its lm_head's") as info:
            target_head(target)
        assert "\n" not in str(info.value)
    finally:
        hook.remove()
    assert target_head(target).multiplier == 0.25
