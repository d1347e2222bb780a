"""Whether a drafter folder fits the target it is to draft for: its vocabulary, hidden size, layer shape, activation,
norm epsilon and RoPE (compared in full: ``rope_type``, ``rope_theta``, where a missing theta is transformers' and
SpecForge's default 10000, and every scaling field), its aux layers and its saved tokenizer; and the target's own
tensors (embedding, output head) and tokenizer read from its local folder, which a folder that shares them needs.
``sliding_window_layers`` reads which layers of a layer config attend through a window, as transformers builds it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specframe.errors import SpecframeError
from specframe.layouts import table
from specframe.values import is_number

if TYPE_CHECKING:
    from specframe.layouts.imported import Imported

#: the RoPE base transformers assumes when a config names none (``RotaryEmbeddingConfigMixin.default_theta``), which
#: is also what SpecForge's drafters use (``getattr(config, "rope_theta", 10000)``)
DEFAULT_ROPE_THETA = 10000.0
# RoPE types whose pretraining length transformers fills in from max_position_embeddings when a config omits it
_ROPE_WITH_ORIGINAL_LENGTH = ("llama3", "yarn", "longrope")
# layer fields a drafter built on the target's LayerShape must share with the target, and how they are compared
_SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")


def rope(cfg: Mapping[str, Any]) -> dict[str, Any]:
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
            out[key] = rope_value(value)
    return out


def rope_value(value: Any) -> Any:
    """A RoPE field's value as ``rope`` compares it: numbers (and lists of them) as floats, anything else as is."""
    if not (is_number(value) or isinstance(value, list | tuple)):
        return value
    return [float(v) for v in value] if isinstance(value, list | tuple) else float(value)


def rope_difference(ours: dict[str, Any], theirs: dict[str, Any]) -> str | None:
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
    record = table.get(imported.layout)
    reads_target_states = record is None or record.aux_hidden_states
    if reads_target_states and int(cfg["target_hidden_size"]) != int(target["hidden_size"]):
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
    differs = rope_difference(rope(cfg), rope(target))
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
    return target_tensor(target_config, "model.embed_tokens.weight")


def target_lm_head(target_config: Any) -> torch.Tensor | None:
    """The target's output head from its local safetensors files (its embedding when the two are tied), or None."""
    head = target_tensor(target_config, "lm_head.weight")
    if head is None and getattr(target_config, "tie_word_embeddings", False):
        head = target_embedding(target_config)
    return head


def target_tensor(target_config: Any, name: str) -> torch.Tensor | None:
    """The target's tensor ``name`` from its local safetensors files (None when not found or not a local folder)."""
    from safetensors import safe_open

    source = getattr(target_config, "_name_or_path", None)
    if not source or not Path(source).is_dir():
        return None
    for f in sorted(Path(source).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            if name in handle.keys():
                return handle.get_tensor(name)
    return None


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
