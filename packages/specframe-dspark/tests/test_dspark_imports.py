"""Foreign DSpark checkpoints imported as specframe's DSpark (packages/specframe-dspark): its own export, DeepSpec's and
SpecForge's folders and speculators' RNN-head ones, each drafting like its source, and the folders it cannot hold
refused by name."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json

import pytest
import torch

from specframe import api

try:
    DIST = importlib.metadata.distribution("specframe-dspark")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - depends on the environment
    pytest.skip("the specframe-dspark distribution is not installed (pip install --no-deps -e "
                "packages/specframe-dspark)", allow_module_level=True)

from tests.block_fixtures import target  # noqa: E402, F401 (target: the module fixture)
from tests.dspark_fixtures import make  # noqa: E402


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
