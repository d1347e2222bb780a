"""The checks every layout's writer and reader share: strict integers, tensors on the CPU, weight shapes, layer
counts, token ids, aux layer order, a RoPE vLLM's drafter models can take, and the export-against-target check.

Each raises one ``SpecframeError`` naming the field or weight; the per-layout checks (``eagle3``, ``block``, ``pard``,
``parallelspec``) and the foreign readers (``formats``) are built from them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from specframe.errors import SpecframeError
from specframe.values import is_int


def check_int(name: str, value: Any, lo: int | None = None, hi: int | None = None, *,
              message: str | None = None) -> int:
    """``value`` if it is an integer within ``lo``..``hi`` (``is_int``), else one ``SpecframeError``: ``message`` when
    given, otherwise "NAME must be <the range>, got VALUE"."""
    if is_int(value, lo, hi):
        return value
    if message is None:
        what = ("a positive integer" if (lo, hi) == (1, None) else f"in {lo}..{hi}" if lo is not None and hi is not None
                else f"an integer of at least {lo}" if lo is not None else f"an integer of at most {hi}"
                if hi is not None else "an integer")
        message = f"{name} must be {what}, got {value!r}"
    raise SpecframeError(message)


def tensors(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` detached, on the CPU and contiguous, as safetensors writes them; a non-tensor is refused by name."""
    out = {}
    for name, value in weights.items():
        if not isinstance(value, torch.Tensor):
            raise SpecframeError(f"weight {name!r} is a {type(value).__name__}, not a tensor")
        out[name] = value.detach().to("cpu").contiguous()
    return out


def require_ints(cfg: Mapping[str, Any], *keys: str) -> list[int]:
    """The ``keys`` of a drafter config as integers; the missing ones are named."""
    missing = [k for k in keys if cfg.get(k) is None]
    if missing:
        raise SpecframeError(f"the drafter config lacks {', '.join(missing)}")
    return [int(cfg[k]) for k in keys]


def check_shape(tensors: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> None:
    """Refuse a missing weight ``name`` or one of another shape than ``shape``."""
    tensor = tensors.get(name)
    if tensor is None:
        raise SpecframeError(f"missing weight {name!r} (expected shape {list(shape)})")
    if tuple(tensor.shape) != tuple(shape):
        raise SpecframeError(f"weight {name!r} has shape {list(tensor.shape)}, expected {list(shape)}")


def check_layer_count(tensors: Mapping[str, torch.Tensor], prefix: str, layers: int) -> None:
    """Refuse weights whose ``prefix{i}.`` layers are not exactly 0..``layers`` - 1."""
    found = {int(m.group(1)) for k in tensors if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
    if found != set(range(layers)):
        raise SpecframeError(
            f"the config says {layers} drafter layers but the weights hold {prefix}{{{', '.join(map(str, sorted(found)))}}}"
        )


def token_id(name: str, value: Any, vocab: int) -> int:
    """``value`` if it is a token id of a ``vocab``-token vocabulary."""
    return check_int(name, value, 0, vocab - 1,
                     message=f"{name} {value!r} is not a token id of the {vocab}-token vocabulary")


def check_layer_order(aux: Sequence[int], name: str) -> None:
    """Refuse aux layer ids that are not strictly increasing."""
    # vLLM's target collects the aux hidden states once each, in layer order (EagleModelMixin: sorted(set(ids))), and
    # hands the drafter their concatenation in that order: ids in another order serve the drafter other inputs than
    # it trained on, silently, and a repeated id leaves it short of one
    if any(b <= a for a, b in zip(aux, aux[1:])):
        raise SpecframeError(
            f"{name} {list(aux)} are not strictly increasing: vLLM collects the target's hidden states once each in "
            f"layer order ({sorted(set(aux))}) and feeds the drafter their concatenation so, which is not what it "
            "trained on; train with increasing drafter.aux_layer_ids"
        )


def check_export_target(cfg: Mapping[str, Any], target_config: Any) -> None:
    """Refuse an export's flat config made for another vocabulary or target width than ``target_config``'s."""
    vocab = int(target_config.vocab_size)
    if int(cfg["vocab_size"]) != vocab:
        raise SpecframeError(f"it was exported for a {cfg['vocab_size']}-token vocabulary, the target has {vocab}")
    if "target_hidden_size" in cfg and int(cfg["target_hidden_size"]) != int(target_config.hidden_size):
        raise SpecframeError(
            f"target_hidden_size: it reads target hidden states of width {cfg['target_hidden_size']}, the target's are "
            f"{target_config.hidden_size}"
        )


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
