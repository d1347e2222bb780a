"""Writers (and the matching reader) for the drafter checkpoint layouts vLLM (0.32 and later) loads.

A drafter plugin's ``export_vllm`` gathers its tensors under the layout's names plus a few config values, and calls
one of ``write_eagle3``, ``write_peagle`` or ``write_pard``. Each writer validates shapes and ids (raising
``SpecframeError`` with the offending name), then writes ``config.json``, ``model.safetensors`` and the tokenizer
files (when given a tokenizer) into a temporary folder beside ``directory`` and moves it into place, so a reader
never sees half an export. ``config.json`` alone says what the folder is (``read_manifest``); a ``specframe`` entry in
it records which drafter plugin and specframe version wrote it.

EAGLE-3 and P-EAGLE are written in the speculators format (vllm-project/speculators; vLLM's
``transformers_utils/configs/speculators``): ``speculators_model_type`` ``eagle3`` / ``peagle``,
``speculators_config`` with ``proposal_methods[0].speculative_tokens`` and ``verifier.name_or_path`` (the target),
``transformer_layer_config`` (the drafter's Llama layer config: sizes, RoPE, ``num_hidden_layers`` = drafter depth,
``vocab_size`` = the target's), and at the top ``draft_vocab_size``, ``target_hidden_size``,
``eagle_aux_hidden_state_layer_ids``, the flags ``norm_before_residual``, ``norm_before_fc``, ``fc_norm`` and
``norm_output`` (each written, as the drafter computes it: vLLM's eagle3 default for an absent ``norm_before_residual``
is true) and, for P-EAGLE, ``mask_token_id``. A drafter with ``qk_norm`` gets a ``qwen3`` layer config (vLLM's
Eagle3Qwen3 / PeagleQwen3 models), one with ``sliding_window`` W ``layer_types`` of ``sliding_attention`` on every layer
with ``sliding_window`` W. vLLM 0.32 then serves the folder alone, ``LLM(model=EXPORT)`` / ``vllm serve EXPORT``: it
starts the verifier named in the folder (a local folder path works) with method ``eagle3`` (P-EAGLE:
``parallel_drafting``) and ``speculative_tokens`` tokens per step; an explicit ``speculative_config`` naming the folder
as ``model`` works as well.

Weights (names as vLLM's ``llama_eagle3`` model loads them): ``fc.weight`` [H, n_aux * H_target], ``layers.{i}.*``
(layer 0's q/k/v read cat(embedding, hidden), 2H wide, and it has ``hidden_norm``; later layers are plain Llama
layers, H wide), ``norm.weight``, ``lm_head.weight`` [draft_vocab, H], ``d2t`` (offsets: target id = draft id +
d2t[draft id]) and ``t2d`` (bool [vocab]) when the draft vocabulary is smaller than the target's, and optionally
``embed_tokens.weight`` [vocab, H] (without it vLLM shares the target's). vLLM feeds layer i > 0 the previous layer's
output through a pre-norm residual stream, and the next autoregressive step reads the final *pre-norm* hidden state
(the normed one with ``norm_output``); ``input_norm.weight`` [n_aux * H_target] with ``norm_before_fc``, and
``self_attn.q_norm`` / ``k_norm`` [head_dim] per layer in a qwen3 layer config.
P-EAGLE adds ``mask_hidden`` [1, 1, n_aux * H_target] (projected by ``fc`` like real aux states).

DFlash (``speculators_model_type`` ``dflash``, vLLM's ``update_dflash``; written by ``write_dflash`` for the
``specframe-dflash`` plugin): the same ``speculators_config`` with a Qwen3 ``transformer_layer_config`` (the DFlash
layers have per-head ``q_norm`` / ``k_norm``), and at the top ``draft_vocab_size``, ``target_hidden_size``,
``mask_token_id``, ``aux_hidden_state_layer_ids`` (specframe's aux ids: vLLM reads target layer output id - 1) and
``block_size``. Weights under vLLM's ``DFlashQwen3Model`` names: ``fc.weight`` [H, n_aux * H_target],
``hidden_norm.weight``, ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``,
``layers.{i}.{input,post_attention}_layernorm.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight``,
``norm.weight``, and ``embed_tokens.weight`` [vocab, H] and ``lm_head.weight`` [vocab, H] (specframe writes both;
without them vLLM shares the target's, and the importer reads the target's). vLLM serves it with method
``dflash`` (its own block drafting, no ``parallel_drafting`` flag) at ``block_size - 1`` tokens per step only: its
proposer runs a block of K + 1 slots, so fewer would be another network than the one trained (``Manifest.refusal``).

DSpark (``speculators_model_type`` ``dspark``, vLLM's ``update_dspark``; written by ``write_dspark`` for the
``specframe-dspark`` plugin): the DFlash layout (the same backbone weights and layer config, architecture
``Qwen3DSparkModel``) plus ``markov_head.markov_w1.weight`` [vocab, rank], ``markov_head.markov_w2.weight``
[vocab, rank] and, with the confidence head, ``confidence_head.proj.weight`` [1, H (+ rank)] and
``confidence_head.proj.bias`` [1]; top-level ``markov_rank``, ``markov_head_type`` (vLLM builds the vanilla head
only), ``enable_confidence_head``, ``confidence_head_with_markov``, ``use_aux_hidden_state`` and
``sample_from_anchor`` true: the anchor slot is the first prediction, so a block of ``block_size`` slots drafts
``block_size`` tokens, and vLLM's DSpark speculator runs exactly K slots for K tokens, so it serves K = block_size
only (a shorter block is another network: bidirectional attention).

PARD (``{"method": "draft_model", "parallel_drafting": true}``; vLLM 0.32 has no speculators type for it): a plain
causal LM (``LlamaForCausalLM`` names: ``model.embed_tokens.weight``, ``model.layers.{i}.*``, ``model.norm.weight``,
``lm_head.weight``) whose config has ``pard_token``. vLLM needs the target and an explicit ``speculative_config``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from specframe import __version__
from specframe.errors import SpecframeError

WEIGHTS = "model.safetensors"
LAYOUTS = ("eagle3", "peagle", "pard", "parallelspec", "dflash", "dspark")
#: the architecture of specframe's vLLM general plugin model for ParallelSpec (``specframe.vllm.vllm_plugin``)
PARALLELSPEC_ARCHITECTURE = "ParallelSpecLlamaForCausalLMEagle3"
#: the speculators layouts (``speculators_model_type``) and the architecture name the speculators library gives them
SPECULATORS = {"eagle3": "Eagle3DraftModel", "peagle": "PEagleDraftModel", "dflash": "DFlashDraftModel",
               # vLLM's update_dspark keeps this architecture (and defaults to it); there is no speculators class
               "dspark": "Qwen3DSparkModel"}
DEFAULT_SPECULATIVE_TOKENS = 5
#: the config.json entry recording which drafter plugin and specframe version wrote an export
PROVENANCE = "specframe"
#: the key in that entry under which a block drafter declares the fewest draft tokens vLLM serves it at
MIN_TOKENS = "min_speculative_tokens"
# the speculators fields specframe's EAGLE-3 layers cannot compute otherwise than as written (value they must have)
_FIXED_FLAGS = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False}
# the EAGLE layer architecture a flat config carries besides the Llama fields (``specframe.eagle.Architecture``):
# qk_norm is the layer config's model_type (qwen3), sliding_window its layer_types, the rest top-level flags
_ARCHITECTURE = ("qk_norm", "sliding_window")
# the layer fields a speculators config may leave out as its config class's default (it writes to_diff_dict)
_LAYER_SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "num_hidden_layers", "vocab_size", "rms_norm_eps", "hidden_act", "max_position_embeddings")
# the layer config keys that spell a sliding window; a flat config says it once, as ``sliding_window``
_WINDOW_KEYS = ("sliding_window", "layer_types", "use_sliding_window", "max_window_layers")
# top-level speculators fields that belong to the drafter, not to its transformer layer config
_EAGLE_FIELDS = ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "mask_token_id")

_LLAMA_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "vocab_size",
    "max_position_embeddings",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "hidden_act",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


@attrs.frozen
class Manifest:
    """What an export's ``config.json`` says: the layout, the vLLM method, whether it drafts in parallel, the drafter
    plugin that wrote it, and (speculators layouts) the verifier and default number of draft tokens."""

    layout: str
    method: str
    parallel_drafting: bool
    drafter: str | None = None
    verifier: str | None = None
    speculative_tokens: int | None = None
    specframe_version: str = __version__
    #: the most draft tokens per step the drafter can serve (ParallelSpec: its masks + 1), None: no limit
    max_speculative_tokens: int | None = None
    #: the fewest draft tokens per step vLLM serves the drafter at as it was trained, None: no limit. DFlash: vLLM's
    #: proposer drafts K tokens from a block of K + 1 slots, and a drafter trained on blocks of ``block_size`` is
    #: another network on a shorter block (bidirectional attention), so K = block_size - 1 unless the drafter that
    #: wrote the export declared otherwise (``write_dflash``'s ``min_speculative_tokens``)
    min_speculative_tokens: int | None = None
    #: the draft block the drafter was trained on (DFlash), None: not a block drafter
    block_size: int | None = None

    @property
    def speculators(self) -> bool:
        """Whether vLLM serves the folder alone (``LLM(model=EXPORT)``)."""
        return self.layout in SPECULATORS

    def refusal(self, num_speculative_tokens: Any) -> str | None:
        """Why vLLM cannot serve this export drafting ``num_speculative_tokens`` per step (one line), None if it can.
        The benchmark suites read it to skip such a K with its reason; ``check_tokens`` raises it."""
        k = num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            return f"num_speculative_tokens must be a positive integer, got {k!r}"
        if self.max_speculative_tokens is not None and k > self.max_speculative_tokens:
            why = ("its block size" if self.layout == "dspark" else "its block size - 1" if self.block_size is not None
                   else "its mask tokens + 1")
            return (f"this {self.layout} export drafts at most {self.max_speculative_tokens} tokens per step ({why}), "
                    f"not {k}")
        low = self.min_speculative_tokens
        if low is not None and k < low:
            high = self.max_speculative_tokens
            serves = f"K = {low}" if high == low else f"K = {low}..{high}" if high is not None else f"K >= {low}"
            slots = "K slots (the anchor predicts too)" if self.layout == "dspark" else "K + 1 slots"
            return (f"vLLM cannot serve this {self.layout} export at {k} draft tokens per step: its {self.method} "
                    f"proposer drafts K tokens from a block of {slots}, and this drafter was trained on blocks of "
                    f"{self.block_size} (bidirectional, so a shorter block is a network it never was); it serves "
                    f"{serves}")
        return None

    def check_tokens(self, num_speculative_tokens: Any) -> None:
        """Refuse (``SpecframeError``, ``refusal``'s line) a number of draft tokens vLLM cannot serve this export at."""
        reason = self.refusal(num_speculative_tokens)
        if reason is not None:
            raise SpecframeError(reason)

    def speculative_config(self, directory: str | os.PathLike, num_speculative_tokens: int) -> dict[str, Any]:
        """vLLM's explicit ``speculative_config`` for this export at ``directory`` drafting ``num_speculative_tokens``
        (the target is then vLLM's ``model``); a number it cannot serve is refused with ``refusal``'s reason."""
        self.check_tokens(num_speculative_tokens)
        config: dict[str, Any] = {
            "method": self.method,
            "model": str(Path(directory).resolve()),
            "num_speculative_tokens": int(num_speculative_tokens),
        }
        if self.parallel_drafting:
            config["parallel_drafting"] = True
        return config


_METHODS = {
    "eagle3": ("eagle3", False),
    "peagle": ("eagle3", True),
    "pard": ("draft_model", True),
    "parallelspec": ("eagle3", True),
    # vLLM's DFlash proposer drafts a block by itself: method dflash, without the parallel_drafting flag
    "dflash": ("dflash", False),
    # vLLM's DSpark speculator: its own block drafting plus the sequential Markov stage
    "dspark": ("dspark", False),
}


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise SpecframeError(f"{directory} is not a vLLM drafter export (no config.json); run `specframe export` first")
    try:
        cfg = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise SpecframeError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise SpecframeError(f"{path} is not a JSON object")
    return cfg


def layout_of(cfg: Mapping[str, Any]) -> str | None:
    """The layout a drafter ``config.json`` is in (``eagle3``, ``peagle``, ``pard``), or None."""
    kind = cfg.get("speculators_model_type")
    if kind is not None:
        return kind if kind in SPECULATORS else None
    if PARALLELSPEC_ARCHITECTURE in (cfg.get("architectures") or []):
        return "parallelspec"
    return "pard" if "pard_token" in cfg else None


def read_manifest(directory: str | os.PathLike) -> Manifest:
    """The manifest of a drafter export (``SpecframeError`` if ``directory`` is not one vLLM and specframe know)."""
    directory = Path(directory)
    cfg = _read_config(directory)
    layout = layout_of(cfg)
    if layout is None:
        kind = cfg.get("speculators_model_type")
        what = f"speculators_model_type {kind!r}" if kind is not None else "neither speculators_config nor pard_token"
        raise SpecframeError(
            f"{directory} is not a vLLM drafter export specframe knows ({what}; known layouts: {', '.join(LAYOUTS)})"
        )
    method, parallel = _METHODS[layout]
    provenance = cfg.get(PROVENANCE) if isinstance(cfg.get(PROVENANCE), dict) else {}
    verifier = tokens = None
    if layout in SPECULATORS:
        spec = cfg.get("speculators_config") if isinstance(cfg.get("speculators_config"), dict) else {}
        verifier = (spec.get("verifier") or {}).get("name_or_path") if isinstance(spec.get("verifier"), dict) else None
        methods = spec.get("proposal_methods")
        if isinstance(methods, list) and methods and isinstance(methods[0], dict):
            tokens = methods[0].get("speculative_tokens")
    masks = cfg.get("parallelspec_num_masks") if layout == "parallelspec" else None
    limit = int(masks) + 1 if isinstance(masks, int) else None
    floor = block = None
    if layout == "dflash" and isinstance(cfg.get("block_size"), int):
        block = int(cfg["block_size"])
        limit = block - 1  # a block is the anchor token plus block_size - 1 mask slots
        # what the drafter that wrote the folder declared; a folder without it (speculators', z-lab's) was trained
        # on full blocks, as every DFlash trainer does
        declared = provenance.get(MIN_TOKENS)
        floor = declared if isinstance(declared, int) and not isinstance(declared, bool) else limit
    if layout == "dspark" and isinstance(cfg.get("block_size"), int):
        block = int(cfg["block_size"])
        # sample_from_anchor: every slot predicts, block_size tokens; a bonus-anchor folder drafts block_size - 1
        limit = block if dspark_samples_from_anchor(cfg) else block - 1
        floor = limit  # vLLM's DSpark speculator runs exactly the slots the K tokens need: full blocks only
    return Manifest(
        layout=layout, method=method, parallel_drafting=parallel, drafter=provenance.get("drafter"),
        verifier=verifier, speculative_tokens=tokens,
        specframe_version=provenance.get("version", "unknown"),
        max_speculative_tokens=limit, min_speculative_tokens=floor, block_size=block,
    )


def speculative_config(directory: str | os.PathLike, num_speculative_tokens: int) -> dict[str, Any]:
    """vLLM's explicit ``speculative_config`` for the export at ``directory``."""
    return read_manifest(directory).speculative_config(directory, num_speculative_tokens)


def verifier_name(target: str | os.PathLike) -> str:
    """How a speculators config names ``target``: an existing local folder as its absolute path, else as given (a
    hub id)."""
    path = Path(target)
    return str(path.resolve()) if path.is_dir() else str(target)


def verifier_of(target_config: Any) -> str | None:
    """The verifier name of the target a transformers config was loaded from (its ``_name_or_path``), or None."""
    source = getattr(target_config, "_name_or_path", None) or getattr(target_config, "name_or_path", None)
    return verifier_name(source) if source else None


def verifier_architectures_of(target_config: Any) -> list[str]:
    """The target's own ``architectures`` (``Qwen2ForCausalLM``, ...), as speculators' VerifierConfig records them;
    empty when its config names none."""
    if isinstance(target_config, Mapping):
        names = target_config.get("architectures")
    else:
        names = getattr(target_config, "architectures", None)
    return [str(a) for a in names or ()]


def llama_config(target_config: Any, num_hidden_layers: int, **overrides: Any) -> dict[str, Any]:
    """A drafter's Llama config dict: the layer shapes of ``target_config`` (a transformers config or a dict), with
    ``num_hidden_layers`` drafter layers and ``overrides`` applied (e.g. a different ``intermediate_size``)."""
    source = target_config if isinstance(target_config, Mapping) else target_config.to_dict()
    config = {k: source[k] for k in _LLAMA_KEYS if source.get(k) is not None}
    # every field the drafter's layers compute with, as they read it (modeling.LayerShape): a family that names one
    # otherwise (Gemma-3's hidden_activation) or leaves it to a default would else be served with vLLM's (silu)
    config.update(drafter_layer_fields(target_config))
    # specframe's drafter layers have no biases, whatever the target's: vLLM builds biased q/k/v/o and MLP
    # projections from these keys, so a target's attention_bias: true copied here made an export vLLM cannot load
    config.update(attention_bias=False, mlp_bias=False)
    config.update(num_hidden_layers=int(num_hidden_layers), **overrides)
    return config


def drafter_layer_fields(target_config: Any) -> dict[str, Any]:
    """The layer fields a drafter built on ``target_config`` (a transformers config or a dict) computes with
    (``modeling.LayerShape.from_config``: sizes, head size, activation, norm epsilon, RoPE), under their config
    names."""
    from types import SimpleNamespace

    from specframe.modeling import LayerShape

    cfg = SimpleNamespace(**target_config) if isinstance(target_config, Mapping) else target_config
    return LayerShape.from_config(cfg).config_fields()


def split_rope(config: Mapping[str, Any]) -> str | None:
    """Why vLLM cannot take the RoPE settings of a drafter layer ``config``: a target family that gives them per
    attention type (Gemma-3: ``rope_parameters`` split into ``sliding_attention`` and ``full_attention``), where vLLM's
    drafter models take one for every layer (they fail deep in start-up with ``TypeError: unhashable type:
    'dict'``); None if it can."""
    for key in ("rope_parameters", "rope_scaling"):
        value = config.get(key)
        if isinstance(value, Mapping):
            parts = sorted(str(k) for k, v in value.items() if isinstance(v, Mapping))
            if parts:
                return (f"the target's {key} is split by attention type ({', '.join(parts)}), and vLLM's drafter "
                        "models take one RoPE setting for every layer")
    return None


# ------------------------------------------------------------------------------------------ speculators config


def speculators_config(
    flat: Mapping[str, Any],
    layout: str,
    *,
    verifier: str | None,
    speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS,
    drafter: str | None = None,
    verifier_architectures: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The speculators ``config.json`` of an EAGLE-3 / P-EAGLE drafter from its flat config (Llama layer fields plus
    ``draft_vocab_size``, ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids`` and, P-EAGLE,
    ``mask_token_id``), naming ``verifier`` (the target: a local folder path or hub id) with its
    ``verifier_architectures`` (``verifier_architectures_of`` the target's config; none known: empty) and drafting
    ``speculative_tokens`` tokens per step by default. ``flat_config`` reads it back."""
    if layout not in SPECULATORS:
        raise SpecframeError(f"layout {layout!r} has no speculators format (speculators layouts: {', '.join(SPECULATORS)})")
    if isinstance(speculative_tokens, bool) or not isinstance(speculative_tokens, int) or speculative_tokens < 1:
        raise SpecframeError(f"speculative_tokens must be a positive integer, got {speculative_tokens!r}")
    if layout == "dflash":
        return _dflash_config(flat, verifier=verifier, speculative_tokens=speculative_tokens, drafter=drafter,
                              verifier_architectures=verifier_architectures)
    if layout == "dspark":
        return _dspark_config(flat, verifier=verifier, speculative_tokens=speculative_tokens, drafter=drafter,
                              verifier_architectures=verifier_architectures)
    layer = {k: v for k, v in flat.items()
             if k not in _EAGLE_FIELDS and k not in _FIXED_FLAGS and k not in _ARCHITECTURE and k not in _WINDOW_KEYS}
    if flat.get("qk_norm"):  # Qwen3 layers (q/k norms): vLLM's Eagle3Qwen3 / PeagleQwen3 models build them
        layer.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", tie_word_embeddings=False)
    else:
        layer.update(architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=False)
    layer.update(_layer_types(flat.get("sliding_window"), int(layer["num_hidden_layers"]), bool(flat.get("qk_norm"))))
    _set_dtype(layer)
    config: dict[str, Any] = {
        "architectures": [SPECULATORS[layout]],
        "speculators_model_type": layout,
        "speculators_config": {
            "algorithm": layout,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures or ())},
        },
        "transformer_layer_config": layer,
        **{k: flat[k] for k in _EAGLE_FIELDS if k in flat},
        # every flag written, true or false: vLLM reads an absent norm_before_residual of an eagle3 folder as true
        **{k: bool(flat.get(k, default)) for k, default in _FIXED_FLAGS.items()},
        "dtype": layer["dtype"],
        PROVENANCE: {"drafter": drafter, "version": __version__},
    }
    return config


def _layer_types(window: Any, layers: int, qwen3: bool) -> dict[str, Any]:
    """The layer config keys of a sliding ``window`` on every one of ``layers`` draft layers (None: full attention),
    as transformers, vLLM and speculators read them (Qwen3 keeps the window only with ``use_sliding_window``)."""
    if window is not None:
        return {"sliding_window": int(window), "layer_types": ["sliding_attention"] * layers,
                "use_sliding_window": True}
    return {"layer_types": ["full_attention"] * layers, "use_sliding_window": False} if qwen3 else {}


def _eagle_layer(config: Mapping[str, Any], layer: Mapping[str, Any]) -> dict[str, Any]:
    """The flat config of a speculators EAGLE-3 / P-EAGLE ``config.json`` whose layer config is ``layer``: its fields
    as transformers builds them (speculators writes only the differences from its config class's defaults), plus the
    architecture (``qk_norm`` from a qwen3 layer, the EAGLE 3.1 flags, ``sliding_window`` from ``layer_types``);
    ``fc_norm``, other layer types and a window on only some layers are refused, naming the field."""
    from transformers import AutoConfig

    model_type = layer.get("model_type", "llama")
    if model_type not in ("llama", "qwen3"):
        raise SpecframeError(f"transformer_layer_config.model_type is {model_type!r}; specframe's EAGLE layers are "
                             "Llama or Qwen3 (q/k norms) layers")
    if config.get("fc_norm"):
        raise SpecframeError("fc_norm is true: specframe's EAGLE-3 layer computes only fc_norm = false (norm_before_fc "
                             "is its single norm over the concatenated aux states)")
    flat = {k: v for k, v in layer.items() if k not in ("architectures", "model_type", "tie_word_embeddings")}
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
    return flat


def sliding_window_layers(layer: Mapping[str, Any]) -> tuple[list[int], int | None]:
    """The drafter layers of a transformers layer config that attend through a sliding window, and its width, as
    transformers builds the config (what vLLM and speculators read: ``layer_types`` entries ``sliding_attention``
    with ``sliding_window`` set; Qwen2 / Qwen3 derive ``layer_types`` from ``use_sliding_window`` and
    ``max_window_layers`` and drop the window without ``use_sliding_window``). ``([], None)`` when there is none."""
    from transformers import AutoConfig

    fields = {k: v for k, v in layer.items() if k not in ("model_type", "architectures", "auto_map")}
    try:
        built = AutoConfig.for_model(str(layer.get("model_type") or "llama"), **fields)
        types, window = getattr(built, "layer_types", None), getattr(built, "sliding_window", None)
    except (ValueError, TypeError, KeyError):  # a config transformers does not build: read the fields as written
        types, window = layer.get("layer_types"), layer.get("sliding_window")
    if window is None or not isinstance(types, list | tuple):
        return [], None
    return [i for i, kind in enumerate(types) if kind == "sliding_attention"], int(window)


def _set_dtype(cfg: dict[str, Any]) -> None:
    """Name the weights' dtype ``dtype``, as transformers 5 does: ``torch_dtype`` is its deprecated spelling (it warns
    on it), which an older export carries and which transformers, vLLM 0.32 and speculators all read as ``dtype``."""
    legacy = cfg.pop("torch_dtype", None)
    cfg.setdefault("dtype", legacy or "float32")


def flat_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The flat drafter config (``transformer_layer_config`` plus the EAGLE fields) of a speculators ``config.json``;
    refuses variants specframe's layers do not compute (``norm_before_residual`` true, ``fc_norm``, ...), naming the
    field."""
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise SpecframeError("config.json lacks transformer_layer_config (the drafter's layer config)")
    if config.get("speculators_model_type") == "dflash":
        if config.get("sample_from_anchor"):
            raise SpecframeError(
                "sample_from_anchor is true: the drafter also predicts from the anchor slot (block_size draft tokens); "
                "specframe's DFlash drafts from the mask slots only (sample_from_anchor = false, block_size - 1 tokens)")
        flat = {k: v for k, v in layer.items() if k not in ("architectures", "model_type", "tie_word_embeddings")}
        flat.update({k: config[k] for k in _DFLASH_FIELDS if config.get(k) is not None})
        return _with_target_hidden_size(flat)
    if config.get("speculators_model_type") == "dspark":
        flat = {k: v for k, v in layer.items() if k not in ("architectures", "model_type", "tie_word_embeddings")}
        flat.update({k: config[k] for k in _DSPARK_FIELDS if config.get(k) is not None})
        provenance = config.get(PROVENANCE) if isinstance(config.get(PROVENANCE), dict) else {}
        flat.update({k: provenance[k] for k in DSPARK_CALIBRATION if provenance.get(k) is not None})
        return _with_target_hidden_size(flat)
    flat = _eagle_layer(config, layer)
    flat.update({k: config[k] for k in _EAGLE_FIELDS if config.get(k) is not None})
    return _with_target_hidden_size(flat)


def _with_target_hidden_size(flat: dict[str, Any]) -> dict[str, Any]:
    # speculators writes target_hidden_size null (its default), meaning "the drafter's own width": vLLM reads an absent
    # or null one as the draft config's hidden_size (llama_eagle3, qwen3_dflash) and speculators sizes fc from it too;
    # whether that is the target's width is check_target's business
    if flat.get("target_hidden_size") is None and flat.get("hidden_size") is not None:
        flat["target_hidden_size"] = flat["hidden_size"]
    return flat


def set_serving(
    directory: str | os.PathLike, *, verifier: str | None = None, speculative_tokens: int | None = None
) -> Manifest:
    """Rewrite the verifier and / or default number of draft tokens of the speculators export at ``directory``
    (``config.json`` replaced atomically); returns the new manifest."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if verifier is None and speculative_tokens is None:
        return manifest
    if speculative_tokens is not None:
        manifest.check_tokens(speculative_tokens)
    if not manifest.speculators:
        raise SpecframeError(f"{directory} is a {manifest.layout} export, which names no verifier (not speculators format)")
    cfg = _read_config(directory)
    flat = flat_config(cfg)
    new = speculators_config(
        flat, manifest.layout, verifier=verifier if verifier is not None else manifest.verifier,
        speculative_tokens=speculative_tokens if speculative_tokens is not None else manifest.speculative_tokens,
        drafter=manifest.drafter,
        verifier_architectures=(cfg.get("speculators_config") or {}).get("verifier", {}).get("architectures"),
    )
    if isinstance(cfg.get(PROVENANCE), dict):  # what the writing drafter declared there (MIN_TOKENS) stays
        new[PROVENANCE] = {**cfg[PROVENANCE], **new[PROVENANCE]}
    tmp = directory / "config.json.tmp"
    tmp.write_text(json.dumps(new, indent=1, sort_keys=True))
    os.replace(tmp, directory / "config.json")
    return read_manifest(directory)


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
) -> dict[str, Any]:
    """Write an autoregressive EAGLE-3 drafter (speculators ``eagle3``).

    ``weights`` uses the layout names above (``midlayer.*`` is accepted for ``layers.0.*``); ``config`` is the
    drafter's Llama config (``llama_config`` builds one) with ``num_hidden_layers`` = drafter layers and
    ``vocab_size`` = the target's; ``draft_vocab_size`` is read from ``lm_head.weight``. ``aux_layer_ids`` are the
    target hidden states the drafter reads (id i = the hidden state entering target layer i, 0 = the embeddings; a
    tiny target needs them explicitly, vLLM's default assumes many layers); ``target_num_layers`` bounds them.
    ``verifier`` names the target vLLM starts for ``LLM(model=EXPORT)`` (``verifier_name`` of its folder or hub id),
    ``verifier_architectures`` its own architectures (``verifier_architectures_of``; recorded, vLLM does not read
    them); ``speculative_tokens`` is the default number of draft tokens per step. ``architecture``: the drafter's
    layer architecture (``specframe.eagle.Architecture.export_fields``: ``qk_norm`` -> a qwen3 layer config,
    ``sliding_window`` -> ``layer_types``, the EAGLE 3.1 flags at the top); none: specframe's default one.
    Returns the manifest (``layout``, ``method``, ``parallel_drafting``, ...) as a dict.
    """
    config = {**config, **(architecture or {})}
    tensors, cfg = _eagle3_parts(weights, config, aux_layer_ids, target_hidden_size, target_num_layers)
    if "mask_hidden" in tensors:
        raise SpecframeError("an autoregressive EAGLE-3 export has no mask_hidden; use write_peagle for P-EAGLE")
    full = speculators_config(cfg, "eagle3", verifier=verifier, speculative_tokens=speculative_tokens, drafter=drafter,
                              verifier_architectures=verifier_architectures)
    return _write(directory, tensors, full, tokenizer)


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
) -> dict[str, Any]:
    """Write a P-EAGLE drafter (speculators ``peagle``: vLLM's eagle3 method with ``parallel_drafting``):
    ``write_eagle3``'s layout plus ``mask_hidden`` [1, 1, n_aux * H_target] in ``weights`` and ``mask_token_id`` (a
    target-vocabulary id whose embedding row the mask slots read) in the config."""
    config = {**config, **(architecture or {})}
    if config.get("norm_output"):
        # vLLM 0.32's update_peagle does not pass norm_output on, and a parallel drafter has no step to feed
        raise SpecframeError("norm_output is true: a P-EAGLE drafter feeds no step forward, and vLLM's peagle reader "
                             "does not take the flag")
    tensors, cfg = _eagle3_parts(weights, config, aux_layer_ids, target_hidden_size, target_num_layers)
    _peagle_parts(tensors, cfg, mask_token_id)
    full = speculators_config(cfg, "peagle", verifier=verifier, speculative_tokens=speculative_tokens, drafter=drafter,
                              verifier_architectures=verifier_architectures)
    return _write(directory, tensors, full, tokenizer)


def write_dflash(
    directory: str | os.PathLike,
    weights: Mapping[str, torch.Tensor],
    *,
    config: Mapping[str, Any],
    aux_layer_ids: Sequence[int],
    target_hidden_size: int,
    mask_token_id: int,
    block_size: int,
    target_num_layers: int | None = None,
    tokenizer: Any = None,
    drafter: str | None = "dflash",
    verifier: str | None = None,
    speculative_tokens: int | None = None,
    verifier_architectures: Sequence[str] | None = None,
    min_speculative_tokens: int | None = None,
) -> dict[str, Any]:
    """Write a DFlash drafter (speculators ``dflash``, module docstring): ``weights`` under vLLM's
    ``DFlashQwen3Model`` names, ``config`` the drafter's layer config (``llama_config`` of the target with
    ``num_hidden_layers`` = drafter layers: the sizes are the same, the Qwen3 model type is set here),
    ``aux_layer_ids`` specframe's aux ids (hidden state entering that target layer), ``mask_token_id`` the
    target-vocabulary id of the mask slots and ``block_size`` the anchor plus its mask slots. ``speculative_tokens``
    defaults to ``block_size - 1``, every mask slot. ``min_speculative_tokens``: the fewest tokens per step vLLM may
    serve it at, as the drafter declares (vLLM's proposer runs a block of K + 1 slots, so a drafter trained on full
    blocks serves only K = block_size - 1, the default); recorded in the export and refused below
    (``Manifest.refusal``)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        raise SpecframeError(f"block_size must be an integer of at least 2 (an anchor and a mask), got {block_size!r}")
    low = block_size - 1 if min_speculative_tokens is None else min_speculative_tokens
    if isinstance(low, bool) or not isinstance(low, int) or not 1 <= low <= block_size - 1:
        raise SpecframeError(f"min_speculative_tokens must be in 1..block_size - 1 ({block_size - 1}), got {low!r}")
    tokens = block_size - 1 if speculative_tokens is None else speculative_tokens
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not low <= tokens <= block_size - 1:
        raise SpecframeError(f"speculative_tokens must be in {low}..block_size - 1 ({block_size - 1}) (the drafter "
                             f"serves no fewer than {low} in vLLM), got {tokens!r}")
    flat = _block_flat(config, target_hidden_size, mask_token_id, aux_layer_ids, block_size)
    tensors = _dflash_parts(_tensors(weights), flat, target_num_layers)
    full = _dflash_config(flat, verifier=verifier, speculative_tokens=tokens, drafter=drafter,
                          verifier_architectures=verifier_architectures)
    full[PROVENANCE][MIN_TOKENS] = low
    return _write(directory, tensors, full, tokenizer)


def _block_flat(config: Mapping[str, Any], target_hidden_size: int, mask_token_id: int, aux_layer_ids: Sequence[int],
                block_size: int) -> dict[str, Any]:
    """The flat config a block drafter's export (DFlash, DSpark) is checked and written from: the drafter's layer
    config without its model identity (the export sets Qwen3's), plus the block fields vLLM's ``update_dflash`` reads."""
    flat = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "tie_word_embeddings")}
    flat.update(
        draft_vocab_size=int(flat["vocab_size"]), target_hidden_size=int(target_hidden_size),
        mask_token_id=mask_token_id, aux_hidden_state_layer_ids=[int(i) for i in aux_layer_ids], block_size=block_size,
    )
    return flat


# the top-level fields of a DFlash speculators config (vLLM's update_dflash reads them), beside its layer config
_DFLASH_FIELDS = ("draft_vocab_size", "target_hidden_size", "mask_token_id", "aux_hidden_state_layer_ids", "block_size")


def _dflash_config(
    flat: Mapping[str, Any], *, verifier: str | None, speculative_tokens: int, drafter: str | None,
    verifier_architectures: Sequence[str] | None = None,
) -> dict[str, Any]:
    layer = {k: v for k, v in flat.items() if k not in _DFLASH_FIELDS}
    # Qwen3: vLLM builds DFlash layers from a Qwen3 config (per-head q_norm / k_norm); the sizes are the drafter's own
    layer.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", tie_word_embeddings=False)
    _set_dtype(layer)
    return {
        "architectures": [SPECULATORS["dflash"]],
        "speculators_model_type": "dflash",
        "speculators_config": {
            "algorithm": "dflash",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures or ())},
        },
        "transformer_layer_config": layer,
        **{k: flat[k] for k in _DFLASH_FIELDS if k in flat},
        "dtype": layer["dtype"],
        PROVENANCE: {"drafter": drafter, "version": __version__},
    }


def _dflash_parts(tensors: dict[str, torch.Tensor], cfg: Mapping[str, Any], target_num_layers: int | None,
                  min_aux: int = 1) -> dict:
    """Check a DFlash export's tensors against its flat config (every weight vLLM's DFlash model loads, shaped);
    ``min_aux``: the least aux id the layout's vLLM model reads (DSpark's reads 0, the embeddings)."""
    h, heads, kv, head_dim, inter, vocab, layers, h_t = _require_ints(
        cfg, "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
        "vocab_size", "num_hidden_layers", "target_hidden_size")
    aux = cfg.get("aux_hidden_state_layer_ids")
    if not isinstance(aux, list) or not aux:
        raise SpecframeError("config.json lacks aux_hidden_state_layer_ids (the target layers DFlash reads)")
    # vLLM reads target layer output id - 1 (update_dflash), so aux id 0 (the embeddings) has no DFlash meaning
    bad = [i for i in aux if isinstance(i, bool) or not isinstance(i, int) or i < min_aux or (
        target_num_layers is not None and i >= target_num_layers)]
    if bad:
        bound = f"{min_aux}..{target_num_layers - 1}" if target_num_layers is not None else f">= {min_aux}"
        raise SpecframeError(f"aux_hidden_state_layer_ids {bad} are not target layers DFlash can read ({bound})")
    _check_layer_order(aux, "aux_hidden_state_layer_ids")
    _token_id("mask_token_id", cfg.get("mask_token_id"), vocab)
    if int(cfg.get("draft_vocab_size", vocab)) != vocab:
        raise SpecframeError("a DFlash export drafts over the target's whole vocabulary (draft_vocab_size = vocab_size)")
    _check_shape(tensors, "fc.weight", (h, len(aux) * h_t))
    for name, shape in (("hidden_norm.weight", (h,)), ("norm.weight", (h,))):
        _check_shape(tensors, name, shape)
    for name in ("embed_tokens.weight", "lm_head.weight"):
        if name in tensors:  # absent: vLLM shares the target's (speculators' DFlash folders carry no embed_tokens)
            _check_shape(tensors, name, (vocab, h))
    _check_layer_count(tensors, "layers.", layers)
    for i in range(layers):
        p = f"layers.{i}."
        for name, shape in (
            ("self_attn.q_proj.weight", (heads * head_dim, h)), ("self_attn.k_proj.weight", (kv * head_dim, h)),
            ("self_attn.v_proj.weight", (kv * head_dim, h)), ("self_attn.o_proj.weight", (h, heads * head_dim)),
            ("self_attn.q_norm.weight", (head_dim,)), ("self_attn.k_norm.weight", (head_dim,)),
            ("input_layernorm.weight", (h,)), ("post_attention_layernorm.weight", (h,)),
            ("mlp.gate_proj.weight", (inter, h)), ("mlp.up_proj.weight", (inter, h)), ("mlp.down_proj.weight", (h, inter)),
        ):
            _check_shape(tensors, p + name, shape)
    extra = sorted(set(tensors) - {"fc.weight", "hidden_norm.weight", "norm.weight", "embed_tokens.weight",
                                   "lm_head.weight"} - {k for k in tensors if k.startswith("layers.")})
    if extra:
        raise SpecframeError(f"weights vLLM's DFlash model does not load: {', '.join(extra)}")
    return tensors


def write_dspark(
    directory: str | os.PathLike,
    weights: Mapping[str, torch.Tensor],
    *,
    config: Mapping[str, Any],
    aux_layer_ids: Sequence[int],
    target_hidden_size: int,
    mask_token_id: int,
    block_size: int,
    markov_rank: int,
    markov_head_type: str,
    enable_confidence_head: bool,
    confidence_head_with_markov: bool,
    target_num_layers: int | None = None,
    tokenizer: Any = None,
    drafter: str | None = "dspark",
    verifier: str | None = None,
    verifier_architectures: Sequence[str] | None = None,
    confidence_temperature: Sequence[float] | None = None,
    confidence_calibration_rule: str | None = None,
) -> dict[str, Any]:
    """Write a DSpark drafter (speculators ``dspark``, module docstring): the DFlash backbone's weights under vLLM's
    names plus the Markov head (``markov_head.markov_w1`` / ``markov_w2``) and the confidence head
    (``confidence_head.proj``), ``config`` the drafter's layer config (as ``write_dflash``'s), ``block_size`` the
    slots of a block (the anchor and ``block_size - 1`` masks; every slot predicts, ``sample_from_anchor``), so it
    drafts ``block_size`` tokens per step, the only K vLLM serves it at. ``confidence_temperature`` (one per slot)
    and ``confidence_calibration_rule``: the confidence's fitted calibration and the verification it was fitted for,
    kept in the ``specframe`` entry (vLLM has no field for them: its adaptive verification reads the raw sigmoid)
    and read back by an import."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise SpecframeError(f"block_size must be a positive integer, got {block_size!r}")
    if markov_head_type != "vanilla":
        # vLLM 0.32's Qwen3DSparkModel builds markov_w1 / markov_w2 only (no gate, no recurrent state), whatever
        # markov_head_type says: another head would load with its extra weights refused or be served as vanilla
        raise SpecframeError(f"vLLM serves the vanilla Markov head only (its Qwen3DSparkModel has markov_w1 / markov_w2 "
                             f"and nothing else); this drafter's head is {markov_head_type!r}")
    flat = _block_flat(config, target_hidden_size, mask_token_id, aux_layer_ids, block_size)
    flat.update(
        markov_rank=int(markov_rank), markov_head_type=markov_head_type,
        enable_confidence_head=bool(enable_confidence_head),
        confidence_head_with_markov=bool(enable_confidence_head and confidence_head_with_markov),
        use_aux_hidden_state=True, sample_from_anchor=True,
    )
    tensors = _dspark_parts(_tensors(weights), flat, target_num_layers)
    full = _dspark_config(flat, verifier=verifier, speculative_tokens=block_size, drafter=drafter,
                          verifier_architectures=verifier_architectures)
    full[PROVENANCE][MIN_TOKENS] = block_size
    if confidence_temperature is not None and enable_confidence_head:
        temperatures = [float(t) for t in confidence_temperature]
        if len(temperatures) != block_size or not all(0 < t < float("inf") for t in temperatures):
            raise SpecframeError(f"confidence_temperature {temperatures} is not {block_size} positive numbers")
        full[PROVENANCE].update(confidence_temperature=temperatures,
                                confidence_calibration_rule=confidence_calibration_rule)
    return _write(directory, tensors, full, tokenizer)


#: the ``specframe`` entry's DSpark calibration fields (``write_dspark``), read back into the flat config
DSPARK_CALIBRATION = ("confidence_temperature", "confidence_calibration_rule")
#: vLLM 0.32's ``update_dspark`` reads an absent ``sample_from_anchor`` as false (a bonus-anchor block), as do the
#: speculators releases before its dspark default; every reader here takes that one default
DSPARK_SAMPLE_FROM_ANCHOR_DEFAULT = False


def dspark_samples_from_anchor(config: Mapping[str, Any]) -> bool:
    """Whether a DSpark config's anchor slot predicts (block_size draft tokens), as vLLM reads it."""
    return bool(config.get("sample_from_anchor", DSPARK_SAMPLE_FROM_ANCHOR_DEFAULT))


# the top-level fields of a DSpark speculators config (vLLM's update_dspark reads them), beside its layer config
_DSPARK_FIELDS = _DFLASH_FIELDS + ("markov_rank", "markov_head_type", "enable_confidence_head",
                                   "confidence_head_with_markov", "use_aux_hidden_state", "sample_from_anchor")


def _dspark_config(
    flat: Mapping[str, Any], *, verifier: str | None, speculative_tokens: int, drafter: str | None,
    verifier_architectures: Sequence[str] | None = None,
) -> dict[str, Any]:
    config = _dflash_config({k: v for k, v in flat.items() if k not in _DSPARK_FIELDS or k in _DFLASH_FIELDS},
                            verifier=verifier, speculative_tokens=speculative_tokens, drafter=drafter,
                            verifier_architectures=verifier_architectures)
    config["architectures"] = [SPECULATORS["dspark"]]
    config["speculators_model_type"] = "dspark"
    config["speculators_config"]["algorithm"] = "dspark"
    config.update({k: flat[k] for k in _DSPARK_FIELDS if k in flat})
    return config


def _dspark_parts(tensors: dict[str, torch.Tensor], cfg: Mapping[str, Any], target_num_layers: int | None) -> dict:
    """Check a DSpark export's tensors against its flat config: the DFlash backbone's, and the heads vLLM's
    ``Qwen3DSparkModel`` loads (shaped)."""
    h, vocab = _require_ints(cfg, "hidden_size", "vocab_size")
    rank = _require_ints(cfg, "markov_rank")[0]
    if rank < 1:
        raise SpecframeError(f"markov_rank must be positive (vLLM always builds the Markov head), got {rank}")
    if cfg.get("markov_head_type", "vanilla") != "vanilla":
        raise SpecframeError(f"markov_head_type is {cfg.get('markov_head_type')!r}; vLLM serves the vanilla head only")
    if not dspark_samples_from_anchor(cfg):
        said = "is false" if "sample_from_anchor" in cfg else "is absent, which vLLM reads as false"
        raise SpecframeError(f"sample_from_anchor {said} (a bonus-anchor block); specframe's DSpark predicts from "
                             "the anchor slot (sample_from_anchor = true, block_size draft tokens)")
    heads = {"markov_head.markov_w1.weight": (vocab, rank), "markov_head.markov_w2.weight": (vocab, rank)}
    if cfg.get("enable_confidence_head"):
        width = h + (rank if cfg.get("confidence_head_with_markov") else 0)
        heads.update({"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)})
    for name, shape in heads.items():
        _check_shape(tensors, name, shape)
    backbone = {k: v for k, v in tensors.items() if k not in heads}
    extra = sorted(k for k in backbone if k.startswith(("markov_head.", "confidence_head.")))
    if extra:
        raise SpecframeError(f"weights vLLM's DSpark model does not load: {', '.join(extra)}")
    # vLLM's DSpark takes aux ids as they are (update_dspark -> eagle_aux_hidden_state_layer_ids, read first by
    # eagle3_utils.get_eagle3_aux_layers_from_config) and the target collects id 0 before its first layer
    # (qwen2.py): the embeddings, as specframe's features and DeepSpec's -1 mean it
    _dflash_parts(backbone, cfg, target_num_layers, min_aux=0)
    return tensors


def write_pard(
    directory: str | os.PathLike,
    weights: Mapping[str, torch.Tensor],
    *,
    config: Mapping[str, Any],
    pard_token: int,
    tokenizer: Any = None,
    drafter: str | None = "pard",
) -> dict[str, Any]:
    """Write a PARD drafter for ``{"method": "draft_model", "parallel_drafting": true}``: a plain causal LM
    (``LlamaForCausalLM`` names unless ``config["architectures"]`` says otherwise) whose config carries
    ``pard_token``, the mask token its parallel slots read. ``config["vocab_size"]`` must be the target's."""
    cfg = dict(config)
    cfg.setdefault("architectures", ["LlamaForCausalLM"])
    cfg.setdefault("model_type", "llama")
    _set_dtype(cfg)
    tensors = _tensors(weights)
    _pard_parts(tensors, cfg, pard_token)
    cfg[PROVENANCE] = {"drafter": drafter, "version": __version__}
    return _write(directory, tensors, cfg, tokenizer)


def write_parallelspec(
    directory: str | os.PathLike,
    weights: Mapping[str, torch.Tensor],
    *,
    config: Mapping[str, Any],
    aux_layer_ids: Sequence[int],
    target_hidden_size: int,
    mask_token_ids: Sequence[int],
    target_num_layers: int | None = None,
    tokenizer: Any = None,
    drafter: str | None = "parallelspec",
) -> dict[str, Any]:
    """Write a ParallelSpec drafter (EAGLE backbone) for vLLM's eagle3 method with ``parallel_drafting``, served by
    specframe's vLLM general plugin model ``ParallelSpecLlamaForCausalLMEagle3`` (``specframe.vllm.vllm_plugin``):
    ``write_eagle3``'s tensors plus ``mask_embeddings`` [masks, H] (slot d's own [MASK]_d embedding), a flat Llama
    config with that architecture, ``pard_token`` (the id vLLM feeds every mask slot: ``mask_token_ids[0]``) and
    ``parallelspec_num_masks``. vLLM needs the target beside it and an explicit ``speculative_config`` (no
    speculators type exists for it); at most ``masks + 1`` draft tokens."""
    weights = dict(weights)
    masks = weights.pop("mask_embeddings", None)
    tensors, cfg = _eagle3_parts(weights, config, aux_layer_ids, target_hidden_size, target_num_layers)
    _parallelspec_parts(tensors, cfg, masks, mask_token_ids)
    cfg.update(architectures=[PARALLELSPEC_ARCHITECTURE], model_type="llama", tie_word_embeddings=False, **_FIXED_FLAGS)
    cfg[PROVENANCE] = {"drafter": drafter, "version": __version__}
    return _write(directory, tensors, cfg, tokenizer)


def _parallelspec_parts(
    tensors: dict[str, torch.Tensor], cfg: dict[str, Any], masks: torch.Tensor | None, mask_token_ids: Sequence[int]
) -> None:
    hidden, vocab = _require_ints(cfg, "hidden_size", "vocab_size")
    ids = [_token_id("mask token id", i, vocab) for i in mask_token_ids]
    if masks is None:
        raise SpecframeError("a ParallelSpec export needs 'mask_embeddings' ([masks, H], one row per draft slot)")
    if masks.dim() != 2 or masks.shape[1] != hidden or masks.shape[0] != len(ids) or not ids:
        raise SpecframeError(
            f"mask_embeddings has shape {list(masks.shape)}, expected [{len(ids)}, {hidden}] (one row per mask token id)"
        )
    tensors["mask_embeddings"] = masks.detach().cpu().contiguous()
    width = len(cfg["eagle_aux_hidden_state_layer_ids"]) * int(cfg["target_hidden_size"])
    # vLLM's parallel drafting requires mask_hidden; the plugin model replaces it by the anchor's hidden state
    tensors.setdefault("mask_hidden", torch.zeros(1, 1, width))
    cfg.update(pard_token=ids[0], parallelspec_mask_token_ids=ids, parallelspec_num_masks=len(ids))


# ------------------------------------------------------------------------------------------------------ validation


def check_layout(directory: str | os.PathLike, target_config: Any = None) -> tuple[Manifest, dict, dict]:
    """Read and validate the export at ``directory`` (for a target with ``target_config``, when given): returns its
    manifest, its tensors under the layout's names and its flat config; one ``SpecframeError`` (without the folder
    prefix) names the problem otherwise. Reads weights through safetensors only."""
    from safetensors.torch import load_file

    from specframe.files import check_safetensors

    directory = Path(directory)
    manifest = read_manifest(directory)
    weights_path = directory / WEIGHTS
    if not weights_path.is_file():
        raise SpecframeError(f"{WEIGHTS} is missing (re-run `specframe export`)")
    cfg = _read_config(directory)
    check_safetensors(weights_path)
    tensors = load_file(str(weights_path))
    if manifest.layout == "dflash":
        flat = flat_config(cfg)
        tensors = _dflash_parts(tensors, flat, getattr(target_config, "num_hidden_layers", None))
    elif manifest.layout == "dspark":
        flat = flat_config(cfg)
        tensors = _dspark_parts(tensors, flat, getattr(target_config, "num_hidden_layers", None))
    elif manifest.speculators:
        flat = flat_config(cfg)
        aux = flat.get("eagle_aux_hidden_state_layer_ids")
        if not isinstance(aux, list):
            raise SpecframeError("config.json lacks eagle_aux_hidden_state_layer_ids")
        h_t = _require_ints(flat, "target_hidden_size")[0]
        layers = getattr(target_config, "num_hidden_layers", None)
        tensors, flat = _eagle3_parts(tensors, flat, aux, h_t, layers)
        if manifest.layout == "peagle":
            _peagle_parts(tensors, flat, flat.get("mask_token_id"))
        elif "mask_hidden" in tensors:
            raise SpecframeError("an autoregressive EAGLE-3 export has no mask_hidden")
    elif manifest.layout == "parallelspec":
        flat = {k: v for k, v in cfg.items() if k not in (PROVENANCE, "architectures", "model_type", *_FIXED_FLAGS)}
        aux = flat.get("eagle_aux_hidden_state_layer_ids")
        if not isinstance(aux, list):
            raise SpecframeError("config.json lacks eagle_aux_hidden_state_layer_ids")
        masks = tensors.pop("mask_embeddings", None)
        tensors, flat = _eagle3_parts(tensors, flat, aux, _require_ints(flat, "target_hidden_size")[0],
                                      getattr(target_config, "num_hidden_layers", None))
        _parallelspec_parts(tensors, flat, masks, list(flat.get("parallelspec_mask_token_ids") or []))
    else:
        flat = {k: v for k, v in cfg.items() if k != PROVENANCE}
        _pard_parts(tensors, flat, flat.get("pard_token"))
    if target_config is not None:
        _check_target(flat, target_config)
    return manifest, tensors, flat


def check_export(directory: str | os.PathLike, target_config: Any = None) -> Manifest:
    """Check that vLLM can load the export at ``directory`` (for a target with ``target_config``, when given) and
    return its manifest; raise one ``SpecframeError`` naming the problem otherwise.

    vLLM meets a damaged or mismatched drafter folder with a long traceback from deep inside model loading, often
    after minutes of start-up; this runs the writers' own shape and id checks on what is on disk instead."""
    from specframe.files import check_safetensors

    if (Path(directory) / WEIGHTS).is_file():
        check_safetensors(Path(directory) / WEIGHTS)  # its message names the file already
    try:
        return check_layout(directory, target_config)[0]
    except SpecframeError as e:
        raise SpecframeError(f"{directory} cannot be served by vLLM: {e}") from None


def _check_target(cfg: Mapping[str, Any], target_config: Any) -> None:
    vocab = int(target_config.vocab_size)
    if int(cfg["vocab_size"]) != vocab:
        raise SpecframeError(f"it was exported for a {cfg['vocab_size']}-token vocabulary, the target has {vocab}")
    if "target_hidden_size" in cfg and int(cfg["target_hidden_size"]) != int(target_config.hidden_size):
        raise SpecframeError(
            f"target_hidden_size: it reads target hidden states of width {cfg['target_hidden_size']}, the target's are "
            f"{target_config.hidden_size}"
        )


def _peagle_parts(tensors: dict[str, torch.Tensor], cfg: dict[str, Any], mask_token_id: Any) -> None:
    width = len(cfg["eagle_aux_hidden_state_layer_ids"]) * int(cfg["target_hidden_size"])
    mask = tensors.get("mask_hidden")
    if mask is None:
        raise SpecframeError("a P-EAGLE export needs 'mask_hidden' (the learned hidden state of mask slots)")
    if mask.numel() != width:
        raise SpecframeError(f"mask_hidden has shape {tuple(mask.shape)}, expected [1, 1, {width}] (n_aux * H_target)")
    tensors["mask_hidden"] = mask.reshape(1, 1, width)
    cfg["mask_token_id"] = _token_id("mask_token_id", mask_token_id, int(cfg["vocab_size"]))


def _pard_parts(tensors: dict[str, torch.Tensor], cfg: dict[str, Any], pard_token: Any) -> None:
    vocab, hidden, layers = _require_ints(cfg, "vocab_size", "hidden_size", "num_hidden_layers")
    if cfg.get("architectures") == ["LlamaForCausalLM"]:
        _check_shape(tensors, "model.embed_tokens.weight", (vocab, hidden))
        _check_shape(tensors, "model.norm.weight", (hidden,))
        if cfg.get("tie_word_embeddings"):
            tensors.pop("lm_head.weight", None)
        else:
            _check_shape(tensors, "lm_head.weight", (vocab, hidden))
        _check_layer_count(tensors, "model.layers.", layers)
    cfg["pard_token"] = _token_id("pard_token", pard_token, vocab)


def _eagle3_parts(
    weights: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    aux_layer_ids: Sequence[int],
    target_hidden_size: int,
    target_num_layers: int | None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {re.sub(r"^midlayer\.", "layers.0.", k): v for k, v in _tensors(weights).items()}
    cfg = dict(config)
    vocab, hidden, layers, heads = _require_ints(cfg, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    inter = _require_ints(cfg, "intermediate_size")[0]
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
    _check_layer_order(aux, "aux layer ids")
    h_t = int(target_hidden_size)

    _check_shape(tensors, "fc.weight", (hidden, len(aux) * h_t))
    _check_shape(tensors, "norm.weight", (hidden,))
    if "embed_tokens.weight" in tensors:
        _check_shape(tensors, "embed_tokens.weight", (vocab, hidden))
    _check_layer_count(tensors, "layers.", layers)
    for i in range(layers):
        width = 2 * hidden if i == 0 else hidden
        p = f"layers.{i}."
        _check_shape(tensors, p + "self_attn.q_proj.weight", (heads * head_dim, width))
        _check_shape(tensors, p + "self_attn.k_proj.weight", (kv_heads * head_dim, width))
        _check_shape(tensors, p + "self_attn.v_proj.weight", (kv_heads * head_dim, width))
        _check_shape(tensors, p + "self_attn.o_proj.weight", (hidden, heads * head_dim))
        _check_shape(tensors, p + "mlp.gate_proj.weight", (inter, hidden))
        _check_shape(tensors, p + "mlp.up_proj.weight", (inter, hidden))
        _check_shape(tensors, p + "mlp.down_proj.weight", (hidden, inter))
        _check_shape(tensors, p + "input_layernorm.weight", (hidden,))
        _check_shape(tensors, p + "post_attention_layernorm.weight", (hidden,))
        for norm in ("q_norm", "k_norm"):
            name = p + f"self_attn.{norm}.weight"
            if cfg.get("qk_norm"):
                _check_shape(tensors, name, (head_dim,))
            elif name in tensors:
                raise SpecframeError(f"{name} is present but the layer config is not qwen3 (no q/k norms)")
        if i == 0:
            _check_shape(tensors, p + "hidden_norm.weight", (hidden,))
        elif p + "hidden_norm.weight" in tensors:
            # vLLM builds a hidden_norm on every layer but reads it only on the first
            del tensors[p + "hidden_norm.weight"]

    if cfg.get("norm_before_fc"):
        _check_shape(tensors, "input_norm.weight", (len(aux) * h_t,))
    elif "input_norm.weight" in tensors:
        del tensors["input_norm.weight"]  # vLLM drops it without norm_before_fc (load_weights), and so does specframe

    head = tensors.get("lm_head.weight")
    if head is None:
        raise SpecframeError("missing weight 'lm_head.weight' ([draft_vocab, H])")
    draft_vocab = int(head.shape[0])
    _check_shape(tensors, "lm_head.weight", (draft_vocab, hidden))
    if not 0 < draft_vocab <= vocab:
        raise SpecframeError(f"lm_head.weight has {draft_vocab} rows; the draft vocabulary must be 1..{vocab}")
    _check_draft_vocab(tensors, draft_vocab, vocab)

    for key in ("architectures", "model_type", "num_aux_hidden_states", "tie_word_embeddings"):
        cfg.pop(key, None)
    cfg.update(draft_vocab_size=draft_vocab, target_hidden_size=h_t, eagle_aux_hidden_state_layer_ids=aux)
    _set_dtype(cfg)
    return tensors, cfg


def _check_layer_order(aux: Sequence[int], name: str) -> None:
    # vLLM's target collects the aux hidden states once each, in layer order (EagleModelMixin: sorted(set(ids))), and
    # hands the drafter their concatenation in that order: ids in another order serve the drafter other inputs than
    # it trained on, silently, and a repeated id leaves it short of one
    if any(b <= a for a, b in zip(aux, aux[1:])):
        raise SpecframeError(
            f"{name} {list(aux)} are not strictly increasing: vLLM collects the target's hidden states once each in "
            f"layer order ({sorted(set(aux))}) and feeds the drafter their concatenation so, which is not what it "
            "trained on; train with increasing drafter.aux_layer_ids"
        )


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
    _check_shape(tensors, "d2t", (draft_vocab,))
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
        _check_shape(tensors, "t2d", (vocab,))
        if not torch.equal(given.bool(), t2d):
            raise SpecframeError("t2d does not mark exactly the target ids that d2t maps to")
    tensors["t2d"] = t2d


def _tensors(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in weights.items():
        if not isinstance(value, torch.Tensor):
            raise SpecframeError(f"weight {name!r} is a {type(value).__name__}, not a tensor")
        out[name] = value.detach().to("cpu").contiguous()
    return out


def _require_ints(cfg: Mapping[str, Any], *keys: str) -> list[int]:
    missing = [k for k in keys if cfg.get(k) is None]
    if missing:
        raise SpecframeError(f"the drafter config lacks {', '.join(missing)}")
    return [int(cfg[k]) for k in keys]


def _check_shape(tensors: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> None:
    tensor = tensors.get(name)
    if tensor is None:
        raise SpecframeError(f"missing weight {name!r} (expected shape {list(shape)})")
    if tuple(tensor.shape) != tuple(shape):
        raise SpecframeError(f"weight {name!r} has shape {list(tensor.shape)}, expected {list(shape)}")


def _check_layer_count(tensors: Mapping[str, torch.Tensor], prefix: str, layers: int) -> None:
    found = {int(m.group(1)) for k in tensors if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
    if found != set(range(layers)):
        raise SpecframeError(
            f"the config says {layers} drafter layers but the weights hold {prefix}{{{', '.join(map(str, sorted(found)))}}}"
        )


def _token_id(name: str, value: int, vocab: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab:
        raise SpecframeError(f"{name} {value!r} is not a token id of the {vocab}-token vocabulary")
    return value


# --------------------------------------------------------------------------------------------------------- writing


def _write(
    directory: str | os.PathLike,
    tensors: dict[str, torch.Tensor],
    config: dict[str, Any],
    tokenizer: Any,
) -> dict[str, Any]:
    from safetensors.torch import save_file

    layer = config.get("transformer_layer_config")
    reason = split_rope(layer if isinstance(layer, Mapping) else config)
    if reason is not None:  # before anything is written: an export vLLM cannot start is no export
        raise SpecframeError(f"cannot export this drafter for vLLM: {reason}")
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.", suffix=".tmp"))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would follow the export into place
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
        manifest = read_manifest(tmp)
        _replace_dir(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return attrs.asdict(manifest)


def _is_export(directory: Path) -> bool:
    try:
        read_manifest(directory)
    except SpecframeError:
        return False
    return True


def _replace_dir(new: Path, directory: Path) -> None:
    """Move ``new`` to ``directory``; an existing export there is swapped out first and removed afterwards."""
    if not directory.exists():
        os.replace(new, directory)
        return
    if any(directory.iterdir()) and not _is_export(directory):
        raise SpecframeError(f"{directory} exists and is not a vLLM drafter export; refusing to overwrite it")
    old = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.", suffix=".old"))
    os.replace(directory, old / "export")
    os.replace(new, directory)
    shutil.rmtree(old, ignore_errors=True)
