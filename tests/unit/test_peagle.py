"""P-EAGLE drafter: section 8 indexing, KV-cached drafting equals a plain forward, checkpoints."""

from __future__ import annotations

import json

import attrs
import pytest
import torch

from specframe import api, plugins
from specframe.drafting.elements import full_grid
from specframe.drafting.modeling import causal_attention
from specframe.targets import load_target
from tests.train_fixtures import build, small_options


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.manual_seed(0)
    target_dir, _ = build(tmp_path_factory.mktemp("peagle"))
    target = load_target(target_dir)
    cls = plugins.get("drafter", "peagle")
    # single-element losses are checked against an unmasked reference (tests/unit/test_vocab_mask.py tests the mask)
    drafter = cls(target.config, cls.Options(**small_options(k_train=4, vocab_position_mask=False)))
    ids = torch.randint(7, target.config.vocab_size, (24,))
    mask = torch.ones(24, dtype=torch.bool)
    mask[:5] = False
    example = api.TrainingExample(ids, mask, torch.zeros(24, dtype=torch.long))
    drafter.prepare(target, [example])
    with torch.no_grad():
        out = target.model(ids[None], output_hidden_states=True)
    feats = {
        "aux_hidden": torch.cat([out.hidden_states[i][0] for i in drafter.aux_layer_ids], -1),
        "final_hidden": out.hidden_states[-1][0],
    }
    example = api.TrainingExample(ids, mask, example.doc, feats)
    return target, drafter, example


def dense(sub):
    return plugins.get("mask builder", "dense")().build(sub, sub)


def test_supervision_is_the_loss_mask_of_x_i_plus_1(setup):
    """Position i reads x_{i+1} and predicts x_{i+2}; by default (``loss_mask_bit`` 'input', speculators') x_{i+1}'s
    bit gates it, with 'predicted' x_{i+2}'s."""
    target, drafter, ex = setup
    sup = drafter.supervision(ex)
    assert sup.shape[0] == ex.input_ids.shape[0] - 1
    assert torch.equal(sup[:-1], ex.loss_mask[1:-1])
    assert not sup[-1]
    cls = type(drafter)
    predicted = cls(target.config, attrs.evolve(drafter.options, loss_mask_bit="predicted")).supervision(ex)
    assert torch.equal(predicted[:-1], ex.loss_mask[2:]) and not predicted[-1]


def test_mask_token_follows_the_vocab_rule_and_is_unseen(setup):
    target, drafter, ex = setup
    counts = api.vocab.count_tokens([ex], drafter.vocab_size, masked_only=False)
    rule = api.vocab.mask_token_ids(target.tokenizer, 1, data_counts=counts, embedding_rows=drafter.vocab_size)
    assert drafter.mask_token_id == rule[0]
    assert drafter.mask_token_id not in set(ex.input_ids.tolist())
    assert not drafter.module().t2d[drafter.mask_token_id]


def _segment_loss(drafter, ex, elems, charged):
    seg = api.Segment(torch.arange(len(elems)), charged)
    return drafter.loss(ex, elems, seg, dense(elems)).loss_sum


def test_element_target_is_read_at_anchor_plus_depth(setup):
    _, drafter, ex = setup
    elems = full_grid(ex.input_ids.shape[0] - 1, 4)
    p = 12
    charged = elems.position == p
    assert charged.sum() == 4  # (12,0), (11,1), (10,2), (9,3)
    base = _segment_loss(drafter, ex, elems, charged)
    moved = dict(ex.features)
    moved["final_hidden"] = ex.features["final_hidden"].clone()
    moved["final_hidden"][p + 1] += 1.0  # the distribution at y_{p+1}
    changed = _segment_loss(drafter, api.TrainingExample(ex.input_ids, ex.loss_mask, ex.doc, moved), elems, charged)
    assert not torch.allclose(base, changed)
    other = dict(ex.features)
    other["final_hidden"] = ex.features["final_hidden"].clone()
    other["final_hidden"][p] += 1.0
    same = _segment_loss(drafter, api.TrainingExample(ex.input_ids, ex.loss_mask, ex.doc, other), elems, charged)
    assert torch.allclose(base, same)


def test_depth0_reads_token_i_plus_1_and_feature_i(setup):
    _, drafter, ex = setup
    elems = full_grid(ex.input_ids.shape[0] - 1, 4)
    charged = (elems.anchor == 10) & (elems.depth == 0)
    base = _segment_loss(drafter, ex, elems, charged)
    ids = ex.input_ids.clone()
    ids[12] = (ids[12] + 1) % 300 + 7  # a later token: invisible to anchor 10
    assert torch.allclose(base, _segment_loss(drafter, api.TrainingExample(ids, ex.loss_mask, ex.doc, ex.features),
                                              elems, charged))
    ids = ex.input_ids.clone()
    ids[11] = (ids[11] + 1) % 300 + 7  # x_{a+1}: the anchor's own input token
    assert not torch.allclose(base, _segment_loss(
        drafter, api.TrainingExample(ids, ex.loss_mask, ex.doc, ex.features), elems, charged))


def test_loss_counts_and_depth_totals(setup):
    _, drafter, ex = setup
    elems = full_grid(ex.input_ids.shape[0] - 1, 4)
    seg = api.Segment(torch.arange(len(elems)), torch.ones(len(elems), dtype=torch.bool))
    terms = drafter.loss(ex, elems, seg, dense(elems))
    sup = drafter.supervision(ex)
    assert terms.count == int(sup[elems.position].sum())
    assert int(terms.total.sum()) == terms.count
    assert terms.loss_sum.item() >= 0  # a KL divergence


def test_propose_with_kv_cache_matches_a_plain_forward(setup):
    _, drafter, ex = setup
    model = drafter.module().eval()
    ids, aux = ex.input_ids, ex.features["aux_hidden"]
    n = 10
    drafter.start(ids[:n], {"aux_hidden": aux[:n]})
    drafter.accept(ids[n : n + 1], {"aux_hidden": aux[n - 1 : n]})
    first = drafter.propose(3)
    drafter.accept(ids[n + 1 : n + 4], {"aux_hidden": aux[n : n + 3]})
    second = drafter.propose(4)
    assert len(first) == 3 and len(second) == 4

    def plain(m, k):  # drafter indices 0..m-1 hold (x_{i+1}, g_i), then k-1 mask slots
        toks = torch.cat([ids[1 : m + 1], torch.full((k - 1,), drafter.mask_token_id)])
        a = torch.cat([aux[:m], aux.new_zeros(k - 1, aux.shape[1])])
        is_mask = torch.arange(m + k - 1) >= m
        with torch.no_grad():
            h, _ = model(toks, a, is_mask, torch.arange(m + k - 1), causal_attention(0))
        d = model.lm_head(h[m - 1 :]).argmax(-1)
        return d + model.d2t[d]

    assert torch.equal(first.tokens, plain(n, 3))
    assert torch.equal(second.tokens, plain(n + 3, 4))
    assert bool(model.t2d[second.tokens].all())


def test_save_load_roundtrip(setup, tmp_path):
    target, drafter, ex = setup
    drafter.save(tmp_path)
    info = json.loads((tmp_path / "drafter.json").read_text())
    assert info["mask_token_id"] == drafter.mask_token_id
    assert info["aux_layer_ids"] == list(drafter.aux_layer_ids)
    clone = type(drafter).from_checkpoint(tmp_path, target.config)
    for k, v in drafter.module().state_dict().items():
        assert torch.equal(v, clone.module().state_dict()[k]), k
    info["drafter"] = "pard"
    (tmp_path / "drafter.json").write_text(json.dumps(info))
    with pytest.raises(api.SpecframeError, match="'pard' drafter"):
        clone.load(tmp_path)


def test_invalid_options_are_usage_errors(setup):
    target, drafter, _ = setup
    with pytest.raises(api.UsageError, match="layers"):
        type(drafter).Options(layers=0)
    with pytest.raises(api.UsageError, match="aux layer ids"):
        type(drafter)(target.config, type(drafter).Options(aux_layer_ids=[0, 1, 99]))


def test_default_aux_layers_follow_vllm_and_stay_distinct():
    from transformers import LlamaConfig

    from specframe_plugins.peagle import PEagleDrafter

    def ids(layers):
        config = LlamaConfig(num_hidden_layers=layers, hidden_size=32, num_attention_heads=4, vocab_size=64)
        return PEagleDrafter(config, PEagleDrafter.Options(layers=1, draft_vocab_size=16)).aux_layer_ids

    assert ids(30) == [2, 15, 27]  # vLLM's (2, L//2, L-3)
    # vLLM keys aux states by layer id, so repeated ids would reach fc as 2H instead of 3H: small targets differ
    assert ids(4) == [1, 2, 3]


@pytest.mark.parametrize("row_chunk", [None, 5])
@pytest.mark.parametrize("builder", ["dense", "chunked"])
def test_activation_checkpointing_gives_the_same_gradients(setup, monkeypatch, row_chunk, builder):
    """Checkpointed layers (and, with a small ``ROW_CHUNK``, their position-wise parts recomputed in row chunks)
    give the gradients of the plain forward."""
    from specframe.drafting import decoder

    if row_chunk is not None:  # the constant run_layers reads (api.modeling re-exports its value)
        monkeypatch.setattr(decoder, "ROW_CHUNK", row_chunk)
    target, drafter, ex = setup
    elems = full_grid(ex.input_ids.shape[0] - 1, 4)
    seg = api.Segment(torch.arange(len(elems)), torch.ones(len(elems), dtype=torch.bool))
    attention = plugins.get("mask builder", builder)().build(elems, elems)
    grads = []
    for flag in (False, True):
        drafter.options.activation_checkpointing = flag
        drafter.module().train().zero_grad()
        drafter.loss(ex, elems, seg, attention).loss_sum.backward()
        grads.append({n: p.grad.clone() for n, p in drafter.module().named_parameters() if p.grad is not None})
    drafter.options.activation_checkpointing = False
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-6), n


@pytest.mark.slow
def test_overfit_drafter_is_accepted_by_the_inference_engine(tmp_path):
    """The indexing guard: a drafter overfit on the target's own greedy output, trained through ``loss`` and served
    through ``start`` / ``accept`` / ``propose``, must be accepted almost always. An off-by-one between the training
    shift and the inference protocol sends acceptance to about zero."""
    from specframe.features import capture_features
    from specframe.inference.engine import generate

    torch.manual_seed(0)
    target = load_target(build(tmp_path)[0])
    prompt = torch.tensor([1, 50, 60, 70, 80])
    verifier = plugins.get("verifier", "greedy")()
    plain = generate(target.model, prompt, verifier, max_new_tokens=40, eos_token_id=())
    seq = torch.cat([prompt, torch.tensor(plain.tokens)])
    mask = torch.arange(len(seq)) >= len(prompt)
    cls = plugins.get("drafter", "peagle")
    drafter = cls(target.config, cls.Options(layers=2, draft_vocab_size=320, k_train=3))
    ex = api.TrainingExample(seq, mask, torch.zeros_like(seq))
    drafter.prepare(target, [ex])
    f = capture_features(target, seq[None], drafter.feature_spec(), dtype=torch.float32)
    ex = api.TrainingExample(seq, mask, ex.doc, {"aux_hidden": f.aux[0], "final_hidden": f.final[0]})
    elems = full_grid(len(seq) - 1, 3)
    seg = api.Segment(torch.arange(len(elems)), torch.ones(len(elems), dtype=torch.bool))
    attention = dense(elems)
    opt = torch.optim.AdamW(drafter.module().parameters(), lr=3e-3)
    for _ in range(200):
        opt.zero_grad()
        terms = drafter.loss(ex, elems, seg, attention)
        (terms.loss_sum / terms.count).backward()
        opt.step()
    drafter.module().eval()
    spec = generate(target.model, prompt, verifier, drafter, k=3, max_new_tokens=40, eos_token_id=())
    assert spec.tokens == plain.tokens
    assert spec.decode_tokens / len(spec.rounds) > 3.0  # at most 4 (3 drafts + bonus)


def test_export_vllm_writes_the_peagle_layout(setup, tmp_path):
    from safetensors.torch import load_file

    target, drafter, _ = setup
    manifest = drafter.export_vllm(tmp_path / "vllm", target.tokenizer)
    assert manifest["method"] == "eagle3" and manifest["parallel_drafting"] is True
    cfg = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert cfg["mask_token_id"] == drafter.mask_token_id
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(drafter.aux_layer_ids)
    tensors = {}
    for f in (tmp_path / "vllm").glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    assert torch.equal(tensors["mask_hidden"], drafter.module().mask_hidden.detach())
    assert torch.equal(tensors["d2t"], drafter.module().d2t)


def test_drafting_feeds_every_mask_slot_the_mask_hidden_projection(setup):
    """While drafting, every mask slot (the first included) reads fc(mask_hidden), as in training, and never the zero
    rows that pad the features: the states reaching the head equal a forward in which those slots are ordinary
    positions whose features are mask_hidden itself (fc is linear, so no is_mask path is involved). mask_hidden is
    scaled up here: at its initial scale (std 0.02) fc(mask_hidden) is so close to fc(0) that argmax drafts, the
    only thing the other drafting tests compare, come out the same either way."""
    _, drafter, ex = setup
    model = drafter.module().eval()
    ids, aux = ex.input_ids, ex.features["aux_hidden"]
    n, k = 10, 4
    saved = model.mask_hidden.detach().clone()
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, a, o: seen.append(a[0].detach().clone()))
    try:
        with torch.no_grad():
            model.mask_hidden.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(3))
        drafter.start(ids[:n], {"aux_hidden": aux[:n]})
        drafter.accept(ids[n : n + 1], {"aux_hidden": aux[n - 1 : n]})
        drafter.propose(k)
        toks = torch.cat([ids[1 : n + 1], torch.full((k - 1,), drafter.mask_token_id)])
        feats = torch.cat([aux[:n], model.mask_hidden.detach().view(1, -1).expand(k - 1, -1).to(aux.dtype)])
        with torch.no_grad():
            ref, _ = model(toks, feats, torch.zeros(n + k - 1, dtype=torch.bool), torch.arange(n + k - 1),
                           causal_attention(0))
            zeros, _ = model(toks, torch.cat([aux[:n], aux.new_zeros(k - 1, aux.shape[1])]),
                             torch.zeros(n + k - 1, dtype=torch.bool), torch.arange(n + k - 1), causal_attention(0))
    finally:
        hook.remove()
        with torch.no_grad():
            model.mask_hidden.copy_(saved)
    drafted = seen[0]
    assert drafted.shape[0] == k
    assert torch.allclose(drafted, ref[n - 1 :], atol=1e-4)
    # the check can tell: zero features at the mask slots give other states at every mask slot
    assert all(not torch.allclose(zeros[n - 1 + j], ref[n - 1 + j], atol=1e-2) for j in range(1, k))
