"""DSpark (packages/specframe-dspark): a plugin distribution on the shared engine and the core's block backbone.

The training loss is checked against an oracle written per block with no mask builder and no chunking (block a =
[x_{a+1}, MASK x (B-1)] at positions a+1 .. with full attention to the context g_c, c <= a in a's document; slot d
predicts x_{a+2+d}; the Markov bias from the previous data token; the l1 distance to the target's distribution at
position a+1+d; the confidence head's BCE toward 1 - TV), drafting against the same per-block forward sampled left to
right, and decoding through the reference engine's verifiers; its export for vLLM. The confidence-scheduled verifier, the
confidence calibration and the foreign checkpoints' imports have modules of their own beside this one
(test_dspark_scheduled.py, test_dspark_calibration.py, test_dspark_imports.py).
"""

from __future__ import annotations

import importlib.metadata
import json
import math

import pytest
import torch
import torch.nn.functional as F

from specframe import api, plugins

try:
    DIST = importlib.metadata.distribution("specframe-dspark")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - depends on the environment
    pytest.skip("the specframe-dspark distribution is not installed (pip install --no-deps -e "
                "packages/specframe-dspark)", allow_module_level=True)

from tests.block_fixtures import (  # noqa: E402, F401 (target: the module fixture)
    grid, imports_only_the_public_api, reference_weight, run, target, train_on_engine, two_turns,
    vllm_pretrained_config
)
from tests.dspark_fixtures import SMALL, block_forward, make, markov_biases, sampling_drafter  # noqa: E402


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

    imports_only_the_public_api(specframe_dspark)


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


@pytest.mark.parametrize("head,docs,confidence,turns", [("vanilla", 1, True, False), ("vanilla", 2, True, False),
                                                        ("rnn", 2, True, False), ("vanilla", 1, False, False),
                                                        ("vanilla", 1, True, True)])
def test_training_loss_and_gradients_equal_the_per_block_oracle(target, head, docs, confidence, turns):
    drafter, ex = make(target, length=20 if turns else 18, docs=docs, mask=two_turns() if turns else None,
                       markov_head_type=head, confidence_head=confidence)
    elems, sup = grid(drafter, ex)
    loss, grads, _ = run(drafter, ex, elems, sup)
    # DeepSpec's normaliser (D5): each term divided by sum(w) over the trained slots, not by the charged count
    normaliser = reference_weight(ex, elems, sup, drafter.options.loss_decay_gamma)
    count = int(sup[elems.position].sum())
    drafter.module().zero_grad(set_to_none=True)
    total = oracle_loss(drafter, ex, elems, sup, target)
    want = total / normaliser
    want.backward()
    assert loss == pytest.approx(float(want.detach()), rel=1e-10)
    assert count > normaliser and loss != pytest.approx(float(total.detach()) / count, rel=1e-6)
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
    """Row chunks (each forming its gradients in its forward) give the same loss and gradients as one chunk."""
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
    losses, reloaded = train_on_engine(tmp_path, "dspark", SMALL, 4, builder, partitioner, parts)
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert reloaded.mask_token_id is not None and reloaded.visibility == "block"
    assert set(reloaded.module().state_dict()) >= {"markov_head.markov_w1.weight", "confidence_head.proj.bias"}


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

    model, drafter = sampling_drafter()

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
    hf = vllm_pretrained_config(cfg)
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
    from specframe.vllm.serving import serve_command

    with pytest.raises(api.SpecframeError, match="the installed vLLM cannot serve this dspark export for target .*: "
                                                 "vLLM serves method dspark only in its V2 model runner"):
        serve_command(None, tmp_path / "out")


