"""The EAGLE family's layer-architecture options that speculators' trainer defaults need (issue 54, item 4), without
speculators installed: ``qk_norm`` (Qwen3's per-head q / k RMSNorm, checked against transformers' own
``Qwen3DecoderLayer``), ``norm_before_residual`` (the first layer's residual from hidden_norm(hidden)),
``norm_before_fc`` (one RMSNorm over the concatenated aux states before fc), ``norm_output`` (an EAGLE-3 step feeds
the next the final norm's output) and ``sliding_window`` (the visibility rule's window clause, applied by every
builder that declares ``windows``, and the reference engine's KV-cache attention). The placements against speculators'
own classes: tests/vllm_integration/test_speculators_default_folders.py. The drafter contract runs at these options too, with
a window that binds on its 18-token examples: every builder and partitioner gives dense's gradients, decoding is
lossless, and a saved drafter drafts the same."""

from __future__ import annotations

import attrs
import pytest
import torch

from specframe import api, plugins
from specframe.drafting.elements import cod_sample, full_grid, rule_matrix, visible
from specframe.errors import UsageError
from specframe.drafting.modeling import DecoderLayer, LayerShape, RMSNorm, causal_attention, rotary
from specframe.testing import DrafterContract, target_features, training_example

SHAPE = LayerShape(hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=48, eps=1e-6)


# ------------------------------------------------------------------------------------------------- the window


def _brute_force(query, key, window):
    """The windowed rule spelled out element by element: same document, and either a depth-0 key of the context at
    most ``window - 1`` positions behind the query's position, or the query's own chain (chain rule)."""
    out = torch.zeros(len(query), len(key), dtype=torch.bool)
    for i in range(len(query)):
        qa, qd, qdoc = int(query.anchor[i]), int(query.depth[i]), int(query.doc[i])
        for j in range(len(key)):
            ka, kd, kdoc = int(key.anchor[j]), int(key.depth[j]), int(key.doc[j])
            if qdoc != kdoc:
                continue
            context = kd == 0 and ka <= qa and (window is None or qa + qd - ka <= window - 1)
            own = ka == qa and kd <= qd
            out[i, j] = context or own
    return out


@pytest.mark.parametrize("window", [None, 1, 2, 5])
def test_the_window_keeps_a_context_key_exactly_while_it_lies_within_w_positions(window):
    doc = torch.tensor([0] * 9 + [1] * 7)
    elems = attrs.evolve(full_grid(16, 3, doc), window=window)
    assert torch.equal(visible(elems, elems), _brute_force(elems, elems, window))
    # the own chain is never cut: depth d of anchor a sees (a, 0) even where a + d - a >= W
    if window == 1:
        qa, qd = torch.tensor([[4]]), torch.tensor([[2]])
        assert bool(rule_matrix("chain", qa, qd, torch.tensor([[4]]), torch.tensor([[0]]), window))
        assert not bool(rule_matrix("chain", qa, qd, torch.tensor([[3]]), torch.tensor([[0]]), window))


def _attend(builder_name, query, key, q, k, v):
    cls = plugins.get("mask builder", builder_name)
    builder = cls(cls.Options(chunk_size=5)) if builder_name == "chunked" else cls()
    att = api.SegmentAttention(builder, builder.build(query, key))
    out = att(q, k, v)
    return (out, *torch.autograd.grad(out.square().sum(), (q, k, v)))


@pytest.mark.parametrize("rule", ["chain", "block"])
@pytest.mark.parametrize("window", [1, 3, 6])
def test_chunked_and_precomputed_apply_the_window_as_dense_does(rule, window):
    """Outputs and gradients of q, k, v equal dense's on two packed documents, for the full grid and a COD subset:
    the chunked builder's maskless prefix must hold only keys every query of its chunk still sees."""
    torch.manual_seed(0)
    doc = torch.tensor([0] * 21 + [1] * 19)
    sup = torch.ones(40, dtype=torch.bool)
    for elems in (full_grid(40, 4, doc), cod_sample(sup, 4, 0.6, 0.2, generator=torch.Generator().manual_seed(0),
                                                    doc=doc)):
        elems = attrs.evolve(elems.with_visibility(rule), window=window)
        n = len(elems)
        q, k, v = (torch.randn(1, 4, n, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
        ref = _attend("dense", elems, elems, q, k, v)
        for name in ("chunked", "precomputed"):
            for got, want in zip(_attend(name, elems, elems, q, k, v), ref, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=f"{name} window {window}")


def test_flex_applies_the_window_as_dense_does_in_its_cpu_forward():
    """FlexAttention trains only on CUDA; its CPU forward (eager, uncompiled) evaluates the same windowed mask_mod."""
    torch.manual_seed(0)
    elems = attrs.evolve(full_grid(40, 4, torch.tensor([0] * 21 + [1] * 19)), window=3)
    q, k, v = (torch.randn(1, 4, len(elems), 8) for _ in range(3))
    flex = plugins.get("mask builder", "flex")
    got = api.SegmentAttention.build(flex(flex.Options(compile=False)), elems)(q, k, v)
    want = api.SegmentAttention.build(plugins.get("mask builder", "dense")(), elems)(q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_builder_that_does_not_apply_windows_is_refused_a_windowed_set():
    class Unwindowed(api.MaskBuilder):
        name = "unwindowed"
        visibilities = frozenset(api.VISIBILITY_RULES)

        def build(self, query, key):
            return lambda q, k, v: q

    elems = full_grid(6, 2)
    api.SegmentAttention.build(Unwindowed(), elems)  # no window: as before
    with pytest.raises(UsageError, match="^mask builder 'unwindowed' does not apply a sliding window, and the "
                                         "drafter attends within 4 positions"):
        api.SegmentAttention.build(Unwindowed(), attrs.evolve(elems, window=4))


@pytest.mark.parametrize("window", [1, 3])
def test_drafting_attention_sees_the_last_w_positions(window):
    """The reference engine's KV-cache attention: a query at position p sees keys p - W + 1 .. p (vLLM's window)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    got = causal_attention(5, window)(q, k, v)
    for i in range(3):
        p = 5 + i
        lo = max(0, p - window + 1)
        want = torch.nn.functional.scaled_dot_product_attention(q[:, :, i:i + 1], k[:, :, lo:p + 1], v[:, :, lo:p + 1])
        torch.testing.assert_close(got[:, :, i:i + 1], want)


# ---------------------------------------------------------------------------------------------- the layer norms


def test_qk_norm_layer_is_transformers_qwen3_decoder_layer():
    """A plain (non-EAGLE) draft layer with ``qk_norm`` computes transformers' Qwen3DecoderLayer with the same
    weights (the q / k norms per head, before RoPE): what speculators' qwen3 layers and vLLM's Qwen3 layers are."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                      rms_norm_eps=1e-6, num_hidden_layers=1, layer_types=["full_attention"])
    cfg._attn_implementation = "eager"
    theirs = Qwen3DecoderLayer(cfg, 0).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    shape = LayerShape.from_config(cfg)
    ours = DecoderLayer(shape, qk_norm=True)
    assert set(ours.state_dict()) == set(theirs.state_dict())  # q_norm / k_norm under vLLM's / speculators' names
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(1, 7, 32)
    pos = torch.arange(7)
    mask = torch.full((7, 7), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want = theirs(x, attention_mask=mask, position_ids=pos[None],
                      position_embeddings=Qwen3RotaryEmbedding(cfg)(x, pos[None]))
        cos, sin = rotary(pos, shape, x.dtype)
        got, _ = ours(x, cos, sin, causal_attention(0))
    torch.testing.assert_close(got, want[0] if isinstance(want, tuple) else want, rtol=1e-5, atol=1e-5)
    without = DecoderLayer(shape)
    without.load_state_dict({k: v for k, v in theirs.state_dict().items() if "_norm" not in k or "layernorm" in k},
                            strict=False)
    with torch.no_grad():
        assert not torch.allclose(without(x, cos, sin, causal_attention(0))[0], got, atol=1e-3)


def _first_layer_reference(layer, embeds, hidden, cos, sin, norm_before_residual):
    """EAGLE-3's first layer as vLLM's llama_eagle3 writes it: embeds = input_layernorm(e); (hidden, residual) =
    (hidden_norm(h), hidden_norm(h)) with norm_before_residual, else (hidden_norm(h), h); attention over
    cat(embeds, hidden); then the usual post-attention half."""
    e = layer.input_layernorm(embeds)
    h = layer.hidden_norm(hidden)
    residual = h if norm_before_residual else hidden
    q, k, v = layer.self_attn.project(torch.cat([e, h], -1), cos, sin)
    attn, _ = layer.self_attn.attend(q, k, v, causal_attention(0))
    out = residual + layer.self_attn.o_proj(attn)
    return out + layer.mlp(layer.post_attention_layernorm(out))


@pytest.mark.parametrize("before", [False, True])
def test_norm_before_residual_starts_the_residual_from_the_normed_hidden_state(before):
    torch.manual_seed(0)
    layer = DecoderLayer(SHAPE, eagle_input=True, norm_before_residual=before)
    with torch.no_grad():
        layer.hidden_norm.weight.mul_(3.0)  # so the normed and the raw hidden state differ clearly
    e, h = torch.randn(1, 6, 32), 5 * torch.randn(1, 6, 32)
    cos, sin = rotary(torch.arange(6), SHAPE, e.dtype)
    with torch.no_grad():
        got, _ = layer(h, cos, sin, causal_attention(0), embeds=e)
        want = _first_layer_reference(layer, e, h, cos, sin, before)
        other = _first_layer_reference(layer, e, h, cos, sin, not before)
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, other, atol=1e-3)


def _built(kind, target, **options):
    torch.manual_seed(0)
    cls = plugins.get("drafter", kind)
    base = {"layers": 2, "draft_vocab_size": 128, "vocab_position_mask": False}
    drafter = cls(target.config, cls.Options(**base, **options))
    training_example(target, drafter)  # prepared as training does (draft vocabulary, mask token)
    with torch.no_grad():
        for p in drafter.module().parameters():
            p.add_(0.1 * torch.randn_like(p))
    drafter.module().eval()
    return drafter


@pytest.mark.parametrize("kind", ["eagle3", "peagle"])
def test_norm_before_fc_normalises_the_concatenated_aux_states_before_fc(specframe_tiny_target, kind):
    drafter = _built(kind, specframe_tiny_target, norm_before_fc=True)
    model = drafter.model
    assert tuple(model.input_norm.weight.shape) == (3 * 32,)
    with torch.no_grad():
        model.input_norm.weight.copy_(torch.rand(96) + 0.5)
        aux = 7 * torch.randn(5, 96)
        torch.testing.assert_close(model.fuse(aux), model.fc(RMSNorm.forward(model.input_norm, aux)))
        assert not torch.allclose(model.fuse(aux), model.fc(aux), atol=1e-3)
    assert "input_norm" not in dict(_built(kind, specframe_tiny_target).model.named_children())


def test_norm_output_feeds_the_next_eagle3_step_the_final_norms_output(specframe_tiny_target):
    """EAGLE 3.1 (speculators' norm_output, vLLM's aux_output): draft step 2 reads norm(step 1's output), so its
    logits are those of a step fed the normed state by hand; without the option, the pre-norm state."""
    for norm_output in (True, False):
        drafter = _built("eagle3", specframe_tiny_target, norm_output=norm_output)
        model = drafter.model
        ids = torch.randint(7, 300, (9,), generator=torch.Generator().manual_seed(2))
        feats = target_features(specframe_tiny_target, ids, drafter)
        with torch.no_grad():
            drafter.start(ids, feats)
            first = drafter._commit()
            token = model.to_target(model.logits(first).argmax(-1))
            fed = model.norm(first) if norm_output else first
            out, _ = model.run(model.embed_tokens(token.view(1)), fed, torch.tensor([drafter._cached]),
                               causal_attention(drafter._cached), past=drafter._cache)
            want = model.to_target(model.logits(out).argmax(-1))
            drafter.start(ids, feats)
            drafted = drafter.propose(2).tokens
        assert int(drafted[0]) == int(token) and int(drafted[1]) == int(want)
        hidden = drafter._step(token.view(1), first, None, 0)[0]
        torch.testing.assert_close(model.logits(hidden), model.logits(out))


def test_peagle_training_forward_with_a_window_equals_its_drafting(specframe_tiny_target):
    """Element (a, d) of P-EAGLE's training forward (windowed chunked attention, the engine's CPU default) has the
    state its drafting gives depth d after a prompt ending at anchor a (windowed KV-cache attention)."""
    drafter = _built("peagle", specframe_tiny_target, sliding_window=3, qk_norm=True, norm_before_residual=True)
    model = drafter.model
    n, k = 14, 3
    ids = torch.randint(7, 300, (n + 1,), generator=torch.Generator().manual_seed(4))
    aux = target_features(specframe_tiny_target, ids, drafter)["aux_hidden"]
    elems = full_grid(n, k)
    chunked = plugins.get("mask builder", "chunked")
    attention = api.eagle.windowed(api.SegmentAttention.build(chunked(chunked.Options(chunk_size=4)), elems),
                                   elems, 3)
    is_mask = elems.depth > 0
    tokens = torch.where(is_mask, torch.full_like(elems.anchor, drafter.mask_token_id), ids[elems.anchor + 1])
    with torch.no_grad():
        trained = model(tokens, aux[:n], is_mask, elems.position, attention, aux_index=elems.anchor)[0]
    captured = []
    handle = model.lm_head.register_forward_hook(lambda m, i, o: captured.append(i[0]))
    try:
        for a in range(n - k + 1):
            captured.clear()
            with torch.no_grad():
                drafter.start(ids[: a + 2], {"aux_hidden": aux[: a + 1]})
                drafter.propose(k)
            rows = ((elems.anchor == a)).nonzero().squeeze(1)
            torch.testing.assert_close(captured[0], trained[rows], rtol=1e-5, atol=1e-5, msg=f"anchor {a}")
    finally:
        handle.remove()


# ------------------------------------------------------------------------------------------- the options


def test_the_options_default_to_todays_architecture_and_come_after_every_existing_option():
    for kind, new in (("eagle3", ["qk_norm", "norm_before_residual", "norm_before_fc", "norm_output",
                                  "sliding_window"]),
                      ("peagle", ["qk_norm", "norm_before_residual", "norm_before_fc", "sliding_window"])):
        cls = plugins.get("drafter", kind)
        names = [f.name for f in attrs.fields(cls.Options)]
        assert names[-len(new):] == new
        defaults = cls.Options()
        assert [getattr(defaults, n) for n in new] == [False] * (len(new) - 1) + [None]
    with pytest.raises(UsageError, match="peagle option 'sliding_window' must be a positive integer or null"):
        plugins.get("drafter", "peagle").Options(sliding_window=0)


# --------------------------------------------------------------------- the drafter contract at these options


class TestPEagleSpeculatorsDefaults(DrafterContract):
    """speculators' default P-EAGLE: Qwen3 layers, norm_before_residual, a window (4) that binds at 18 tokens."""

    drafter = "peagle"
    options = {"layers": 2, "vocab_position_mask": False, "qk_norm": True, "norm_before_residual": True,
               "sliding_window": 4}


class TestEagle3SpeculatorsDefaults(DrafterContract):
    """speculators' default EAGLE-3 (EAGLE 3.1): norm_before_fc, norm_output, norm_before_residual, a window."""

    drafter = "eagle3"
    options = {"vocab_position_mask": False, "norm_before_fc": True, "norm_output": True,
               "norm_before_residual": True, "sliding_window": 4}
