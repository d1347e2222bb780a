"""What a vLLM export writes for a target whose layers are not Llama's: every field the drafter's forward computes
with (``modeling.LayerShape``: activation, norm epsilon, head size, RoPE), read from the target however its family
names them, and a RoPE vLLM's drafter models cannot take (Gemma-3's, split by attention type) refused by name.

The targets are configs only (no weights): a Gemma-2 style one names its activation ``hidden_activation`` (not
``hidden_act``, which the export once copied alone, so vLLM built the drafter with silu) and has a scaled RoPE of
another base; a Gemma-3 one splits its RoPE into sliding and full attention. vLLM is never imported: its model
registry (``support._model_class``) is stubbed out.
"""

from __future__ import annotations

import json

import pytest
import torch

from specframe import api, plugins
from specframe.layouts import export
from specframe.vllm import support

ACT, EPS, HEAD_DIM, THETA = "gelu_pytorch_tanh", 1e-6, 32, 50000.0
ROPE = {"rope_type": "linear", "factor": 2.0, "rope_theta": THETA}
SIZES = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
             num_key_value_heads=1, head_dim=HEAD_DIM, max_position_embeddings=1024, rms_norm_eps=EPS)


def gemma2_config():
    from transformers import Gemma2Config

    cfg = Gemma2Config(**SIZES, rope_parameters=dict(ROPE))
    assert getattr(cfg, "hidden_act", None) is None and cfg.hidden_activation == ACT  # the family's own spelling
    return cfg


def gemma3_config():
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(**SIZES)
    assert set(cfg.rope_parameters) == {"sliding_attention", "full_attention"}
    return cfg


@pytest.fixture(autouse=True)
def no_vllm_registry(monkeypatch):
    """The rules tested here read configs only; vLLM's model registry takes a minute to import on a CPU."""
    monkeypatch.setattr(support, "_model_class", lambda arch: None)


def drafter(name: str, target_config):
    torch.manual_seed(0)
    cls = plugins.get("drafter", name)
    options = {"layers": 1, "draft_vocab_size": 160} if name != "pard" else {"layers": 1, "init_from_target": False}
    d = cls(target_config, cls.Options(**{k: v for k, v in options.items() if hasattr(cls.Options(), k)}))
    # the mask tokens training would choose (a reserved id of the vocabulary)
    if hasattr(d, "mask_token_ids"):
        d.mask_token_ids = list(range(300, 300 + d.options.masks))
    if hasattr(d, "mask_token_id"):
        d.mask_token_id = 300
    return d


def layer_config(directory) -> dict:
    cfg = json.loads((directory / "config.json").read_text())
    return cfg.get("transformer_layer_config", cfg)


@pytest.mark.parametrize("name", ["eagle3", "peagle", "parallelspec", "pard"])
def test_the_export_writes_every_field_the_drafters_forward_reads(name, tmp_path):
    target = gemma2_config()
    d = drafter(name, target)
    d.export_vllm(tmp_path / "out", None)
    layer = layer_config(tmp_path / "out")
    assert layer["hidden_act"] == ACT  # vLLM builds a layer config without it with silu
    assert layer["rms_norm_eps"] == EPS and layer["head_dim"] == HEAD_DIM
    assert (layer["hidden_size"], layer["intermediate_size"]) == (64, 128)
    assert (layer["num_attention_heads"], layer["num_key_value_heads"]) == (2, 1)
    rope = layer["rope_parameters"]
    assert (rope["rope_type"], rope["factor"], rope["rope_theta"]) == ("linear", 2.0, THETA)
    assert layer["max_position_embeddings"] == 1024
    # and they are what the drafter's own layers compute with
    shape = api.modeling.LayerShape.from_config(target)
    assert (shape.act, shape.eps, shape.head_dim, shape.rope_theta) == (ACT, EPS, HEAD_DIM, THETA)


def test_llama_config_takes_the_activation_however_the_target_names_it():
    for source in (gemma2_config(), gemma2_config().to_dict()):
        cfg = export.llama_config(source, 2)
        assert (cfg["hidden_act"], cfg["num_hidden_layers"], cfg["rope_parameters"]["rope_theta"]) == (ACT, 2, THETA)


def test_the_support_check_reads_the_activation_the_export_wrote(tmp_path):
    """vLLM's EAGLE-3 drafter model builds silu layers only: an export that writes the target's activation is refused
    by that rule; one written without it (an older export) for a target that is not silu is refused too, since vLLM
    would build silu layers where the drafter computed the target's activation."""
    target = gemma2_config()
    target.save_pretrained(tmp_path / "target")  # the config is all the check reads of it
    drafter("eagle3", target).export_vllm(tmp_path / "out", None)
    with pytest.raises(api.SpecframeError) as info:
        support.prestart(str(tmp_path / "target"), tmp_path / "out")
    message = str(info.value)
    assert message.startswith("the installed vLLM cannot serve this eagle3 export for target")
    assert f"builds only silu layers, and this drafter's activation is the target's {ACT}" in message
    assert "\n" not in message
    with pytest.raises(api.SpecframeError, match=f"builds only silu layers.*{ACT}"):
        support.prestart(None, tmp_path / "out")  # the written field alone, no target config to read
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    del cfg["transformer_layer_config"]["hidden_act"]
    (tmp_path / "out" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(api.SpecframeError, match=f"names no hidden_act, so vLLM would build its layers with silu, "
                                                 f"while the drafter computes the target's {ACT}"):
        support.prestart(str(tmp_path / "target"), tmp_path / "out")


def test_a_pard_export_of_a_silu_target_passes_the_check(tmp_path):
    from transformers import LlamaConfig

    target = LlamaConfig(**SIZES, rope_parameters=dict(ROPE))
    target.save_pretrained(tmp_path / "target")
    drafter("pard", target).export_vllm(tmp_path / "out", None)
    assert layer_config(tmp_path / "out")["hidden_act"] == "silu"
    support.prestart(str(tmp_path / "target"), tmp_path / "out")  # nothing known against it


@pytest.mark.parametrize("name", ["eagle3", "pard"])
def test_a_rope_split_by_attention_type_is_refused_by_name_before_anything_is_written(name, tmp_path):
    """Gemma-3's RoPE settings per attention type (sliding, full): vLLM's drafter models take one for every layer
    and failed deep in start-up (``TypeError: unhashable type: 'dict'``)."""
    d = drafter(name, gemma3_config())
    with pytest.raises(api.SpecframeError) as info:
        d.export_vllm(tmp_path / "out", None)
    assert str(info.value) == (
        "cannot export this drafter for vLLM: the target's rope_parameters is split by attention type "
        "(full_attention, sliding_attention), and vLLM's drafter models take one RoPE setting for every layer")
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


def test_an_export_written_with_a_split_rope_is_refused_before_vllm_starts(tmp_path):
    """An export from elsewhere (or an older specframe) carrying the split RoPE: the pre-start check names it."""
    drafter("eagle3", gemma2_config()).export_vllm(tmp_path / "out", None)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    cfg["transformer_layer_config"]["rope_parameters"] = gemma3_config().rope_parameters
    (tmp_path / "out" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(api.SpecframeError) as info:
        support.prestart(None, tmp_path / "out")
    assert "the target's rope_parameters is split by attention type (full_attention, sliding_attention)" in str(
        info.value)
