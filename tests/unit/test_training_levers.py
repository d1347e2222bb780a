"""Issue 54's training levers on the EAGLE family (docs/training/deviations.md): each option does what its help says,
and its default is the behaviour the drafters had before it existed."""

from __future__ import annotations

import attrs
import pytest
import torch

from specframe import api, memory, plugins

from specframe.drafting import modeling
from specframe.drafting.elements import cod_sample, full_grid, position_docs
from specframe.targets import load_target
from tests.train_fixtures import build, small_options

FAMILY = ("peagle", "eagle3", "parallelspec")
LEVERS = ("train_head", "loss_mask_bit", "loss_normalisation", "loss", "ce_weight", "init_from_target_layers")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    torch.manual_seed(0)
    target_dir, _ = build(tmp_path_factory.mktemp("levers"))
    return load_target(target_dir)


def _example(target, drafter, n=24, docs=(0,), masked=5, seed=0):
    """A sequence of ``docs`` (in order, the last the longest) whose first ``masked`` tokens of each document are prompt."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(7, target.config.vocab_size, (n,), generator=gen)
    # uneven documents (the first a third of the sequence), so a token mean and a document mean differ
    part = n // (len(docs) + 1)
    doc = torch.tensor([docs[min(i // part, len(docs) - 1)] for i in range(n)])
    mask = torch.ones(n, dtype=torch.bool)
    for d in docs:
        start = int((doc == d).nonzero()[0])
        mask[start : start + masked] = False
    return api.TrainingExample(ids, mask, doc)


def _features(target, drafter, ex):
    with torch.no_grad():
        out = target.model(ex.input_ids[None], output_hidden_states=True)
    feats = {"final_hidden": out.hidden_states[-1][0]}
    if getattr(drafter, "aux_layer_ids", None):
        feats["aux_hidden"] = torch.cat([out.hidden_states[i][0] for i in drafter.aux_layer_ids], -1)
    return api.TrainingExample(ex.input_ids, ex.loss_mask, ex.doc, feats)


def _drafter(target, name, **options):
    cls = plugins.get("drafter", name)
    if name == "pard":  # the full vocabulary and no teacher: no draft_vocab_size, no vocab_position_mask
        return cls(target.config, cls.Options(**{"layers": 2, "k_train": 4, **options}))
    extra = {"k_train": 4} if name != "eagle3" else {"ttt_steps": 3}
    return cls(target.config, cls.Options(**small_options(vocab_position_mask=False, **extra, **options)))


def _prepared(target, name, docs=(0,), **options):
    torch.manual_seed(0)
    drafter = _drafter(target, name, **options)
    ex = _example(target, drafter, docs=docs)
    drafter.prepare(target, [ex])
    return drafter, _features(target, drafter, ex)


def _dense(sub):
    return plugins.get("mask builder", "dense")().build(sub, sub)


def _loss(drafter, ex, charged=None, elems=None, segments=1):
    """Sum of the segments' losses over ``elems`` (default the full grid), cut into ``segments`` by position."""
    depth = 3 if drafter.name == "eagle3" else 4
    elems = elems if elems is not None else full_grid(drafter.supervision(ex).shape[0], depth)
    charged = torch.ones(len(elems), dtype=torch.bool) if charged is None else charged
    total, count = 0.0, 0
    bounds = torch.linspace(0, ex.input_ids.shape[0], segments + 1)
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        # causally complete: a segment holds every element whose anchor is below its end, charged only in its own
        idx = (elems.anchor < hi).nonzero().squeeze(1)
        own = ((elems.anchor >= lo) & (elems.anchor < hi) & charged)[idx]
        sub = elems.subset(idx)
        terms = drafter.loss(ex, elems, api.Segment(idx, own), _dense(sub))
        total = total + terms.loss_sum
        count += terms.count
    return total, count


# ------------------------------------------------------------------------------------------------ option plumbing
#: options appended after the levers, in a later change (speculators' default architectures)
LATER_OPTIONS = {"qk_norm", "norm_before_residual", "norm_before_fc", "norm_output", "sliding_window"}


@pytest.mark.parametrize("name", FAMILY)
def test_levers_are_appended_with_help_and_the_decided_defaults(name):
    cls = plugins.get("drafter", name)
    fields = attrs.fields(cls.Options)
    names = [f.name for f in fields]
    # appended after every option the drafter had: recorded config.json and --print-config keep their order. Only
    # options added later (speculators' architecture options, a4bc1a6) may follow them
    start = names.index(LEVERS[0])
    assert names[start:start + len(LEVERS)] == list(LEVERS)
    assert set(names[start + len(LEVERS):]) <= LATER_OPTIONS, names
    for f in fields:
        assert f.metadata.get("help"), f.name
    opts = cls.Options()
    # P-EAGLE's ablations (docs/training/deviations.md): the input token's bit and the whole vocabulary adopted
    # from the references (rows 4, 6), the others kept
    assert (opts.train_head, opts.loss_mask_bit, opts.loss_normalisation, opts.loss, opts.init_from_target_layers,
            opts.draft_vocab_size) == (True, "input", "tokens", "kl", False, None)


@pytest.mark.parametrize("name", FAMILY)
def test_the_draft_head_has_the_whole_vocabulary_by_default_and_a_stated_size_clamped(target, name):
    v = int(target.config.vocab_size)
    rows = {size: _drafter(target, name, draft_vocab_size=size).module().lm_head.weight.shape[0]
            for size in (None, v // 2, 10 * v)}
    # None: the whole vocabulary (row 6); a size under the target's is kept; one past it (a preset states one size
    # for targets of any vocabulary) is the whole vocabulary, never a head with rows no token maps to
    assert rows == {None: v, v // 2: v // 2, 10 * v: v}
    assert api.eagle.draft_vocab_size(None, v) == v and api.eagle.draft_vocab_size(7, v) == 7


@pytest.mark.parametrize("bad", [{"loss": "tv"}, {"loss_mask_bit": "output"}, {"loss_normalisation": "batch"},
                                 {"ce_weight": 1.5}, {"train_head": "no"}, {"init_from_target_layers": 1}])
def test_bad_lever_values_are_usage_errors(bad):
    cls = plugins.get("drafter", "peagle")
    with pytest.raises(api.UsageError, match=next(iter(bad))):
        cls.Options(**bad)


def test_peagle_mask_hidden_std_sets_the_init_scale(target):
    cls = plugins.get("drafter", "peagle")
    torch.manual_seed(0)
    wide = cls(target.config, cls.Options(mask_hidden_std=1.0)).module().mask_hidden
    torch.manual_seed(0)
    narrow = cls(target.config, cls.Options(mask_hidden_std=0.02)).module().mask_hidden
    assert 0.7 < float(wide.detach().std()) < 1.3  # 3H = 96 draws of N(0, 1)
    assert float(narrow.detach().std()) < 0.05
    assert cls.Options().mask_hidden_std == 1.0  # the references' N(0, 1), adopted (deviations row 1)
    with pytest.raises(api.UsageError, match="mask_hidden_std"):
        cls.Options(mask_hidden_std=-0.1)


# ------------------------------------------------------------------------------------------------------ train_head
@pytest.mark.parametrize("name", (*FAMILY, "pard"))
def test_frozen_head_gets_no_gradient_and_is_not_counted_trainable(target, name):
    drafter, ex = _prepared(target, name, train_head=False)
    head = drafter.module().lm_head.weight
    assert not head.requires_grad
    # still the target's rows of the draft vocabulary (what speculators freezes)
    rows = drafter.module().draft_ids() if name != "pard" else slice(None)
    assert torch.equal(head, target.model.get_output_embeddings().weight[rows])
    loss, _ = _loss(drafter, ex)
    loss.backward()
    assert head.grad is None
    assert any(p.grad is not None for p in drafter.module().parameters() if p.requires_grad)
    # the memory estimate (and the engine's optimizer) read requires_grad: the head leaves the trainable set
    est = {}
    for train in (True, False):
        cfg = memory.MemoryConfig(drafter=name, target_config=target.config, seq_len=32, depth=2,
                                  mask_builder="dense",
                                  drafter_options={"train_head": train, **({} if name == "pard" else {"draft_vocab_size": 128})})
        est[train] = memory.estimate(cfg).breakdown
    assert est[True]["drafter_gradients"] - est[False]["drafter_gradients"] == head.numel() * 4


# --------------------------------------------------------------------------------------------------------- COD floor
def test_cod_min_ratio_zero_is_accepted_and_means_no_floor():
    for name in FAMILY:
        cls = plugins.get("drafter", name)
        assert cls.training(cls.Options(cod_min_ratio=0.0)).cod_min_ratio == 0.0
    sup = torch.ones(200, dtype=torch.bool)
    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    floored = cod_sample(sup, 8, 0.5, 0.2, generator=gen())
    paper = cod_sample(sup, 8, 0.5, 0.0, generator=gen())
    # depth 5: 0.5**5 = 0.03 of 200 -> 6 without a floor, 40 with the 0.2 floor
    assert int((paper.depth == 5).sum()) == 6
    assert int((floored.depth == 5).sum()) == 40


# ---------------------------------------------------------------------------------------------------- loss_mask_bit
def test_loss_mask_bit_input_gates_by_the_token_read():
    mask = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 0, 0], dtype=torch.bool)
    doc = torch.zeros(10, dtype=torch.long)
    predicted = api.eagle.shifted_supervision(mask, doc)
    read = api.eagle.shifted_supervision(mask, doc, "input")
    # position i reads x_{i+1} and predicts x_{i+2}
    assert predicted.nonzero().squeeze(1).tolist() == [2, 3, 4, 5]
    assert read.nonzero().squeeze(1).tolist() == [3, 4, 5, 6]
    assert not read[-1] and not predicted[-1]
    two_docs = torch.tensor([0] * 5 + [1] * 5)
    # x_i, x_{i+1}, x_{i+2} in one document, whichever bit gates
    assert not api.eagle.shifted_supervision(torch.ones(10, dtype=torch.bool), two_docs, "input")[3:5].any()


@pytest.mark.parametrize("name", FAMILY)
def test_drafters_supervise_by_their_loss_mask_bit(target, name):
    drafter = _drafter(target, name, loss_mask_bit="input")
    ex = _example(target, drafter)
    assert torch.equal(drafter.supervision(ex), api.eagle.shifted_supervision(ex.loss_mask, ex.doc, "input"))
    assert not torch.equal(drafter.supervision(ex), api.eagle.shifted_supervision(ex.loss_mask, ex.doc))


# -------------------------------------------------------------------------------------------------------- loss kind
def _kl_inputs(seed=0, n=6, vd=11, h=8):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float32, requires_grad=True)
    head = torch.randn(vd, h, generator=gen, dtype=torch.float32, requires_grad=True)
    th = torch.randn(n, h, generator=gen, dtype=torch.float32)
    t_head = torch.randn(vd, h, generator=gen, dtype=torch.float32) * 3
    return hidden, head, th, t_head


@pytest.mark.parametrize("w", [0.0, 0.3, 1.0])
def test_ce_weight_mixes_kl_and_ce_against_the_teacher_argmax(w):
    hidden, head, th, t_head = _kl_inputs()
    got = modeling.chunked_forward_kl(hidden, head, th, t_head, chunk=4, ce_weight=w).loss_sum
    got.backward()
    g_hidden, g_head = hidden.grad.clone(), head.grad.clone()
    hidden.grad = head.grad = None
    logq = torch.log_softmax(hidden @ head.T, -1)
    logp = torch.log_softmax(th @ t_head.T, -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    ce = -logq.gather(1, logp.argmax(-1, keepdim=True))[:, 0]
    want = ((1 - w) * kl + w * ce).sum()
    want.backward()
    assert torch.allclose(got.detach(), want.detach(), rtol=1e-5, atol=1e-5)
    assert torch.allclose(g_hidden, hidden.grad, atol=1e-5) and torch.allclose(g_head, head.grad, atol=1e-5)


def test_ce_weight_outside_the_unit_interval_is_refused():
    hidden, head, th, t_head = _kl_inputs()
    with pytest.raises(ValueError, match="ce_weight"):
        modeling.chunked_forward_kl(hidden, head, th, t_head, ce_weight=1.5)


@pytest.mark.parametrize("name", FAMILY)
def test_drafter_loss_option_reaches_the_loss(target, name, monkeypatch):
    seen = []
    real = modeling.chunked_forward_kl

    def spy(*args, **kwargs):
        seen.append(kwargs.get("ce_weight", 0.0))
        return real(*args, **kwargs)

    monkeypatch.setattr(api.modeling, "chunked_forward_kl", spy)
    for loss, ce_weight, want in (("kl", 0.4, 0.0), ("ce", 0.4, 1.0), ("mix", 0.4, 0.4)):
        drafter, ex = _prepared(target, name, loss=loss, ce_weight=ce_weight)
        seen.clear()
        _loss(drafter, ex)
        assert seen and set(seen) == {want}, (loss, seen)


# ------------------------------------------------------------------------------------------------ loss_normalisation
@pytest.mark.parametrize("name", (*FAMILY, "pard"))
def test_sequence_normalisation_is_a_mean_per_document_across_segments(target, name):
    docs = (0, 1)
    tokens, ex = _prepared(target, name, docs=docs)
    per_seq, _ = _prepared(target, name, docs=docs, loss_normalisation="sequence")
    per_seq.module().load_state_dict(tokens.module().state_dict())
    depth = 3 if name == "eagle3" else 4
    n = tokens.supervision(ex).shape[0]  # the drafter's own positions (PARD's are unshifted)
    elems = full_grid(n, depth, position_docs(ex.doc, n))  # as the engine builds them
    sup = tokens.supervision(ex)[elems.position]
    docs = torch.unique(elems.doc[sup]).tolist()
    assert len(docs) == 2
    # the tokens-mode sum and count of each document alone
    means = []
    for d in docs:
        s, c = _loss(tokens, ex, charged=(elems.doc == d), elems=elems)
        assert c == int((sup & (elems.doc == d)).sum()) > 0
        means.append(float(s.detach()) / c)
    # two documents of different supervised lengths, so a token mean would weigh them differently
    counts = [int((sup & (elems.doc == d)).sum()) for d in docs]
    assert counts[0] != counts[1]
    for segments in (1, 3):
        got, _ = _loss(per_seq, ex, elems=elems, segments=segments)
        assert float(got.detach()) == pytest.approx(per_seq._sequence_scale * sum(means), rel=1e-5)
    # the scale: the training data's mean supervised positions per document
    assert per_seq._sequence_scale == pytest.approx(int(tokens.supervision(ex).sum()) / 2)


def test_sequence_weights_sum_to_the_scale_per_document_over_segments():
    doc = torch.tensor([0] * 6 + [1] * 14)
    elems = full_grid(20, 3, doc=doc)
    sup = torch.ones(20, dtype=torch.bool)
    sup[:2] = False
    charged = sup[elems.position]
    sums = torch.zeros(2)
    for part in torch.tensor_split(torch.arange(len(elems)), 3):
        rows = part[charged[part]]
        w = api.eagle.sequence_weights(elems, sup, rows, 5.0)
        sums.index_add_(0, elems.doc[rows], w)
    assert torch.allclose(sums, torch.tensor([5.0, 5.0]))


# -------------------------------------------------------------------------------------------- init_from_target_layers
@pytest.mark.parametrize("name", FAMILY)
def test_init_from_target_layers_copies_the_last_layers(target, name):
    drafter, _ = _prepared(target, name, init_from_target_layers=True)
    fresh, _ = _prepared(target, name)
    source = target.model.state_dict()
    total = int(target.config.num_hidden_layers)
    layers = drafter.module().layers
    copied = 0
    for i, layer in enumerate(layers):
        for key, value in layer.state_dict().items():
            src = source.get(f"model.layers.{total - len(layers) + i}.{key}")
            if src is not None and src.shape == value.shape:
                assert torch.equal(value, src.to(value.dtype)), (i, key)
                copied += 1
            else:
                # EAGLE-3's fused first layer: q/k/v read 2H and hidden_norm has no counterpart
                assert layer.eagle_input and (key.startswith("self_attn.") and key[10] in "qkv" or key == "hidden_norm.weight"), key
                assert torch.equal(value, fresh.module().layers[i].state_dict()[key]), key
    assert copied >= 9 * len(layers) - 4
    # off (the default): the layers are not the target's
    assert not torch.equal(fresh.module().layers[-1].mlp.down_proj.weight,
                           source[f"model.layers.{total - 1}.mlp.down_proj.weight"])


def test_init_from_target_layers_refuses_more_layers_than_the_target(target):
    with pytest.raises(api.UsageError, match="init_from_target_layers"):
        _prepared(target, "peagle", init_from_target_layers=True, layers=int(target.config.num_hidden_layers) + 1)


# ------------------------------------------------------------------------------------------------- full vocabulary
@pytest.mark.parametrize("name", FAMILY)
def test_full_target_vocabulary_trains_and_exports(target, name, tmp_path):
    full = int(target.config.vocab_size)
    drafter, ex = _prepared(target, name, draft_vocab_size=full)
    model = drafter.module()
    assert model.lm_head.weight.shape[0] == full
    assert torch.equal(model.draft_ids(), torch.arange(full))  # d2t all zero: no mapping
    assert not model.d2t.any() and bool(model.t2d.all())
    loss, count = _loss(drafter, ex)
    assert count > 0 and torch.isfinite(loss)
    loss.backward()
    info = drafter.export_vllm(tmp_path / "export", target.tokenizer)
    assert info is not None
    assert any((tmp_path / "export").iterdir())
