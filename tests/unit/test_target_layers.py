"""Training from a feature cache keeps only the target layers its drafter reads (``Drafter.target_layers``, API 15):
the others are dropped once loaded (``specframe.targets.keep_layers``), reading one raises, every built-in drafter
starts exactly as it does from the whole target, and the memory estimate charges what the run holds."""

from __future__ import annotations

import pytest
import torch

from specframe.engine import TrainConfig
from specframe.engine.loop import Trainer
from specframe.errors import SpecframeError
from specframe.dropped_layers import is_absent
from specframe.targets import keep_layers, load_target
from tests.train_fixtures import build, small_options


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build(tmp_path_factory.mktemp("target-layers"))


@pytest.fixture(scope="module")
def cache(assets, tmp_path_factory):
    """A cache holding every layer's state, so each drafter finds the aux layers it reads."""
    from specframe.cache import prepare_cache
    from specframe.data.specs import load_data
    from specframe.features import FeatureSpec

    target = load_target(assets[0])
    out = tmp_path_factory.mktemp("cache") / "cache"
    spec = FeatureSpec(aux_layers=tuple(range(target.num_layers)), final_hidden=True)
    prepare_cache(target, load_data(str(assets[1])), out, spec=spec, dtype="float32", draft_vocab=None)
    return out


def layer_params(model, i):
    return sum(p.numel() for p in model.model.layers[i].parameters())


def test_keep_layers_drops_the_others_and_reading_one_raises(assets):
    whole = load_target(assets[0])
    light = load_target(assets[0])
    assert keep_layers(light.model, [3], "tiny") == 3
    assert [is_absent(layer) for layer in light.model.model.layers] == [True, True, True, False]
    assert light.num_layers == 4 and light.vocab_size == whole.vocab_size  # the config and embedding stay
    n_whole = sum(p.numel() for p in whole.model.parameters())
    n_light = sum(p.numel() for p in light.model.parameters())
    assert n_whole - n_light == sum(layer_params(whole.model, i) for i in range(3))
    assert not any(k.startswith(("model.layers.0.", "model.layers.2.")) for k in light.model.state_dict())
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(SpecframeError, match="ran decoder layer 0, which was not loaded"):
        light.model(ids)
    with pytest.raises(SpecframeError, match="read 'self_attn' of decoder layer 1"):
        light.model.model.layers[1].self_attn
    with pytest.raises(SpecframeError, match=r"has decoder layers 0\.\.3; asked to keep \[4\]"):
        keep_layers(light.model, [4])


def cases():
    """(drafter, options) for every built-in drafter that trains, with each way it reads the target's body."""
    from specframe import plugins

    names = plugins.load().names("drafter")
    out = [("peagle", small_options(k_train=4)), ("peagle", small_options(k_train=4, init_from_target_layers=True)),
           ("eagle3", {"layers": 2, "draft_vocab_size": 128, "init_from_target_layers": True}),
           ("parallelspec", {"backbone": "standalone", "layers": 2, "draft_vocab_size": 128}),
           ("parallelspec", {"layers": 1, "draft_vocab_size": 128, "init_from_target_layers": True}),
           ("pard", {"layers": 2, "init_from_target": True}), ("pard", {"layers": 2, "init_from_target": False})]
    out += [(name, {}) for name in ("dflash", "dspark") if name in names]
    return out


@pytest.mark.parametrize("drafter,options", cases())
def test_a_drafter_starts_alike_from_the_layers_it_declares(assets, cache, tmp_path, drafter, options):
    def trainer(out, target=None):
        cfg = TrainConfig(drafter=drafter, output=str(tmp_path / out), target=str(assets[0]), data=None,
                          cache=str(cache),
                          seq_len=48, max_steps=1, batch_size=1, val_examples=1, mask_builder="dense", depth=3,
                          drafter_options=dict(options))
        return Trainer(cfg, target=target, log=lambda *a: None)

    light = trainer("light")
    try:
        declared = light.drafter.target_layers(light.target.num_layers)
        kept = [i for i, layer in enumerate(light.target.model.model.layers) if not is_absent(layer)]
        assert kept == sorted(declared)
        full = trainer("full", target=load_target(assets[0]))
        try:
            a, b = light.drafter.module().state_dict(), full.drafter.module().state_dict()
            assert a.keys() == b.keys()
            for key in a:
                assert torch.equal(a[key], b[key]), key
        finally:
            full.close()
    finally:
        light.close()


def test_init_from_target_layers_refuses_a_layer_that_was_not_loaded(assets):
    from specframe.drafting.eagle import copy_target_layers

    light = load_target(assets[0])
    keep_layers(light.model, [3])
    layers = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])  # draft layers 0, 1 <- target 2, 3
    with pytest.raises(SpecframeError, match=r"no tensors of its layers \[2\]"):
        copy_target_layers(layers, light.model)


def test_the_estimate_charges_the_layers_a_cache_run_keeps(assets):
    from specframe import memory as mem

    target = load_target(assets[0])
    per_layer = layer_params(target.model, 0)

    def charged(features, **options):
        est = mem.estimate(mem.MemoryConfig(drafter="peagle", target_config=target.config, seq_len=48, depth=3,
                                            mask_builder="dense", drafter_options=small_options(**options),
                                            features=features))
        return est.breakdown["target_weights"]

    assert charged("online") - charged("cache") == 4 * per_layer * 4  # fp32: no layer held
    assert charged("online") - charged("cache", init_from_target_layers=True) == 2 * per_layer * 4
    assert charged("online") == sum(p.numel() for p in target.model.parameters()) * 4


@pytest.mark.parametrize("declared", [[4], [-1], [1.0], "0", 3])
def test_a_declaration_outside_the_targets_layers_names_the_drafter(declared):
    from specframe.engine.validate import check_target_layers
    from specframe.errors import PluginError

    assert check_target_layers(None, "x", 4) is None and check_target_layers((3, 0), "x", 4) == [3, 0]
    with pytest.raises(PluginError, match=r"drafter 'x': target_layers\(4\) returned .*0\.\.3"):
        check_target_layers(declared, "x", 4)


def test_a_drafter_that_declares_nothing_keeps_the_whole_target(assets, cache, tmp_path, monkeypatch):
    """A drafter written for API 14 (``target_layers`` None) is handed every layer, as before the hook."""
    from specframe import api

    monkeypatch.setattr(api.eagle.FamilyTraining, "target_layers", lambda self, n: None)
    cfg = TrainConfig(drafter="peagle", output=str(tmp_path / "run"), target=str(assets[0]), data=None,
                      cache=str(cache), seq_len=48, max_steps=1, batch_size=1, val_examples=1, mask_builder="dense",
                      depth=3, drafter_options=small_options(k_train=4))
    trainer = Trainer(cfg, log=lambda *a: None)
    try:
        assert not any(is_absent(layer) for layer in trainer.target.model.model.layers)
    finally:
        trainer.close()


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
def test_one_decoder_finder_for_the_loader_the_head_check_and_the_capture(tmp_path, family):
    """``keep_layers`` drops layers in the decoder the head check and the feature capture run (one finder,
    ``target_head.find_decoder``): a layer dropped there is the one the capture would have hooked."""
    from specframe.features import FeatureSpec, capture_features
    from specframe.target_head import decoder, find_decoder
    from specframe.targets import decoder_layers, tiny_target

    model = load_target(tiny_target(tmp_path / family, family=family, seed=0)).model
    assert find_decoder(model) is model.model and decoder_layers(model) is model.model.layers
    keep_layers(model, [], family)
    assert all(is_absent(layer) for layer in decoder(model).layers)
    with pytest.raises(SpecframeError, match="decoder layer 0"):
        capture_features(model, torch.tensor([[1, 2, 3]]), FeatureSpec(aux_layers=(1,), final_hidden=True))


def test_a_model_without_decoder_layers_is_named():
    from specframe.target_head import decoder, find_decoder
    from specframe.targets import decoder_layers

    class Bare(torch.nn.Module):
        pass

    assert find_decoder(Bare()) is None and decoder_layers(Bare()) is None
    with pytest.raises(SpecframeError, match="Bare: cannot find the decoder layers"):
        decoder(Bare())
