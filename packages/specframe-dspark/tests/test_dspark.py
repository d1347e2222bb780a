"""DSpark (packages/specframe-dspark): a plugin distribution on the shared engine and the core's block backbone.

The training loss is checked against an oracle written per block with no mask builder and no chunking (block a =
[x_{a+1}, MASK x (B-1)] at positions a+1 .. with full attention to the context g_c, c <= a in a's document; slot d
predicts x_{a+2+d}; the Markov bias from the previous data token; the l1 distance to the target's distribution at
position a+1+d; the confidence head's BCE toward 1 - TV), drafting against the same per-block forward sampled left to
right, and decoding through the reference engine's verifiers.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specframe import api, plugins
from specframe.elements import position_docs

try:
    DIST = importlib.metadata.distribution("specframe-dspark")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - depends on the environment
    pytest.skip("the specframe-dspark distribution is not installed (pip install --no-deps -e "
                "packages/specframe-dspark)", allow_module_level=True)

from tests.block_fixtures import SDPA, grid, make_block, run, target  # noqa: E402, F401 (target: the module fixture)

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


def oracle_loss(drafter, ex, elems, sup, target):
    opts = drafter.options
    B, L = opts.block_size, ex.input_ids.shape[0]
    head = target.model.get_output_embeddings().weight.double()
    conf = drafter.model.confidence_head
    total = torch.zeros((), dtype=torch.float64)
    for a in sorted(set(elems.anchor.tolist())):
        # DeepSpec's sampler: a block whose anchor token is supervised, slots up to its first unsupervised one
        want = [int(d) for aa, d in zip(elems.anchor.tolist(), elems.depth.tolist())
                if aa == a and ex.loss_mask[a + 1] and bool(sup[a : a + d + 1].all())]
        if not want:
            continue
        hidden = block_forward(drafter, ex, a)
        prev = ex.input_ids[[min(a + 1 + s, L - 1) for s in range(B)]]
        logits = drafter.model.lm_head(hidden) + markov_biases(drafter, hidden, prev)
        for d in want:
            logq = torch.log_softmax(logits[d], -1)
            p = torch.softmax(ex.features["final_hidden"][a + 1 + d] @ head.T, -1)
            ce = -logq[ex.input_ids[a + 2 + d]]
            l1 = (logq.exp() - p).abs().sum()
            per = opts.ce_weight * ce + opts.l1_weight * l1
            if conf is not None:
                accept = (1 - l1.detach() / 2).clamp(0, 1)
                feats = torch.cat([hidden[d], drafter.model.markov_head.markov_w1.weight[prev[d]]])
                x = (conf.proj.weight @ feats + conf.proj.bias)[0]
                per = per + opts.confidence_weight * -(accept * F.logsigmoid(x) + (1 - accept) * F.logsigmoid(-x))
            total = total + per * (math.exp(-d / opts.loss_decay_gamma) if opts.loss_decay_gamma else 1.0)
    return total


# ------------------------------------------------------------------------------------------------------ packaging


def test_listed_by_specframe_plugins_from_its_own_distribution():
    reg = plugins.load()
    assert "dspark" in reg.names("drafter")
    assert [ep.value for ep in DIST.entry_points if ep.group == "specframe"] == ["specframe_dspark"]
    assert reg.get("drafter", "dspark").__module__ == "specframe_dspark"


def test_the_package_imports_only_the_public_api():
    import specframe_dspark

    root = os.path.dirname(specframe_dspark.__file__)
    for name in os.listdir(root):
        if name.endswith(".py"):
            text = Path(root, name).read_text()
            imports = [line for line in text.splitlines() if line.startswith(("import specframe", "from specframe"))]
            assert all(line == "from specframe import api" for line in imports), (name, imports)


def test_declares_the_block_rule_its_depth_and_defaults(target):
    cls = plugins.get("drafter", "dspark")
    defaults = cls.Options()
    # DeepSpec's config/dspark/dspark_qwen3_4b.py
    assert (defaults.block_size, defaults.layers, defaults.markov_rank, defaults.markov_head_type) == (7, 5, 256,
                                                                                                       "vanilla")
    assert (defaults.ce_weight, defaults.l1_weight, defaults.loss_decay_gamma, defaults.k_infer) == (0.1, 0.9, 4.0, 7)
    drafter, _ = make(target)
    assert drafter.visibility == "block" and drafter.depth == 4 and drafter.options.k_train == 4
    assert drafter.forwarded_rows(10, 3) == 12  # every slot of every anchor's block
    with pytest.raises(api.UsageError, match="at most block_size = 4 depths"):
        drafter.check_training(5, "dense", "none")
    with pytest.raises(api.UsageError, match="'markov_head_type' must be one of vanilla, rnn, got 'gru'"):
        cls.Options(markov_head_type="gru")
    with pytest.raises(api.UsageError, match=r"'k_infer' must be in 1\.\.block_size \(7\), got 8"):
        cls.Options(k_infer=8)
    with pytest.raises(api.UsageError, match="'markov_rank' must be a positive integer"):
        cls.Options(markov_rank=0)


@pytest.mark.parametrize("head", ["vanilla", "rnn"])
def test_starts_as_the_reference_does(target, head):
    """DeepSpec's post_init (SpecForge and speculators alike): every Linear / Embedding N(0, 0.02), biases 0; the
    Markov head's W1 is not PyTorch's N(0, 1) embedding default."""
    cls = plugins.get("drafter", "dspark")
    torch.manual_seed(0)
    model = cls(target.config, cls.Options(**{**SMALL, "markov_rank": 64, "markov_head_type": head})).model
    linear = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear | torch.nn.Embedding)}
    assert {"markov_head.markov_w1", "markov_head.markov_w2", "confidence_head.proj", "fc"} <= set(linear)
    for name, m in linear.items():
        w = m.weight.detach().double()
        assert abs(float(w.std()) - 0.02) < 0.1 * 0.02 and abs(float(w.mean())) < 0.01, (name, float(w.std()))
        if getattr(m, "bias", None) is not None:
            assert not m.bias.any(), name
    assert (head == "rnn") == ("markov_head.joint_proj" in linear)
    norms = [p for name, p in model.named_parameters() if name.endswith("norm.weight")]
    assert norms and all(bool((p == 1).all()) for p in norms)


# ------------------------------------------------------------------------------------------------------- training


def two_turns(length=20):
    """A loss mask of two assistant turns after their prompts: x_4..x_9 and x_12..x_19 supervised (the second
    prompt shorter than a block, so a block anchored in the first answer reaches into the second)."""
    mask = torch.zeros(length, dtype=torch.bool)
    mask[4:10] = mask[12:] = True
    return mask


@pytest.mark.parametrize("head,docs,confidence,turns", [("vanilla", 1, True, False), ("vanilla", 2, True, False),
                                                        ("rnn", 2, True, False), ("vanilla", 1, False, False),
                                                        ("vanilla", 1, True, True)])
def test_training_loss_and_gradients_equal_the_per_block_oracle(target, head, docs, confidence, turns):
    drafter, ex = make(target, length=20 if turns else 18, docs=docs, mask=two_turns() if turns else None,
                       markov_head_type=head, confidence_head=confidence)
    elems, sup = grid(drafter, ex)
    loss, grads, _ = run(drafter, ex, elems, sup)
    count = int(sup[elems.position].sum())
    drafter.module().zero_grad(set_to_none=True)
    want = oracle_loss(drafter, ex, elems, sup, target) / count
    want.backward()
    assert loss == pytest.approx(float(want.detach()), rel=1e-10)
    for name, p in drafter.module().named_parameters():
        if p.grad is not None:
            assert torch.allclose(grads[name], p.grad, atol=1e-10), name
    assert ("markov_head.markov_w1.weight" in grads) and (("confidence_head.proj.weight" in grads) == confidence)
    if head == "rnn":
        assert "markov_head.joint_proj.weight" in grads


def test_blocks_are_anchored_on_answer_tokens_and_stop_at_their_first_unsupervised_slot(target):
    """DeepSpec's and SpecForge's samplers: an element (a, d) trains only if its anchor token x_{a+1} and the
    targets x_{a+2} .. x_{a+2+d} are all supervised. The others the engine charges carry no loss and no confidence
    (so no held-out chain for calibration), but keep their verdicts."""
    mask = two_turns()
    drafter, ex = make(target, length=20, mask=mask)
    elems, sup = grid(drafter, ex)
    seg = api.Segment(torch.arange(len(elems)), torch.ones(len(elems), dtype=torch.bool))
    terms = drafter.loss(ex, elems, seg, api.SegmentAttention.build(plugins.get("mask builder", "dense")(), elems))
    charged = sup[elems.position]
    anchor, depth = elems.anchor[charged], elems.depth[charged]
    rule = torch.tensor([bool(mask[a + 1 : a + 3 + d].all()) for a, d in zip(anchor.tolist(), depth.tolist())])
    assert torch.equal(drafter.last_trained, rule)
    assert torch.equal(terms.confidence.isnan(), ~rule) and terms.hit.numel() == terms.count == int(charged.sum())
    on_prompt = ~mask[anchor + 1]  # anchored on a prompt token, its own target supervised
    after_gap = mask[anchor + 1] & ~rule  # a slot past the first unsupervised one of an answer-anchored block
    assert on_prompt.any() and after_gap.any() and not drafter.last_trained[on_prompt | after_gap].any()
    # that they carry no loss is the oracle test's two-turn case (loss and gradients)


def test_the_chunked_loss_is_the_unchunked_one(target):
    """Row chunks recomputed in backward (activation checkpointing) give the same loss and gradients."""
    drafter, ex = make(target)
    elems, sup = grid(drafter, ex)
    whole, g_whole, _ = run(drafter, ex, elems, sup)
    drafter.options.loss_chunk = 5
    chunked, g_chunked, _ = run(drafter, ex, elems, sup)
    assert chunked == pytest.approx(whole, rel=1e-12)
    for name in g_whole:
        assert torch.allclose(g_whole[name], g_chunked[name], atol=1e-12), name


@pytest.mark.parametrize("partitioner,parts", [("none", 1), ("peagle", 3)])
@pytest.mark.parametrize("builder", ["dense", "precomputed", "chunked"])
def test_every_builder_and_partition_matches_dense(target, builder, partitioner, parts):
    drafter, ex = make(target, docs=2)
    elems, sup = grid(drafter, ex)
    want, g_want, hits_want = run(drafter, ex, elems, sup)
    got, g_got, hits = run(drafter, ex, elems, sup, builder, partitioner, parts)
    assert got == pytest.approx(want, rel=1e-9) and hits == hits_want
    for name in g_want:
        assert torch.allclose(g_want[name], g_got[name], atol=1e-9), name


def test_overfits_one_example_and_the_confidence_follows_acceptance(target):
    drafter, ex = make(target, length=14)
    drafter.module().float()
    ex = api.TrainingExample(ex.input_ids, ex.loss_mask, ex.doc, {k: v.float() for k, v in ex.features.items()})
    elems, sup = grid(drafter, ex)
    opt = torch.optim.Adam([p for p in drafter.module().parameters() if p.requires_grad], lr=1e-2)
    seg = api.Segment(torch.arange(len(elems)), torch.ones(len(elems), dtype=torch.bool))
    dense = plugins.get("mask builder", "dense")()

    def confidence_error():
        with torch.no_grad():
            drafter.loss(ex, elems, seg, api.SegmentAttention.build(dense, elems))
        assert drafter.last_acceptance.numel() == int(sup[elems.position].sum())
        return float((drafter.last_confidence_estimate - drafter.last_acceptance).abs().mean())

    before = confidence_error()
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss, _, _ = run(drafter, ex, elems, sup)
        losses.append(loss)
        opt.step()
    assert losses[-1] < 0.5 * losses[0], (losses[0], losses[-1])
    # the confidence head's estimate approaches the analytical acceptance it is trained toward
    after = confidence_error()
    assert after < 0.5 * before, (before, after)


def test_a_top_k_teacher_cache_is_refused_with_the_reason(target):
    drafter, ex = make(target)
    elems, sup = grid(drafter, ex)
    bare = api.TrainingExample(ex.input_ids, ex.loss_mask, ex.doc, {"aux_hidden": ex.features["aux_hidden"]})
    seg = api.Segment(torch.arange(len(elems)), torch.ones(len(elems), dtype=torch.bool))
    with pytest.raises(api.UsageError, match="dspark needs the target's final hidden states"):
        drafter.loss(bare, elems, seg, api.SegmentAttention.build(plugins.get("mask builder", "dense")(), elems))


# ------------------------------------------------------------------------------------------------------ inference


def free_running(drafter, ex, a, k):
    """The oracle's drafts of block a: slot by slot, the bias from the token drafted before (the anchor first)."""
    hidden = block_forward(drafter, ex, a)
    base = drafter.model.lm_head(hidden)
    prev, out = int(ex.input_ids[a + 1]), []
    for s in range(k):
        # the bias of slot s given the drafted prefix: the head recomputed over the whole prefix (RNN: its state)
        prefix = torch.tensor([int(ex.input_ids[a + 1])] + out)
        bias = markov_biases(drafter, hidden, prefix)[s]
        prev = int((base[s] + bias).argmax())
        out.append(prev)
    return out


def slot_distributions(drafter, ex, a, drafted):
    """The oracle's q at each slot of block a given the drafted prefix (the anchor, then ``drafted``)."""
    hidden = block_forward(drafter, ex, a)
    prefix = torch.tensor([int(ex.input_ids[a + 1])] + list(drafted))
    k = len(drafted)
    logits = drafter.model.lm_head(hidden[:k]) + markov_biases(drafter, hidden, prefix[:k])
    return torch.softmax(logits.double(), -1)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("head", ["vanilla", "rnn"])
def test_propose_drafts_the_per_block_forward_left_to_right(target, head, temperature):
    """start / accept / propose (context cached across rounds) against the oracle's block forward and sequential
    stage: an off-by-one between the indexings (context up to t vs t + 1, the anchor, positions), a bias from the
    wrong previous token or a dropped recurrent state breaks the equality. Greedy: the drafts are the oracle's
    slot-by-slot argmax; sampled: each slot's q is the oracle's given the drafted prefix (continuous, so a bias
    too small to move an argmax still shows)."""
    drafter, ex = make(target, length=20, markov_head_type=head, draft_temperature=temperature)
    drafter.module().eval()
    seq, aux = ex.input_ids, ex.features["aux_hidden"]
    n0 = 5
    drafter.start(seq[:n0], {"aux_hidden": aux[: n0 - 1]})
    drafter.accept(seq[n0 : n0 + 1], {"aux_hidden": aux[n0 - 1 : n0]})
    committed = n0 + 1
    g = torch.Generator().manual_seed(5)
    for step, k in ((1, 4), (3, 2), (2, 3), (1, 1)):
        with torch.no_grad():
            draft = drafter.propose(k, g)
            a = committed - 2
            if temperature == 0:
                assert draft.probs is None
                assert draft.tokens.tolist() == free_running(drafter, ex, a, k), (committed, k)
            else:
                q = slot_distributions(drafter, ex, a, draft.tokens.tolist())
                assert torch.allclose(draft.probs.double(), q, atol=1e-6), (committed, k)
        assert drafter.last_confidence.shape == (k,)
        drafter.accept(seq[committed : committed + step], {"aux_hidden": aux[committed - 1 : committed - 1 + step]})
        committed += step


@pytest.mark.parametrize("head", ["vanilla", "rnn"])
def test_greedy_decoding_through_the_engine_is_lossless(target, head):
    from specframe.inference import TreeShape  # noqa: F401  (the engine's public entry, as the other drafters use)
    from specframe.inference.engine import generate

    drafter, _ = make(target, markov_head_type=head)
    drafter.module().float().eval()
    verifier = plugins.get("verifier", "greedy")()
    prompt = torch.randint(7, target.config.vocab_size, (10,), generator=torch.Generator().manual_seed(1))
    plain = generate(target.model, prompt, verifier, max_new_tokens=24, eos_token_id=())
    spec = generate(target.model, prompt, verifier, drafter, k=4, max_new_tokens=24, eos_token_id=())
    assert spec.tokens == plain.tokens
    assert max(r.nodes for r in spec.rounds) == 4


def test_sampled_drafts_carry_their_distribution_and_follow_the_generator(target):
    drafter, ex = make(target, draft_temperature=1.0)
    drafter.module().eval()
    seq, aux = ex.input_ids, ex.features["aux_hidden"]

    def draft(seed):
        drafter.start(seq[:6], {"aux_hidden": aux[:5]})
        return drafter.propose(4, torch.Generator().manual_seed(seed))

    a, b = draft(3), draft(3)
    assert torch.equal(a.tokens, b.tokens) and a.probs.shape == (4, target.config.vocab_size)
    assert torch.allclose(a.probs.sum(-1), torch.ones(4, dtype=a.probs.dtype), atol=1e-5)
    assert all(float(a.probs[i, t]) > 0 for i, t in enumerate(a.tokens.tolist()))
    assert any(not torch.equal(draft(s).tokens, a.tokens) for s in range(4, 12))


# ------------------------------------------------------------------------------------------------- the shared engine


@pytest.mark.slow
@pytest.mark.parametrize("builder,partitioner,parts", [("dense", "none", 1), ("chunked", "peagle", 2)])
def test_trains_on_the_shared_engine(tmp_path, builder, partitioner, parts):
    from specframe.drafter_folders import load_drafter
    from specframe.engine import TrainConfig, train
    from specframe.targets import load_target
    from tests.train_fixtures import build

    target_dir, chat = build(tmp_path / "assets")
    out = tmp_path / "run"
    train(TrainConfig(drafter="dspark", target=str(target_dir), data=str(chat), output=str(out), seq_len=32,
                      max_steps=4, batch_size=1, val_examples=1, lr=3e-3, mask_builder=builder,
                      partitioner=partitioner, partitions=parts, drafter_options=dict(SMALL)), progress=False)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [m["train_loss"] for m in metrics if m.get("train_loss") is not None]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    reloaded = load_drafter(out, load_target(target_dir).config)
    assert reloaded.mask_token_id is not None and reloaded.visibility == "block"
    assert set(reloaded.module().state_dict()) >= {"markov_head.markov_w1.weight", "confidence_head.proj.bias"}


def _sampling_drafter():
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


@pytest.mark.slow
def test_speculative_sampling_with_sampled_dspark_drafts_matches_the_target_law():
    """The engine's speculative sampling with DSpark's sampled drafts (q = Draft.probs) emits the target's exact joint
    law of the first tokens (chi-square, as tests/unit/test_sampling_distribution.py for the reference drafter), and the
    same run through the classic broken verifier (resampling from p after a rejection) is rejected."""
    from specframe.inference import generate
    from tests.unit.test_sampling_distribution import (
        N_TOKENS,
        PROMPT,
        THRESHOLD,
        BrokenSampling,
        chi_square_pvalue,
        exact_joint,
    )

    model, drafter = _sampling_drafter()

    def samples(verifier, n):
        g = torch.Generator().manual_seed(11)
        return [tuple(generate(model, torch.tensor(PROMPT), verifier, drafter, k=2, max_new_tokens=N_TOKENS,
                               eos_token_id=(), generator=g).tokens) for _ in range(n)]

    exact = exact_joint()
    assert chi_square_pvalue(samples(plugins.get("verifier", "sampling")(), 3000), exact) > THRESHOLD
    assert chi_square_pvalue(samples(BrokenSampling(), 1500), exact) < 1e-6


# ------------------------------------------------------------------------------------------------------------ vLLM


def test_export_writes_the_speculators_dspark_layout(target, tmp_path):
    """The export is what vLLM 0.32's own ``update_dspark`` turns into a Qwen3DSparkModel config (anchor as the
    first prediction, target layers = aux ids - 1, the heads' settings), every weight under vLLM's
    ``Qwen3DSparkModel`` names; check_export validates it and names a damage; vLLM serves it at K = block_size only."""
    from safetensors.torch import load_file, save_file

    from specframe.layouts import export

    drafter, _ = make(target)
    drafter.module().float()
    out = tmp_path / "out"
    manifest = drafter.export_vllm(out, target.tokenizer)
    assert manifest["layout"] == "dspark" and manifest["method"] == "dspark" and not manifest["parallel_drafting"]
    assert (manifest["min_speculative_tokens"], manifest["max_speculative_tokens"]) == (4, 4)
    assert manifest["speculative_tokens"] == 4 and manifest["block_size"] == 4
    assert export.check_export(out, target.config).layout == "dspark"
    assert export.speculative_config(out, 4) == {"method": "dspark", "model": str(out.resolve()),
                                                 "num_speculative_tokens": 4}
    assert export.read_manifest(out).refusal(3) == (
        "vLLM cannot serve this dspark export at 3 draft tokens per step: its dspark proposer drafts K tokens from a "
        "block of K slots (the anchor predicts too), and this drafter was trained on blocks of 4 (bidirectional, so a "
        "shorter block is a network it never was); it serves K = 4")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["speculators_model_type"] == "dspark"
    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == set(drafter.module().state_dict())
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
            "confidence_head.proj.bias", "fc.weight", "hidden_norm.weight", "layers.1.self_attn.q_norm.weight"} <= set(
        weights)
    assert weights["confidence_head.proj.weight"].shape == (1, drafter.shape.hidden + 8)
    try:
        from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
    except ImportError:  # pragma: no cover - vLLM absent
        pytest.skip("vLLM is not installed: the config is checked by vLLM's own speculators reader")
    hf = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(cfg)))
    assert hf["architectures"] == ["Qwen3DSparkModel"] and hf["model_type"] == "qwen3"
    assert hf["sample_from_anchor"] is True and hf["dspark_bonus_anchor"] is False
    assert hf["target_layer_ids"] == [i - 1 for i in drafter.aux_layer_ids]
    assert hf["eagle_aux_hidden_state_layer_ids"] == drafter.aux_layer_ids
    assert (hf["mask_token_id"], hf["block_size"], hf["markov_rank"], hf["markov_head_type"]) == (
        drafter.mask_token_id, 4, 8, "vanilla")
    assert hf["enable_confidence_head"] is True and hf["confidence_head_with_markov"] is True
    assert hf["use_aux_hidden_state"] is True and hf["draft_vocab_size"] == drafter.vocab_size
    assert hf["num_hidden_layers"] == 2
    del weights["markov_head.markov_w2.weight"]
    save_file(weights, str(out / "model.safetensors"))
    with pytest.raises(api.SpecframeError, match="missing weight 'markov_head.markov_w2.weight'"):
        export.check_export(out, target.config)


def test_an_rnn_head_is_not_exported_for_vllm(target, tmp_path):
    drafter, _ = make(target, markov_head_type="rnn")
    with pytest.raises(api.SpecframeError, match="vLLM serves the vanilla Markov head only .* this drafter's head is "
                                                 "'rnn'"):
        drafter.export_vllm(tmp_path / "out", target.tokenizer)
    assert not (tmp_path / "out").exists()


def test_vllm_without_triton_refuses_dspark_with_the_reason(monkeypatch):
    """vLLM 0.32 runs DSpark only in its V2 model runner, which it picks only with Triton: without it (the CPU build)
    the refusal names that; with Triton there is no such reason, unless the V2 runner is turned off. (One engine start
    on this CPU with an export and the SmolLM2 target: vLLM resolved the folder as Qwen3DSparkModel, fell back to the
    V1 runner for want of Triton and failed its config validation with "Model Runner V1 does not support: dspark
    speculative decoding" after 128 s.)"""
    pytest.importorskip("vllm")
    import vllm.triton_utils

    from specframe.vllm import support

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", False)
    assert support.dspark_runner_problem() == (
        "vLLM serves method dspark only in its V2 model runner (DSparkSpeculator), and it has no Triton (the CPU "
        "build), so it would start its V1 runner, which refuses dspark speculative decoding")
    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", True)
    assert support.dspark_runner_problem() is None
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert "VLLM_USE_V2_MODEL_RUNNER turns that runner off" in support.dspark_runner_problem()


@pytest.mark.slow  # imports vLLM's model registry (a minute on this CPU)
def test_serving_an_export_on_this_vllm_is_refused_before_start_up(target, tmp_path):
    pytest.importorskip("vllm")
    from vllm.triton_utils import HAS_TRITON

    from specframe.vllm.jobs import drafter_job

    if HAS_TRITON:
        pytest.skip("this vLLM has Triton: its V2 runner serves DSpark (the parity check belongs there)")
    drafter, _ = make(target)
    drafter.module().float()
    drafter.export_vllm(tmp_path / "out", target.tokenizer)
    with pytest.raises(api.SpecframeError) as info:
        drafter_job(tmp_path / "out", 4, target=str(tmp_path / "target-does-not-matter"))
    message = str(info.value)
    assert message.startswith("the installed vLLM cannot serve this dspark export for target")
    assert "only in its V2 model runner" in message and "\n" not in message
    from specframe.cli.serve_cmd import serve_command

    with pytest.raises(api.SpecframeError, match="the installed vLLM cannot serve this dspark export for target .*: "
                                                 "vLLM serves method dspark only in its V2 model runner"):
        serve_command(None, tmp_path / "out")


# ------------------------------------------------------------------------------------ the confidence-scheduled verifier


def scheduled(**options):
    cls = plugins.get("verifier", "scheduled")
    return cls(cls.Options(**options))


def _chain(confidence):
    n = len(confidence)
    return api.Draft(tokens=torch.arange(n), confidence=torch.tensor(confidence, dtype=torch.float32))


def test_the_schedule_keeps_tokens_while_they_raise_expected_tokens_per_cost():
    # E(m) = 1 + sum_j prod_{i<=j} c_i over T(m) = 1 + 0.1 m: 1.0, 1.727, 2.183, then 2.126 (down): two tokens
    assert scheduled().schedule(_chain([0.9, 0.8, 0.2, 0.9])) == 2
    assert scheduled(cost_per_token=0.0).schedule(_chain([0.9, 0.8, 0.2, 0.9])) == 4  # free tokens: all of them
    assert scheduled(cost_per_token=1.0).schedule(_chain([0.9, 0.8])) == 0  # 1.9 / 2 < 1: plain decoding pays more
    assert scheduled().schedule(_chain([0.9, 0.0, 0.9])) == 1  # a token that is surely rejected ends the prefix
    # a measured curve: the fourth token costs as much as the first three together
    assert scheduled(cost_curve=[1.0, 1.05, 1.1, 1.15, 2.0]).schedule(_chain([0.95] * 6)) == 3
    with pytest.raises(api.UsageError, match="needs per-token confidence"):
        scheduled().schedule(api.Draft(tokens=torch.arange(3)))
    with pytest.raises(api.UsageError, match="'cost_curve' must list at least two positive costs"):
        scheduled(cost_curve=[1.0])
    with pytest.raises(api.UsageError, match="'rule' must be one of greedy, sampling"):
        scheduled(rule="tree")
    with pytest.raises(api.InvalidDraftError, match="confidence values must lie in"):
        api.Draft(tokens=torch.arange(2), confidence=torch.tensor([0.5, 1.5]))


def test_the_engine_verifies_the_scheduled_prefix_and_stays_lossless(target):
    from specframe.inference.engine import generate

    drafter, _ = make(target)
    drafter.module().float().eval()
    prompt = torch.randint(7, target.config.vocab_size, (10,), generator=torch.Generator().manual_seed(1))
    plain = generate(target.model, prompt, plugins.get("verifier", "greedy")(), max_new_tokens=20, eos_token_id=())

    def run_with(verifier):
        return generate(target.model, prompt, verifier, drafter, k=4, max_new_tokens=20, eos_token_id=())

    free, costly, mixed = (run_with(scheduled(cost_per_token=c, measure=False)) for c in (0.0, 100.0, 0.3))
    assert free.tokens == plain.tokens and costly.tokens == plain.tokens and mixed.tokens == plain.tokens
    assert all(r.nodes == 4 for r in free.rounds) and all(r.nodes == 0 for r in costly.rounds)

    class Lying(type(scheduled())):
        def schedule(self, draft):
            return 9

    with pytest.raises(api.PluginError, match=r"verifier 'scheduled' scheduled 9 tokens of a 4-token draft"):
        run_with(Lying(Lying.Options()))
    blind, _ = make(target, confidence_head=False)
    with pytest.raises(api.UsageError, match="needs per-token confidence"):
        generate(target.model, prompt, scheduled(), blind, k=4, max_new_tokens=4, eos_token_id=())


def _round(drafted, verified=None, draft_seconds=0.5, target_seconds=1.0):
    verified = drafted if verified is None else verified
    return api.RoundCost(drafted=drafted, verified=verified, accepted=0, draft_seconds=draft_seconds,
                         target_seconds=target_seconds)


def test_skip_drafting_backs_off_while_drafts_do_not_pay_and_resumes_when_one_does():
    """API 11: after a draft whose best prefix, drafting included, returns less per cost than a plain step, the next
    1, 2, 4 .. max_skip rounds are not drafted; a draft that pays resets it. Linear costs T(m) = 1 + 0.1 m, drafting
    0.5: a draft of confidences 0.2 returns at best 1.2 / 1.6 < 1 (skip), one of 0.95s 4.52 / 1.9 > 1 (draft)."""
    v = scheduled(measure=False, skip_drafting=True, max_skip=4, draft_cost=0.5)
    v.bind(None)

    def drafted(confidence):
        v.schedule(_chain(confidence))
        v.observe(_round(len(confidence), 0))

    def skipped_run():
        n = 0
        while v.draft_budget(3) == 0:  # the call that returns 3 is the next probe
            n += 1
        return n

    assert v.draft_budget(3) == 3
    runs = []
    for _ in range(5):
        drafted([0.2, 0.2, 0.2])
        runs.append(skipped_run())
    assert runs == [1, 2, 4, 4, 4]
    drafted([0.95] * 5)  # a draft that pays: drafting every round again
    assert [v.draft_budget(3) for _ in range(3)] == [3, 3, 3]
    drafted([0.2, 0.2, 0.2])
    assert skipped_run() == 1  # the run starts at 1 again
    # off (the default): never skips; a round that was not drafted teaches nothing; a new decode starts afresh
    off = scheduled(measure=False, draft_cost=0.5)
    off.schedule(_chain([0.2, 0.2, 0.2]))
    off.observe(_round(3, 0))
    assert off.draft_budget(3) == 3
    v.schedule(_chain([0.2]))
    v.observe(_round(0))
    assert v.draft_budget(3) == 3
    v.schedule(_chain([0.2]))
    v.observe(_round(1, 0))
    v.bind(None)
    assert v.draft_budget(3) == 3


def test_skip_drafting_measures_the_drafting_cost_in_the_curves_unit():
    """Without ``draft_cost`` the drafting seconds the engine reports count, converted to the cost curve's unit by the
    round's own forward: drafting as long as the forward (cost 1.2 at m = 2) is 1.2 units, which a draft of 0.5s
    does not pay for ((1 + 0.5 + 0.25) / 2.4 < 1), and nearly free drafting does."""
    v = scheduled(measure=False, skip_drafting=True)
    v.bind(None)
    v.schedule(_chain([0.5, 0.5]))
    v.observe(_round(2, 2, draft_seconds=0.010, target_seconds=0.010))
    assert v.draft_budget(2) == 0
    cheap = scheduled(measure=False, skip_drafting=True)
    cheap.bind(None)
    cheap.schedule(_chain([0.5, 0.5]))
    cheap.observe(_round(2, 2, draft_seconds=0.0001, target_seconds=0.010))
    assert cheap.draft_budget(2) == 2
    with pytest.raises(api.UsageError, match="'draft_cost' must be a non-negative number"):
        scheduled(draft_cost=-1.0)
    with pytest.raises(api.UsageError, match="'skip_drafting' must be true or false"):
        scheduled(skip_drafting="yes")


def test_the_engine_skips_drafting_losslessly_when_drafts_do_not_pay(target):
    """Through the engine: drafting priced above what any draft returns leaves most rounds undrafted (no propose),
    free drafting leaves none, and both outputs equal plain decoding's."""
    from specframe.inference.engine import generate

    drafter, _ = make(target)
    drafter.module().float().eval()
    calls = []
    propose = drafter.propose
    drafter.propose = lambda k, generator=None: calls.append(k) or propose(k, generator)
    prompt = torch.randint(7, target.config.vocab_size, (10,), generator=torch.Generator().manual_seed(1))
    plain = generate(target.model, prompt, plugins.get("verifier", "greedy")(), max_new_tokens=24, eos_token_id=())
    costly = generate(target.model, prompt, scheduled(measure=False, skip_drafting=True, draft_cost=100.0, max_skip=4),
                      drafter, k=4, max_new_tokens=24, eos_token_id=())
    skipped = sum(r.nodes == 0 and r.drafted == 0 for r in costly.rounds)
    assert costly.tokens == plain.tokens and len(calls) + skipped == len(costly.rounds) and skipped > len(calls)
    calls.clear()
    free = generate(target.model, prompt, scheduled(measure=False, skip_drafting=True, draft_cost=0.0,
                                                    cost_per_token=0.0), drafter, k=4, max_new_tokens=24,
                    eos_token_id=())
    assert free.tokens == plain.tokens and len(calls) == len(free.rounds)


def test_the_schedule_declares_itself_greedy_exactly_under_the_greedy_rule():
    # bench checks every greedy run's output against plain decoding's: a greedy schedule must say it is one
    assert scheduled().greedy and not scheduled(rule="sampling").greedy


def test_the_cost_curve_is_measured_on_the_model():
    from specframe_dspark.scheduled import measure_cost_curve

    from tests.unit.test_sampling_distribution import target_model

    curve = measure_cost_curve(target_model(), 3, context=16, repeats=2)
    assert len(curve) == 4 and all(t > 0 for t in curve)
    assert scheduled(cost_curve=curve).options.cost(2) == curve[2]


def test_the_engine_hands_the_target_over_and_the_curve_is_measured_on_it_once(target, monkeypatch):
    """API 10: by default the schedule weighs the target's measured round costs, not the linear placeholder model:
    the engine binds the target before its clock starts, the curve is measured once per target (not per decode), a
    curve the user gives is kept, and ``measure=False`` keeps the linear model. Fails when the engine stops calling
    ``bind``, when bind measures on every decode, or when it replaces a given curve."""
    import specframe_dspark.scheduled as sched

    from specframe.inference.engine import generate

    measured = []

    def fake_measure(model, max_tokens, **_):
        measured.append((model, max_tokens))
        return [1.0 + 0.5 * m for m in range(max_tokens + 1)]

    monkeypatch.setattr(sched, "measure_cost_curve", fake_measure)
    drafter, _ = make(target)
    drafter.module().float().eval()
    prompt = torch.randint(7, target.config.vocab_size, (10,), generator=torch.Generator().manual_seed(1))
    verifier = scheduled(measure_tokens=5)
    assert verifier.options.cost_curve is None
    for _ in range(2):
        generate(target.model, prompt, verifier, drafter, k=4, max_new_tokens=6, eos_token_id=())
    assert measured == [(target.model, 5)]
    assert verifier.options.cost_curve == [1.0 + 0.5 * m for m in range(6)] and verifier.options.cost(2) == 2.0
    other = torch.nn.Module()
    verifier.bind(other)  # another target: its own curve
    assert measured[-1] == (other, 5)
    given = scheduled(cost_curve=[1.0, 3.0])
    given.bind(target.model)
    linear = scheduled(measure=False)
    linear.bind(target.model)
    assert given.options.cost_curve == [1.0, 3.0] and linear.options.cost_curve is None and len(measured) == 2


@pytest.mark.slow
def test_scheduled_speculative_sampling_matches_the_target_law_and_a_token_peeking_schedule_does_not():
    """Sampled DSpark drafts (confidence from the random head, so the schedule truncates at varying lengths) through
    the scheduled verifier's sampling rule emit the target's exact joint law; a schedule that decides on a token by
    looking at the token itself (the lossless condition broken) is rejected by the same check."""
    from specframe.inference import generate
    from tests.unit.test_sampling_distribution import N_TOKENS, PROMPT, THRESHOLD, chi_square_pvalue, exact_joint

    model, drafter = _sampling_drafter()
    exact = exact_joint()
    base = type(scheduled())

    class Peeking(base):
        def schedule(self, draft):
            keep = 0
            while keep < len(draft) and int(draft.tokens[keep]) % 2 == 0:
                keep += 1
            return keep

    def samples(verifier, n):
        g = torch.Generator().manual_seed(13)
        out, nodes = [], set()
        rounds[:] = [0]
        for _ in range(n):
            gen = generate(model, torch.tensor(PROMPT), verifier, drafter, k=3, max_new_tokens=N_TOKENS,
                           eos_token_id=(), generator=g)
            out.append(tuple(gen.tokens))
            nodes.update(r.nodes for r in gen.rounds)
            rounds[0] += len(gen.rounds)
        return out, nodes

    rounds = [0]

    got, nodes = samples(scheduled(rule="sampling", cost_per_token=0.9, measure=False), 3000)
    assert nodes == {0, 1, 2, 3}, nodes  # the schedule cut the 3-token drafts at every length
    assert chi_square_pvalue(got, exact) > THRESHOLD
    # API 11: rounds whose drafting was skipped after a draft that did not pay (the choice reads earlier rounds only)
    proposed = []
    propose = drafter.propose
    drafter.propose = lambda k, generator=None: proposed.append(k) or propose(k, generator)
    gated = scheduled(rule="sampling", cost_per_token=0.9, measure=False, skip_drafting=True, draft_cost=0.4,
                      max_skip=2)
    got, nodes = samples(gated, 3000)
    del drafter.propose
    # each decode's first round drafts; a second one never pays for its drafting at these costs (E(m) <= m + 1 <
    # 1.4 + 0.9 m) and is skipped
    assert len(proposed) == 3000 < rounds[0] and nodes == {0, 1, 2, 3}, (len(proposed), rounds, nodes)
    assert chi_square_pvalue(got, exact) > THRESHOLD
    got, _ = samples(Peeking(base.Options(rule="sampling", cost_per_token=0.9, measure=False)), 3000)
    assert chi_square_pvalue(got, exact) < 1e-6


@pytest.mark.slow
def test_an_overfit_drafter_is_accepted_block_after_block(target):
    """Trained through ``loss`` on the target's own greedy continuation and served through start / accept / propose
    on the reference engine: lossless, and its drafts accepted almost always (an indexing slip between training and
    inference, e.g. the target position the l1 term's teacher is read at, or the context a block reads, sends
    acceptance to about one token a round; measured: 39 tokens in 34 rounds with the teacher one position late). At
    the paper's weights the l1 term dominates, so a slip in the CE labels alone is the oracle test's to catch."""
    from specframe.features import capture_features
    from specframe.inference.engine import generate

    torch.manual_seed(0)
    prompt = torch.tensor([1, 50, 60, 70, 80])
    verifier = plugins.get("verifier", "greedy")()
    plain = generate(target.model, prompt, verifier, max_new_tokens=40, eos_token_id=())
    seq = torch.cat([prompt, torch.tensor(plain.tokens)])
    mask = torch.arange(len(seq)) >= len(prompt)
    cls = plugins.get("drafter", "dspark")
    drafter = cls(target.config, cls.Options(**SMALL))
    ex = api.TrainingExample(seq, mask, torch.zeros_like(seq))
    drafter.prepare(target, [ex])
    f = capture_features(target, seq[None], drafter.feature_spec(), dtype=torch.float32)
    ex = api.TrainingExample(seq, mask, ex.doc, {"aux_hidden": f.aux[0], "final_hidden": f.final[0]})
    elems, sup = grid(drafter, ex)
    opt = torch.optim.AdamW([p for p in drafter.module().parameters() if p.requires_grad], lr=3e-3)
    for _ in range(150):
        opt.zero_grad()
        run(drafter, ex, elems, sup)
        opt.step()
    drafter.module().eval()
    spec = generate(target.model, prompt, verifier, drafter, k=4, max_new_tokens=40, eos_token_id=())
    assert spec.tokens == plain.tokens
    assert spec.decode_tokens / len(spec.rounds) > 3.5  # at most 5 (4 drafts + the bonus)


# ------------------------------------------------------------------------------------------ confidence calibration


def _train_dspark(tmp_path, **options):
    from specframe.engine import TrainConfig, train
    from tests.train_fixtures import build

    target_dir, chat = build(tmp_path / "assets")
    out = tmp_path / "run"
    train(TrainConfig(drafter="dspark", target=str(target_dir), data=str(chat), output=str(out), seq_len=48,
                      max_steps=3, batch_size=2, val_examples=3, eval_every=2, lr=3e-3, mask_builder="dense",
                      drafter_options={**SMALL, **options}), progress=False)
    return target_dir, out, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_engine_calibrates_on_the_held_out_chains_and_the_checkpoint_keeps_it(tmp_path, monkeypatch):
    """API 8 end to end: every validation reports the prefix ECE, the final one's held-out chains (raw logits and
    verdicts, [anchors, block_size]) reach ``calibrate``, and the final checkpoint carries what it fitted, which a
    reloaded drafter drafts with."""
    from specframe import calibration
    from specframe.drafter_folders import load_drafter
    from specframe.targets import load_target

    import specframe_dspark.sts

    calls = []
    fitted = torch.tensor([0.5, 1.5, 2.0, 3.0], dtype=torch.float64)

    def fake_fit(logits, accepted):
        calls.append((logits.clone(), accepted.clone()))
        return fitted

    monkeypatch.setattr(specframe_dspark.sts, "fit_temperatures", fake_fit)
    monkeypatch.setattr(calibration, "fit_temperatures", lambda *a: pytest.fail("the cross-entropy fit was used"))
    target_dir, out, metrics = _train_dspark(tmp_path, calibration_rule="sampling")
    evals = [m for m in metrics if "val_loss" in m]
    assert len(evals) == 2 and all(0.0 <= m["val_confidence_ece"] <= 1.0 for m in evals)
    record = [m for m in metrics if m.get("calibrated")]
    assert len(record) == 1 and record[0]["step"] == 3 and record[0]["calibration_in_sample"] is False
    n = record[0]["calibration_anchors"]
    assert n > 0 and n == evals[-1]["val_confidence_anchors"]
    # first on the even validation sequences (the odd ones measured out of sample), then on every chain
    assert len(calls) == 2 and calls[1][0].shape == calls[1][1].shape == (n, SMALL["block_size"])
    assert 0 < calls[0][0].shape[0] < n and record[0]["calibration_checked_anchors"] == n - calls[0][0].shape[0]
    assert torch.isfinite(calls[1][0]).all()
    # API 12: what reaches the fit is the drafter's acceptance under its rule (sampling: 1 - TV, a probability),
    # not the engine's 0 / 1 top-1 hits
    accepted = calls[1][1]
    assert accepted.dtype == torch.float64 and ((accepted > 0) & (accepted < 1)).any()
    assert 0.0 <= record[0]["confidence_ece_after"] <= 1.0
    info = json.loads((out / (out / "latest").read_text().strip() / "drafter.json").read_text())
    assert info["confidence_temperature"] == fitted.tolist() and info["confidence_calibration_rule"] == "sampling"
    reloaded = load_drafter(out, load_target(target_dir).config)
    assert reloaded.confidence_temperature.tolist() == fitted.tolist()
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5]])
    assert reloaded.calibrated_confidence(logits).tolist() == torch.sigmoid(logits.double() / fitted).tolist()


@pytest.mark.slow  # trains a drafter; per-method verifiers are fast-tested in tests/unit/test_bench.py
def test_bench_measures_the_block_whole_and_scheduled_side_by_side(tmp_path):
    """`bench acceptance --verifier greedy --also-verifier scheduled`: the same DSpark checkpoint decoded under both
    verifiers in one interleaved run, both lossless, the scheduled one labelled and reported as such."""
    from click.testing import CliRunner

    from specframe.cli import main

    _, out, _ = _train_dspark(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "add the fox"}]}) + "\n")
    res = CliRunner().invoke(main, ["bench", "acceptance", "--checkpoint", str(out), "--dataset", str(prompts),
                                    "--max-new-tokens", "12", "--also-verifier", "scheduled", "--json",
                                    "-o", str(tmp_path / "r.json")], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output[res.output.index("{"):])
    whole = [label for label in summary["methods"] if label.startswith("dspark/") and "+" not in label]
    assert len(whole) == 1 and f"{whole[0]}+scheduled" in summary["methods"]
    scheduled_ = summary["methods"][f"{whole[0]}+scheduled"]
    assert scheduled_["verifier"] == "scheduled" and scheduled_["lossless"] and summary["methods"][whole[0]]["lossless"]
    # API 10: the schedule weighed the round costs measured on this target, and the results file records them
    curve = json.loads((tmp_path / "r.json").read_text())["config"]["also_verifier_options"]["scheduled"]["cost_curve"]
    assert len(curve) == 9 and all(isinstance(t, float) and t > 0 for t in curve)


@pytest.mark.parametrize("rule", ["greedy", "sampling"])
def test_the_confidence_is_calibrated_against_the_rule_that_will_verify(target, rule):
    """The acceptance the calibration is fitted on (``LossTerms.acceptance``) is the verifying rule's: greedy, the
    draft token equals the target's argmax; sampling, 1 - TV(q, p). Random data tokens are not the target's
    argmax: a drafter fitted to them by cross-entropy alone hits them, and is not what either rule accepts."""
    drafter, ex = make(target, length=14, calibration_rule=rule, ce_weight=1.0, l1_weight=0.0)
    elems, sup = grid(drafter, ex)
    opt = torch.optim.Adam([p for p in drafter.module().parameters() if p.requires_grad], lr=1e-2)
    for _ in range(30):
        opt.zero_grad()
        run(drafter, ex, elems, sup)
        opt.step()
    seg = api.Segment(torch.arange(len(elems)), torch.ones(len(elems), dtype=torch.bool))
    with torch.no_grad():
        terms = drafter.loss(ex, elems, seg, api.SegmentAttention.build(plugins.get("mask builder", "dense")(), elems))
        head = target.model.get_output_embeddings().weight.double()
        charged = sup[elems.position]
        want = []
        for a, d in zip(elems.anchor[charged].tolist(), elems.depth[charged].tolist()):
            hidden = block_forward(drafter, ex, a)
            prev = ex.input_ids[[min(a + 1 + s, ex.input_ids.shape[0] - 1) for s in range(drafter.depth)]]
            q = torch.softmax(drafter.model.lm_head(hidden[d]) + markov_biases(drafter, hidden, prev)[d], -1)
            p = torch.softmax(ex.features["final_hidden"][a + 1 + d] @ head.T, -1)
            want.append(float(q.argmax() == p.argmax()) if rule == "greedy" else float(1 - 0.5 * (q - p).abs().sum()))
    assert terms.acceptance.dtype == torch.float64
    assert torch.allclose(terms.acceptance, torch.tensor(want, dtype=torch.float64), atol=1e-9)
    assert not torch.equal(terms.acceptance, terms.hit.double())
    with pytest.raises(api.UsageError, match="'calibration_rule' must be one of greedy, sampling"):
        plugins.get("drafter", "dspark").Options(calibration_rule="top1")


def test_the_calibration_minimises_the_ece_of_the_product_not_the_cross_entropy():
    """The paper's fit (section 3.2.1): per position, the grid temperature of least ECE of the cumulative product.
    Two groups of anchors no single temperature fits: the ECE and cross-entropy optima differ."""
    from specframe import calibration
    from specframe_dspark import sts

    z = torch.cat([torch.full((100,), 4.0), torch.full((100,), -1.0)])
    y = torch.cat([torch.arange(100) < 90, torch.arange(100) < 80]).double()

    def ece(t):  # 10 equal-width bins, as the engine reports it, written out
        p = torch.sigmoid(z / t)
        b = (p * 10).long().clamp(0, 9)
        return float(sum((p[b == i].sum() - y[b == i].sum()).abs() for i in range(10)) / len(z))

    fitted = float(sts.fit_temperatures(z[:, None], y[:, None])[0])
    best = min(ece(float(t)) for t in torch.logspace(math.log10(0.05), math.log10(20), 2000))
    assert ece(fitted) <= best + 2e-3
    assert ece(float(calibration.fit_temperatures(z[:, None], y[:, None])[0])) > ece(fitted) + 0.01
    # positions where every anchor's prefix went one way have nothing to fit, and the fit is deterministic
    assert sts.fit_temperatures(torch.stack([z, z], 1), torch.zeros(200, 2)).tolist() == [1.0, 1.0]
    assert torch.equal(sts.fit_temperatures(torch.stack([z, z], 1), torch.stack([y, y], 1)),
                       sts.fit_temperatures(torch.stack([z, z], 1), torch.stack([y, y], 1)))


def test_without_calibration_the_head_is_kept_as_trained(tmp_path):
    _, out, metrics = _train_dspark(tmp_path, calibrate_confidence=False)
    assert not any(m.get("calibrated") for m in metrics)
    assert any("val_confidence_ece" in m for m in metrics)  # still measured
    info = json.loads((out / (out / "latest").read_text().strip() / "drafter.json").read_text())
    assert info["confidence_temperature"] == [1.0] * SMALL["block_size"]


def test_drafting_reads_the_calibrated_confidence(target):
    drafter, ex = make(target)
    drafter.module().eval()
    drafter.start(ex.input_ids[:8], {k: v[:8] for k, v in ex.features.items()})
    raw = drafter.propose(4).confidence.double()
    drafter.confidence_temperature = torch.tensor([0.5, 2.0, 1.0, 4.0], dtype=torch.float64)
    drafter.start(ex.input_ids[:8], {k: v[:8] for k, v in ex.features.items()})
    scaled = drafter.propose(4).confidence.double()
    logit = torch.log(raw / (1 - raw))
    assert scaled.tolist() == pytest.approx(torch.sigmoid(logit / drafter.confidence_temperature).tolist(), rel=1e-5)


def test_a_checkpoint_with_bad_temperatures_is_refused(target):
    drafter, _ = make(target)
    info = {**drafter.describe(), "confidence_temperature": [1.0, -2.0, 1.0, 1.0]}
    with pytest.raises(api.SpecframeError, match="confidence_temperature"):
        drafter.restore_checkpoint(info)
    older = {k: v for k, v in drafter.describe().items() if k != "confidence_temperature"}
    drafter.restore_checkpoint(older)  # written before calibration existed: T = 1
    assert drafter.confidence_temperature.tolist() == [1.0] * SMALL["block_size"]


# ---------------------------------------------------------------------------------------------------- imports


def test_an_export_imports_back_as_the_same_drafter(target, tmp_path):
    """A speculators ``dspark`` folder (``specframe export``'s) opens as a DSpark drafter of its shape (block, heads,
    aux layers and K read from the config), with its weights and mask token, and drafts what the original drafts; a
    folder without embed_tokens / lm_head (vLLM shares the target's) takes the target's from its files."""
    from safetensors.torch import load_file, save_file

    from specframe.drafter_folders import load_drafter
    from specframe.layouts import imports

    drafter, ex = make(target, markov_rank=8)
    drafter.module().float()
    out = tmp_path / "out"
    drafter.export_vllm(out, target.tokenizer)
    back = load_drafter(out, target.config)
    assert back.name == "dspark" and back.mask_token_id == drafter.mask_token_id
    assert (back.options.block_size, back.options.markov_rank, back.options.k_infer) == (4, 8, 4)
    assert back.aux_layer_ids == drafter.aux_layer_ids and back.options.confidence_head
    assert back.confidence_temperature.tolist() == [1.0] * 4
    assert_same_drafter(drafter, back, ex)

    weights = load_file(str(out / "model.safetensors"))
    del weights["embed_tokens.weight"], weights["lm_head.weight"]
    save_file(weights, str(out / "model.safetensors"))
    shared = load_drafter(out, target.config)
    assert torch.equal(shared.module().embed_tokens.weight, imports.target_embedding(target.config).float())
    assert torch.equal(shared.module().lm_head.weight, imports.target_lm_head(target.config).float())


@pytest.mark.parametrize("options, says", [
    ({"block_size": 5}, "its block_size is 4, this dspark drafter's is 5"),
    ({"markov_rank": 16}, "its markov_rank is 8, this dspark drafter's is 16"),
    ({"confidence_head": False}, "its enable_confidence_head is true, this dspark drafter's confidence_head is false"),
])
def test_a_folder_of_another_shape_is_refused_by_name(target, tmp_path, options, says):
    from specframe.layouts import imports

    drafter, _ = make(target, markov_rank=8)
    drafter.module().float()
    drafter.export_vllm(tmp_path / "out", target.tokenizer)
    other, _ = make(target, **{"markov_rank": 8, **options})
    with pytest.raises(api.SpecframeError, match=says):
        imports.warm_start(other, tmp_path / "out", target.config, target.tokenizer)


def assert_same_drafter(drafter, back, ex):
    """``back`` (an imported folder) holds ``drafter``'s weights, name for name, and drafts the same tokens with the
    same confidences from the same context."""
    mine, theirs = drafter.module().state_dict(), back.module().state_dict()
    assert set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
    ctx = {k: v[:9].float() for k, v in ex.features.items()}
    drafts = []
    for d in (drafter, back):
        d.module().eval()
        d.start(ex.input_ids[:9], ctx)
        drafts.append(d.propose(4))
    assert torch.equal(drafts[0].tokens, drafts[1].tokens)
    assert torch.allclose(drafts[0].confidence, drafts[1].confidence)


def deepspec_folder(drafter, target, path):
    """A folder in DeepSpec's own layout (``Qwen3DSparkModel.save_pretrained``, deepseek-ai/DeepSpec
    ``deepspec/modeling/dspark/qwen3``): the target's config plus the draft fields, DeepSpec's layer ids (output of
    layer k = specframe's aux id k + 1), the module's weights under its names (vLLM took them from it)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    cfg = {**target.config.to_dict(), "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3",
           "num_target_layers": int(target.config.num_hidden_layers), "num_hidden_layers": drafter.options.layers,
           "block_size": drafter.options.block_size, "tie_word_embeddings": False,
           "layer_types": ["full_attention"] * drafter.options.layers, "mask_token_id": drafter.mask_token_id,
           "target_layer_ids": [i - 1 for i in drafter.aux_layer_ids], "num_anchors": 512,
           "enable_confidence_head": True, "confidence_head_with_markov": True,
           "markov_rank": drafter.options.markov_rank, "markov_head_type": drafter.options.markov_head_type}
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.detach().contiguous().float() for k, v in drafter.module().state_dict().items()},
              str(path / "model.safetensors"))
    return cfg


def test_a_deepspec_checkpoint_imports_as_dspark(target, tmp_path):
    from specframe.drafter_folders import load_drafter
    from specframe.layouts import imports

    drafter, ex = make(target, markov_rank=8)
    drafter.module().float()
    folder = tmp_path / "deepspec"
    deepspec_folder(drafter, target, folder)
    assert imports.format_of(folder) == "deepspec"
    back = load_drafter(folder, target.config)
    assert back.aux_layer_ids == drafter.aux_layer_ids and back.mask_token_id == drafter.mask_token_id
    assert (back.options.block_size, back.options.markov_rank, back.options.layers) == (4, 8, 2)
    mine, theirs = drafter.module().state_dict(), back.module().state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    ctx = {k: v[:9].float() for k, v in ex.features.items()}
    for d in (drafter, back):
        d.module().eval()
        d.start(ex.input_ids[:9], ctx)
    assert torch.equal(drafter.propose(4).tokens, back.propose(4).tokens)


@pytest.mark.parametrize("change, says", [
    ({"markov_head_type": "gated"}, "markov_head_type is 'gated'"),
    ({"markov_rank": 0}, "markov_rank is 0: a DeepSpec drafter without a Markov head"),
    ({"target_layer_ids": None}, "lacks target_layer_ids"),
    ("other rope theta", "rope_theta"),
    ({"rms_norm_eps": 0.001}, "rms_norm_eps 0.001 differs from the target"),
    ({"attention_bias": True}, "attention_bias is true"),
])
def test_a_deepspec_folder_it_cannot_hold_is_refused_by_name(target, tmp_path, change, says):
    from specframe.drafter_folders import load_drafter

    drafter, _ = make(target, markov_rank=8)
    drafter.module().float()
    folder = tmp_path / "deepspec"
    cfg = deepspec_folder(drafter, target, folder)
    if change == "other rope theta":  # however the target's config spells its RoPE
        rope = cfg.get("rope_parameters") or {}
        change = ({"rope_parameters": {**rope, "rope_theta": 1234.0}} if rope else {"rope_theta": 1234.0})
    (folder / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(api.SpecframeError, match=f"cannot import {folder}: .*{says}"):
        load_drafter(folder, target.config)


def test_rnn_head_folders_of_deepspec_and_speculators_import_and_draft_like_their_source(target, tmp_path):
    """DeepSpec's and speculators' RNN head is specframe's name for name (``markov_head.joint_proj`` over [state;
    W1[x_prev]; h]): both folders import (vLLM serves only the vanilla head, so the export check is not theirs)."""
    from safetensors.torch import load_file, save_file

    from specframe.drafter_folders import load_drafter
    from specframe.layouts import export as layouts

    drafter, ex = make(target, markov_rank=8, markov_head_type="rnn")
    drafter.module().float()
    deepspec_folder(drafter, target, tmp_path / "deepspec")
    assert_same_drafter(drafter, load_drafter(tmp_path / "deepspec", target.config), ex)
    # a speculators dspark folder with the RNN head: the layout vLLM reads, markov_head_type "rnn", joint_proj beside
    weights = {k: v.detach().contiguous().float() for k, v in drafter.module().state_dict().items()}
    recurrence = {k: weights.pop(k) for k in list(weights) if ".joint_proj." in k}
    out = tmp_path / "speculators"
    layouts.write_dspark(out, weights, config=layouts.llama_config(target.config, 2, **drafter.shape.config_fields()),
                         aux_layer_ids=drafter.aux_layer_ids, target_hidden_size=drafter.shape.hidden,
                         mask_token_id=drafter.mask_token_id, block_size=4, markov_rank=8, markov_head_type="vanilla",
                         enable_confidence_head=True, confidence_head_with_markov=True)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "markov_head_type": "rnn"}))
    save_file({**load_file(str(out / "model.safetensors")), **recurrence}, str(out / "model.safetensors"))
    back = load_drafter(out, target.config)
    assert back.options.markov_head_type == "rnn"
    assert_same_drafter(drafter, back, ex)
    with pytest.raises(api.SpecframeError, match="vanilla"):  # still not served by vLLM
        layouts.check_layout(out)


def test_an_untrained_confidence_head_is_refused_and_an_old_one_exported_switched_off(target, tmp_path):
    """confidence_weight 0 never trains the head (DeepSpec: enable_confidence_head = confidence_head_alpha > 0):
    training refuses it; a checkpoint that has one exports without it, so vLLM does not verify by its estimates."""
    from safetensors.torch import load_file

    drafter, _ = make(target, confidence_weight=0.0)
    with pytest.raises(api.UsageError, match="'confidence_weight' is 0, so the confidence head would never train"):
        drafter.check_training(4, "dense", "none")
    make(target, confidence_weight=0.0, confidence_head=False)[0].check_training(4, "dense", "none")
    drafter.module().float()
    drafter.export_vllm(tmp_path / "out", target.tokenizer)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["enable_confidence_head"] is False and cfg["confidence_head_with_markov"] is False
    assert not any(k.startswith("confidence_head.") for k in load_file(str(tmp_path / "out" / "model.safetensors")))


def test_the_fitted_calibration_travels_with_the_export(target, tmp_path):
    """vLLM has no field for the temperatures: they are kept in the export's specframe entry with the rule they were
    fitted for, and an import drafts with them; an uncalibrated drafter writes none."""
    from specframe.drafter_folders import load_drafter

    drafter, _ = make(target)
    drafter.module().float()
    drafter.export_vllm(tmp_path / "raw", target.tokenizer)
    assert "confidence_temperature" not in json.loads((tmp_path / "raw" / "config.json").read_text())["specframe"]
    fitted = [0.5, 1.5, 2.0, 3.0]
    drafter.confidence_temperature = torch.tensor(fitted, dtype=torch.float64)
    drafter.calibration_rule = "sampling"
    drafter.export_vllm(tmp_path / "out", target.tokenizer)
    entry = json.loads((tmp_path / "out" / "config.json").read_text())["specframe"]
    assert entry["confidence_temperature"] == fitted and entry["confidence_calibration_rule"] == "sampling"
    back = load_drafter(tmp_path / "out", target.config)
    assert back.confidence_temperature.tolist() == fitted and back.calibration_rule == "sampling"
    assert load_drafter(tmp_path / "raw", target.config).calibration_rule is None


def test_aux_id_0_the_embeddings_trains_exports_and_imports(target, tmp_path):
    """vLLM's DSpark takes aux ids as they are and the target collects id 0 before its first layer (the embeddings),
    as specframe's features and DeepSpec's -1 mean it: what trains exports, and DeepSpec's -1 imports as aux 0."""
    from specframe.drafter_folders import load_drafter

    drafter, ex = make(target, markov_rank=8, aux_layer_ids=[0, 3])
    drafter.module().float()
    drafter.export_vllm(tmp_path / "out", target.tokenizer)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["aux_hidden_state_layer_ids"] == [0, 3]
    assert_same_drafter(drafter, load_drafter(tmp_path / "out", target.config), ex)
    cfg = deepspec_folder(drafter, target, tmp_path / "deepspec")
    assert cfg["target_layer_ids"] == [-1, 2]
    assert load_drafter(tmp_path / "deepspec", target.config).aux_layer_ids == [0, 3]


@pytest.mark.parametrize("value, says", [(None, "is absent, which vLLM reads as false"), (False, "is false")])
def test_an_absent_sample_from_anchor_is_read_one_way_everywhere(target, tmp_path, value, says):
    """vLLM 0.32 reads an absent sample_from_anchor as false (a bonus-anchor block): the manifest's token limit and
    the layout check agree with it, and such a folder is refused by name rather than imported one slot off."""
    from specframe.drafter_folders import load_drafter
    from specframe.layouts import export as layouts

    drafter, _ = make(target, markov_rank=8)
    drafter.module().float()
    out = tmp_path / "out"
    drafter.export_vllm(out, target.tokenizer)
    assert layouts.read_manifest(out).max_speculative_tokens == 4
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("sample_from_anchor")
    if value is not None:
        cfg["sample_from_anchor"] = value
    (out / "config.json").write_text(json.dumps(cfg))
    assert layouts.read_manifest(out).max_speculative_tokens == 3
    with pytest.raises(api.SpecframeError, match=f"sample_from_anchor {says}"):
        load_drafter(out, target.config)


def test_a_vllm_that_hard_codes_the_bonus_anchor_is_refused_before_it_starts(tmp_path, monkeypatch):
    """vLLM builds before PR #48639 set dspark_bonus_anchor whatever the config says, serving an anchor-first export
    one slot off with no error: the installed update_dspark is asked how it reads the export, and such a build is
    refused in one line naming the PR."""
    from functools import partial

    from specframe.vllm import support

    old, fixed = tmp_path / "old.py", tmp_path / "fixed.py"
    old.write_text("def update_dspark(config_dict, pre_trained_config):\n"
                   "    pre_trained_config['dspark_bonus_anchor'] = True\n")
    fixed.write_text("def update_dspark(config_dict, pre_trained_config):\n"
                     "    anchor = config_dict.get('sample_from_anchor', False)\n"
                     "    pre_trained_config.update(sample_from_anchor=anchor, dspark_bonus_anchor=not anchor)\n")
    assert "PR #48639" in support.dspark_anchor_problem(old)
    assert support.dspark_anchor_problem(fixed) is None
    monkeypatch.setattr(support, "dspark_runner_problem", lambda: None)
    monkeypatch.setattr(support, "dspark_anchor_problem", partial(support.dspark_anchor_problem, old))
    (reason,) = support.problems("dspark", [], None)
    assert "one slot off" in reason and "\n" not in reason
    assert support.problems("dflash", [], None) == []
    if importlib.util.find_spec("vllm") is not None:  # the installed vLLM (0.32) reads the field
        monkeypatch.undo()
        assert support.dspark_anchor_problem() is None


# SpecForge (sgl-project/SpecForge): DSparkDraftModel, saved by specforge.export.to_hf
SPECFORGE_LAYOUTS = ("main", "first release", "torchspec port", "nested heads")


def specforge_folder(drafter, target, path, layout="main"):
    """A folder as SpecForge saves its DSpark drafter (``specforge.export.to_hf``: the draft built from the config it
    trained with, in bf16, ``save_pretrained``, then ``apply_legacy_rope_scaling``'s top-level ``rope_theta``): a
    transformers ``Qwen3Config`` with ``block_size``, ``num_target_layers``, ``draft_vocab_size`` and the DSpark fields
    in ``dflash_config``, SpecForge's layer ids (output of layer k = specframe's aux id k + 1), and the module's
    weights without ``embed_tokens`` / ``lm_head`` (SpecForge's draft has none: it runs the target's). ``layout``:
    SpecForge's main line, its first release (``DFlashDraftModel`` with ``projector_type`` dspark), the unmerged
    TorchSpec port (head fields at the top level) or heads saved under ``logit_head.`` (which SpecForge loads). The
    drafter's weights are rounded to bf16 and its embedding / head set to the target's files' (what the import reads)."""
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    from specframe.layouts import imports

    t, opts, module = target.config, drafter.options, drafter.module()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))
        module.embed_tokens.weight.copy_(imports.target_embedding(t))
        module.lm_head.weight.copy_(imports.target_lm_head(t))
    heads = {"markov_rank": opts.markov_rank, "markov_head_type": opts.markov_head_type, "confidence_head_alpha": 1.0,
             "enable_confidence_head": opts.confidence_head,
             "confidence_head_with_markov": opts.confidence_head_with_markov}
    method = {"attention_mode": "gqa", "mask_token_id": drafter.mask_token_id,
              "target_layer_ids": [i - 1 for i in drafter.aux_layer_ids], "projector_type": "dspark"}
    top = heads if layout == "torchspec port" else {}
    method.update({} if layout == "torchspec port" else heads)
    architecture, source = ("DFlashDraftModel", "dflash") if layout == "first release" else ("DSparkDraftModel", "dspark")
    config = Qwen3Config(
        architectures=[architecture], auto_map={"AutoModel": f"{source}.{architecture}"}, vocab_size=t.vocab_size,
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim, hidden_act=t.hidden_act,
        rms_norm_eps=t.rms_norm_eps, max_position_embeddings=t.max_position_embeddings,
        rope_parameters=dict(t.rope_parameters), num_hidden_layers=opts.layers,
        layer_types=["full_attention"] * opts.layers, max_window_layers=opts.layers, tie_word_embeddings=False,
        block_size=opts.block_size, num_target_layers=t.num_hidden_layers, draft_vocab_size=t.vocab_size,
        dflash_config=method, dtype="bfloat16", **top)
    cfg = json.loads(config.to_json_string(use_diff=True))
    cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    weights = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in module.state_dict().items()
               if k not in ("embed_tokens.weight", "lm_head.weight")}
    if layout == "nested heads":
        weights = {("logit_head." + k if k.startswith(("markov_head.", "confidence_head.")) else k): v
                   for k, v in weights.items()}
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return cfg


@pytest.mark.parametrize("head", ["vanilla", "rnn"])
@pytest.mark.parametrize("layout", SPECFORGE_LAYOUTS)
def test_a_specforge_checkpoint_imports_as_dspark(target, tmp_path, layout, head):
    """SpecForge's folder opens as the dspark drafter it came from: shape, aux layers (its layer ids + 1), mask token,
    every weight (embedding and head from the target's files) and the tokens and confidences it drafts."""
    from specframe.drafter_folders import load_drafter
    from specframe.layouts import imports

    drafter, ex = make(target, markov_rank=8, markov_head_type=head)
    drafter.module().float()
    folder = tmp_path / "specforge"
    specforge_folder(drafter, target, folder, layout)
    assert imports.format_of(folder) == "specforge-dspark"
    back = load_drafter(folder, target.config)
    assert back.aux_layer_ids == drafter.aux_layer_ids == [1, 3] and back.mask_token_id == drafter.mask_token_id
    assert (back.options.block_size, back.options.markov_rank, back.options.layers) == (4, 8, 2)
    assert back.options.markov_head_type == head
    assert back.options.confidence_head and back.options.confidence_head_with_markov
    assert_same_drafter(drafter, back, ex)


def test_specforge_defaults_fill_what_its_config_leaves_out(target, tmp_path):
    """Without target_layer_ids SpecForge reads build_target_layer_ids(num_target_layers, layers) (one draft layer:
    the middle output L // 2, specframe's aux id L // 2 + 1); without enable_confidence_head the head exists when
    confidence_head_alpha > 0, and confidence_head_with_markov defaults to false."""
    from specframe.drafter_folders import load_drafter
    from specframe.layouts import imports

    assert imports._specforge_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # SpecForge's Qwen3-8B / 4B DSpark configs
    assert imports._specforge_layer_ids(7, 3) == [1, 2, 4]  # 2.5 rounds to 2, as Python's round in SpecForge's code
    drafter, ex = make(target, markov_rank=8, layers=1, aux_layer_ids=[3], confidence_head_with_markov=False)
    drafter.module().float()
    folder = tmp_path / "specforge"
    cfg = specforge_folder(drafter, target, folder)
    for key in ("target_layer_ids", "enable_confidence_head", "confidence_head_with_markov"):
        del cfg["dflash_config"][key]
    (folder / "config.json").write_text(json.dumps(cfg))
    back = load_drafter(folder, target.config)
    assert back.aux_layer_ids == [3] and back.options.confidence_head and not back.options.confidence_head_with_markov
    ctx = {k: v[:9].float() for k, v in ex.features.items()}
    for d in (drafter, back):
        d.module().eval()
        d.start(ex.input_ids[:9], ctx)
    assert torch.equal(drafter.propose(4).tokens, back.propose(4).tokens)


def test_format_of_tells_specforge_dspark_from_the_other_folders(target, tmp_path):
    """SpecForge's DFlash and Domino folders (DFlashDraftModel without projector_type dspark) are none of the formats;
    a DeepSpec folder and specframe's speculators export keep theirs."""
    from specframe.layouts import imports

    drafter, _ = make(target, markov_rank=8)
    drafter.module().float()
    cfg = specforge_folder(drafter, target, tmp_path / "specforge", "first release")
    for projector in (None, "domino"):
        other = tmp_path / f"specforge-{projector}"
        other.mkdir()
        (other / "config.json").write_text(json.dumps(
            {**cfg, "dflash_config": {**cfg["dflash_config"], "projector_type": projector}}))
        assert imports.format_of(other) is None
    deepspec_folder(drafter, target, tmp_path / "deepspec")
    assert imports.format_of(tmp_path / "deepspec") == "deepspec"
    drafter.export_vllm(tmp_path / "export", target.tokenizer)
    assert imports.format_of(tmp_path / "export") == "speculators"


@pytest.mark.parametrize("change, says", [
    ({"markov_head_type": "gated"}, "markov_head_type is 'gated'"),
    ({"markov_rank": 0}, "markov_rank is 0: a SpecForge DSpark drafter without a Markov head"),
    ({"mask_token_id": None}, "records no dflash_config.mask_token_id"),
    ({"attention_mode": "mla"}, "attention mode 'mla'"),
    ({"projector_type": "domino"}, "projector_type is 'domino'"),
    ({"target_layer_ids": [-1, 2]}, r"target_layer_ids is \[-1, 2\]"),
    ({"top": {"num_target_layers": 36}}, "num_target_layers 36 differs from the target's 4"),
    ({"top": {"block_size": None}}, "block_size is None"),
    ({"top": {"markov_rank": 16}}, "dflash_config.markov_rank is 8 and the top-level markov_rank is 16"),
    ({"target_layer_ids": None, "top": {"num_target_layers": None}}, "neither dflash_config.target_layer_ids nor"),
    ({"top": {"rope_theta": 1234.0, "rope_parameters": {"rope_theta": 1234.0, "rope_type": "default"}}}, "rope_theta"),
    ({"top": {"rms_norm_eps": 0.001}}, "rms_norm_eps 0.001 differs from the target"),
    ({"top": {"attention_bias": True}}, "attention_bias is true"),
    ({"top": {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0,
              "layer_types": ["sliding_attention"] * 2}}, "sliding_window 8"),
    ("d2t", "tensor 'd2t': SpecForge's DSpark drafts over the target's whole vocabulary"),
    ("gate_proj", "markov_head.gate_proj"),
])
def test_a_specforge_folder_it_cannot_hold_is_refused_by_name(target, tmp_path, change, says):
    from safetensors.torch import load_file, save_file

    from specframe.drafter_folders import load_drafter

    drafter, _ = make(target, markov_rank=8)
    drafter.module().float()
    folder = tmp_path / "specforge"
    cfg = specforge_folder(drafter, target, folder)
    if change in ("d2t", "gate_proj"):  # a draft vocabulary; the gated head's weights with its type
        weights = load_file(str(folder / "model.safetensors"))
        if change == "d2t":
            weights["d2t"] = torch.zeros(target.config.vocab_size, dtype=torch.long)
        else:
            weights["markov_head.gate_proj.weight"] = torch.zeros(8, 8 + target.config.hidden_size)
            cfg["dflash_config"]["markov_head_type"] = "gated"
        save_file(weights, str(folder / "model.safetensors"))
        change = {}
    change = dict(change)
    for where, values in ((cfg, change.pop("top", {})), (cfg["dflash_config"], change)):
        for key, value in values.items():
            if value is None:
                where.pop(key, None)
            else:
                where[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(api.SpecframeError, match=f"cannot import {folder}: .*{says}"):
        load_drafter(folder, target.config)
