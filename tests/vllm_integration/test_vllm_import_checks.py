"""GPU-path review item 13, the import's leniencies and gaps: RoPE compared in full (a missing theta is 10000, the
scaling fields count), the speculators path's ``verifier_*`` tensors dropped as documented, SpecForge's P-EAGLE
folders (``PEagleDraftModel``, flat) imported when they record their mask token and refused with the reason when they
do not, and pickled (``pytorch_model.bin``) folders refused with why and how to convert. No vLLM (fast)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from specframe import plugins
from specframe.drafter_folders import load_drafter
from specframe.errors import SpecframeError
from specframe.layouts import imports
from tests.vllm_fixtures import AUX, build_target, eagle3_weights, mask_token, target_parts

DRAFT_VOCAB = 160
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    torch.set_num_threads(1)
    path = build_target(tmp_path_factory.mktemp("target") / "t")
    config, tok = target_parts(path)
    return SimpleNamespace(path=path, config=config, tok=tok)


def with_rope(config, **rope):
    """The target's config with other RoPE parameters (as a target of that RoPE would load)."""
    other = copy.deepcopy(config)
    other.rope_parameters = {"rope_theta": 10000.0, "rope_type": "default", **rope}
    return other


def specforge_eagle3(target, folder: Path, **config) -> dict[str, torch.Tensor]:
    """A SpecForge EAGLE-3 folder: flat LlamaForCausalLMEagle3 config in the pre-5 transformers spelling (top-level
    ``rope_theta``, ``rope_scaling``), ``midlayer.*`` tensors; ``config`` replaces its fields (None: drop one)."""
    folder.mkdir()
    w = eagle3_weights(target.config, 1, DRAFT_VOCAB)
    w = {k.replace("layers.0.", "midlayer."): v for k, v in w.items()}
    w["t2d"] = torch.zeros(target.config.vocab_size, dtype=torch.bool)
    w["t2d"][torch.arange(DRAFT_VOCAB) + w["d2t"]] = True
    cfg = {k: v for k, v in target.config.to_dict().items() if k != "rope_parameters"}
    cfg.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, draft_vocab_size=DRAFT_VOCAB,
               rope_theta=10000.0, rope_scaling=None,
               eagle_config={"eagle_aux_hidden_state_layer_ids": AUX, "use_aux_hidden_state": True})
    cfg.update(config)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    save_file(w, str(folder / "model.safetensors"))
    return w


# ------------------------------------------------------------------------------------------------------- RoPE


def test_a_missing_theta_is_the_default_not_any_theta(target, tmp_path):
    """SpecForge builds its drafter with getattr(config, "rope_theta", 10000) and some of its configs carry none: such
    a drafter ran at theta 10000 and is refused for a theta-500000 target, naming both values."""
    specforge_eagle3(target, tmp_path / "e", rope_theta=None)
    imports.read(tmp_path / "e", target.config)  # the target's theta is 10000: the same RoPE
    with pytest.raises(SpecframeError, match=r"rope_parameters differ from the target's: rope_theta is 10000\.0 in the "
                                             r"drafter's config and 500000\.0 in the target's") as info:
        imports.read(tmp_path / "e", with_rope(target.config, rope_theta=500000.0))
    assert "\n" not in str(info.value)


def test_rope_scaling_fields_are_compared(target, tmp_path):
    """A llama3-scaled target: the same scaling in the older spelling (rope_scaling with "type", ints for floats)
    imports; another factor, or no scaling at all, is refused naming the field and both values."""
    llama3 = with_rope(target.config, **LLAMA3)
    old_spelling = {"type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4,
                    "original_max_position_embeddings": 64}
    specforge_eagle3(target, tmp_path / "same", rope_scaling=old_spelling)
    assert imports.read(tmp_path / "same", llama3).layout == "eagle3"
    specforge_eagle3(target, tmp_path / "factor", rope_scaling={**old_spelling, "factor": 16})
    with pytest.raises(SpecframeError, match=r"factor is 16\.0 in the drafter's config and 8\.0 in the target's"):
        imports.read(tmp_path / "factor", llama3)
    specforge_eagle3(target, tmp_path / "length", rope_scaling={**old_spelling, "original_max_position_embeddings": 32})
    with pytest.raises(SpecframeError, match=r"original_max_position_embeddings is 32\.0 in the drafter's config and "
                                             r"64\.0 in the target's"):
        imports.read(tmp_path / "length", llama3)
    specforge_eagle3(target, tmp_path / "plain")
    with pytest.raises(SpecframeError, match=r"rope_type is 'default' in the drafter's config and 'llama3' in the "
                                             r"target's"):
        imports.read(tmp_path / "plain", llama3)
    # a yarn target: the pretraining length transformers fills in from max_position_embeddings when a config omits it
    yarn = with_rope(target.config, rope_type="yarn", factor=4.0)
    specforge_eagle3(target, tmp_path / "yarn", rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                             "original_max_position_embeddings": 2048})
    imports.read(tmp_path / "yarn", yarn)


def test_a_speculators_export_with_other_rope_scaling_is_refused(target, tmp_path):
    """The same check on the speculators path (the RoPE sits in transformer_layer_config)."""
    drafter = _peagle(target)
    drafter.export_vllm(tmp_path / "pe", target.tok)
    cfg = json.loads((tmp_path / "pe" / "config.json").read_text())
    cfg["transformer_layer_config"]["rope_parameters"] = {"rope_theta": 10000.0, **LLAMA3, "factor": 2.0}
    (tmp_path / "pe" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecframeError, match=r"factor is 2\.0 in the drafter's config and 8\.0 in the target's"):
        imports.read(tmp_path / "pe", with_rope(target.config, **LLAMA3))
    with pytest.raises(SpecframeError, match=r"rope_type is 'llama3' in the drafter's config and 'default'"):
        imports.read(tmp_path / "pe", target.config)


# ------------------------------------------------------------------------------------ speculators verifier_*


def test_the_speculators_path_drops_verifier_tensors(target, tmp_path):
    """Older speculators releases saved the verifier's lm_head and norm beside the drafter (the module docstring says
    they are dropped): the folder imports, with the drafter's own weights only."""
    drafter = _peagle(target)
    drafter.export_vllm(tmp_path / "pe", target.tok)
    weights = load_file(str(tmp_path / "pe" / "model.safetensors"))
    h, v = target.config.hidden_size, target.config.vocab_size
    save_file({**weights, "verifier_lm_head.weight": torch.randn(v, h), "verifier_norm.weight": torch.ones(h)},
              str(tmp_path / "pe" / "model.safetensors"))
    imported = imports.read(tmp_path / "pe", target.config)
    assert not [k for k in imported.tensors if k.startswith("verifier_")]
    copy_ = load_drafter(tmp_path / "pe", target.config, target.tok)
    for name, value in drafter.model.state_dict().items():
        assert torch.equal(copy_.model.state_dict()[name], value), name


# ------------------------------------------------------------------------------------------ SpecForge P-EAGLE


def _peagle(target):
    cls = plugins.get("drafter", "peagle")
    torch.manual_seed(0)
    drafter = cls(target.config, cls.Options(layers=2, aux_layer_ids=AUX, draft_vocab_size=DRAFT_VOCAB))
    drafter.model.set_draft_vocab(torch.arange(0, 2 * DRAFT_VOCAB, 2))
    torch.nn.init.normal_(drafter.model.mask_hidden, std=0.1)
    drafter.mask_token_id = mask_token(target.tok)
    return drafter


def specforge_peagle(drafter, target, folder: Path, *, mask_token_id: int | None) -> None:
    """A specframe P-EAGLE saved as SpecForge's PEagleDraftModel saves one (specforge/modeling/draft/peagle.py,
    configs/qwen3-8b-peagle.json): a flat Llama config with that architecture and draft_vocab_size, no aux layer ids
    (the target's default ones are used) and the module's own tensor names (layers.N.*, mask_hidden [1, 1, 3 H])."""
    folder.mkdir()
    cfg = {k: v for k, v in target.config.to_dict().items() if k != "rope_parameters"}
    cfg.update(architectures=["PEagleDraftModel"], model_type="llama", num_hidden_layers=2, rope_theta=10000.0,
               rope_scaling=None, draft_vocab_size=DRAFT_VOCAB, tie_word_embeddings=False)
    if mask_token_id is not None:
        cfg["mask_token_id"] = mask_token_id
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in drafter.model.state_dict().items()}, str(folder / "model.safetensors"))


def test_a_specforge_peagle_folder_imports_with_identical_weights_and_proposals(target, tmp_path):
    original = _peagle(target)
    specforge_peagle(original, target, tmp_path / "sf", mask_token_id=original.mask_token_id)
    imported = imports.read(tmp_path / "sf", target.config)
    assert (imported.format, imported.layout, imported.aux_layer_ids) == ("peagle-flat", "peagle", AUX)
    copy_ = load_drafter(tmp_path / "sf", target.config, target.tok)
    assert copy_.name == "peagle" and copy_.mask_token_id == original.mask_token_id
    state = copy_.model.state_dict()
    for name, value in original.model.state_dict().items():
        assert torch.equal(state[name], value), name
    prompt = torch.tensor(target.tok("The quick brown fox")["input_ids"])
    aux = torch.randn(len(prompt), 3 * target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    drafts = []
    for d in (original, copy_):
        d.module().eval()
        d.start(prompt, {"aux_hidden": aux})
        d.accept(torch.tensor([5]), {"aux_hidden": aux[-1:]})
        drafts.append(d.propose(4).tokens.tolist())
    assert drafts[0] == drafts[1]


def test_a_specforge_peagle_folder_without_its_mask_token_is_refused_with_the_reason(target, tmp_path):
    specforge_peagle(_peagle(target), target, tmp_path / "sf", mask_token_id=None)
    with pytest.raises(SpecframeError, match=r"a SpecForge P-EAGLE folder \(PEagleDraftModel\) whose config.json "
                                             r"records no mask_token_id: SpecForge passes the mask token to its "
                                             r"trainer and does not save it") as info:
        load_drafter(tmp_path / "sf", target.config, target.tok)
    assert "\n" not in str(info.value) and str(tmp_path / "sf") in str(info.value)


# ---------------------------------------------------------------------------------------- pickled weights


def test_a_pickled_eagle3_folder_is_refused_with_how_to_convert_and_imports_once_converted(target, tmp_path,
                                                                                        monkeypatch):
    """SafeAILab's published EAGLE-3 drafters are pytorch_model.bin folders: refused (nothing is unpickled) with the
    reason and a conversion; after that conversion the folder imports."""
    import pickle

    folder = tmp_path / "safeailab"
    w = specforge_eagle3(target, folder, eagle_config=None)
    (folder / "model.safetensors").unlink()
    torch.save(w, folder / "pytorch_model.bin")

    def refuse(*args, **kwargs):
        raise AssertionError("unpickled")

    with monkeypatch.context() as m:
        m.setattr(pickle, "load", refuse)
        m.setattr(pickle, "loads", refuse)
        m.setattr(torch, "load", refuse)
        with pytest.raises(SpecframeError, match=r"pytorch_model.bin is a pickle file, and specframe reads weights "
                                                 r"through safetensors only .*nothing was loaded\): convert it once, "
                                                 r"e\.g\. safetensors\.torch\.save_file\(torch\.load\(") as info:
            imports.read(folder, target.config)
    assert "\n" not in str(info.value)
    save_file(torch.load(folder / "pytorch_model.bin", weights_only=True), str(folder / "model.safetensors"))
    shutil.move(folder / "pytorch_model.bin", tmp_path / "pytorch_model.bin")
    drafter = load_drafter(folder, target.config, target.tok)
    assert torch.equal(drafter.model.state_dict()["fc.weight"], w["fc.weight"])
