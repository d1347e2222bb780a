"""speculators 0.9.0 (vllm-project/speculators), installed beside specframe, as a client no one here wrote (issue 30
item 3), both ways:

- it reads every speculators-format export specframe writes (EAGLE-3, P-EAGLE, DFlash) through its own config and
  model classes, loads the weights with no missing or unexpected key, and its forward gives the drafter's logits to
  within 1e-5 and the same greedy proposals; its own trainer accepts them (``speculators train --from-pretrained
  EXPORT --dry-run``, slow);
- specframe imports the folders speculators writes (its config classes and ``save_pretrained`` on a model built as its
  trainer builds one, for the test's tiny target) for a matching drafter: ``load_drafter`` / ``warm_start``, and
  ``train --init-from``, ``generate --checkpoint`` and ``export`` through the CLI; the imported drafter gives the
  logits speculators' own model gives for the folder; only real differences are refused, one line naming the field
  (fc_norm, another activation, a window on some layers only); a sliding window is imported and exported, never
  dropped;
- the exports name their dtype ``dtype`` (transformers 5's name; ``torch_dtype`` is deprecated), which speculators and
  vLLM 0.32 read.

speculators is installed ``--no-deps`` (its torchvision / torchaudio requirements pull CUDA wheels) by ``make setup``;
without it this module is skipped with the reason. Logits are compared with speculators' ``eager`` attention (its
``--draft-attn-impl eager``), in fp32.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

try:
    import speculators  # noqa: F401
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig
except ImportError as e:  # pragma: no cover - depends on the environment
    pytest.skip(f"speculators 0.9.0 is not importable ({e}); `make setup` installs it (pip install --no-deps "
                "speculators==0.9.0 hs-connectors==0.9.0, plus openai and loguru)", allow_module_level=True)

from click.testing import CliRunner  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from specframe import plugins  # noqa: E402
from specframe.drafter_folders import load_drafter
from specframe.errors import SpecframeError  # noqa: E402
from specframe.layouts import export, imports  # noqa: E402
from tests.train_fixtures import build  # noqa: E402

AUX = [1, 2, 3]  # EAGLE-3 / P-EAGLE aux ids of the 4-layer target
DFLASH_AUX = [1, 3]
BLOCK = 4
DRAFT_VOCAB = 160
LAYERS = 2
TOL = 1e-5
#: (config class, model class) speculators reads each layout with
CLASSES = {"eagle3": (Eagle3SpeculatorConfig, Eagle3DraftModel), "peagle": (PEagleSpeculatorConfig, PEagleDraftModel),
           "dflash": (DFlashSpeculatorConfig, DFlashDraftModel)}
#: what a speculators model holds that the folder does not (the verifier's own head and norm, loaded from it)
VERIFIER_OWNED = {"verifier_lm_head.weight", "verifier_norm.weight"}

try:
    import importlib.metadata

    importlib.metadata.distribution("specframe-dflash")
    KINDS = ["eagle3", "peagle", "dflash"]
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - depends on the environment
    KINDS = ["eagle3", "peagle", pytest.param("dflash", marks=pytest.mark.skip(
        reason="the specframe-dflash distribution is not installed (pip install --no-deps -e packages/specframe-dflash)"))]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from transformers import AutoConfig, AutoTokenizer

    root = tmp_path_factory.mktemp("speculators")
    path, chat = build(root)
    tok = AutoTokenizer.from_pretrained(path)
    return SimpleNamespace(path=path, chat=chat, root=root, config=AutoConfig.from_pretrained(path), tok=tok,
                           mask=int(tok.convert_tokens_to_ids("<|reserved_0|>")),
                           hidden=AutoConfig.from_pretrained(path).hidden_size)


def _perturb(module: torch.nn.Module, seed: int, skip: tuple[str, ...] = ()) -> None:
    """Random weights far from their init (norms included), so logits are spread and a name or wiring mix-up shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.is_floating_point() and name not in skip:
                p.add_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * 0.1)


def specframe_drafter(kind: str, target) -> object:
    """A specframe drafter as after training (reduced draft vocabulary, mask token), weights spread out."""
    torch.manual_seed(0)
    cls = plugins.get("drafter", kind)
    options = {"eagle3": dict(layers=LAYERS, aux_layer_ids=AUX, draft_vocab_size=DRAFT_VOCAB),
               "peagle": dict(layers=LAYERS, aux_layer_ids=AUX, draft_vocab_size=DRAFT_VOCAB),
               "dflash": dict(layers=LAYERS, block_size=BLOCK, aux_layer_ids=DFLASH_AUX)}[kind]
    drafter = cls(target.config, cls.Options(**options))
    # DFlash shares the target's embedding and head (prepare copies them; vLLM and speculators take the target's)
    _perturb(drafter.module(), seed=1, skip=("embed_tokens.weight", "lm_head.weight") if kind == "dflash" else ())
    if kind == "dflash":
        with torch.no_grad():
            drafter.model.embed_tokens.weight.copy_(imports.target_embedding(target.config))
            drafter.model.lm_head.weight.copy_(imports.target_lm_head(target.config))
    else:
        drafter.model.set_draft_vocab(torch.arange(0, 2 * DRAFT_VOCAB, 2))
    if kind != "eagle3":
        drafter.mask_token_id = target.mask
    drafter.module().eval()
    return drafter


@pytest.fixture(scope="module")
def exports(target):
    root = target.root / "exports"
    out = {}
    for kind in ("eagle3", "peagle", "dflash"):
        if kind == "dflash" and "dflash" not in KINDS:
            continue
        drafter = specframe_drafter(kind, target)
        drafter.export_vllm(root / kind, target.tok)
        out[kind] = SimpleNamespace(folder=root / kind, drafter=drafter)
    return out


# ------------------------------------------------------------------------------------------- speculators' side


def load_speculators(kind: str, folder: Path, dtype: torch.dtype = torch.float32):
    """speculators' model of ``folder`` (its ``from_pretrained``: the folder's weights plus the verifier's), with its
    eager attention, loaded in ``dtype`` (a bf16 folder would otherwise round the verifier's fp32 embedding and head
    that it loads into the model to bf16)."""
    config_cls, model_cls = CLASSES[kind]
    config = config_cls.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "eager"
    return model_cls.from_pretrained(folder, config=config, dtype=dtype).eval()


def loading_report(kind: str, folder: Path) -> dict:
    """transformers' loading report of the same load (speculators' ``from_pretrained`` returns the model only)."""
    from speculators.model import SpeculatorModel

    config_cls, model_cls = CLASSES[kind]
    config = config_cls.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "eager"
    _, info = super(SpeculatorModel, model_cls).from_pretrained(folder, config=config, output_loading_info=True)
    return info


class Logits:
    """Collects what a module (an ``lm_head``) returns while it is registered."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.out: list[torch.Tensor] = []
        self._handle = module.register_forward_hook(lambda m, i, o: self.out.append(o.detach().float().clone()))

    def __enter__(self) -> list[torch.Tensor]:
        return self.out

    def __exit__(self, *exc) -> None:
        self._handle.remove()


def inputs(target, n: int, width: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """n + 1 token ids (7.. avoids the special tokens) and n rows of aux features of ``width``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(7, target.config.vocab_size, (n + 1,), generator=g), torch.randn(n, width, generator=g)


def _greedy(logits: torch.Tensor) -> tuple[int, float]:
    top = torch.topk(logits, 2)
    return int(top.indices[0]), float(top.values[0] - top.values[1])


def compare_eagle3(drafter, model, x: torch.Tensor, aux: torch.Tensor, k: int = 3) -> list[tuple]:
    """For every anchor: specframe's ``propose(k)`` (its lm_head outputs per draft step) against speculators'
    training-time-test forward, run greedily: step s at index a reads the token drafted at step s - 1 (teacher
    forcing on speculators' own proposals) and its own previous pre-norm state, at rotary position a + s, as vLLM
    drafts. Returns (anchor, step, max |logit difference|, our token, their token, our top-2 gap) rows."""
    rows = []
    n = aux.shape[0]
    for a in range(1, n - 1):
        with Logits(drafter.model.lm_head) as ours:
            drafter.start(x[: a + 2], {"aux_hidden": aux[: a + 1]})
            drafter.propose(k)
        proposed: list[int] = []
        for s in range(k):
            ids = torch.cat([x[1 : a + 2], torch.tensor(proposed, dtype=torch.long)])
            length = ids.shape[0]
            hidden = torch.cat([aux[: a + 1], aux.new_zeros(length - a - 1, aux.shape[1])])
            with Logits(model.lm_head) as theirs, torch.no_grad():
                model(hidden_states=hidden[None], input_ids=ids[None],
                      document_ids=torch.zeros(1, length, dtype=torch.long), position_ids=torch.arange(length)[None],
                      ttt_steps=s + 1)
            mine, their = ours[s][-1], theirs[s][0, a]
            token, gap = _greedy(mine)
            drafted = int(their.argmax())
            rows.append((a, s, float((mine - their).abs().max()), token, drafted, gap))
            proposed.append(drafted + int(model.d2t[drafted]) if model.d2t is not None else drafted)
    return rows


def compare_peagle(drafter, model, x: torch.Tensor, aux: torch.Tensor, monkeypatch, k: int = 4) -> list[tuple]:
    """speculators' P-EAGLE training forward over COD-sampled (anchor, depth) elements (keep ratio 1: nearly the
    full grid; the sample recorded as its forward draws it) against specframe's ``propose(k)`` from each anchor,
    whose depth-d row is the element (a, d): a mask slot reading the mask token and ``fc(mask_hidden)``."""
    import speculators.models.peagle.core as core
    from speculators.losses import resolve_loss_config

    drawn = []

    def recorded(*args, **kwargs):
        drawn.append(sample(*args, **kwargs))
        return drawn[-1]

    sample = core.generate_cod_sample_indices
    monkeypatch.setattr(core, "generate_cod_sample_indices", recorded)
    n = aux.shape[0]
    loss_mask = torch.ones(1, n)
    loss_mask[0, 0] = 0  # no element anchored before the sequence (speculators' depth-1 pool holds the seeds)
    torch.manual_seed(5)
    with Logits(model.lm_head) as theirs, torch.no_grad():
        model(hidden_states=aux[None], input_ids=x[None, 1:], document_ids=torch.zeros(1, n, dtype=torch.long),
              loss_mask=loss_mask, verifier_last_hidden_states=torch.zeros(1, n, model.hidden_size),
              loss_config=resolve_loss_config("kl_div", "eager"), num_depths=k, down_sample_ratio=1.0,
              down_sample_ratio_min=1.0)
    anchor, depth = drawn[0]
    assert int(depth.max()) == k - 1 and int(anchor.min()) >= 0
    rows = []
    for a in sorted(set(anchor.tolist())):
        with Logits(drafter.model.lm_head) as ours:
            drafter.start(x[: a + 2], {"aux_hidden": aux[: a + 1]})
            drafter.propose(k)
        for j in (anchor == a).nonzero().squeeze(1).tolist():
            d = int(depth[j])
            mine, their = ours[0][d], theirs[0][0, j]
            token, gap = _greedy(mine)
            rows.append((a, d, float((mine - their).abs().max()), token, int(their.argmax()), gap))
    return rows


def compare_dflash(drafter, model, x: torch.Tensor, aux: torch.Tensor) -> list[tuple]:
    """speculators' DFlash training forward with every anchor (block A: the token x_A then mask slots at positions
    A.., attending to the context g_0..g_{A-1} and to the whole block) against specframe's ``propose`` after the
    prompt x_0..x_A (the anchor token x_A, the features of the positions before it): slot s >= 1 is draft s."""
    from speculators.losses import resolve_loss_config

    n = aux.shape[0]
    loss_mask = torch.ones(1, n)
    loss_mask[0, 0] = 0  # anchor 0 would have no context; specframe's drafter always has one
    anchors = list(range(1, n - BLOCK))  # speculators leaves the last block_size positions out
    with Logits(model.lm_head) as theirs, torch.no_grad():
        model(hidden_states=aux[None], input_ids=x[None, :n], loss_mask=loss_mask,
              verifier_last_hidden_states=torch.zeros(1, n, model.hidden_size),
              document_ids=torch.zeros(1, n, dtype=torch.long), loss_config=resolve_loss_config("kl_div", "eager"),
              max_anchors=len(anchors))
    blocks = theirs[0][0].view(len(anchors), BLOCK, -1)
    rows = []
    for i, a in enumerate(anchors):
        with Logits(drafter.model.lm_head) as ours:
            drafter.start(x[: a + 1], {"aux_hidden": aux[:a]})
            drafter.propose(BLOCK - 1)
        for s in range(1, BLOCK):
            mine, their = ours[0][s - 1], blocks[i, s]
            token, gap = _greedy(mine)
            rows.append((a, s, float((mine - their).abs().max()), token, int(their.argmax()), gap))
    return rows


def compare(kind: str, drafter, model, target, monkeypatch) -> list[tuple]:
    width = (len(DFLASH_AUX) if kind == "dflash" else len(AUX)) * target.hidden
    x, aux = inputs(target, 12, width)
    if kind == "eagle3":
        return compare_eagle3(drafter, model, x, aux)
    if kind == "peagle":
        return compare_peagle(drafter, model, x, aux, monkeypatch)
    return compare_dflash(drafter, model, x, aux)


def assert_same_drafts(rows: list[tuple]) -> None:
    """Every logit within TOL and every greedy token equal (no top-2 gap in the fixtures is within 10 TOL, where a
    difference within TOL could flip the greedy token)."""
    worst = max(r[2] for r in rows)
    assert worst <= TOL, f"max |logit difference| {worst:.3g} > {TOL} at {max(rows, key=lambda r: r[2])[:2]}"
    ties = [r for r in rows if r[5] < 10 * TOL]
    assert not ties, f"near ties in the fixture (pick another seed): {ties}"
    differ = [r for r in rows if r[3] != r[4]]
    assert not differ, f"(anchor, step, diff, ours, theirs, gap) differ: {differ}"


# --------------------------------------------------------------------------------- specframe exports -> speculators


@pytest.mark.parametrize("kind", KINDS)
def test_speculators_reads_every_export_with_no_missing_or_unexpected_key(exports, target, kind):
    from speculators import SpeculatorModel, SpeculatorModelConfig

    folder = exports[kind].folder
    config_cls, model_cls = CLASSES[kind]
    # its registry resolves the folder to the layout's classes, from config.json alone
    config = SpeculatorModelConfig.from_pretrained(folder)
    assert type(config) is config_cls and config.speculators_model_type == kind
    layer = config.transformer_layer_config
    assert layer.model_type == ("qwen3" if kind == "dflash" else "llama")
    assert (layer.hidden_size, layer.num_hidden_layers, layer.vocab_size) == (target.hidden, LAYERS, 320)
    assert config.target_hidden_size == target.hidden and config.speculators_config.verifier.name_or_path == str(
        target.path.resolve())
    if kind == "dflash":
        assert (config.aux_hidden_state_layer_ids, config.block_size, config.mask_token_id) == (DFLASH_AUX, BLOCK,
                                                                                               target.mask)
        assert config.draft_vocab_size == 320 and config.sample_from_anchor is False
    else:
        assert (config.eagle_aux_hidden_state_layer_ids, config.draft_vocab_size) == (AUX, DRAFT_VOCAB)
        assert not (config.norm_before_residual or config.norm_before_fc or config.fc_norm or config.norm_output)
        if kind == "peagle":
            assert config.mask_token_id == target.mask
    assert not getattr(layer, "layer_types", None) or set(layer.layer_types) == {"full_attention"}
    assert type(SpeculatorModel.from_pretrained(folder)) is model_cls
    info = loading_report(kind, folder)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    assert not info["error_msgs"]
    # every tensor of the folder is in its model as written, and the model holds nothing else but the verifier's own
    model = load_speculators(kind, folder)
    state, written = model.state_dict(), load_file(str(folder / "model.safetensors"))
    assert set(state) - set(written) <= VERIFIER_OWNED, set(state) - set(written)
    assert all(torch.equal(state[k], v) for k, v in written.items())


@pytest.mark.parametrize("kind", KINDS)
def test_speculators_forward_gives_the_drafters_logits_and_proposals(exports, target, kind, monkeypatch):
    model = load_speculators(kind, exports[kind].folder)
    rows = compare(kind, exports[kind].drafter, model, target, monkeypatch)
    assert len(rows) >= 20
    assert_same_drafts(rows)


def test_the_exports_name_their_dtype_as_transformers_5_and_vllm_and_speculators_read_it(exports, target, tmp_path):
    """``torch_dtype`` is transformers' deprecated name (it warns: "`torch_dtype` is deprecated! Use `dtype`
    instead!"); the exports write ``dtype``, at the top and in the layer config, and a folder written before with
    ``torch_dtype`` is rewritten with ``dtype`` on its way through specframe."""
    for kind, item in exports.items():
        cfg = json.loads((item.folder / "config.json").read_text())
        assert "torch_dtype" not in json.dumps(cfg), kind
        assert cfg["dtype"] == cfg["transformer_layer_config"]["dtype"] == "float32", kind
        config = CLASSES[kind][0].from_pretrained(item.folder)
        assert config.dtype == torch.float32 and config.transformer_layer_config.dtype == torch.float32, kind
        try:
            from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
        except ImportError:  # pragma: no cover - vLLM is optional
            continue
        assert SpeculatorsConfig.from_pretrained(str(item.folder)).dtype == torch.float32, kind
    # an export of an older specframe (torch_dtype): read, and written again with dtype only
    legacy = shutil.copytree(exports["peagle"].folder, tmp_path / "legacy")
    cfg = json.loads((legacy / "config.json").read_text())
    cfg["torch_dtype"] = cfg.pop("dtype")
    cfg["transformer_layer_config"]["torch_dtype"] = cfg["transformer_layer_config"].pop("dtype")
    (legacy / "config.json").write_text(json.dumps(cfg))
    export.set_serving(legacy, speculative_tokens=3)
    rewritten = json.loads((legacy / "config.json").read_text())
    assert "torch_dtype" not in json.dumps(rewritten) and rewritten["transformer_layer_config"]["dtype"] == "float32"
    load_drafter(legacy, target.config, target.tok).export_vllm(tmp_path / "again", target.tok)
    assert "torch_dtype" not in (tmp_path / "again" / "config.json").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_speculators_own_trainer_accepts_the_exports(exports, target, kind, tmp_path):
    """``speculators train --from-pretrained EXPORT --dry-run``: its trainer builds the drafter from the export and
    saves it again (in bf16) without a word against it; what it saved is the export's weights and fields, and
    specframe imports it back."""
    folder, out = exports[kind].folder, tmp_path / "dry"
    run = subprocess.run(
        [sys.executable, "-m", "speculators", "train", "--from-pretrained", str(folder), "--dry-run",
         "--speculator-type", kind, "--verifier-name-or-path", str(target.path), "--save-path", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    saved, ours = load_file(str(out / "model.safetensors")), load_file(str(folder / "model.safetensors"))
    # speculators saves a DFlash drafter without the verifier's embedding and full-vocabulary head
    dropped = {"embed_tokens.weight", "lm_head.weight"} if kind == "dflash" else set()
    assert set(saved) == set(ours) - dropped
    assert all(torch.equal(saved[k].float(), ours[k].to(saved[k].dtype).float()) for k in saved)
    cfg, back = json.loads((out / "config.json").read_text()), json.loads((folder / "config.json").read_text())
    for key in ("speculators_model_type", "draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids",
                "aux_hidden_state_layer_ids", "mask_token_id", "block_size", "norm_before_residual"):
        assert cfg.get(key) == back.get(key), key
    drafter = load_drafter(out, target.config, target.tok)
    state = drafter.module().state_dict()
    assert all(torch.equal(state[k], saved[k].to(state[k].dtype)) for k in saved)


# ------------------------------------------------------------------------------- speculators folders -> specframe


def speculators_folder(kind: str, target, out: Path, *, full_attention: bool = True, dtype=torch.bfloat16,
                       seed: int = 3, **flags) -> Path:
    """The folder speculators' trainer writes for the tiny target (its ``create_transformer_layer_config``, the
    model's ``from_training_args`` and ``save_pretrained``, in bf16 as its dry-run saves), for a drafter specframe's
    layers compute: Llama layers for EAGLE-3 / P-EAGLE (speculators' P-EAGLE default is Qwen3), the norm flags off
    (its EAGLE-3 defaults are EAGLE 3.1's), full attention on every layer unless ``full_attention`` is False (its
    default: a 2048-token sliding window on all); ``flags`` override its trainer arguments. Weights spread out."""
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    arch = "qwen3" if kind == "dflash" else "llama"
    layer = create_transformer_layer_config(
        verifier_name_or_path=str(target.path), num_layers=LAYERS, draft_arch=flags.pop("draft_arch", arch),
        hidden_act=flags.pop("hidden_act", None), sliding_window=2048,
        full_attention_indices=list(range(LAYERS)) if full_attention else [])
    layer._attn_implementation = "eager"
    vocab = target.config.vocab_size
    t2d = d2t = None
    draft_vocab = vocab
    if kind != "dflash":  # a reduced draft vocabulary, as its trainer derives it from token counts
        freq = {t: 1000 - t for t in range(7, vocab, 2)}
        d2t, t2d = build_vocab_mappings_from_distribution(freq, DRAFT_VOCAB, vocab)
        draft_vocab = DRAFT_VOCAB
    args = {"verifier_name_or_path": str(target.path), "draft_vocab_size": draft_vocab,
            "target_layer_ids": DFLASH_AUX if kind == "dflash" else AUX, "draft_attn_impl": "eager",
            "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False,
            "ttt_steps": 3, "mask_token_id": target.mask, "block_size": BLOCK, "num_depths": 4, **flags}
    torch.manual_seed(seed)
    model = CLASSES[kind][1].from_training_args(verifier_config=layer, t2d=t2d, d2t=d2t, **args)
    _perturb(model, seed, skip=("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                                "verifier_norm.weight"))
    model.to(dtype).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def folders(target):
    root = target.root / "speculators-folders"
    return {kind: speculators_folder(kind, target, root / kind) for kind in ("eagle3", "peagle", "dflash")}


@pytest.mark.parametrize("kind", KINDS)
def test_specframe_imports_speculators_folders_and_drafts_what_its_model_drafts(folders, target, kind, monkeypatch):
    """The folder's config says target_hidden_size null (speculators' default: the drafter's own width, as vLLM reads
    it), which was refused as "the drafter config lacks target_hidden_size"; the DFlash folder has no embed_tokens /
    lm_head (the verifier's). Imported for generate / bench / export (``load_drafter``) and for ``train --init-from``
    (``warm_start``), the drafter computes the logits speculators' own model computes for the folder."""
    folder = folders[kind]
    assert json.loads((folder / "config.json").read_text())["target_hidden_size"] is None
    drafter = load_drafter(folder, target.config, target.tok)
    assert drafter.name == kind and drafter.options.layers == LAYERS
    drafter.module().eval()
    model = load_speculators(kind, folder)  # bf16 weights, computed in fp32 on both sides
    assert_same_drafts(compare(kind, drafter, model, target, monkeypatch))
    state, written = drafter.module().state_dict(), load_file(str(folder / "model.safetensors"))
    assert all(torch.equal(state[k], v.to(state[k].dtype)) for k, v in written.items())
    # train --init-from: a drafter built from the run's options takes the same weights
    cls = plugins.get("drafter", kind)
    fresh = cls(target.config, drafter.options)
    if kind == "dflash":  # prepared: its embedding and head are the target's (the folder has none)
        with torch.no_grad():
            fresh.model.embed_tokens.weight.copy_(imports.target_embedding(target.config))
            fresh.model.lm_head.weight.copy_(imports.target_lm_head(target.config))
        fresh.mask_token_id = target.mask
    imports.warm_start(fresh, folder, target.config, target.tok)
    assert all(torch.equal(fresh.module().state_dict()[k], v) for k, v in state.items())
    assert getattr(fresh, "mask_token_id", None) == getattr(drafter, "mask_token_id", None)


def cli(*args) -> tuple[int, str]:
    from specframe.cli import main

    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def cli_json(*args) -> dict:
    code, text = cli(*args, "--json")
    assert code == 0, text
    return json.loads(text[text.index("{"):])


@pytest.mark.parametrize("kind", KINDS)
def test_the_cli_generates_trains_from_and_exports_a_speculators_folder(folders, target, kind, tmp_path):
    """``generate --checkpoint``, ``train --init-from`` and ``export --checkpoint`` on the folder speculators wrote;
    speculators reads the export specframe writes of it with no missing key and the same weights."""
    folder = folders[kind]
    out = cli_json("generate", "--checkpoint", folder, "--prompt", "the quick brown fox", "--k", 3,
                   "--max-new-tokens", 6)
    assert out["drafter"] == kind and len(out["tokens"]) >= 1
    options = {"eagle3": f"layers = {LAYERS}\naux_layer_ids = {AUX}\ndraft_vocab_size = {DRAFT_VOCAB}\nttt_steps = 2\n",
               "peagle": f"layers = {LAYERS}\naux_layer_ids = {AUX}\ndraft_vocab_size = {DRAFT_VOCAB}\nk_train = 2\n",
               "dflash": f"layers = {LAYERS}\naux_layer_ids = {DFLASH_AUX}\nblock_size = {BLOCK}\n"}[kind]
    (tmp_path / "run.toml").write_text("[drafter]\n" + options)
    code, text = cli("train", "--drafter", kind, "--target", target.path, "--data", target.chat, "--seq-len", 48,
                     "--output", tmp_path / "run", "--config", tmp_path / "run.toml", "--mask-builder", "dense",
                     "--max-steps", 1, "--lr", 1e-12, "--init-from", folder)
    assert code == 0, text
    warm = load_file(str(tmp_path / "run" / "step-00000001" / "model.safetensors"))
    written = load_file(str(folder / "model.safetensors"))
    for name in ("fc.weight", "layers.1.mlp.up_proj.weight", "norm.weight"):
        assert torch.allclose(warm[name], written[name].float(), atol=1e-6), name
    manifest = cli_json("export", "--checkpoint", folder, "--output", tmp_path / "export")
    assert manifest["layout"] == kind and manifest["verifier"] == str(target.path.resolve())
    again = tmp_path / "export"
    assert loading_report(kind, again)["missing_keys"] == set()
    state = load_speculators(kind, again).state_dict()
    assert all(torch.equal(state[k].float(), v.float()) for k, v in written.items())


# ------------------------------------------------------------------------------------------ what is refused, why


def test_speculators_variants_specframe_cannot_compute_are_refused_by_field(target, tmp_path):
    """What is still another network: EAGLE-3's fc_norm (one norm per aux state), another activation than the
    target's and, for DFlash, drafting from the anchor slot. Each is refused in one line naming the field. (The
    trainer's defaults, Qwen3 layers, the EAGLE 3.1 norms and the sliding window, import:
    tests/vllm_integration/test_speculators_default_folders.py.)"""
    cases = [
        ("eagle3", dict(fc_norm=True), "fc_norm is true: specframe's EAGLE-3 layer computes only fc_norm = false"),
        ("eagle3", dict(hidden_act="gelu"), "hidden_act 'gelu' differs from the target's 'silu'"),
        ("dflash", dict(sample_from_anchor=True), "sample_from_anchor is true"),
    ]
    for i, (kind, flags, message) in enumerate(cases):
        if kind not in KINDS:
            continue
        folder = speculators_folder(kind, target, tmp_path / f"{kind}-{i}", **flags)
        with pytest.raises(SpecframeError, match=f"^cannot import {folder}: {message}"):
            load_drafter(folder, target.config, target.tok)


@pytest.mark.parametrize("kind", ["eagle3", "peagle"])
def test_a_sliding_window_is_imported_and_never_dropped_on_export(target, tmp_path, kind):
    """speculators' default: every draft layer sliding_attention with a 2048-token window, which vLLM (llama.py:
    per_layer_sliding_window from layer_types) and speculators' own forward apply. It was imported without a word
    and exported without the window, then refused; it now becomes the drafter's sliding_window, and specframe's
    export writes it back as speculators and vLLM read it. A window on some layers only is refused, naming them; a
    folder whose layers are all full_attention (speculators' --full-attention-indices) exports no window."""
    folder = speculators_folder(kind, target, tmp_path / "sliding", full_attention=False)
    layer = json.loads((folder / "config.json").read_text())["transformer_layer_config"]
    assert layer["sliding_window"] == 2048 and set(layer["layer_types"]) == {"sliding_attention"}
    drafter = load_drafter(folder, target.config, target.tok)
    assert drafter.options.sliding_window == 2048
    drafter.export_vllm(tmp_path / "windowed", target.tok)
    written = json.loads((tmp_path / "windowed" / "config.json").read_text())["transformer_layer_config"]
    assert written["sliding_window"] == 2048 and written["layer_types"] == ["sliding_attention"] * LAYERS
    assert load_speculators(kind, tmp_path / "windowed").sliding_window_indices == [0, 1]
    # a window on one layer only is named for that layer
    cfg = json.loads((folder / "config.json").read_text())
    cfg["transformer_layer_config"]["layer_types"] = ["full_attention", "sliding_attention"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecframeError, match=r"make drafter layers \[1\] of 2 sliding_attention"):
        imports.read(folder, target.config)
    code, text = cli("export", "--checkpoint", folder, "--output", tmp_path / "out")
    assert code != 0 and "sliding_attention" in text and not (tmp_path / "out").exists()
    # full attention everywhere (the window field stays, unused, as speculators writes it): imports, and specframe's
    # export of it has no window for vLLM or speculators to apply
    cfg["transformer_layer_config"]["layer_types"] = ["full_attention", "full_attention"]
    (folder / "config.json").write_text(json.dumps(cfg))
    full = load_drafter(folder, target.config, target.tok)
    assert full.options.sliding_window is None
    full.export_vllm(tmp_path / "full", target.tok)
    written = json.loads((tmp_path / "full" / "config.json").read_text())["transformer_layer_config"]
    assert "sliding_window" not in written and "layer_types" not in written
    assert load_speculators(kind, tmp_path / "full").sliding_window_indices == []


def test_sliding_window_layers_reads_a_config_as_transformers_builds_it():
    """Qwen2 / Qwen3 layer configs without layer_types derive them from use_sliding_window and max_window_layers, and
    drop the window without use_sliding_window; a Llama config has one only through layer_types."""
    read = imports.sliding_window_layers
    qwen = {"model_type": "qwen3", "num_hidden_layers": 3, "sliding_window": 16}
    assert read({**qwen, "use_sliding_window": True, "max_window_layers": 1}) == ([1, 2], 16)
    assert read({**qwen, "use_sliding_window": False, "layer_types": ["sliding_attention"] * 3}) == ([], None)
    assert read(qwen) == ([], None)
    llama = {"model_type": "llama", "num_hidden_layers": 2, "sliding_window": 8}
    assert read(llama) == ([], None)
    assert read({**llama, "layer_types": ["sliding_attention", "full_attention"]}) == ([0], 8)
