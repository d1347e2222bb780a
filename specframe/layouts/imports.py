"""Read drafter checkpoints of the ecosystem's formats into specframe's drafter plugins.

What ``read`` recognises (``config.json`` decides; weights are read through safetensors only, a folder carrying
pickles such as ``pytorch_model.bin`` is refused before anything is loaded, with how to convert it: specframe never
unpickles, and SafeAILab's published EAGLE-3 drafters are ``pytorch_model.bin`` folders):

- ``speculators``: vllm-project/speculators EAGLE-3 / P-EAGLE (``speculators_model_type`` ``eagle3`` / ``peagle``),
  what ``specframe export`` writes. Tensors ``fc``, ``layers.N.*``, ``norm``, ``lm_head``, optional
  ``embed_tokens``, ``d2t`` / ``t2d``, ``mask_hidden``; the library's ``verifier_*`` copies (older speculators
  releases saved the verifier's ``verifier_lm_head`` / ``verifier_norm`` beside the drafter), when saved, are dropped.
  ``target_hidden_size`` null (what speculators writes by default) is the drafter's own width, as vLLM reads it; a
  DFlash folder (``dflash``) without ``embed_tokens`` / ``lm_head`` (speculators saves neither) takes the target's.
- ``eagle3-flat``: a flat ``LlamaForCausalLMEagle3`` config (``architectures``), as SafeAILab/EAGLE (EAGLE-3) and
  SpecForge (sgl-project) save their EAGLE-3 drafters: Llama config fields plus ``draft_vocab_size``; the aux layers
  under ``eagle_aux_hidden_state_layer_ids`` or SpecForge's ``eagle_config.eagle_aux_hidden_state_layer_ids``,
  otherwise the original default (2, L//2, L-3) of the target; the decoder layer named ``midlayer.*`` (or
  ``layers.N.*``). A config whose ``mask_token_id`` is set with a ``mask_hidden`` tensor is read as P-EAGLE.
- ``peagle-flat``: SpecForge's P-EAGLE (``architectures`` ``PEagleDraftModel``), the same flat Llama config and
  tensors (``layers.N.*``, ``mask_hidden`` [1, 1, 3 H_target]), read as ``eagle3-flat`` is. SpecForge hands the mask
  token to its trainer and does not save it, so a folder whose config lacks ``mask_token_id`` is refused with that
  reason (the mask slots' token cannot be guessed); one that records it imports.
- ``pard``: a causal LM (``LlamaForCausalLM`` names) whose config has ``pard_token``, PARD's released layout.
- ``deepspec``: a DSpark drafter as deepseek-ai/DeepSpec's trainer saves it (``Qwen3DSparkModel.save_pretrained``,
  ``deepspec/modeling/dspark/qwen3``): the target's config with the draft fields (``num_hidden_layers`` the draft
  layers, ``block_size``, ``mask_token_id``, ``target_layer_ids``, ``markov_rank``, ``markov_head_type``,
  ``enable_confidence_head``, ``confidence_head_with_markov``) and no ``speculators_config``; the weights carry the
  names vLLM's ``Qwen3DSparkModel`` took from it (``fc``, ``hidden_norm``, ``layers.N.*``, ``norm``,
  ``embed_tokens``, ``lm_head``, ``markov_head.markov_w1`` / ``markov_w2``, ``confidence_head.proj``). DeepSpec's
  layer id k is the output of target layer k (``hidden_states[k + 1]``, -1 the embeddings), specframe's aux id k + 1;
  its anchor is the first prediction slot, as specframe's DSpark. Its RNN head (``markov_head.joint_proj``) is
  specframe's, name for name; its gated Markov head has no specframe counterpart and is refused.
- ``specforge-dspark``: a DSpark drafter as sgl-project/SpecForge saves it (``specforge.export.to_hf``:
  ``DSparkDraftModel.save_pretrained``, ``specforge/modeling/draft/dspark.py`` on ``dflash.py``'s backbone): a Qwen3
  config (``architectures`` ``DSparkDraftModel``; the first release wrote ``DFlashDraftModel`` with
  ``projector_type`` ``dspark``) with top-level ``block_size``, ``num_target_layers`` and ``draft_vocab_size`` (the
  target's vocabulary) and the DSpark fields in ``dflash_config``: ``mask_token_id``, ``target_layer_ids``,
  ``projector_type``, ``attention_mode``, ``markov_rank``, ``markov_head_type``, ``enable_confidence_head`` (default:
  ``confidence_head_alpha`` > 0), ``confidence_head_with_markov`` (default false); an unmerged port (TorchSpec's) kept
  the head fields at the top level, read when ``dflash_config`` lacks them. Weights: ``fc``, ``hidden_norm``,
  ``layers.N.*``, ``norm``, ``markov_head.markov_w1`` / ``markov_w2`` (the RNN head's ``markov_head.joint_proj``),
  ``confidence_head.proj``, no ``embed_tokens`` / ``lm_head`` (the target's are used) and no ``d2t`` / ``t2d``; heads
  saved under ``logit_head.`` (SpecForge loads such early checkpoints) are renamed. Its layer id k is target layer
  k's output (``hidden_states[k + 1]``; SGLang captures before layer k + 1), specframe's aux id k + 1; absent, the
  ids are SpecForge's default for ``num_target_layers``. Its training anchor is the first prediction slot, as
  specframe's DSpark. The gated Markov head, a drafter without a Markov head, attention other than GQA / MHA and a
  config without ``mask_token_id`` are refused.

speculators' trainer defaults import into the EAGLE family's options of the same names (``layouts.flat_config``,
``Imported.architecture``): Qwen3 layers (``qk_norm``), ``norm_before_residual``, EAGLE 3.1's ``norm_before_fc`` and
``norm_output``, and a sliding window on every layer (``sliding_window``, honoured in training, drafting and export).
A pickle beside the safetensors weights (its checkpoints' ``optimizer_state_dict.pt``, ``scheduler_state_dict.pt``) is
never opened and named in one line on stderr. Layer variants specframe's drafter layers do not compute are refused,
one line naming the field and both values: ``fc_norm``, a window on some layers only (or in a non-speculators
folder), DFlash's ``sample_from_anchor``, biased projections, another activation or norm epsilon than the target's.

RoPE is compared in full with the target's (``rope_type``, ``rope_theta`` and every scaling field such as ``factor``,
``low_freq_factor``, ``original_max_position_embeddings``): specframe's drafters run the target's RoPE, so a drafter
trained with other frequencies is refused. A missing theta is transformers' (and SpecForge's) default, 10000, not "any
theta".

``read`` returns an ``Imported`` (flat config, tensors under specframe's / vLLM's layout names, verifier when named);
``check_target`` compares it with the target (hidden size, layer shape, RoPE, vocabulary, aux layer range,
tokenizer) and raises one ``SpecframeError`` naming the field; ``specframe.drafter_folders.load_drafter`` builds
the drafter plugin the folder holds and loads it (``Drafter.import_weights``), for ``generate`` / ``bench`` /
``export``; ``specframe train --init-from`` calls ``warm_start``, which loads it into the drafter the run built.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from specframe.errors import SpecframeError
from specframe.layouts import export as layouts

FORMATS = ("speculators", "eagle3-flat", "peagle-flat", "pard", "deepspec", "specforge-dspark")
FLAT_EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
#: SpecForge's P-EAGLE drafter (``specforge/modeling/draft/peagle.py``), saved as a flat Llama config
FLAT_PEAGLE_ARCHITECTURE = "PEagleDraftModel"
#: DeepSpec's DSpark drafter (``deepspec/modeling/dspark/qwen3/modeling.py``), saved by transformers' save_pretrained
DEEPSPEC_DSPARK_ARCHITECTURE = "Qwen3DSparkModel"
#: SpecForge's DSpark drafter (``specforge/modeling/draft/dspark.py``), saved by ``specforge.export.to_hf``
SPECFORGE_DSPARK_ARCHITECTURE = "DSparkDraftModel"
#: SpecForge's DFlash drafter, which carried DSpark (``dflash_config.projector_type`` ``dspark``) in its first release
SPECFORGE_DFLASH_ARCHITECTURE = "DFlashDraftModel"
#: the RoPE base transformers assumes when a config names none (``RotaryEmbeddingConfigMixin.default_theta``), which
#: is also what SpecForge's drafters use (``getattr(config, "rope_theta", 10000)``)
DEFAULT_ROPE_THETA = 10000.0
# RoPE types whose pretraining length transformers fills in from max_position_embeddings when a config omits it
_ROPE_WITH_ORIGINAL_LENGTH = ("llama3", "yarn", "longrope")
# layer fields a drafter built on the target's LayerShape must share with the target, and how they are compared
_SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")


@attrs.frozen
class Imported:
    """A foreign drafter folder, read and validated: ``layout`` (eagle3 / peagle / pard), the ``format`` it came in,
    its flat ``config``, its ``tensors`` under the layout's names and the ``verifier`` it names (if any)."""

    directory: Path
    format: str
    layout: str
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    verifier: str | None = None
    drafter: str | None = None
    speculative_tokens: int | None = None

    @property
    def plugin(self) -> str:
        """The drafter plugin that serves this layout (the one recorded by specframe, else the layout's)."""
        return self.drafter or self.layout

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def aux_layer_ids(self) -> list[int]:
        # the EAGLE layouts' key, and the DFlash layout's (vLLM's update_dflash reads it, as write_dflash writes it)
        ids = self.config.get("eagle_aux_hidden_state_layer_ids") or self.config.get("aux_hidden_state_layer_ids")
        return [int(i) for i in ids or []]

    @property
    def draft_vocab_size(self) -> int:
        head = self.tensors.get("lm_head.weight")  # a DFlash folder may share the target's head (vLLM does)
        if head is not None:
            return int(head.shape[0])
        return int(self.config.get("draft_vocab_size") or self.config["vocab_size"])

    @property
    def architecture(self) -> dict[str, Any]:
        """The EAGLE layer architecture the folder's config asks for, under the drafter option names (``qk_norm``,
        ``norm_before_residual``, ``norm_before_fc``, ``norm_output``, ``sliding_window``; ``layouts.flat_config``
        reads them from a speculators config); absent ones are specframe's defaults."""
        defaults = {"qk_norm": False, "norm_before_residual": False, "norm_before_fc": False, "norm_output": False,
                    "sliding_window": None}
        if self.format != "speculators" or self.layout not in ("eagle3", "peagle"):
            return defaults  # the other readers refuse these variants (``_refuse_layer_variants``)
        return {k: self.config.get(k, v) for k, v in defaults.items()}

    @property
    def mask_token_id(self) -> int | None:
        key = "pard_token" if self.layout == "pard" else "mask_token_id"
        value = self.config.get(key)
        return None if value is None else int(value)

    # What a drafter's ``import_weights`` needs, as methods, so a plugin reaches them through the object it is
    # handed and imports nothing past ``specframe.api`` (API 5).

    def check_target(self, target_config: Any, tokenizer: Any = None) -> None:
        """``check_target``: refuse a folder made for another target (one line naming the field)."""
        check_target(self, target_config, tokenizer)

    def check_shape(self, drafter: str, **expected: Any) -> None:
        """``check_shape``: refuse a folder whose layers / aux layer ids / draft vocabulary differ from ``expected``."""
        check_shape(self, drafter, **expected)

    def block_state(self, own: Mapping[str, torch.Tensor], *, own_shared_are_target: bool) -> dict[str, torch.Tensor]:
        """``block_state``: the folder's DFlash / DSpark tensors as a full state dict for a module whose state dict is
        ``own``, in its dtypes. A missing ``embed_tokens`` / ``lm_head`` (vLLM shares the target's; the reader filled
        them from the target's files where it found them) is ``own``'s when ``own_shared_are_target`` (a prepared
        drafter's are the target's); an extra, missing or misshapen tensor is one error naming it."""
        where = f"cannot import {self.directory}"
        tensors = dict(self.tensors)
        for shared in ("embed_tokens.weight", "lm_head.weight"):
            if shared not in tensors and own_shared_are_target:
                tensors[shared] = own[shared]
        extra, missing = sorted(set(tensors) - set(own)), sorted(set(own) - set(tensors))
        if extra:
            raise SpecframeError(f"{where}: tensor {extra[0]!r} has no place in the drafter")
        if missing:
            why = (" (the folder shares the target's, which was not found in a local safetensors folder)"
                   if missing[0] in ("embed_tokens.weight", "lm_head.weight") else "")
            raise SpecframeError(f"{where}: missing tensor {missing[0]!r}{why}")
        for name, value in own.items():
            if tuple(tensors[name].shape) != tuple(value.shape):
                raise SpecframeError(f"{where}: tensor {name!r} has shape {list(tensors[name].shape)}, the "
                                     f"drafter's is {list(value.shape)}")
        return {k: tensors[k].to(own[k].dtype) for k in own}

    def eagle_state(self, own: Mapping[str, torch.Tensor], target_config: Any, *,
                    own_embedding_is_target: bool = False) -> dict[str, torch.Tensor]:
        """``eagle_state``: the folder's EAGLE tensors as a full state dict for a module whose state dict is ``own``."""
        return eagle_state(self, own, target_config, own_embedding_is_target=own_embedding_is_target)


def format_of(directory: str | os.PathLike) -> str | None:
    """Which importable format ``directory`` holds (None when it is none of them, e.g. a training checkpoint)."""
    directory = Path(directory)
    path = directory / "config.json"
    if (directory / "state.json").exists() or not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(cfg, dict):
        return None
    if "speculators_config" in cfg or "speculators_model_type" in cfg:
        return "speculators"
    if FLAT_EAGLE3_ARCHITECTURE in (cfg.get("architectures") or []):
        return "eagle3-flat"
    if FLAT_PEAGLE_ARCHITECTURE in (cfg.get("architectures") or []):
        return "peagle-flat"
    if DEEPSPEC_DSPARK_ARCHITECTURE in (cfg.get("architectures") or []):  # a speculators dspark folder returned above
        return "deepspec"
    if _is_specforge_dspark(cfg):
        return "specforge-dspark"
    if layouts.layout_of(cfg) == "parallelspec":
        return "parallelspec"
    if "pard_token" in cfg:
        return "pard"
    return None


def named_target(directory: str | os.PathLike) -> str | None:
    """The verifier a speculators folder names (its target), else None."""
    if format_of(directory) != "speculators":
        return None
    try:
        return layouts.read_manifest(directory).verifier
    except SpecframeError:
        return None


def read(directory: str | os.PathLike, target_config: Any = None) -> Imported:
    """Read and validate the drafter folder at ``directory``; with ``target_config`` also ``check_target``. Every
    refusal is one ``SpecframeError`` starting with the folder and naming the field or tensor."""
    directory = Path(directory)
    try:
        imported = _read(directory, target_config)
        if target_config is not None:
            check_target(imported, target_config)
            imported = _with_shared_target_weights(imported, target_config)
    except SpecframeError as e:
        raise SpecframeError(f"cannot import {directory}: {e}") from None
    return imported


def _read(directory: Path, target_config: Any) -> Imported:
    fmt = format_of(directory)
    if fmt is None:
        raise SpecframeError(
            "not a drafter folder specframe imports (config.json with speculators_config, a LlamaForCausalLMEagle3, "
            "PEagleDraftModel, Qwen3DSparkModel or DSparkDraftModel architecture, or pard_token)"
        )
    _refuse_pickles(directory)
    _check_safetensors(directory)
    if fmt == "speculators" and _is_recurrent_dspark(directory):
        imported = _read_speculators_rnn_dspark(directory, target_config)
    elif fmt == "speculators":
        manifest, tensors, flat = layouts.check_layout(directory)
        # older speculators releases saved the verifier's own lm_head / norm beside the drafter: not the drafter's
        tensors = {k: v for k, v in tensors.items() if not k.startswith("verifier_")}
        imported = Imported(directory, fmt, manifest.layout, flat, tensors, manifest.verifier, manifest.drafter,
                            manifest.speculative_tokens)
    elif fmt in ("pard", "parallelspec"):
        manifest, tensors, flat = layouts.check_layout(directory)
        imported = Imported(directory, fmt, manifest.layout, flat, tensors, None, manifest.drafter)
    elif fmt == "deepspec":
        imported = _read_deepspec(directory, target_config)
    elif fmt == "specforge-dspark":
        imported = _read_specforge_dspark(directory, target_config)
    else:
        imported = _read_flat_eagle3(directory, target_config, fmt)
    _refuse_layer_variants(directory, fmt)
    return imported


def _refuse_pickles(directory: Path) -> None:
    """A folder of pickled weights (``pytorch_model.bin``: SafeAILab's published EAGLE-3 drafters) refused with why and
    how to convert, before anything in it is read. Beside safetensors weights a pickle is something else (speculators'
    checkpoints keep ``optimizer_state_dict.pt`` and ``scheduler_state_dict.pt`` there): never opened, named in one
    line on stderr, and no reason to refuse the drafter."""
    from specframe.files import PICKLE_SUFFIXES

    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles and any(directory.glob("*.safetensors")):
        sys.stderr.write(f"note: {directory}: left unread (pickles, never opened; the drafter's weights are the "
                         f"safetensors): {', '.join(pickles)}\n")
        return
    if pickles:
        raise SpecframeError(
            f"{pickles[0]} is a pickle file, and specframe reads weights through safetensors only (unpickling can run "
            "code from the file; nothing was loaded): convert it once, e.g. safetensors.torch.save_file(torch.load("
            f"'{pickles[0]}', weights_only=True), 'model.safetensors'), and move {pickles[0]} out of the folder")


def _check_safetensors(directory: Path) -> None:
    """``files.check_files`` without its pickle refusal (``_refuse_pickles`` decided about those): every safetensors
    file in the folder is checked before anything is loaded."""
    from specframe.files import check_safetensors

    for path in sorted(directory.rglob("*.safetensors")):
        check_safetensors(path)


def _refuse_layer_variants(directory: Path, fmt: str) -> None:
    """Refuse a drafter whose layer config asks for attention or projections specframe's drafter layers do not
    compute (a sliding window, biases), naming the field; the layout's own checks (norm variants, Qwen3 layers) ran
    first."""
    cfg = json.loads((directory / "config.json").read_text())
    layer = cfg.get("transformer_layer_config") if fmt == "speculators" else cfg
    if not isinstance(layer, dict):
        return  # check_layout names the missing layer config
    for key in ("attention_bias", "mlp_bias"):
        if layer.get(key):
            raise SpecframeError(
                f"{key} is true: vLLM and speculators build biased {'q/k/v/o' if key == 'attention_bias' else 'MLP'} "
                "projections from it, and specframe's drafter layers have none (attention_bias = mlp_bias = false)")
    sliding, window = sliding_window_layers(layer)
    if sliding and fmt != "speculators":  # a speculators folder's window is read into the drafter's sliding_window
        every = " ".join(map(str, range(int(layer.get("num_hidden_layers") or len(sliding)))))
        raise SpecframeError(
            f"sliding_window {window}: its layer_types make drafter layers {sliding} sliding_attention, which vLLM and "
            f"speculators run over the last {window} positions only, and specframe's drafters attend to the whole "
            "context in training and decoding (a window they would neither apply nor export); import a drafter "
            f"trained with full attention (speculators train --full-attention-indices {every})")


#: re-exported: the reader that decides whether a layer config attends through a window
sliding_window_layers = layouts.sliding_window_layers


def _read_flat_eagle3(directory: Path, target_config: Any, fmt: str = "eagle3-flat") -> Imported:
    from specframe.features import default_aux_layers

    cfg = json.loads((directory / "config.json").read_text())
    if fmt == "peagle-flat" and cfg.get("mask_token_id") is None:
        raise SpecframeError(
            f"a SpecForge P-EAGLE folder ({FLAT_PEAGLE_ARCHITECTURE}) whose config.json records no mask_token_id: "
            "SpecForge passes the mask token to its trainer and does not save it, and the token its mask slots were "
            "trained on cannot be guessed; add \"mask_token_id\": <the id it trained with> to config.json")
    tensors = _load_weights(directory)
    tensors = {k: v for k, v in tensors.items() if not k.startswith("verifier_")}
    if "fc.bias" in tensors:
        raise SpecframeError("tensor 'fc.bias': specframe's EAGLE-3 fc has no bias")
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    if aux is None and isinstance(cfg.get("eagle_config"), dict):
        aux = cfg["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
    if aux is None:
        if target_config is None:
            raise SpecframeError(
                "eagle_aux_hidden_state_layer_ids is not recorded; the default (2, L//2, L-3) needs the target"
            )
        aux = list(default_aux_layers(int(target_config.num_hidden_layers)))
    kept = (*layouts._LLAMA_KEYS, "num_hidden_layers", "torch_dtype", "dtype")
    flat = {k: v for k, v in cfg.items() if k in kept}
    if cfg.get("target_hidden_size") is not None:  # null: the drafter's own width, as vLLM reads it
        h_t = int(cfg["target_hidden_size"])
    else:
        fc = tensors.get("fc.weight")
        if fc is None or fc.shape[1] % max(len(aux), 1):
            raise SpecframeError("missing tensor 'fc.weight' (or its width is not a multiple of the aux layers)")
        h_t = int(fc.shape[1]) // len(aux)
    layers = None if target_config is None else int(target_config.num_hidden_layers)
    tensors, flat = layouts._eagle3_parts(tensors, flat, aux, h_t, layers)
    layout = "eagle3"
    if "mask_hidden" in tensors or fmt == "peagle-flat":
        layout = "peagle"
        layouts._peagle_parts(tensors, flat, cfg.get("mask_token_id"))
    return Imported(directory, fmt, layout, flat, tensors, None, None)


def _read_deepspec(directory: Path, target_config: Any) -> Imported:
    """DeepSpec's DSpark folder (module docstring) as the ``dspark`` layout, checked as a speculators ``dspark``
    export is (``layouts._dspark_parts``: every weight vLLM's model loads, shaped by the config)."""
    cfg = json.loads((directory / "config.json").read_text())
    ids = cfg.get("target_layer_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise SpecframeError("config.json lacks target_layer_ids (the target layers DeepSpec's DSpark reads)")
    if min(ids) < -1:  # DeepSpec's validate_target_layer_ids: -1 (the embeddings) or a layer's output
        raise SpecframeError(f"target_layer_ids {ids} name no target layer output (DeepSpec's ids are >= -1)")
    rank = cfg.get("markov_rank")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise SpecframeError(f"markov_rank is {rank!r}: a DeepSpec drafter without a Markov head is its DFlash, and "
                             "specframe's dspark always has one")
    head = cfg.get("markov_head_type", "vanilla")
    if head not in ("vanilla", "rnn"):
        raise SpecframeError(f"markov_head_type is {head!r}: specframe's dspark computes DeepSpec's vanilla and RNN "
                             "Markov heads only (the gated head's weights have no counterpart)")
    if cfg.get("sample_from_anchor") is False or cfg.get("dspark_bonus_anchor"):
        raise SpecframeError("the drafter predicts from the mask slots only (a bonus-anchor block); specframe's DSpark "
                             "predicts from the anchor slot (block_size draft tokens)")
    skipped = ("architectures", "auto_map", "model_type", "target_layer_ids", "tie_word_embeddings")
    flat = {k: v for k, v in cfg.items() if k not in skipped}
    flat.update(
        aux_hidden_state_layer_ids=[int(i) + 1 for i in ids], target_hidden_size=int(cfg["hidden_size"]),
        draft_vocab_size=int(cfg["vocab_size"]), markov_head_type=head, sample_from_anchor=True,
        enable_confidence_head=bool(cfg.get("enable_confidence_head", False)),
        confidence_head_with_markov=bool(cfg.get("enable_confidence_head", False)
                                         and cfg.get("confidence_head_with_markov", False)),
    )
    tensors = _load_weights(directory)
    layers = None if target_config is None else int(target_config.num_hidden_layers)
    recurrent = _recurrence(tensors, head, rank, int(cfg["hidden_size"]))
    tensors = layouts._dspark_parts(tensors, {**flat, "markov_head_type": "vanilla"}, layers)
    return Imported(directory, "deepspec", "dspark", flat, {**tensors, **recurrent}, None, None)


def _recurrence(tensors: dict[str, torch.Tensor], head: str, rank: int, hidden: int) -> dict[str, torch.Tensor]:
    """The RNN head's recurrence (``markov_head.joint_proj`` over [state; W1[x_prev]; h] -> gate, candidate, output:
    DeepSpec's, SpecForge's and speculators' ``RNNHead`` alike, and specframe's), checked and taken out of
    ``tensors``, so the rest is checked as the vanilla head vLLM serves (the export check knows no other)."""
    recurrent = {}
    if head == "rnn":
        for name, shape in (("markov_head.joint_proj.weight", (3 * rank, 2 * rank + hidden)),
                            ("markov_head.joint_proj.bias", (3 * rank,))):
            layouts._check_shape(tensors, name, shape)
            recurrent[name] = tensors.pop(name)
    return recurrent


def _is_recurrent_dspark(directory: Path) -> bool:
    cfg = json.loads((directory / "config.json").read_text())
    return cfg.get("speculators_model_type") == "dspark" and cfg.get("markov_head_type") == "rnn"


def _read_speculators_rnn_dspark(directory: Path, target_config: Any) -> Imported:
    """A speculators ``dspark`` folder with the RNN head (speculators trains it; vLLM serves the vanilla head only,
    so ``check_layout``, the export check, refuses it): the layout's checks with the recurrence set aside."""
    from safetensors.torch import load_file

    from specframe.files import check_safetensors

    cfg = json.loads((directory / "config.json").read_text())
    manifest = layouts.read_manifest(directory)
    flat = layouts.flat_config(cfg)
    rank, hidden = layouts._require_ints(flat, "markov_rank", "hidden_size")
    weights = directory / layouts.WEIGHTS
    if not weights.is_file():
        raise SpecframeError(f"{layouts.WEIGHTS} is missing")
    check_safetensors(weights)
    tensors = {k: v for k, v in load_file(str(weights)).items() if not k.startswith("verifier_")}
    recurrent = _recurrence(tensors, "rnn", rank, hidden)
    layers = None if target_config is None else int(target_config.num_hidden_layers)
    tensors = layouts._dspark_parts(tensors, {**flat, "markov_head_type": "vanilla"}, layers)
    return Imported(directory, "speculators", "dspark", flat, {**tensors, **recurrent}, manifest.verifier,
                    manifest.drafter, manifest.speculative_tokens)


def _is_specforge_dspark(cfg: Mapping[str, Any]) -> bool:
    """SpecForge's DSpark config: a ``DSparkDraftModel``, or (its first release) a ``DFlashDraftModel`` whose
    ``dflash_config.projector_type`` is ``dspark``; a SpecForge DFlash or Domino folder is neither."""
    architectures = cfg.get("architectures") or []
    if SPECFORGE_DSPARK_ARCHITECTURE in architectures:
        return True
    method = cfg.get("dflash_config")
    return (SPECFORGE_DFLASH_ARCHITECTURE in architectures and isinstance(method, dict)
            and method.get("projector_type") == "dspark")


def _specforge_layer_ids(target_layers: int, draft_layers: int) -> list[int]:
    """The target layer ids SpecForge's DFlash backbone reads when its config names none (``build_target_layer_ids``
    in ``specforge/modeling/draft/dflash.py``): the middle layer for one draft layer, else one per draft layer spread
    evenly over layer outputs 1 .. L - 3, rounded by Python's round (half to even)."""
    if draft_layers == 1:
        return [target_layers // 2]
    step = (target_layers - 4) / (draft_layers - 1)
    return [round(1 + i * step) for i in range(draft_layers)]


# SpecForge's DSpark head fields: in dflash_config (SpecForge's main line), at the top level (the unmerged TorchSpec port)
_SPECFORGE_HEAD_FIELDS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
                          "confidence_head_alpha")


def _read_specforge_dspark(directory: Path, target_config: Any) -> Imported:
    """SpecForge's DSpark folder (module docstring) as the ``dspark`` layout: its ``dflash_config`` mapped onto the
    fields the speculators ``dspark`` layout carries, then checked as that export is (``layouts._dspark_parts``)."""
    cfg = json.loads((directory / "config.json").read_text())
    method = cfg.get("dflash_config") or {}
    if not isinstance(method, dict):
        raise SpecframeError(f"dflash_config is {method!r}, not the table of SpecForge's DFlash / DSpark fields")
    hidden, vocab, layers = layouts._require_ints(cfg, "hidden_size", "vocab_size", "num_hidden_layers")

    def head_field(name: str, default: Any) -> Any:
        if name in method and name in cfg and method[name] != cfg[name]:
            raise SpecframeError(f"dflash_config.{name} is {method[name]!r} and the top-level {name} is {cfg[name]!r}: "
                                 "SpecForge's DSpark reads the first, the TorchSpec port the second")
        return method[name] if name in method else cfg.get(name, default)

    projector = method.get("projector_type", "dspark")
    if projector != "dspark":
        raise SpecframeError(f"dflash_config.projector_type is {projector!r}: SpecForge's DSparkDraftModel requires "
                             "'dspark'")
    modes = method.get("attention_modes", [method.get("attention_mode", "gqa")])
    bad = [m for m in (modes if isinstance(modes, list | tuple) else [modes]) if str(m).lower() not in ("gqa", "mha")]
    if bad:
        raise SpecframeError(f"dflash_config attention mode {bad[0]!r}: specframe's DSpark layers are GQA / MHA "
                             "attention, as SpecForge's DSpark (its DFlash backbone's other modes have no counterpart)")
    rank = head_field("markov_rank", 0)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise SpecframeError(f"markov_rank is {rank!r}: a SpecForge DSpark drafter without a Markov head (markov_rank "
                             "0, its default) has no counterpart; specframe's dspark always has one")
    head = str(head_field("markov_head_type", "vanilla")).lower()
    if head not in ("vanilla", "rnn"):
        raise SpecframeError(f"markov_head_type is {head!r}: specframe's dspark computes SpecForge's vanilla and RNN "
                             "Markov heads only (the gated head's markov_head.gate_proj has no counterpart)")
    alpha = head_field("confidence_head_alpha", 0.0) or 0.0
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise SpecframeError(f"confidence_head_alpha is {alpha!r}, not a number")
    enable = head_field("enable_confidence_head", None)
    enable = bool(alpha > 0.0 if enable is None else enable)  # SpecForge's default: the head exists when weighted
    with_markov = enable and bool(head_field("confidence_head_with_markov", False))
    mask = method.get("mask_token_id")
    if mask is None:
        raise SpecframeError(
            "config.json records no dflash_config.mask_token_id: SpecForge resolves the mask token when training "
            "starts and exports the draft config it was given, so the token its mask slots were trained on is not in "
            "the folder; add \"mask_token_id\": <the id it trained with> to dflash_config")
    block = cfg.get("block_size")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise SpecframeError(f"block_size is {block!r}: SpecForge's DSpark config carries its block size there")
    n_target = cfg.get("num_target_layers")
    if target_config is not None and isinstance(n_target, int) and n_target != int(target_config.num_hidden_layers):
        raise SpecframeError(f"num_target_layers {n_target} differs from the target's {target_config.num_hidden_layers} "
                             "layers (the folder was trained for another target)")
    ids = method.get("target_layer_ids")
    if ids is None:
        if isinstance(n_target, bool) or not isinstance(n_target, int):
            raise SpecframeError("config.json has neither dflash_config.target_layer_ids nor num_target_layers (the "
                                 "target layers SpecForge's DSpark reads)")
        ids = _specforge_layer_ids(n_target, layers)
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                       for i in ids):
        raise SpecframeError(f"dflash_config.target_layer_ids is {ids!r}, not a list of target layer outputs (>= 0)")
    tensors = _load_weights(directory)
    maps = sorted(k for k in tensors if k in ("d2t", "t2d"))
    if maps:
        raise SpecframeError(f"tensor {maps[0]!r}: SpecForge's DSpark drafts over the target's whole vocabulary with "
                             "its lm_head, and specframe's dspark has no draft vocabulary to map")
    for name in [k for k in tensors if k.startswith(("logit_head.markov_head.", "logit_head.confidence_head."))]:
        tensors.setdefault(name[len("logit_head."):], tensors.pop(name))  # as SpecForge loads them: direct names win
    skipped = ("architectures", "auto_map", "model_type", "dflash_config", "tie_word_embeddings", "num_target_layers",
               *_SPECFORGE_HEAD_FIELDS)
    flat = {k: v for k, v in cfg.items() if k not in skipped}
    flat.update(
        aux_hidden_state_layer_ids=[i + 1 for i in ids], target_hidden_size=hidden, draft_vocab_size=vocab,
        mask_token_id=mask, markov_rank=rank, markov_head_type=head, sample_from_anchor=True,
        enable_confidence_head=enable, confidence_head_with_markov=with_markov,
    )
    recurrent = _recurrence(tensors, head, rank, hidden)
    target_layers = None if target_config is None else int(target_config.num_hidden_layers)
    tensors = layouts._dspark_parts(tensors, {**flat, "markov_head_type": "vanilla"}, target_layers)
    return Imported(directory, "specforge-dspark", "dspark", flat, {**tensors, **recurrent}, None, None)


def _load_weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise SpecframeError("no *.safetensors weights in the folder (pickled weights are not read)")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


# ------------------------------------------------------------------------------------------------ target checks


def _rope(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A config's RoPE as transformers standardises it (``rope_parameters``, else the older ``rope_scaling`` with a
    top-level ``rope_theta``): ``rope_type``, ``rope_theta`` (10000 when absent) and every scaling field, numbers as
    floats, so two configs that give the same frequencies compare equal however they spell them."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    params = dict(params) if isinstance(params, Mapping) else {}
    kind, legacy = params.pop("rope_type", None), params.pop("type", None)  # "type": before transformers 4.45
    kind = legacy if kind is None else kind
    theta = params.pop("rope_theta", None)
    theta = cfg.get("rope_theta") if theta is None else theta
    out: dict[str, Any] = {"rope_type": str(kind or "default"),
                           "rope_theta": float(DEFAULT_ROPE_THETA if theta is None else theta)}
    if out["rope_type"] in _ROPE_WITH_ORIGINAL_LENGTH and params.get("original_max_position_embeddings") is None:
        params["original_max_position_embeddings"] = cfg.get("original_max_position_embeddings",
                                                             cfg.get("max_position_embeddings"))
    for key, value in sorted(params.items()):
        if value is not None:
            out[key] = _rope_value(value)
    return out


def _rope_value(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float | list | tuple):
        return value
    return [float(v) for v in value] if isinstance(value, list | tuple) else float(value)


def _rope_difference(ours: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """One line naming the first RoPE field that differs and both values, or None when they agree."""
    for key in sorted(set(ours) | set(theirs), key=lambda k: (k not in ("rope_type", "rope_theta"), k)):
        a, b = ours.get(key), theirs.get(key)
        if a != b:
            show = lambda v: "absent" if v is None else repr(v)  # noqa: E731
            whole = lambda rope: ", ".join(f"{k} {v!r}" for k, v in rope.items())  # noqa: E731
            return (f"rope_parameters differ from the target's: {key} is {show(a)} in the drafter's config and "
                    f"{show(b)} in the target's (drafter: {whole(ours)}; target: {whole(theirs)}); specframe's drafters "
                    "run the target's RoPE, so a drafter trained with other frequencies cannot be imported")
    return None


def check_target(imported: Imported, target_config: Any, tokenizer: Any = None) -> None:
    """Refuse (one ``SpecframeError`` naming the field) a folder that cannot draft for ``target_config``: another
    vocabulary or hidden size, a layer shape, activation, norm epsilon or RoPE the drafter (built on the target's layer
    shape) cannot hold, aux layers the target does not have, or (``tokenizer`` given and the folder carries one)
    another tokenizer."""
    cfg = imported.config
    target = target_config.to_dict() if hasattr(target_config, "to_dict") else dict(target_config)
    if int(cfg["vocab_size"]) != int(target["vocab_size"]):
        raise SpecframeError(f"vocab_size {cfg['vocab_size']} differs from the target's {target['vocab_size']}")
    if imported.layout != "pard" and int(cfg["target_hidden_size"]) != int(target["hidden_size"]):
        raise SpecframeError(
            f"target_hidden_size {cfg['target_hidden_size']} differs from the target's hidden size {target['hidden_size']}"
        )
    heads = int(target["num_attention_heads"])
    expected = {
        "hidden_size": target["hidden_size"],
        "intermediate_size": target["intermediate_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": target.get("num_key_value_heads") or heads,
        "head_dim": target.get("head_dim") or int(target["hidden_size"]) // heads,
    }
    for key in _SHAPE_FIELDS:
        value = cfg.get(key)
        if key == "head_dim" and value is None:
            value = int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
        if key == "num_key_value_heads" and value is None:
            value = cfg.get("num_attention_heads")
        if value is not None and int(value) != int(expected[key]):
            raise SpecframeError(
                f"{key} {value} differs from the target's {expected[key]} (specframe's drafters use the target's "
                "layer shape)"
            )
    # the drafter's layers run the target's activation and norm epsilon (LayerShape.from_config), so a folder trained
    # with others would be imported as another network
    act = target.get("hidden_act") or target.get("hidden_activation") or "silu"
    if cfg.get("hidden_act") is not None and str(cfg["hidden_act"]) != str(act):
        raise SpecframeError(f"hidden_act {cfg['hidden_act']!r} differs from the target's {act!r} (specframe's drafters "
                             "use the target's activation)")
    eps = target.get("rms_norm_eps")
    if cfg.get("rms_norm_eps") is not None and eps is not None and float(cfg["rms_norm_eps"]) != float(eps):
        raise SpecframeError(f"rms_norm_eps {cfg['rms_norm_eps']} differs from the target's {eps} (specframe's drafters "
                             "use the target's norm epsilon)")
    differs = _rope_difference(_rope(cfg), _rope(target))
    if differs:
        raise SpecframeError(differs)
    n = int(target["num_hidden_layers"])
    bad = [i for i in imported.aux_layer_ids if not 0 <= i < n]
    if bad:
        raise SpecframeError(
            f"eagle_aux_hidden_state_layer_ids {imported.aux_layer_ids}: {bad} are not layers of the {n}-layer target"
        )
    if tokenizer is not None:
        check_tokenizer(imported.directory, tokenizer)


def check_tokenizer(directory: Path, tokenizer: Any) -> None:
    """Refuse a folder whose saved tokenizer (when it carries one) maps tokens to other ids than ``tokenizer``."""
    if not any((directory / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return
    from transformers import AutoTokenizer

    try:
        theirs = AutoTokenizer.from_pretrained(str(directory)).get_vocab()
    except (OSError, ValueError) as e:
        raise SpecframeError(f"tokenizer: its saved tokenizer does not load ({e})") from None
    ours = tokenizer.get_vocab()
    if theirs != ours:
        differ = len(set(theirs.items()) ^ set(ours.items()))
        raise SpecframeError(
            f"tokenizer: its saved tokenizer is not the target's ({len(theirs)} vs {len(ours)} tokens, {differ} "
            "token-id pairs differ)"
        )


def target_tokenizer(target_config: Any) -> Any:
    """The tokenizer of the target a config was loaded from, when it is a local folder (else None)."""
    source = getattr(target_config, "_name_or_path", None)
    if not source or not Path(source).is_dir():
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError):
        return None


def target_embedding(target_config: Any) -> torch.Tensor | None:
    """The target's input embedding, read from its local safetensors files (None when not found)."""
    from safetensors import safe_open

    source = getattr(target_config, "_name_or_path", None)
    if not source or not Path(source).is_dir():
        return None
    for f in sorted(Path(source).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            if "model.embed_tokens.weight" in handle.keys():
                return handle.get_tensor("model.embed_tokens.weight")
    return None


def target_lm_head(target_config: Any) -> torch.Tensor | None:
    """The target's output head from its local safetensors files (its embedding when the two are tied), or None."""
    head = _target_tensor(target_config, "lm_head.weight")
    if head is None and getattr(target_config, "tie_word_embeddings", False):
        head = target_embedding(target_config)
    return head


def _target_tensor(target_config: Any, name: str) -> torch.Tensor | None:
    from safetensors import safe_open

    source = getattr(target_config, "_name_or_path", None)
    if not source or not Path(source).is_dir():
        return None
    for f in sorted(Path(source).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            if name in handle.keys():
                return handle.get_tensor(name)
    return None


def _with_shared_target_weights(imported: Imported, target_config: Any) -> Imported:
    """A DFlash or DSpark folder without ``embed_tokens`` / ``lm_head`` (speculators writes none: vLLM shares the target's) with
    the target's, read from its local files; left without them when those are not found (the drafter names it)."""
    if imported.layout not in ("dflash", "dspark"):  # DSpark's export is DFlash's layout plus its heads
        return imported
    tensors = dict(imported.tensors)
    for name, read_target in (("embed_tokens.weight", target_embedding), ("lm_head.weight", target_lm_head)):
        if name not in tensors:
            value = read_target(target_config)
            if value is not None:
                tensors[name] = value
    return attrs.evolve(imported, tensors=tensors)


# -------------------------------------------------------------------------------------------- into a drafter


def drafter_options(imported: Imported, cls: type) -> Any:
    """The drafter plugin options that give ``cls`` the folder's shape (layers, aux layers, draft vocabulary, ...):
    what the drafter declares for it (``Drafter.import_options``, API 6)."""
    return cls.Options(**cls.import_options(imported))


def warm_start(drafter: Any, directory: str | os.PathLike, target_config: Any, tokenizer: Any = None) -> None:
    """``train --init-from``: load the folder at ``directory`` into a built and prepared ``drafter`` (its draft
    vocabulary and mask token come from the folder), after checking it against the target and tokenizer."""
    imported = read(directory, target_config)
    if imported.plugin != drafter.name and imported.layout != drafter.name:
        raise SpecframeError(
            f"cannot import {directory}: it holds a {imported.layout} drafter, and this run trains '{drafter.name}' "
            f"(pass --drafter {imported.layout})"
        )
    if tokenizer is not None:
        try:
            check_tokenizer(imported.directory, tokenizer)
        except SpecframeError as e:
            raise SpecframeError(f"cannot import {directory}: {e}") from None
    drafter.import_weights(imported)


def missing_embedding(imported: Imported, target_config: Any) -> torch.Tensor:
    """The embedding an EAGLE folder without ``embed_tokens`` shares with the target (vLLM does the same)."""
    emb = target_embedding(target_config)
    if emb is None:
        raise SpecframeError(
            f"cannot import {imported.directory}: it has no embed_tokens.weight (it shares the target's) and the "
            "target's embedding was not found in a local safetensors folder"
        )
    return emb


def eagle_state(
    imported: Imported, own: Mapping[str, torch.Tensor], target_config: Any, *, own_embedding_is_target: bool = False
) -> dict[str, torch.Tensor]:
    """The folder's EAGLE tensors as a full state dict for a module whose state dict is ``own``: a missing
    ``embed_tokens`` is the target's (from its files, or ``own``'s when ``own_embedding_is_target``: a prepared
    drafter), a full draft vocabulary gets identity ``d2t`` / all-true ``t2d``; an unexpected or missing tensor is
    named."""
    tensors = dict(imported.tensors)
    if "embed_tokens.weight" not in tensors:
        emb = target_embedding(target_config)
        if emb is None and own_embedding_is_target:
            emb = own["embed_tokens.weight"]
        tensors["embed_tokens.weight"] = emb if emb is not None else missing_embedding(imported, target_config)
    if "d2t" not in tensors and "d2t" in own:
        tensors["d2t"] = torch.zeros(imported.draft_vocab_size, dtype=torch.long)
        tensors["t2d"] = torch.ones(int(imported.config["vocab_size"]), dtype=torch.bool)
    extra = sorted(set(tensors) - set(own))
    missing = sorted(set(own) - set(tensors))
    if extra:
        raise SpecframeError(f"cannot import {imported.directory}: tensor {extra[0]!r} has no place in the drafter")
    if missing:
        raise SpecframeError(f"cannot import {imported.directory}: missing tensor {missing[0]!r}")
    for name, value in own.items():
        if tuple(tensors[name].shape) != tuple(value.shape):
            raise SpecframeError(
                f"cannot import {imported.directory}: tensor {name!r} has shape {list(tensors[name].shape)}, the "
                f"drafter's is {list(value.shape)}"
            )
    return {k: tensors[k].to(own[k].dtype) for k in own}


def check_shape(imported: Imported, drafter: str, **expected: Any) -> None:
    """Refuse a folder whose shape differs from a drafter built from the run's options (``--init-from``)."""
    actual = {"layers": imported.num_layers, "aux_layer_ids": imported.aux_layer_ids,
              "draft_vocab_size": imported.draft_vocab_size, **imported.architecture}
    for key, value in expected.items():
        if actual[key] != value:
            raise SpecframeError(
                f"cannot import {imported.directory}: its {key} is {actual[key]}, this {drafter} drafter's is {value} "
                f"(set drafter.{key} to match)"
            )

