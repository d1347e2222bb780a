"""Target loading: the embedded default target (GGUF -> cached safetensors), tiny targets, bad targets."""

from __future__ import annotations

import json

import pytest
import torch

from specframe import targets
from specframe.errors import SpecframeError
from specframe.targets import TARGET_INFO_FILE, load_target, tiny_target, weights_hash
from tests.target_fixtures import PINNED_IDS, PINNED_PROMPT


def test_default_target_loads_from_converted_cache_and_gives_pinned_tokens(default_target):  # noqa: F811
    from specframe.data.chat import encode_prompt

    folder = targets.default_target_dir()
    assert default_target.path == folder and (folder / "model.safetensors").exists()
    assert default_target.id == targets.DEFAULT_ID
    info = json.loads((folder / TARGET_INFO_FILE).read_text())
    assert info["weights_hash"] == default_target.weights_hash
    assert default_target.num_layers == 30 and default_target.hidden_size == 576 and default_target.vocab_size == 49152
    assert "<|im_start|>" in default_target.tokenizer.chat_template
    ids = torch.tensor([encode_prompt(default_target.tokenizer, PINNED_PROMPT)])
    with torch.no_grad():
        out = default_target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert out[0, ids.shape[1] :].tolist() == PINNED_IDS


def test_interrupted_conversion_leaves_no_half_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFRAME_HOME", str(tmp_path))

    def broken(src_dir, gguf, out):
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt  # as if killed mid-write

    monkeypatch.setattr(targets, "_convert_gguf", broken)
    with pytest.raises(KeyboardInterrupt):
        targets.ensure_default_target()
    models = tmp_path / "models"
    assert not targets.default_target_dir().exists()
    assert list(models.iterdir()) == []


def test_tiny_target_round_trip_and_stable_hash(tmp_path, tiny):  # noqa: F811
    assert tiny.num_layers == 4 and tiny.hidden_size == 32
    assert tiny.tokenizer.chat_template and "<|reserved_3|>" in tiny.tokenizer.get_vocab()
    assert tiny.weights_hash == weights_hash(tiny.path, cache=False)
    again = load_target(tiny.path)
    assert again.weights_hash == tiny.weights_hash
    # the hash reads tensors, not files: re-sharding the same weights keeps it
    tiny.model.save_pretrained(tmp_path / "resharded", max_shard_size="20KB")
    assert len(list((tmp_path / "resharded").glob("*.safetensors"))) > 1
    assert weights_hash(tmp_path / "resharded") == tiny.weights_hash
    # another seed, another hash
    other = tiny_target(tmp_path / "other", seed=1)
    assert weights_hash(other) != tiny.weights_hash


def test_bad_targets(tmp_path):
    with pytest.raises(SpecframeError, match="target path ./no/such/model does not exist"):
        load_target("./no/such/model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecframeError, match="has no config.json"):
        load_target(tmp_path / "empty")
    # a tokenizer with more tokens than the model has embeddings does not match it
    path = tiny_target(tmp_path / "mismatch")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens([f"<extra_{i}>" for i in range(8)], special_tokens=True)
    tok.save_pretrained(path)
    with pytest.raises(SpecframeError, match=r"tokenizer of target .* has 328 tokens but the model has only 320 "
                                             r"embeddings: tokenizer and model do not match"):
        load_target(path)


def test_a_device_map_loads_the_same_target(tmp_path, monkeypatch):
    """--device-map loads through transformers / accelerate (on this CPU-only machine every layer lands on the CPU):
    the same weights and the same features as a plain load. Several GPUs: `make gpu-check`."""
    import torch

    from specframe.features import FeatureSpec, capture_features
    from specframe.targets import load_target, tiny_target

    from transformers import AutoModelForCausalLM

    folder = tiny_target(tmp_path / "t")
    plain = load_target(folder)
    asked = []
    original = AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **kw: asked.append(kw.get("device_map")) or original(*a, **kw))
    mapped = load_target(folder, device_map="auto")
    assert asked == ["auto"] and plain.weights_hash == mapped.weights_hash
    ids = torch.tensor([[5, 9, 13, 2, 7]])
    spec = FeatureSpec(aux_layers=(1, 2), final_hidden=True)
    a, b = capture_features(plain, ids, spec), capture_features(mapped, ids, spec)
    assert torch.equal(a.aux, b.aux) and torch.equal(a.final, b.final)


def test_a_device_map_that_offloads_part_of_the_target_is_refused(tmp_path, monkeypatch):
    """accelerate leaves an offloaded module's weights on the meta device (GPU-path review item 15): feature capture
    would read meta tensors, so such a placement is refused with the modules it offloaded. transformers is made to
    offload here as it would with too little GPU memory (this machine has no GPU)."""
    from transformers import AutoModelForCausalLM

    from specframe.errors import SpecframeError
    from specframe.targets import load_target, tiny_target

    folder = tiny_target(tmp_path / "t")
    original = AutoModelForCausalLM.from_pretrained

    def offloading(*args, **kwargs):
        model = original(*args, **kwargs)
        model.model.layers[2:].to("meta")
        model.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 0,
                               "model.layers.2": "cpu", "model.layers.3": "disk", "model.norm": 0, "lm_head": 0}
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", offloading)
    with pytest.raises(SpecframeError, match=r"--device-map auto: transformers offloaded part of target '.*' "
                                             r"\(model\.layers\.2, model\.layers\.3\) to the CPU or disk"):
        load_target(folder, device_map="auto")


def test_device_map_is_refused_under_torchrun(tmp_path, monkeypatch):
    from specframe.engine import TrainConfig, train
    from specframe.errors import UsageError

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UsageError, match="--device-map spreads one target"):
        train(TrainConfig(drafter="peagle", output=str(tmp_path / "o"), device_map="auto"), progress=False)
    assert not (tmp_path / "o").exists()
