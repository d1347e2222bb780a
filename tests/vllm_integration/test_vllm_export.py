"""The vLLM layout writers, vLLM-count conversion and the parity helpers, without vLLM itself (fast)."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from specframe import api
from specframe.errors import SpecframeError
from specframe.layouts import export
from specframe.vllm import parity
from specframe.vllm.counters import Round, SpecCounters, rounds_from_steps
from tests.vllm_fixtures import AUX, build_target, eagle3_weights, mask_token, pard_weights, target_parts


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = build_target(tmp_path_factory.mktemp("target") / "t")
    config, tok = target_parts(path)
    return SimpleNamespace(path=path, config=config, tok=tok)


def eagle_kwargs(target, layers=1):
    return dict(
        config=export.llama_config(target.config, layers),
        aux_layer_ids=AUX,
        target_hidden_size=target.config.hidden_size,
        target_num_layers=target.config.num_hidden_layers,
        verifier=export.verifier_name(target.path),
    )


def test_peagle_layout_round_trips(target, tmp_path):
    v = target.config.vocab_size
    w = eagle3_weights(target.config, 4, v // 2, parallel=True)
    out = tmp_path / "peagle"
    manifest = export.write_peagle(out, w, mask_token_id=mask_token(target.tok), tokenizer=target.tok, **eagle_kwargs(target, 4))
    assert manifest["method"] == "eagle3" and manifest["parallel_drafting"] is True
    cfg = json.loads((out / "config.json").read_text())
    # the speculators format: what vLLM's SpeculatorsConfig reads to serve the folder alone
    assert cfg["speculators_model_type"] == "peagle" and cfg["architectures"] == ["PEagleDraftModel"]
    spec = cfg["speculators_config"]
    assert spec["proposal_methods"][0]["speculative_tokens"] == 5
    assert spec["verifier"]["name_or_path"] == str(target.path.resolve())
    layer = cfg["transformer_layer_config"]
    assert layer["num_hidden_layers"] == 4 and layer["vocab_size"] == v and layer["model_type"] == "llama"
    assert layer["rope_parameters"] == target.config.rope_parameters and "rope_parameters" not in cfg
    assert cfg["draft_vocab_size"] == v // 2 and cfg["target_hidden_size"] == target.config.hidden_size
    assert cfg["eagle_aux_hidden_state_layer_ids"] == AUX and cfg["mask_token_id"] == mask_token(target.tok)
    assert cfg["norm_before_residual"] is False and cfg["specframe"]["drafter"] == "peagle"
    assert not (out / "specframe_vllm.json").exists()
    m = export.read_manifest(out)
    assert (m.layout, m.verifier, m.speculative_tokens) == ("peagle", str(target.path.resolve()), 5)
    saved = load_file(str(out / "model.safetensors"))
    assert saved["mask_hidden"].shape == (1, 1, 3 * target.config.hidden_size)
    draft_ids = torch.arange(v // 2) + saved["d2t"]
    assert saved["t2d"].dtype == torch.bool and saved["t2d"].sum() == v // 2 and saved["t2d"][draft_ids].all()
    assert "layers.3.self_attn.q_proj.weight" in saved and (out / "tokenizer.json").exists()
    assert export.speculative_config(out, 5) == {
        "method": "eagle3", "model": str(out.resolve()), "num_speculative_tokens": 5, "parallel_drafting": True
    }


def test_eagle3_accepts_midlayer_names_and_drops_identity_maps(target, tmp_path):
    v = target.config.vocab_size
    w = eagle3_weights(target.config, 1, v)
    w = {k.replace("layers.0.", "midlayer."): t for k, t in w.items()}
    w["d2t"] = torch.zeros(v, dtype=torch.long)
    export.write_eagle3(tmp_path / "e", w, **eagle_kwargs(target))
    saved = load_file(str(tmp_path / "e" / "model.safetensors"))
    assert "layers.0.hidden_norm.weight" in saved and not any(k.startswith("midlayer.") for k in saved)
    # vLLM has no draft-to-target map for a full draft vocabulary and would refuse these
    assert "d2t" not in saved and "t2d" not in saved
    assert export.speculative_config(tmp_path / "e", 3) == {
        "method": "eagle3", "model": str((tmp_path / "e").resolve()), "num_speculative_tokens": 3
    }


@pytest.mark.parametrize("layout", ["eagle3", "peagle"])
def test_a_full_draft_vocabulary_with_a_non_identity_d2t_is_refused(target, tmp_path, layout):
    """With draft_vocab_size == vocab_size vLLM's llama_eagle3 has no draft-to-target map (draft_id_to_target_id is
    None and the logits are read as target ids), so a permuting d2t cannot be carried: dropping it would serve
    every draft token as the wrong target token. The writer refuses it, naming d2t, and writes nothing."""
    v = target.config.vocab_size
    w = eagle3_weights(target.config, 4 if layout == "peagle" else 1, v, parallel=layout == "peagle")
    ids = torch.arange(v).roll(1)  # a permutation of the whole vocabulary
    w["d2t"] = ids - torch.arange(v)
    with pytest.raises(SpecframeError, match="d2t is not the identity although the draft vocabulary is the full"):
        if layout == "peagle":
            export.write_peagle(tmp_path / "x", w, mask_token_id=mask_token(target.tok), **eagle_kwargs(target, 4))
        else:
            export.write_eagle3(tmp_path / "x", w, **eagle_kwargs(target))
    assert not list(tmp_path.iterdir())


def test_pard_layout(target, tmp_path):
    w, cfg = pard_weights(target.config, 1)
    manifest = export.write_pard(tmp_path / "p", w, config=cfg, pard_token=mask_token(target.tok))
    assert (manifest["method"], manifest["parallel_drafting"]) == ("draft_model", True)
    assert json.loads((tmp_path / "p" / "config.json").read_text())["pard_token"] == mask_token(target.tok)
    assert export.speculative_config(tmp_path / "p", 4)["parallel_drafting"] is True


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda w: w.update({"fc.weight": w["fc.weight"][:, :-1]}), "'fc.weight' has shape"),
        (lambda w: w.pop("mask_hidden"), "needs 'mask_hidden'"),
        (lambda w: w.pop("layers.3.mlp.up_proj.weight"), "missing weight 'layers.3.mlp.up_proj.weight'"),
        (lambda w: w.update({"layers.4.input_layernorm.weight": torch.ones(64)}), "4 drafter layers"),
        (lambda w: w.update({"d2t": -torch.arange(w["d2t"].numel())}), "same target id"),
        (lambda w: w.update({"d2t": w["d2t"] + 10_000}), "outside"),
        (lambda w: w.pop("d2t"), "needs 'd2t'"),
        (lambda w: w.update({"t2d": torch.ones(w["embed_tokens.weight"].shape[0], dtype=torch.bool)}), "t2d does not mark"),
    ],
)
def test_invalid_peagle_exports_are_refused(target, tmp_path, edit, message):
    w = eagle3_weights(target.config, 4, target.config.vocab_size // 2, parallel=True)
    edit(w)
    with pytest.raises(SpecframeError, match=message):
        export.write_peagle(tmp_path / "x", w, mask_token_id=mask_token(target.tok), **eagle_kwargs(target, 4))
    assert not (tmp_path / "x").exists() and not list(tmp_path.iterdir())  # nothing half-written


def test_check_export_reads_back_every_layout_and_names_what_vllm_would_choke_on(target, tmp_path):
    from safetensors.torch import save_file

    v = target.config.vocab_size
    export.write_peagle(tmp_path / "pe", eagle3_weights(target.config, 2, v // 2, parallel=True),
                        mask_token_id=mask_token(target.tok), **eagle_kwargs(target, 2))
    export.write_eagle3(tmp_path / "e3", eagle3_weights(target.config, 1, v // 2), **eagle_kwargs(target))
    w, cfg = pard_weights(target.config, 1)
    export.write_pard(tmp_path / "pa", w, config=cfg, pard_token=mask_token(target.tok))
    for name, layout in (("pe", "peagle"), ("e3", "eagle3"), ("pa", "pard")):
        assert export.check_export(tmp_path / name, target.config).layout == layout

    saved = load_file(str(tmp_path / "pe" / "model.safetensors"))
    del saved["mask_hidden"]
    save_file(saved, str(tmp_path / "pe" / "model.safetensors"))
    with pytest.raises(SpecframeError, match=r"pe cannot be served by vLLM: a P-EAGLE export needs 'mask_hidden'"):
        export.check_export(tmp_path / "pe")
    (tmp_path / "e3" / "config.json").write_text("{")
    with pytest.raises(SpecframeError, match="e3 cannot be served by vLLM: .*config.json is not valid JSON"):
        export.check_export(tmp_path / "e3")
    smaller = SimpleNamespace(vocab_size=v - 1, hidden_size=target.config.hidden_size, num_hidden_layers=2)
    with pytest.raises(SpecframeError, match=f"exported for a {v}-token vocabulary, the target has {v - 1}"):
        export.check_export(tmp_path / "pa", smaller)
    (tmp_path / "pa" / "model.safetensors").unlink()
    with pytest.raises(SpecframeError, match="model.safetensors is missing"):
        export.check_export(tmp_path / "pa")


def test_ids_are_checked(target, tmp_path):
    w = eagle3_weights(target.config, 4, target.config.vocab_size // 2, parallel=True)
    with pytest.raises(SpecframeError, match="mask_token_id .* not a token id"):
        export.write_peagle(tmp_path / "x", w, mask_token_id=target.config.vocab_size, **eagle_kwargs(target, 4))
    kwargs = eagle_kwargs(target, 4) | {"aux_layer_ids": [1, 2, 5]}
    with pytest.raises(SpecframeError, match="aux layer ids"):
        export.write_peagle(tmp_path / "x", w, mask_token_id=1, **kwargs)
    # id L is the last layer's output, which vLLM's target never collects (it collects the inputs of layers
    # 0..L-1), so it is refused as training refuses it (GPU-path review item 14)
    layers = target.config.num_hidden_layers
    kwargs = eagle_kwargs(target, 4) | {"aux_layer_ids": [1, 2, layers]}
    with pytest.raises(SpecframeError, match=rf"aux layer ids \[1, 2, {layers}\] are invalid .* \(valid: "
                                             rf"0\.\.{layers - 1}, the hidden state entering each layer"):
        export.write_peagle(tmp_path / "x", w, mask_token_id=1, **kwargs)
    export.write_peagle(tmp_path / "x", w, mask_token_id=1, **(kwargs | {"aux_layer_ids": [0, 2, layers - 1]}))
    pw, cfg = pard_weights(target.config, 1)
    with pytest.raises(SpecframeError, match="pard_token"):
        export.write_pard(tmp_path / "p", pw, config=cfg, pard_token=-1)


def test_overwrite_is_atomic_and_refuses_foreign_folders(target, tmp_path):
    w, cfg = pard_weights(target.config, 1)
    out = tmp_path / "p"
    export.write_pard(out, w, config=cfg, pard_token=3)
    export.write_pard(out, w, config=cfg, pard_token=4)
    assert json.loads((out / "config.json").read_text())["pard_token"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p"]  # no temp or old folders left
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    with pytest.raises(SpecframeError, match="refusing to overwrite"):
        export.write_pard(foreign, w, config=cfg, pard_token=3)
    assert (foreign / "keep.txt").read_text() == "mine"


def test_config_is_required(tmp_path):
    with pytest.raises(SpecframeError, match="not a vLLM drafter export"):
        export.speculative_config(tmp_path, 3)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(SpecframeError, match="neither speculators_config nor pard_token"):
        export.read_manifest(tmp_path)


def test_speculators_config_reads_back_and_matches_what_vllm_extracts(target, tmp_path):
    """The writer's config and vLLM's own reader agree (method, tokens, layer config), without starting vLLM."""
    flat = {**export.llama_config(target.config, 2), "draft_vocab_size": 160, "target_hidden_size": 64,
            "eagle_aux_hidden_state_layer_ids": AUX, "mask_token_id": 3}
    cfg = export.speculators_config(flat, "peagle", verifier="/models/t", speculative_tokens=4, drafter="peagle")
    arch = {"qk_norm": False, "sliding_window": None, "norm_before_residual": False, "norm_before_fc": False,
            "norm_output": False}
    assert export.flat_config(cfg) == {**flat, "dtype": "float32", **arch}
    assert export.layout_of(cfg) == "peagle"
    try:
        from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
    except ImportError:
        return
    assert SpeculatorsConfig.extract_vllm_speculative_config(cfg) == {
        "method": "eagle3", "num_speculative_tokens": 4, "parallel_drafting": True
    }
    pre = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(cfg)))
    assert pre["architectures"] == ["PeagleLlamaForCausalLM"] and pre["pard_token"] == 3
    assert pre["norm_before_residual"] is False and pre["num_hidden_layers"] == 2


@pytest.mark.parametrize("layout", ["eagle3", "peagle"])
def test_a_biased_targets_flags_do_not_reach_the_drafter_layers(target, tmp_path, layout):
    """GPU-path review item 9: specframe's drafter layers have no biases, and vLLM builds biased q/k/v/o and MLP
    projections from the layer config's attention_bias / mlp_bias: a Llama target with both set must still export
    them false (llama_config is every layout's layer config: EAGLE-3, P-EAGLE, ParallelSpec and DFlash)."""
    biased = copy.deepcopy(target.config)
    biased.attention_bias = biased.mlp_bias = True
    assert export.llama_config(biased, 1)["attention_bias"] is False
    assert export.llama_config(biased.to_dict(), 1)["mlp_bias"] is False
    kwargs = {**eagle_kwargs(target), "config": export.llama_config(biased, 1)}
    v = target.config.vocab_size
    if layout == "eagle3":
        export.write_eagle3(tmp_path / layout, eagle3_weights(target.config, 1, v // 2), **kwargs)
    else:
        export.write_peagle(tmp_path / layout, eagle3_weights(target.config, 1, v // 2, parallel=True),
                            mask_token_id=mask_token(target.tok), **kwargs)
    layer = json.loads((tmp_path / layout / "config.json").read_text())["transformer_layer_config"]
    assert layer["attention_bias"] is False and layer["mlp_bias"] is False


@pytest.mark.parametrize("kind", ["eagle3", "peagle", "dflash"])
def test_the_exported_verifier_names_the_targets_own_architectures(tmp_path, kind):
    """GPU-path review item 14: speculators' VerifierConfig records the verifier's architectures; a Qwen2 target's
    export said LlamaForCausalLM. Through each speculators drafter's own export_vllm, and kept by set_serving."""
    from specframe import plugins

    path = build_target(tmp_path / "qwen2", family="qwen2")
    config, tok = target_parts(path)
    assert config.architectures == ["Qwen2ForCausalLM"]
    cls = plugins.get("drafter", kind)
    options = {"eagle3": dict(layers=1, aux_layer_ids=AUX), "peagle": dict(layers=2, aux_layer_ids=AUX),
               "dflash": dict(layers=2, block_size=4, aux_layer_ids=[1, 3])}[kind]
    drafter = cls(config, cls.Options(**options))
    if kind != "eagle3":
        drafter.mask_token_id = mask_token(tok)
    drafter.export_vllm(tmp_path / "out", tok)
    verifier = json.loads((tmp_path / "out" / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": str(path.resolve()), "architectures": ["Qwen2ForCausalLM"]}
    # DFlash (block 4) is served in vLLM at block_size - 1 only (GPU-path review item 3)
    export.set_serving(tmp_path / "out", verifier="org/qwen2", speculative_tokens=3 if kind == "dflash" else 2)
    verifier = json.loads((tmp_path / "out" / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": "org/qwen2", "architectures": ["Qwen2ForCausalLM"]}
    assert export.verifier_architectures_of(config.to_dict()) == ["Qwen2ForCausalLM"]
    assert export.verifier_architectures_of({}) == []


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.update(fc_norm=True), "fc_norm is true"),
        (lambda c: c.pop("transformer_layer_config"), "lacks transformer_layer_config"),
        (lambda c: c["transformer_layer_config"].update(model_type="mistral"), "model_type is 'mistral'"),
    ],
)
def test_speculators_variants_specframe_cannot_compute_are_named(target, edit, message):
    flat = {**export.llama_config(target.config, 1), "draft_vocab_size": 160, "target_hidden_size": 64,
            "eagle_aux_hidden_state_layer_ids": AUX}
    cfg = export.speculators_config(flat, "eagle3", verifier="t")
    edit(cfg)
    with pytest.raises(SpecframeError, match=message):
        export.flat_config(cfg)


@pytest.mark.parametrize(
    "edit, read",
    [
        (lambda c: c.update(norm_before_residual=True), {"norm_before_residual": True}),
        (lambda c: c.pop("norm_before_residual"), {"norm_before_residual": True}),  # vLLM's eagle3 default
        (lambda c: c.update(norm_before_fc=True, norm_output=True), {"norm_before_fc": True, "norm_output": True}),
        (lambda c: c["transformer_layer_config"].update(model_type="qwen3"), {"qk_norm": True}),
    ],
)
def test_speculators_defaults_read_into_the_architecture_fields(target, edit, read):
    """speculators' trainer defaults are drafter options now (issue 54 item 4), read where they were refused."""
    flat = {**export.llama_config(target.config, 1), "draft_vocab_size": 160, "target_hidden_size": 64,
            "eagle_aux_hidden_state_layer_ids": AUX}
    cfg = export.speculators_config(flat, "eagle3", verifier="t")
    edit(cfg)
    got = export.flat_config(cfg)
    assert {k: got[k] for k in read} == read


def test_set_serving_rewrites_verifier_and_tokens(target, tmp_path):
    v = target.config.vocab_size
    export.write_eagle3(tmp_path / "e", eagle3_weights(target.config, 1, v // 2), **eagle_kwargs(target))
    before = (tmp_path / "e" / "model.safetensors").read_bytes()
    m = export.set_serving(tmp_path / "e", verifier="org/model", speculative_tokens=7)
    assert (m.verifier, m.speculative_tokens, m.layout, m.drafter) == ("org/model", 7, "eagle3", "eagle3")
    assert (tmp_path / "e" / "model.safetensors").read_bytes() == before
    w, cfg = pard_weights(target.config, 1)
    export.write_pard(tmp_path / "p", w, config=cfg, pard_token=3)
    with pytest.raises(SpecframeError, match="names no verifier"):
        export.set_serving(tmp_path / "p", verifier="x")


def test_default_drafter_export_refuses(tmp_path):
    class Bare(api.Drafter):
        name = "bare"
        feature_spec = module = supervision = loss = start = propose = accept = lambda *a, **k: None

    with pytest.raises(SpecframeError, match="drafter 'bare' cannot be exported to vLLM"):
        Bare(None).export_vllm(tmp_path, None)


# ----------------------------------------------------------------------------------------- vLLM counts -> metrics


def test_rounds_from_steps_cut_at_max_tokens_and_count_draftless_forwards():
    # 12 tokens: prefill 1, then steps emitting 4, 1, 3 and a last step that accepted 3 but only 2 tokens fit
    rounds = rounds_from_steps(12, accepted=[3, 0, 2, 3], drafted=[3, 3, 3, 3])
    assert [r.emitted for r in rounds] == [4, 1, 3, 3]
    assert rounds[-1] == Round(drafted=3, accepted=3, emitted=3)
    cut = rounds_from_steps(11, accepted=[3, 0, 2, 3], drafted=[3, 3, 3, 3])
    assert cut[-1] == Round(drafted=3, accepted=2, emitted=2)
    # two decode forwards without a draft (e.g. ngram found no match)
    spare = rounds_from_steps(6, accepted=[2], drafted=[3])
    assert [(r.drafted, r.emitted) for r in spare] == [(3, 3), (0, 1), (0, 1)]
    with pytest.raises(SpecframeError):
        rounds_from_steps(6, accepted=[4], drafted=[3])


def test_counters_from_vllm_metrics():
    metric = lambda name, **kw: SimpleNamespace(name=f"vllm:spec_decode_{name}", **kw)  # noqa: E731
    snapshot = [
        metric("num_drafts", value=10),
        metric("num_draft_tokens", value=30),
        metric("num_accepted_tokens", value=12),
        metric("num_accepted_tokens_per_pos", values=[6, 4, 2]),
        SimpleNamespace(name="vllm:generation_tokens", value=99),
    ]
    c = SpecCounters.from_metrics(snapshot)
    assert c == SpecCounters(drafts=10, draft_tokens=30, accepted_tokens=12, accepted_per_pos=(6, 4, 2))
    assert c.drafting_acceptance_length() == pytest.approx(2.2)
    assert c.per_slot_acceptance() == pytest.approx([0.6, 0.4, 0.2])
    assert c.minus(SpecCounters(4, 12, 5, (3, 1, 1))) == SpecCounters(6, 18, 7, (3, 3, 1))


# ------------------------------------------------------------------------------------------------------- parity


def test_compare_tokens_stops_at_near_ties():
    gaps = torch.tensor([1.0, 0.5, 1e-5, 1.0])
    assert parity.compare_tokens([1, 2, 3, 4], [1, 2, 9, 9], gaps) == parity.TokenParity(2, None, 2)
    assert parity.compare_tokens([1, 2, 3, 4], [1, 7, 3, 4], gaps).first_mismatch == 1
    assert parity.compare_tokens([1, 2, 3, 4], [1, 2, 3], torch.ones(4)).first_mismatch == 3
    assert parity.compare_tokens([1, 2, 3, 4], [1, 2, 3, 4], torch.ones(4)).equal


def test_top2_gaps_follow_the_reference_tokens(target):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target.path).eval()
    prompt = target.tok("def add(a, b):")["input_ids"]
    with torch.no_grad():
        greedy = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt) :].tolist()
    gaps = parity.top2_gaps(model, prompt, greedy)
    assert gaps.shape == (6,) and (gaps >= 0).all()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    top = logits.topk(2).values
    assert gaps[0] == pytest.approx(float(top[0] - top[1]), rel=1e-5)


def test_compare_rounds_and_per_slot():
    R = Round
    ref = [R(3, 3, 4), R(3, 1, 2), R(3, 0, 1), R(3, 2, 3)]
    cand = [R(3, 3, 4), R(3, 0, 1), R(3, 1, 2), R(3, 2, 3)]
    tp = parity.TokenParity(compared=11, first_mismatch=None, tie_at=None)  # 10 decode tokens
    rp = parity.compare_rounds(ref, cand, tp)
    assert (rp.compared, rp.equal, rp.first_difference) == (4, 2, 1)
    short = parity.compare_rounds(ref, cand, parity.TokenParity(compared=6, first_mismatch=None, tie_at=5))
    assert short.reference == (3,) and short.candidate == (3, 0)[: short.compared]
    assert parity.per_slot_counts(ref, 3) == [3, 2, 1]
    agg = parity.compare_per_slot(ref, [3, 2, 1], drafts=4, k=3)
    assert agg["max_abs_difference"] == 0.0


@pytest.mark.slow  # imports vLLM's model registry (a minute on this CPU)
def test_a_target_vllm_cannot_serve_is_refused_before_start_up_with_the_reasons(tmp_path):
    """A Gemma target: vLLM's GemmaForCausalLM has no SupportsEagle3 (no aux hidden states for the drafter), and its
    llama_eagle3 drafter builds only silu layers while this drafter is tanh-GELU like its target. drafter_job names
    both before an engine starts; a Qwen2 target (SupportsEagle3, silu) passes the check."""
    from specframe.vllm import vllm_available
    from specframe.vllm.jobs import drafter_job

    for family in ("gemma", "qwen2"):
        path = build_target(tmp_path / family, family=family)
        config, _ = target_parts(path)
        kwargs = dict(config=export.llama_config(config, 1), aux_layer_ids=AUX, target_hidden_size=config.hidden_size,
                      target_num_layers=config.num_hidden_layers, verifier=export.verifier_name(path))
        export.write_eagle3(tmp_path / f"{family}-export", eagle3_weights(config, 1, 64), **kwargs)
    with pytest.raises(SpecframeError) as info:
        drafter_job(tmp_path / "gemma-export", 3)
    message = str(info.value)
    assert message.startswith("the installed vLLM cannot serve this eagle3 export for target")
    assert "builds only silu layers" in message and "gelu_pytorch_tanh" in message
    if vllm_available():
        assert "GemmaForCausalLM does not implement SupportsEagle3" in message
    assert drafter_job(tmp_path / "qwen2-export", 3).target == str((tmp_path / "qwen2-export").resolve())
