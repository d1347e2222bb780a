"""The EAGLE-3 and P-EAGLE layouts: speculators ``eagle3`` / ``peagle``, written by ``write_eagle3`` /
``write_peagle``, served by vLLM's eagle3 method (P-EAGLE: with ``parallel_drafting``).

``config.json``: the speculators envelope (``specframe.layouts.speculators``) with ``transformer_layer_config`` (the
drafter's Llama layer config: sizes, RoPE, ``num_hidden_layers`` = drafter depth, ``vocab_size`` = the target's), and
at the top ``draft_vocab_size``, ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids``, the flags
``norm_before_residual``, ``norm_before_fc``, ``fc_norm`` and ``norm_output`` (each written, as the drafter computes
it: vLLM's eagle3 default for an absent ``norm_before_residual`` is true) and, for P-EAGLE, ``mask_token_id``. A
drafter with ``qk_norm`` gets a ``qwen3`` layer config (vLLM's Eagle3Qwen3 / PeagleQwen3 models), one with
``sliding_window`` W ``layer_types`` of ``sliding_attention`` on every layer with ``sliding_window`` W. vLLM 0.32 then
serves the folder alone, ``LLM(model=EXPORT)`` / ``vllm serve EXPORT``: it starts the verifier named in the folder (a
local folder path works) with method ``eagle3`` (P-EAGLE: ``parallel_drafting``) and ``speculative_tokens`` tokens per
step; an explicit ``speculative_config`` naming the folder as ``model`` works as well.

Weights (names as vLLM's ``llama_eagle3`` model loads them): ``fc.weight`` [H, n_aux * H_target], ``layers.{i}.*``
(layer 0's q/k/v read cat(embedding, hidden), 2H wide, and it has ``hidden_norm``; later layers are plain Llama
layers, H wide), ``norm.weight``, ``lm_head.weight`` [draft_vocab, H], ``d2t`` (offsets: target id = draft id +
d2t[draft id]) and ``t2d`` (bool [vocab]) when the draft vocabulary is smaller than the target's, and optionally
``embed_tokens.weight`` [vocab, H] (without it vLLM shares the target's). vLLM feeds layer i > 0 the previous layer's
output through a pre-norm residual stream, and the next autoregressive step reads the final *pre-norm* hidden state
(the normed one with ``norm_output``); ``input_norm.weight`` [n_aux * H_target] with ``norm_before_fc``, and
``self_attn.q_norm`` / ``k_norm`` [head_dim] per layer in a qwen3 layer config.
P-EAGLE adds ``mask_hidden`` [1, 1, n_aux * H_target] (projected by ``fc`` like real aux states).

``eagle3_parts`` (the EAGLE backbone's tensor checks) is ParallelSpec's too, and the foreign EAGLE readers'.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from specframe.errors import SpecframeError
from specframe.layouts.checks import (
    check_int,
    check_layer_count,
    check_layer_order,
    check_shape,
    require_ints,
    tensors as cpu_tensors,
    token_id,
)
from specframe.layouts.manifest import DEFAULT_SPECULATIVE_TOKENS, Manifest, Serving
from specframe.layouts.speculators import (
    IDENTITY_KEYS,
    envelope,
    layer_config,
    set_dtype,
    with_target_hidden_size,
)
from specframe.layouts.table import Layout, register_layout
from specframe.layouts.target_checks import sliding_window_layers
from specframe.layouts.writing import write

#: the speculators fields specframe's EAGLE-3 layers cannot compute otherwise than as written (value they must have)
FIXED_FLAGS = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False}
# the EAGLE layer architecture a flat config carries besides the Llama fields (``specframe.drafting.family_options.Architecture``):
# qk_norm is the layer config's model_type (qwen3), sliding_window its layer_types, the rest top-level flags
_ARCHITECTURE = ("qk_norm", "sliding_window")
# the layer fields a speculators config may leave out as its config class's default (it writes to_diff_dict)
_LAYER_SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "num_hidden_layers", "vocab_size", "rms_norm_eps", "hidden_act", "max_position_embeddings")
# the layer config keys that spell a sliding window; a flat config says it once, as ``sliding_window``
_WINDOW_KEYS = ("sliding_window", "layer_types", "use_sliding_window", "max_window_layers")
#: top-level speculators fields that belong to the drafter, not to its transformer layer config
EAGLE_FIELDS = ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "mask_token_id")


# --------------------------------------------------------------------------------------------------------- writers


def write_eagle3(
    directory: str | os.PathLike,
    weights: Mapping[str, torch.Tensor],
    *,
    config: Mapping[str, Any],
    aux_layer_ids: Sequence[int],
    target_hidden_size: int,
    target_num_layers: int | None = None,
    tokenizer: Any = None,
    drafter: str | None = "eagle3",
    verifier: str | None = None,
    speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS,
    verifier_architectures: Sequence[str] | None = None,
    architecture: Mapping[str, Any] | None = None,
    serving: Serving | None = None,
) -> Manifest:
    """Write an autoregressive EAGLE-3 drafter (speculators ``eagle3``).

    ``weights`` uses the layout names above (``midlayer.*`` is accepted for ``layers.0.*``); ``config`` is the
    drafter's Llama config (``llama_config`` builds one) with ``num_hidden_layers`` = drafter layers and
    ``vocab_size`` = the target's; ``draft_vocab_size`` is read from ``lm_head.weight``. ``aux_layer_ids`` are the
    target hidden states the drafter reads (id i = the hidden state entering target layer i, 0 = the embeddings; a
    tiny target needs them explicitly, vLLM's default assumes many layers); ``target_num_layers`` bounds them.
    ``verifier`` names the target vLLM starts for ``LLM(model=EXPORT)`` (``verifier_name`` of its folder or hub id),
    ``verifier_architectures`` its own architectures (``verifier_architectures_of``; recorded, vLLM does not read
    them); ``speculative_tokens`` is the default number of draft tokens per step. ``architecture``: the drafter's
    layer architecture (``specframe.drafting.family_options.Architecture.export_fields``: ``qk_norm`` -> a qwen3 layer config,
    ``sliding_window`` -> ``layer_types``, the EAGLE 3.1 flags at the top); none: specframe's default one.
    ``serving`` (API 14): the verifier and draft tokens the user chose (``Drafter.export_vllm`` is handed them),
    which replace ``verifier`` / ``speculative_tokens`` where given (a number of draft tokens the export cannot be
    served at refused) before ``config.json`` is written, once. Returns the ``Manifest`` of what was written (every
    writer does; ``Manifest.as_dict()`` is the dict they returned up to API 13).
    """
    config = {**config, **(architecture or {})}
    tensors, cfg = eagle3_parts(weights, config, aux_layer_ids, target_hidden_size, target_num_layers)
    if "mask_hidden" in tensors:
        raise SpecframeError("an autoregressive EAGLE-3 export has no mask_hidden; use write_peagle for P-EAGLE")
    full = _eagle3_config(cfg, verifier=verifier, speculative_tokens=speculative_tokens, drafter=drafter,
                          verifier_architectures=verifier_architectures)
    return write(directory, tensors, full, tokenizer, serving)


def write_peagle(
    directory: str | os.PathLike,
    weights: Mapping[str, torch.Tensor],
    *,
    config: Mapping[str, Any],
    aux_layer_ids: Sequence[int],
    target_hidden_size: int,
    mask_token_id: int,
    target_num_layers: int | None = None,
    tokenizer: Any = None,
    drafter: str | None = "peagle",
    verifier: str | None = None,
    speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS,
    verifier_architectures: Sequence[str] | None = None,
    architecture: Mapping[str, Any] | None = None,
    serving: Serving | None = None,
) -> Manifest:
    """Write a P-EAGLE drafter (speculators ``peagle``: vLLM's eagle3 method with ``parallel_drafting``):
    ``write_eagle3``'s layout plus ``mask_hidden`` [1, 1, n_aux * H_target] in ``weights`` and ``mask_token_id`` (a
    target-vocabulary id whose embedding row the mask slots read) in the config; ``serving`` as ``write_eagle3``'s."""
    config = {**config, **(architecture or {})}
    if config.get("norm_output"):
        # vLLM 0.32's update_peagle does not pass norm_output on, and a parallel drafter has no step to feed
        raise SpecframeError("norm_output is true: a P-EAGLE drafter feeds no step forward, and vLLM's peagle reader "
                             "does not take the flag")
    tensors, cfg = eagle3_parts(weights, config, aux_layer_ids, target_hidden_size, target_num_layers)
    peagle_parts(tensors, cfg, mask_token_id)
    full = _peagle_config(cfg, verifier=verifier, speculative_tokens=speculative_tokens, drafter=drafter,
                          verifier_architectures=verifier_architectures)
    return write(directory, tensors, full, tokenizer, serving)


# ------------------------------------------------------------------------------------- config.json and its inverse


def _eagle_config(kind: str, architecture: str):
    """The ``config`` builder of the ``kind`` layout (speculators architecture ``architecture``)."""

    def config(flat: Mapping[str, Any], *, verifier: str | None, speculative_tokens: int, drafter: str | None,
               verifier_architectures: Sequence[str] | None = None) -> dict[str, Any]:
        check_int("speculative_tokens", speculative_tokens, 1)
        layer = {k: v for k, v in flat.items()
                 if k not in EAGLE_FIELDS and k not in FIXED_FLAGS and k not in _ARCHITECTURE and k not in _WINDOW_KEYS}
        if flat.get("qk_norm"):  # Qwen3 layers (q/k norms): vLLM's Eagle3Qwen3 / PeagleQwen3 models build them
            layer.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", tie_word_embeddings=False)
        else:
            layer.update(architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=False)
        layer.update(_layer_types(flat.get("sliding_window"), int(layer["num_hidden_layers"]),
                                  bool(flat.get("qk_norm"))))
        full = envelope(kind, architecture, layer, verifier=verifier, speculative_tokens=speculative_tokens,
                        drafter=drafter, verifier_architectures=verifier_architectures)
        full.update({k: flat[k] for k in EAGLE_FIELDS if k in flat})
        # every flag written, true or false: vLLM reads an absent norm_before_residual of an eagle3 folder as true
        full.update({k: bool(flat.get(k, default)) for k, default in FIXED_FLAGS.items()})
        return full

    return config


_eagle3_config = _eagle_config("eagle3", "Eagle3DraftModel")
_peagle_config = _eagle_config("peagle", "PEagleDraftModel")


def _layer_types(window: Any, layers: int, qwen3: bool) -> dict[str, Any]:
    """The layer config keys of a sliding ``window`` on every one of ``layers`` draft layers (None: full attention),
    as transformers, vLLM and speculators read them (Qwen3 keeps the window only with ``use_sliding_window``)."""
    if window is not None:
        return {"sliding_window": int(window), "layer_types": ["sliding_attention"] * layers,
                "use_sliding_window": True}
    return {"layer_types": ["full_attention"] * layers, "use_sliding_window": False} if qwen3 else {}


def eagle_flat(config: Mapping[str, Any]) -> dict[str, Any]:
    """The flat config of a speculators EAGLE-3 / P-EAGLE ``config.json``: its layer config's fields as transformers
    builds them (speculators writes only the differences from its config class's defaults), plus the architecture
    (``qk_norm`` from a qwen3 layer, the EAGLE 3.1 flags, ``sliding_window`` from ``layer_types``) and the EAGLE
    fields; ``fc_norm``, other layer types and a window on only some layers are refused, naming the field."""
    from transformers import AutoConfig

    layer = layer_config(config)
    model_type = layer.get("model_type", "llama")
    if model_type not in ("llama", "qwen3"):
        raise SpecframeError(f"transformer_layer_config.model_type is {model_type!r}; specframe's EAGLE layers are "
                             "Llama or Qwen3 (q/k norms) layers")
    if config.get("fc_norm"):
        raise SpecframeError("fc_norm is true: specframe's EAGLE-3 layer computes only fc_norm = false (norm_before_fc "
                             "is its single norm over the concatenated aux states)")
    flat = {k: v for k, v in layer.items() if k not in IDENTITY_KEYS}
    fields = {k: v for k, v in layer.items() if k not in ("model_type", "architectures", "auto_map")}
    try:
        built = AutoConfig.for_model(model_type, **fields).to_dict()
    except (ValueError, TypeError, KeyError):
        built = {}
    for key in _LAYER_SIZES:  # what the layers compute with, as speculators' reader and vLLM take it when unwritten
        if flat.get(key) is None and built.get(key) is not None:
            flat[key] = built[key]
    layers = int(flat.get("num_hidden_layers") or 1)
    sliding, window = sliding_window_layers(layer)
    if sliding and len(sliding) != layers:
        raise SpecframeError(
            f"layer_types make drafter layers {sliding} of {layers} sliding_attention (window {window}) and the rest "
            "full attention; specframe's sliding_window applies to every draft layer")
    for key in _WINDOW_KEYS:
        flat.pop(key, None)
    kind = config.get("speculators_model_type")
    flat.update(
        qk_norm=model_type == "qwen3",
        sliding_window=window if sliding else None,
        # vLLM reads a missing norm_before_residual of an eagle3 speculator as true (update_eagle3), of peagle false
        norm_before_residual=bool(config.get("norm_before_residual", kind == "eagle3")),
        norm_before_fc=bool(config.get("norm_before_fc", False)),
        norm_output=bool(config.get("norm_output", False)),
    )
    flat.update({k: config[k] for k in EAGLE_FIELDS if config.get(k) is not None})
    return with_target_hidden_size(flat)


# --------------------------------------------------------------------------------------------------- tensor checks


def eagle3_parts(
    weights: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    aux_layer_ids: Sequence[int],
    target_hidden_size: int,
    target_num_layers: int | None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Check an EAGLE backbone's tensors against its Llama config (every weight vLLM's ``llama_eagle3`` loads,
    shaped; ``midlayer.*`` read as ``layers.0.*``); returns the tensors as written and the flat config with the EAGLE
    fields (``draft_vocab_size`` from ``lm_head``, ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids``)."""
    tensors = {re.sub(r"^midlayer\.", "layers.0.", k): v for k, v in cpu_tensors(weights).items()}
    cfg = dict(config)
    vocab, hidden, layers, heads = require_ints(cfg, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    inter = require_ints(cfg, "intermediate_size")[0]
    aux = [int(i) for i in aux_layer_ids]
    if not aux:
        raise SpecframeError("aux_layer_ids is empty: EAGLE-3 reads at least one target hidden state")
    # id i is the hidden state entering target layer i; vLLM's target collects those of layers 0..L-1 only, so id L
    # (the last layer's output) would never reach the drafter
    if target_num_layers is not None and any(not 0 <= i < target_num_layers for i in aux):
        raise SpecframeError(
            f"aux layer ids {aux} are invalid for a target with {target_num_layers} layers (valid: "
            f"0..{target_num_layers - 1}, the hidden state entering each layer, which is what vLLM's target collects)"
        )
    check_layer_order(aux, "aux layer ids")
    h_t = int(target_hidden_size)

    check_shape(tensors, "fc.weight", (hidden, len(aux) * h_t))
    check_shape(tensors, "norm.weight", (hidden,))
    if "embed_tokens.weight" in tensors:
        check_shape(tensors, "embed_tokens.weight", (vocab, hidden))
    check_layer_count(tensors, "layers.", layers)
    for i in range(layers):
        width = 2 * hidden if i == 0 else hidden
        p = f"layers.{i}."
        check_shape(tensors, p + "self_attn.q_proj.weight", (heads * head_dim, width))
        check_shape(tensors, p + "self_attn.k_proj.weight", (kv_heads * head_dim, width))
        check_shape(tensors, p + "self_attn.v_proj.weight", (kv_heads * head_dim, width))
        check_shape(tensors, p + "self_attn.o_proj.weight", (hidden, heads * head_dim))
        check_shape(tensors, p + "mlp.gate_proj.weight", (inter, hidden))
        check_shape(tensors, p + "mlp.up_proj.weight", (inter, hidden))
        check_shape(tensors, p + "mlp.down_proj.weight", (hidden, inter))
        check_shape(tensors, p + "input_layernorm.weight", (hidden,))
        check_shape(tensors, p + "post_attention_layernorm.weight", (hidden,))
        for norm in ("q_norm", "k_norm"):
            name = p + f"self_attn.{norm}.weight"
            if cfg.get("qk_norm"):
                check_shape(tensors, name, (head_dim,))
            elif name in tensors:
                raise SpecframeError(f"{name} is present but the layer config is not qwen3 (no q/k norms)")
        if i == 0:
            check_shape(tensors, p + "hidden_norm.weight", (hidden,))
        elif p + "hidden_norm.weight" in tensors:
            # vLLM builds a hidden_norm on every layer but reads it only on the first
            del tensors[p + "hidden_norm.weight"]

    if cfg.get("norm_before_fc"):
        check_shape(tensors, "input_norm.weight", (len(aux) * h_t,))
    elif "input_norm.weight" in tensors:
        del tensors["input_norm.weight"]  # vLLM drops it without norm_before_fc (load_weights), and so does specframe

    head = tensors.get("lm_head.weight")
    if head is None:
        raise SpecframeError("missing weight 'lm_head.weight' ([draft_vocab, H])")
    draft_vocab = int(head.shape[0])
    check_shape(tensors, "lm_head.weight", (draft_vocab, hidden))
    if not 0 < draft_vocab <= vocab:
        raise SpecframeError(f"lm_head.weight has {draft_vocab} rows; the draft vocabulary must be 1..{vocab}")
    _check_draft_vocab(tensors, draft_vocab, vocab)

    for key in ("architectures", "model_type", "num_aux_hidden_states", "tie_word_embeddings"):
        cfg.pop(key, None)
    cfg.update(draft_vocab_size=draft_vocab, target_hidden_size=h_t, eagle_aux_hidden_state_layer_ids=aux)
    set_dtype(cfg)
    return tensors, cfg


def peagle_parts(tensors: dict[str, torch.Tensor], cfg: dict[str, Any], mask_token_id: Any) -> None:
    """Check P-EAGLE's ``mask_hidden`` (reshaped to [1, 1, n_aux * H_target]) and its ``mask_token_id`` (set in
    ``cfg``)."""
    width = len(cfg["eagle_aux_hidden_state_layer_ids"]) * int(cfg["target_hidden_size"])
    mask = tensors.get("mask_hidden")
    if mask is None:
        raise SpecframeError("a P-EAGLE export needs 'mask_hidden' (the learned hidden state of mask slots)")
    if mask.numel() != width:
        raise SpecframeError(f"mask_hidden has shape {tuple(mask.shape)}, expected [1, 1, {width}] (n_aux * H_target)")
    tensors["mask_hidden"] = mask.reshape(1, 1, width)
    cfg["mask_token_id"] = token_id("mask_token_id", mask_token_id, int(cfg["vocab_size"]))


def _check_draft_vocab(tensors: dict[str, torch.Tensor], draft_vocab: int, vocab: int) -> None:
    d2t = tensors.get("d2t")
    if draft_vocab == vocab:
        # vLLM has no draft-to-target map for a full draft vocabulary and refuses one in the weights
        if d2t is not None and bool(d2t.ne(0).any()):
            raise SpecframeError("d2t is not the identity although the draft vocabulary is the full target vocabulary")
        tensors.pop("d2t", None)
        tensors.pop("t2d", None)
        return
    if d2t is None:
        raise SpecframeError(f"a draft vocabulary of {draft_vocab} < {vocab} tokens needs 'd2t' (offsets to target ids)")
    check_shape(tensors, "d2t", (draft_vocab,))
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise SpecframeError(f"d2t must hold integer offsets, got {d2t.dtype}")
    targets = torch.arange(draft_vocab) + d2t.long()
    if int(targets.min()) < 0 or int(targets.max()) >= vocab:
        raise SpecframeError(f"d2t maps draft ids to target ids outside 0..{vocab - 1}")
    if targets.unique().numel() != draft_vocab:
        raise SpecframeError("d2t maps two draft ids to the same target id")
    tensors["d2t"] = d2t.long()
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[targets] = True
    given = tensors.get("t2d")
    if given is not None:
        check_shape(tensors, "t2d", (vocab,))
        if not torch.equal(given.bool(), t2d):
            raise SpecframeError("t2d does not mark exactly the target ids that d2t maps to")
    tensors["t2d"] = t2d


def eagle_backbone(tensors: dict, flat: dict[str, Any], target_num_layers: int | None) -> tuple[dict, dict]:
    """``eagle3_parts`` of an export's tensors and flat config, the aux layers and target width read from the
    config."""
    aux = flat.get("eagle_aux_hidden_state_layer_ids")
    if not isinstance(aux, list):
        raise SpecframeError("config.json lacks eagle_aux_hidden_state_layer_ids")
    return eagle3_parts(tensors, flat, aux, require_ints(flat, "target_hidden_size")[0], target_num_layers)


def _check_eagle3(tensors: dict, cfg: Mapping[str, Any], target_num_layers: int | None) -> tuple[dict, dict]:
    tensors, flat = eagle_backbone(tensors, eagle_flat(cfg), target_num_layers)
    if "mask_hidden" in tensors:
        raise SpecframeError("an autoregressive EAGLE-3 export has no mask_hidden")
    return tensors, flat


def _check_peagle(tensors: dict, cfg: Mapping[str, Any], target_num_layers: int | None) -> tuple[dict, dict]:
    tensors, flat = eagle_backbone(tensors, eagle_flat(cfg), target_num_layers)
    peagle_parts(tensors, flat, flat.get("mask_token_id"))
    return tensors, flat


EAGLE3 = register_layout(Layout(
    name="eagle3", method="eagle3", parallel_drafting=False, check=_check_eagle3, speculators="Eagle3DraftModel",
    config=_eagle3_config, flat=eagle_flat, silu_only=True, eagle_architecture=True,
))
PEAGLE = register_layout(Layout(
    name="peagle", method="eagle3", parallel_drafting=True, check=_check_peagle, speculators="PEagleDraftModel",
    config=_peagle_config, flat=eagle_flat, silu_only=True, eagle_architecture=True,
))
