"""speculators 0.9.0's folders in its trainer's DEFAULT architectures (issue 54, item 4), written by its own classes
for the tiny target, import into specframe, compute what speculators' own model computes, decode losslessly, train
further and export for vLLM:

- P-EAGLE: Qwen3 layers (per-head q / k norms), ``norm_before_residual``, every layer ``sliding_attention``;
- EAGLE-3: EAGLE 3.1's ``norm_before_fc`` and ``norm_output``, ``norm_before_residual``, every layer sliding;
- the window is 5 here (speculators' default is 2048) so that it binds on these short sequences;
- the folder is a checkpoint as its trainer saves one: ``model.safetensors`` (bf16) beside ``optimizer_state_dict.pt``
  and ``scheduler_state_dict.pt``, pickles that are named in one line and never opened (these ones would fail the
  test if they were).

Where speculators' EAGLE-3 trainer and vLLM differ, specframe follows vLLM: at training-time-test step s >= 1
speculators windows the context from the anchor a, (a - W, a], while vLLM drafts step s at position a + s over
(a + s - W, a + s]; the parity below compares every step where both agree (step 0, and the steps no window cuts).
No vLLM engine starts: vLLM 0.32's own speculators config readers (``update_eagle3`` / ``update_peagle``, run from
their source file) and transformers' config classes are checked to build the same network from the export."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import torch

pytest.importorskip("speculators", reason="speculators 0.9.0 is not importable; `make setup` installs it "
                    "(pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0, plus openai and loguru)")

from safetensors.torch import load_file  # noqa: E402

from specframe import plugins  # noqa: E402
from specframe.drafter_folders import load_drafter  # noqa: E402
from specframe.errors import SpecframeError  # noqa: E402
from specframe.layouts import imports  # noqa: E402
from tests.vllm_integration.test_speculators_client import (  # noqa: E402,F401
    AUX,
    CLASSES,
    DRAFT_VOCAB,
    LAYERS,
    _perturb,
    assert_same_drafts,
    cli,
    compare_eagle3,
    compare_peagle,
    inputs,
    load_speculators,
    loading_report,
    target,
)

WINDOW = 5
#: speculators 0.9.0's trainer defaults per layout (train/config/schema.py: draft_arch qwen3 for peagle, llama for
#: eagle3; norm_before_residual True; norm_before_fc / norm_output True for eagle3 only; every layer sliding)
DEFAULTS = {
    "peagle": {"draft_arch": "qwen3", "norm_before_residual": True, "norm_before_fc": False, "norm_output": False},
    "eagle3": {"draft_arch": "llama", "norm_before_residual": True, "norm_before_fc": True, "norm_output": True},
}
#: the drafter options a folder of each layout imports as
OPTIONS = {
    "peagle": {"qk_norm": True, "norm_before_residual": True, "norm_before_fc": False, "sliding_window": WINDOW},
    "eagle3": {"qk_norm": False, "norm_before_residual": True, "norm_before_fc": True, "norm_output": True,
               "sliding_window": WINDOW},
}
KINDS = ["peagle", "eagle3"]


class _Trap:
    """A pickle whose loading fails the test: the trainer-state files must never be opened."""

    def __reduce__(self):
        return (_unpickled, ())


def _unpickled():  # pragma: no cover - runs only if a pickle is opened
    raise AssertionError("a trainer-state pickle was opened")


def default_folder(kind: str, target, out: Path, seed: int = 3) -> Path:
    """The checkpoint folder speculators' trainer writes at its defaults (its ``create_transformer_layer_config`` with
    no ``--full-attention-indices``, ``from_training_args``, ``save_pretrained`` in bf16) plus its trainer-state
    pickles. Weights spread out, so a misplaced norm shows in the logits."""
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    flags = dict(DEFAULTS[kind])
    layer = create_transformer_layer_config(
        verifier_name_or_path=str(target.path), num_layers=LAYERS, draft_arch=flags.pop("draft_arch"),
        hidden_act=None, sliding_window=WINDOW, full_attention_indices=[])
    layer._attn_implementation = "eager"
    vocab = target.config.vocab_size
    d2t, t2d = build_vocab_mappings_from_distribution({t: 1000 - t for t in range(7, vocab, 2)}, DRAFT_VOCAB, vocab)
    args = {"verifier_name_or_path": str(target.path), "draft_vocab_size": DRAFT_VOCAB, "target_layer_ids": AUX,
            "draft_attn_impl": "eager", "fc_norm": False, "ttt_steps": 3, "mask_token_id": target.mask,
            "num_depths": 4, **flags}
    torch.manual_seed(seed)
    model = CLASSES[kind][1].from_training_args(verifier_config=layer, t2d=t2d, d2t=d2t, **args)
    _perturb(model, seed, skip=("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                                "verifier_norm.weight"))
    model.to(torch.bfloat16).save_pretrained(out)
    for name in ("optimizer_state_dict.pt", "scheduler_state_dict.pt"):
        torch.save({"state": _Trap()}, out / name)
    return out


@pytest.fixture(scope="module")
def folders(target):
    root = target.root / "speculators-defaults"
    return {kind: default_folder(kind, target, root / kind) for kind in KINDS}


def test_the_fixture_is_speculators_default_architecture(folders):
    """What the tests below rely on: speculators' own config says Qwen3 layers for P-EAGLE, the EAGLE 3.1 norms for
    EAGLE-3, norm_before_residual, and a window on every layer, and its model applies it."""
    for kind, folder in folders.items():
        cfg = json.loads((folder / "config.json").read_text())
        layer = cfg["transformer_layer_config"]
        assert layer["model_type"] == ("qwen3" if kind == "peagle" else "llama")
        assert layer["layer_types"] == ["sliding_attention"] * LAYERS and layer["sliding_window"] == WINDOW
        assert cfg["norm_before_residual"] is True
        assert cfg["norm_before_fc"] is cfg["norm_output"] is (kind == "eagle3")
        assert load_speculators(kind, folder).sliding_window_indices == list(range(LAYERS))
        assert sorted(p.name for p in folder.glob("*.pt")) == ["optimizer_state_dict.pt", "scheduler_state_dict.pt"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_default_folder_imports_with_its_architecture_and_names_the_pickles_it_leaves_unread(
        folders, target, kind, capsys):
    folder = folders[kind]
    drafter = load_drafter(folder, target.config, target.tok)
    note = capsys.readouterr().err
    assert (f"note: {folder}: left unread (pickles, never opened; the drafter's weights are the safetensors): "
            "optimizer_state_dict.pt, scheduler_state_dict.pt") in note
    assert drafter.name == kind
    assert {k: getattr(drafter.options, k) for k in OPTIONS[kind]} == OPTIONS[kind]
    state, written = drafter.module().state_dict(), load_file(str(folder / "model.safetensors"))
    assert all(torch.equal(state[k], v.to(state[k].dtype)) for k, v in written.items())
    if kind == "peagle":
        assert "layers.0.self_attn.q_norm.weight" in written and "layers.1.self_attn.k_norm.weight" in written
    else:
        assert "input_norm.weight" in written


def test_specframe_computes_what_speculators_p_eagle_computes_at_its_defaults(folders, target, monkeypatch):
    """Every (anchor, depth) element of speculators' P-EAGLE forward (its qwen3 layers, norm_before_residual, its
    windowed mask) against specframe's drafting of it; the window binds for anchors >= 5."""
    folder = folders["peagle"]
    drafter = load_drafter(folder, target.config, target.tok)
    drafter.module().eval()
    model = load_speculators("peagle", folder)
    x, aux = inputs(target, 12, len(AUX) * target.hidden)
    rows = compare_peagle(drafter, model, x, aux, monkeypatch)
    assert max(r[0] for r in rows) >= WINDOW  # some anchors lie past the window
    assert_same_drafts(rows)


def test_specframe_computes_what_speculators_eagle3_computes_at_its_defaults(folders, target):
    """speculators' EAGLE-3 training-time-test forward (norm_before_fc, norm_output feeding step s + 1 the normed
    state, norm_before_residual, the window) against specframe's drafting, at every anchor for step 0 (the window
    binds from anchor 5) and at every step no window cuts (see the module docstring)."""
    folder = folders["eagle3"]
    drafter = load_drafter(folder, target.config, target.tok)
    drafter.module().eval()
    model = load_speculators("eagle3", folder)
    x, aux = inputs(target, 12, len(AUX) * target.hidden)
    rows = [r for r in compare_eagle3(drafter, model, x, aux) if r[1] == 0 or r[0] + r[1] < WINDOW]
    assert {r[1] for r in rows} == {0, 1, 2} and max(r[0] for r in rows if r[1] == 0) >= WINDOW
    assert_same_drafts(rows)


@pytest.mark.parametrize("kind", KINDS)
def test_a_default_folder_decodes_losslessly(folders, target, kind):
    """Greedy speculative decoding with the imported drafter emits plain greedy decoding's tokens, over a context
    long enough (12 + 20 tokens) that the window binds in drafting."""
    from specframe.inference.engine import generate
    from specframe.targets import load_target

    model = load_target(target.path).model.eval()
    drafter = load_drafter(folders[kind], target.config, target.tok)
    drafter.module().eval()
    prompt = torch.randint(7, int(target.config.vocab_size), (12,), generator=torch.Generator().manual_seed(1))
    greedy = plugins.get("verifier", "greedy")()
    plain = generate(model, prompt, greedy, max_new_tokens=20, eos_token_id=())
    spec = generate(model, prompt, greedy, drafter, k=3, max_new_tokens=20, eos_token_id=())
    assert spec.tokens == plain.tokens and len(spec.rounds) < len(plain.tokens)


def _vllm_reader(kind: str):
    """vLLM 0.32's own speculators config reader for ``kind`` (update_eagle3 / update_peagle), run from its source
    file (it imports nothing), so no engine and no vLLM import is needed."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    path = Path(spec.submodule_search_locations[0]) / "transformers_utils" / "configs" / "speculators" / "algos.py"
    return runpy.run_path(str(path))["SUPPORTED_SPECULATORS_TYPES"][kind]


def vllm_builds(folder: Path) -> dict:
    """The config vLLM 0.32 builds the drafter from (its reader's output, as transformers' config class holds it)."""
    from transformers import AutoConfig

    cfg = json.loads((folder / "config.json").read_text())
    layer = dict(cfg["transformer_layer_config"])
    _vllm_reader(cfg["speculators_model_type"])(cfg, layer)
    fields = {k: v for k, v in layer.items() if k not in ("model_type",)}
    built = AutoConfig.for_model(layer["model_type"], **fields)
    return {"architectures": layer["architectures"], "layer_types": list(built.layer_types),
            "sliding_window": built.sliding_window, **{k: layer.get(k) for k in
                                                       ("norm_before_residual", "norm_before_fc", "norm_output")}}


@pytest.mark.parametrize("kind", KINDS)
def test_a_default_folder_trains_further_and_exports_what_vllm_builds_as_the_same_network(folders, target, kind,
                                                                                         tmp_path):
    """``train --init-from`` the folder (a run whose options leave out its architecture is refused, naming the
    option), a few steps with the window binding at --seq-len 48, then ``export``: speculators loads the export with
    no missing key; vLLM's reader builds the same architecture (Qwen3 / Llama, the norm flags, the window on every
    layer) from it as from speculators' own folder; and the export imports back into the same drafter."""
    folder = folders[kind]
    shape = f"layers = {LAYERS}\naux_layer_ids = {AUX}\ndraft_vocab_size = {DRAFT_VOCAB}\n"
    shape += "ttt_steps = 2\n" if kind == "eagle3" else "k_train = 2\n"
    arch = "".join(f"{k} = {json.dumps(v)}\n" for k, v in OPTIONS[kind].items())
    base = ["train", "--drafter", kind, "--target", target.path, "--data", target.chat, "--seq-len", 48,
            "--init-from", folder]
    (tmp_path / "bare.toml").write_text("[drafter]\n" + shape)
    code, text = cli(*base, "--output", tmp_path / "bare", "--config", tmp_path / "bare.toml", "--max-steps", 1)
    first = OPTIONS[kind]["qk_norm"] and "qk_norm" or "norm_before_residual"
    assert code != 0 and f"its {first} is True, this {kind} drafter's is False (set drafter.{first} to match)" in text
    (tmp_path / "run.toml").write_text("[drafter]\n" + shape + arch)
    code, text = cli(*base, "--output", tmp_path / "run", "--config", tmp_path / "run.toml", "--max-steps", 3,
                     "--lr", 1e-3)
    assert code == 0, text
    trained = load_file(str(tmp_path / "run" / "step-00000003" / "model.safetensors"))
    written = load_file(str(folder / "model.safetensors"))
    assert set(written) <= set(trained)
    assert not torch.equal(trained["fc.weight"], written["fc.weight"].float())  # it trained
    code, text = cli("export", "--checkpoint", tmp_path / "run", "--output", tmp_path / "export")
    assert code == 0, text
    export = tmp_path / "export"
    assert loading_report(kind, export)["missing_keys"] == set()
    assert load_speculators(kind, export).sliding_window_indices == list(range(LAYERS))
    assert vllm_builds(export) == vllm_builds(folder)
    assert vllm_builds(export)["layer_types"] == ["sliding_attention"] * LAYERS
    back = load_drafter(export, target.config, target.tok)
    assert {k: getattr(back.options, k) for k in OPTIONS[kind]} == OPTIONS[kind]
    state = back.module().state_dict()
    assert all(torch.equal(state[k].float(), v.float()) for k, v in trained.items() if k in state)


def test_what_vllm_cannot_build_or_specframe_cannot_compute_is_refused_by_name(folders, target, tmp_path):
    """A window on only some layers (specframe's window is every layer's), fc_norm (per-aux-state norms), and a
    P-EAGLE export with norm_output (vLLM's peagle reader does not take it): one line each, nothing written."""
    import shutil

    folder = tmp_path / "mixed"
    shutil.copytree(folders["peagle"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["transformer_layer_config"]["layer_types"] = ["full_attention", "sliding_attention"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecframeError, match=rf"^cannot import {folder}: layer_types make drafter layers \[1\] of 2 "
                                             "sliding_attention \\(window 5\\) and the rest full attention"):
        imports.read(folder, target.config)
    cfg["transformer_layer_config"]["layer_types"] = ["sliding_attention"] * 2
    cfg["fc_norm"] = True
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecframeError, match=f"^cannot import {folder}: fc_norm is true"):
        imports.read(folder, target.config)
    drafter = load_drafter(folders["peagle"], target.config, target.tok)
    weights = {k: v.detach() for k, v in drafter.module().state_dict().items()}
    from specframe import api  # the writer as a plugin reaches it

    with pytest.raises(SpecframeError, match="^norm_output is true: a P-EAGLE drafter feeds no step forward"):
        api.vllm_layouts.write_peagle(
            tmp_path / "out", weights, config=api.vllm_layouts.llama_config(target.config, LAYERS),
            aux_layer_ids=AUX, target_hidden_size=target.hidden, mask_token_id=target.mask,
            architecture={**drafter.model.architecture.export_fields(), "norm_output": True})
    assert not (tmp_path / "out").exists()
