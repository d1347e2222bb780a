"""Import of the ecosystem's drafter folders (speculators EAGLE-3 / P-EAGLE, SafeAILab and SpecForge EAGLE-3, PARD)
into specframe's drafter plugins, the refusals, and the export -> import -> export round trip. No vLLM (fast)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from specframe import plugins
from specframe.drafter_folders import load_drafter
from specframe.errors import SpecframeError
from specframe.layouts import export, imports
from tests.vllm_fixtures import AUX, build_target, eagle3_weights, mask_token, target_parts

DRAFT_VOCAB = 160


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = build_target(tmp_path_factory.mktemp("target") / "t")
    config, tok = target_parts(path)
    return SimpleNamespace(path=path, config=config, tok=tok)


def trained(kind: str, target) -> object:
    """A drafter plugin with random weights, a reduced draft vocabulary and its mask token set (as after training)."""
    cls = plugins.get("drafter", kind)
    options = {"eagle3": dict(layers=1, aux_layer_ids=AUX, draft_vocab_size=DRAFT_VOCAB),
               "peagle": dict(layers=2, aux_layer_ids=AUX, draft_vocab_size=DRAFT_VOCAB),
               "pard": dict(layers=2, init_from_target=False)}[kind]
    torch.manual_seed(0)
    drafter = cls(target.config, cls.Options(**options))
    if kind != "pard":
        drafter.model.set_draft_vocab(torch.arange(0, 2 * DRAFT_VOCAB, 2))
    if kind == "peagle":
        torch.nn.init.normal_(drafter.model.mask_hidden, std=0.1)
    if kind in ("peagle", "pard"):
        drafter.mask_token_id = mask_token(target.tok)
    return drafter


def tensors_bytes(folder: Path) -> dict[str, bytes]:
    return {k: v.numpy().tobytes() for k, v in load_file(str(folder / "model.safetensors")).items()}


@pytest.mark.parametrize("kind", ["eagle3", "peagle", "pard"])
def test_export_import_export_round_trip_is_byte_identical(target, tmp_path, kind):
    first = tmp_path / "first"
    trained(kind, target).export_vllm(first, target.tok)
    drafter = load_drafter(first, target.config, target.tok)
    assert drafter.name == kind
    second = tmp_path / "second"
    drafter.export_vllm(second, target.tok)
    assert tensors_bytes(first) == tensors_bytes(second)
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
    assert (first / "config.json").read_text() == (second / "config.json").read_text()
    if kind != "pard":
        assert export.read_manifest(second).verifier == str(target.path.resolve())


def test_imported_drafter_drafts_like_the_original(target, tmp_path):
    original = trained("peagle", target)
    original.export_vllm(tmp_path / "pe", target.tok)
    copy = load_drafter(tmp_path / "pe", target.config, target.tok)
    assert copy.mask_token_id == original.mask_token_id
    prompt = torch.tensor(target.tok("The quick brown fox")["input_ids"])
    aux = torch.randn(len(prompt), 3 * target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    drafts = []
    for d in (original, copy):
        d.module().eval()
        d.start(prompt, {"aux_hidden": aux})
        d.accept(torch.tensor([5]), {"aux_hidden": aux[-1:]})
        drafts.append(d.propose(4).tokens.tolist())
    assert drafts[0] == drafts[1]


def _flat_eagle3(target, folder: Path, *, specforge: bool) -> dict[str, torch.Tensor]:
    """An EAGLE-3 folder as SafeAILab/EAGLE (``specforge`` False: no aux ids, no embedding) or SpecForge (aux ids
    under ``eagle_config``, embedding saved) write it: flat LlamaForCausalLMEagle3 config, ``midlayer.*`` names."""
    folder.mkdir()
    w = eagle3_weights(target.config, 1, DRAFT_VOCAB)
    w = {k.replace("layers.0.", "midlayer."): v for k, v in w.items()}
    w["t2d"] = torch.zeros(target.config.vocab_size, dtype=torch.bool)
    w["t2d"][torch.arange(DRAFT_VOCAB) + w["d2t"]] = True
    cfg = {**target.config.to_dict(), "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
           "draft_vocab_size": DRAFT_VOCAB}
    if specforge:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": AUX, "use_aux_hidden_state": True}
    else:
        del w["embed_tokens.weight"]
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(w, str(folder / "model.safetensors"))
    return w


@pytest.mark.parametrize("specforge", [False, True], ids=["safeailab", "specforge"])
def test_safeailab_and_specforge_eagle3_folders_import(target, tmp_path, specforge):
    w = _flat_eagle3(target, tmp_path / "e", specforge=specforge)
    imported = imports.read(tmp_path / "e", target.config)
    assert (imported.format, imported.layout, imported.aux_layer_ids) == ("eagle3-flat", "eagle3", AUX)
    drafter = load_drafter(tmp_path / "e", target.config, target.tok)
    state = drafter.model.state_dict()
    assert torch.equal(state["layers.0.hidden_norm.weight"], w["midlayer.hidden_norm.weight"])
    assert torch.equal(state["layers.0.self_attn.q_proj.weight"], w["midlayer.self_attn.q_proj.weight"])
    assert torch.equal(state["d2t"], w["d2t"]) and torch.equal(state["fc.weight"], w["fc.weight"])
    target_embedding = load_file(str(target.path / "model.safetensors"))["model.embed_tokens.weight"]
    expected = w["embed_tokens.weight"] if specforge else target_embedding  # without one, the target's (as vLLM)
    assert torch.equal(state["embed_tokens.weight"], expected)
    # and it exports in the speculators format
    manifest = drafter.export_vllm(tmp_path / "out", target.tok)
    assert manifest["layout"] == "eagle3" and manifest["verifier"] == str(target.path.resolve())


@pytest.fixture(scope="module")
def exported(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("exports")
    for kind in ("eagle3", "peagle", "pard"):
        trained(kind, target).export_vllm(root / kind, target.tok)
    return root


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_wrong_hidden_size_is_named(exported, tmp_path):
    from specframe.targets import tiny_target

    other = tiny_target(tmp_path / "narrow", vocab=320, layers=4, hidden=32, heads=4, kv_heads=2, seed=0)
    config, _ = target_parts(other)
    with pytest.raises(SpecframeError, match="target_hidden_size 64 differs from the target's hidden size 32"):
        imports.read(exported / "eagle3", config)
    with pytest.raises(SpecframeError, match="hidden_size 64 differs from the target's 32"):
        load_drafter(exported / "pard", config)


def test_missing_tensor_is_named(exported, target, tmp_path):
    folder = _copy(exported / "peagle", tmp_path / "pe")
    w = load_file(str(folder / "model.safetensors"))
    del w["layers.1.mlp.up_proj.weight"]
    save_file(w, str(folder / "model.safetensors"))
    with pytest.raises(SpecframeError, match=r"cannot import .*pe: missing weight 'layers.1.mlp.up_proj.weight'"):
        load_drafter(folder, target.config, target.tok)


def test_another_tokenizer_is_refused(exported, tmp_path):
    from specframe.targets import tiny_target

    # same sizes and vocabulary size, but one more special token shifts every id
    other = tiny_target(tmp_path / "other", vocab=320, layers=4, hidden=64, heads=2, kv_heads=1, intermediate=128,
                        spare_special=5, seed=0)
    config, tok = target_parts(other)
    with pytest.raises(SpecframeError, match="tokenizer: its saved tokenizer is not the target's"):
        load_drafter(exported / "eagle3", config, tok)


def test_other_refusals_name_the_field(exported, target, tmp_path):
    pe = _copy(exported / "peagle", tmp_path / "pe")
    cfg = json.loads((pe / "config.json").read_text())
    cfg["norm_before_residual"] = True
    (pe / "config.json").write_text(json.dumps(cfg))
    # speculators' trainer default: imported as the drafter option, and refused to a drafter built without it
    assert imports.read(pe, target.config).architecture["norm_before_residual"] is True
    peagle = plugins.get("drafter", "peagle")
    plain = peagle(target.config, peagle.Options(layers=2, aux_layer_ids=AUX, draft_vocab_size=DRAFT_VOCAB))
    with pytest.raises(SpecframeError, match="its norm_before_residual is True, this peagle drafter's is False"):
        imports.warm_start(plain, pe, target.config)
    pickled = _copy(exported / "eagle3", tmp_path / "pk")
    torch.save({}, pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()  # the weights are the pickle (a SafeAILab folder)
    with pytest.raises(SpecframeError, match="pickle"):
        imports.read(pickled)
    with pytest.raises(SpecframeError, match="not a drafter folder specframe imports"):
        imports.read(target.path)
    # a drafter built with other options refuses the folder by field (train --init-from)
    cls = plugins.get("drafter", "eagle3")
    other = cls(target.config, cls.Options(layers=2, aux_layer_ids=AUX, draft_vocab_size=DRAFT_VOCAB))
    with pytest.raises(SpecframeError, match=r"its layers is 1, this eagle3 drafter's is 2 \(set drafter.layers"):
        other.import_weights(imports.read(exported / "eagle3", target.config))
    with pytest.raises(SpecframeError, match="it holds a peagle drafter, not eagle3"):
        other.import_weights(imports.read(exported / "peagle", target.config))


# ------------------------------------------------------------------------------------ train --init-from, export


def test_train_init_from_a_speculators_export_warm_starts(tmp_path):
    from click.testing import CliRunner

    from specframe.cli import main
    from tests.train_fixtures import build

    tgt, chat = build(tmp_path)
    cfg = tmp_path / "small.toml"
    cfg.write_text("[drafter]\nlayers = 2\ndraft_vocab_size = 100\nk_train = 3\n")

    def run(*args):
        result = CliRunner().invoke(main, list(map(str, args)))
        return result.exit_code, result.output

    def train(out, *extra):
        return run("train", "--drafter", "peagle", "--target", tgt, "--data", chat, "--seq-len", 48, "--output", out,
                   "--mask-builder", "dense", "--json", *extra)

    code, text = train(tmp_path / "a", "--config", cfg, "--max-steps", 2, "--lr", 1e-2)
    assert code == 0, text
    code, text = run("export", "--checkpoint", tmp_path / "a", "--output", tmp_path / "e", "--k", 4, "--json")
    assert code == 0, text
    manifest = json.loads(text)
    assert (manifest["layout"], manifest["verifier"], manifest["speculative_tokens"]) == ("peagle", str(tgt.resolve()), 4)
    exported = load_file(str(tmp_path / "e" / "model.safetensors"))
    # generate and bench acceptance read the folder like a checkpoint (target: the verifier it names)
    prompt = "the quick brown fox jumps over the lazy dog"
    outs = []
    for source in (tmp_path / "a", tmp_path / "e"):
        code, text = run("generate", "--checkpoint", source, "--prompt", prompt, "--k", 3, "--max-new-tokens", 12,
                         "--json")
        assert code == 0, text
        outs.append(json.loads(text[text.index("{"):]))
    assert outs[0]["tokens"] == outs[1]["tokens"] and outs[1]["drafter"] == "peagle"
    assert outs[0]["acceptance_length"] == outs[1]["acceptance_length"] and outs[1]["target"] == outs[0]["target"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": prompt}]}) + "\n")
    code, text = run("bench", "acceptance", "--checkpoint", tmp_path / "e", "--dataset", prompts, "--num-prompts", 1,
                     "--max-new-tokens", 8, "--output", tmp_path / "bench.json", "--json")
    assert code == 0, text
    assert json.loads(text[text.index("{"):])["methods"]["peagle/k4"]["lossless"] is True
    # a tiny learning rate: after one step the weights are still the imported ones
    code, text = train(tmp_path / "b", "--config", cfg, "--max-steps", 1, "--lr", 1e-12, "--init-from", tmp_path / "e")
    assert code == 0, text
    warm = load_file(str(tmp_path / "b" / "step-00000001" / "model.safetensors"))
    assert json.loads((tmp_path / "b" / "config.json").read_text())["init_from"] == str(tmp_path / "e")
    for name in ("fc.weight", "layers.1.mlp.up_proj.weight", "mask_hidden", "lm_head.weight", "d2t"):
        assert torch.allclose(warm[name].float(), exported[name].float(), atol=1e-6), name
    # another depth in the run's options: one error naming the field
    other = tmp_path / "other.toml"
    other.write_text("[drafter]\nlayers = 3\ndraft_vocab_size = 100\nk_train = 3\n")
    code, text = train(tmp_path / "c", "--config", other, "--max-steps", 1, "--init-from", tmp_path / "e")
    assert code != 0 and "its layers is 2, this peagle drafter's is 3 (set drafter.layers to match)" in text
    code, text = run("train", "--drafter", "eagle3", "--target", tgt, "--data", chat, "--output", tmp_path / "d",
                     "--max-steps", 1, "--init-from", tmp_path / "e")
    assert code != 0 and "holds a peagle drafter, and this run trains 'eagle3'" in text
    # the export of an imported folder is the same folder (the round trip through the CLI)
    code, text = run("export", "--checkpoint", tmp_path / "e", "--output", tmp_path / "e2")
    assert code == 0, text
    assert (tmp_path / "e2" / "model.safetensors").read_bytes() == (tmp_path / "e" / "model.safetensors").read_bytes()
    assert (tmp_path / "e2" / "config.json").read_text() == (tmp_path / "e" / "config.json").read_text()


# ------------------------------------------------------------------------------------------------ ParallelSpec


def test_parallelspec_slot_inputs_give_each_mask_its_own_embedding_and_the_anchor_state():
    """What specframe's vLLM plugin model does to vLLM's flattened parallel-drafting batch: per request
    [tokens | bonus | mask x (k-1) | rejected padding]."""
    from specframe.vllm.vllm_plugin import slot_inputs

    M = 99
    ids = torch.tensor([5, 6, M, M, M, 0, 7, 8, M, M])
    hidden = torch.arange(10.0)[:, None].repeat(1, 4)
    embeds = -torch.arange(10.0)[:, None].repeat(1, 4)
    masks = torch.tensor([[100.0] * 4, [200.0] * 4, [300.0] * 4])
    e, h = slot_inputs(ids, hidden, embeds, M, masks)
    assert e[:, 0].tolist() == [0, -1, 100, 200, 300, -5, -6, -7, 100, 200]
    assert h[:, 0].tolist() == [0, 1, 1, 1, 1, 5, 6, 7, 7, 7]


class _Registry:
    """vLLM's ModelRegistry as the general plugin sees it (the real one needs vLLM imported: ~20 s)."""

    def __init__(self, fail: Exception | None = None):
        self.models, self.fail = {}, fail

    def get_supported_archs(self):
        return self.models.keys()

    def register_model(self, arch, cls):
        if self.fail is not None:
            raise self.fail
        self.models[arch] = cls


@pytest.fixture
def plugin(monkeypatch):
    """specframe.vllm.vllm_plugin with a fake ``vllm`` (its ModelRegistry) and vLLM's EAGLE-3 model module
    unimportable, as on a vLLM whose model code moved; registration state reset."""
    import sys

    from specframe.vllm import vllm_plugin

    registry = _Registry()
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(ModelRegistry=registry))
    monkeypatch.setitem(sys.modules, "vllm.model_executor.models.llama_eagle3", None)  # import raises ImportError
    monkeypatch.setattr(vllm_plugin, "_registered", False)
    return SimpleNamespace(module=vllm_plugin, registry=registry)


def test_vllm_plugin_registers_lazily_and_a_broken_model_import_does_not_reach_register(plugin):
    """vLLM calls the general plugin unguarded in every process: register() imports no vLLM model code, it only
    names the class (GPU-path review item 8)."""
    plugin.module.register()
    assert dict(plugin.registry.models) == {"ParallelSpecLlamaForCausalLMEagle3":
                                            "specframe.vllm.vllm_plugin:ParallelSpecLlamaForCausalLMEagle3"}
    # where vLLM does load the drafter, the broken import surfaces there, for ParallelSpec only
    with pytest.raises(ImportError):
        getattr(plugin.module, plugin.module.ARCHITECTURE)


def test_vllm_plugin_register_only_warns_when_vllm_refuses(plugin, caplog):
    plugin.registry.fail = TypeError("register_model() changed")
    with caplog.at_level("WARNING", logger="specframe.vllm.vllm_plugin"):
        plugin.module.register()  # does not raise
    assert "could not register its vLLM model ParallelSpecLlamaForCausalLMEagle3" in caplog.text
    assert "TypeError: register_model() changed" in caplog.text
    assert not plugin.module._registered  # a later call tries again


def _plugin_model(monkeypatch, masks: int, mask_token_id: int):
    """specframe's vLLM plugin model built on a stand-in for vLLM's Eagle3LlamaForCausalLM whose inner model returns
    the embeddings and hidden states it is given (what the plugin's forward adds is all that is under test)."""
    import sys
    from types import ModuleType

    from specframe.vllm import vllm_plugin

    class Inner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(128, 4)

        def embed_input_ids(self, input_ids):
            return self.embed_tokens(input_ids)

        def forward(self, input_ids, positions, hidden_states, input_embeds=None):
            return input_embeds, hidden_states

    class Eagle3LlamaForCausalLM(torch.nn.Module):
        def __init__(self, *, vllm_config, prefix=""):
            super().__init__()
            self.config, self.model = vllm_config, Inner()

    fake = ModuleType("vllm.model_executor.models.llama_eagle3")
    fake.Eagle3LlamaForCausalLM = Eagle3LlamaForCausalLM
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    config = SimpleNamespace(parallelspec_num_masks=masks, pard_token=mask_token_id, hidden_size=4)
    model = vllm_plugin._build_model_class()(vllm_config=config)
    with torch.no_grad():
        model.model.mask_embeddings.copy_(torch.tensor([[100.0] * 4, [200.0] * 4]))
    return model


def test_parallelspec_vllm_model_refuses_inputs_embeds_without_ids_and_substitutes_given_embeds(monkeypatch):
    """vLLM's multimodal-embeddings path passes inputs_embeds and no ids: the mask slots cannot be found, so the
    model refuses rather than draft silently as P-EAGLE with a zero mask_hidden (GPU-path review item 12)."""
    M = 99
    model = _plugin_model(monkeypatch, masks=2, mask_token_id=M)
    assert model.supports_multimodal_embeddings is False  # vLLM then takes the token-id path
    ids = torch.tensor([5, 6, M, M, 0])
    hidden = torch.arange(5.0)[:, None].repeat(1, 4)
    embeds = -torch.arange(5.0)[:, None].repeat(1, 4)
    with pytest.raises(ValueError, match="needs input_ids to find its parallel-drafting mask slots"):
        model(None, torch.arange(5), hidden, embeds)
    # embeddings given with the ids: the slots are still substituted
    e, h = model(ids, torch.arange(5), hidden, embeds)
    assert e[:, 0].tolist() == [0, -1, 100, 200, -4] and h[:, 0].tolist() == [0, 1, 1, 1, 4]
    # ids only (vLLM's text path): the model's own embedding, then the same substitution
    e, h = model(ids, torch.arange(5), hidden)
    assert torch.equal(e[[0, 1, 4]], model.model.embed_tokens(ids[[0, 1, 4]]))
    assert e[2:4, 0].tolist() == [100, 200] and h[:, 0].tolist() == [0, 1, 1, 1, 4]


def test_parallelspec_export_round_trips_and_refuses_the_standalone_backbone(target, tmp_path):
    cls = plugins.get("drafter", "parallelspec")
    torch.manual_seed(0)
    drafter = cls(target.config, cls.Options(layers=1, aux_layer_ids=AUX, draft_vocab_size=DRAFT_VOCAB, k_train=4))
    drafter.mask_token_ids = [3, 4, 5]
    drafter.model.set_draft_vocab(torch.arange(0, 2 * DRAFT_VOCAB, 2))
    manifest = drafter.export_vllm(tmp_path / "ps", target.tok)
    assert (manifest["layout"], manifest["method"], manifest["parallel_drafting"]) == ("parallelspec", "eagle3", True)
    cfg = json.loads((tmp_path / "ps" / "config.json").read_text())
    assert cfg["architectures"] == [export.PARALLELSPEC_ARCHITECTURE] and cfg["pard_token"] == 3
    assert cfg["parallelspec_num_masks"] == 3
    assert export.speculative_config(tmp_path / "ps", 4)["parallel_drafting"] is True
    with pytest.raises(SpecframeError, match="at most 4 tokens per step"):
        export.speculative_config(tmp_path / "ps", 5)
    copy = load_drafter(tmp_path / "ps", target.config, target.tok)
    assert copy.mask_token_ids == [3, 4, 5]
    copy.export_vllm(tmp_path / "ps2", target.tok)
    assert (tmp_path / "ps" / "model.safetensors").read_bytes() == (tmp_path / "ps2" / "model.safetensors").read_bytes()
    standalone = cls(target.config, cls.Options(backbone="standalone", layers=1, draft_vocab_size=DRAFT_VOCAB))
    standalone.mask_token_ids = [3, 4, 5, 6]
    with pytest.raises(SpecframeError, match="backbone 'standalone' cannot be exported to vLLM"):
        standalone.export_vllm(tmp_path / "st", target.tok)
