"""What the installed vLLM can serve, checked before an engine starts: an export whose target or drafter vLLM cannot
run is refused with the reason, instead of failing minutes later deep in vLLM's start-up (``RuntimeError: Model does
not support EAGLE3 interface``, ``Unsupported activation``).

EAGLE-family drafters (``eagle3``, ``peagle``, ``parallelspec``, and DFlash, which also reads the target's aux hidden
states) need a target model class implementing vLLM's ``SupportsEagle3`` (it hands its aux hidden states to the
drafter); vLLM's Llama-based EAGLE-3 drafter (``llama_eagle3``) builds its MLP for ``silu`` only, while specframe's
drafter takes the target's ``hidden_act`` (so a Gemma drafter is tanh-GELU). PARD is a standalone draft model: any
target vLLM serves.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specframe.errors import SpecframeError

#: layouts whose drafter reads the target's aux hidden states
AUX_LAYOUTS = ("eagle3", "peagle", "parallelspec", "dflash")
#: layouts served by vLLM's Llama-based EAGLE-3 drafter model (its MLP: silu only)
LLAMA_EAGLE3_LAYOUTS = ("eagle3", "peagle")


def problems(layout: str, target_architectures: Sequence[str], drafter_hidden_act: str | None) -> list[str]:
    """Why the installed vLLM cannot serve a ``layout`` drafter for a target of ``target_architectures`` (empty: no
    known reason)."""
    found = []
    if layout in LLAMA_EAGLE3_LAYOUTS and drafter_hidden_act not in (None, "silu"):
        found.append(f"vLLM's EAGLE-3 drafter model (llama_eagle3) builds only silu layers, and this drafter's "
                     f"activation is the target's {drafter_hidden_act}")
    if layout in AUX_LAYOUTS:
        for arch in target_architectures:
            cls = _model_class(arch)
            if cls is not None and not _supports_eagle3(cls):
                found.append(f"vLLM's {arch} does not implement SupportsEagle3, so it cannot hand its aux hidden "
                             "states to the drafter")
    return found


def check(export_dir: str | os.PathLike, layout: str, target: str | os.PathLike | None) -> None:
    """Refuse (``SpecframeError``, every reason named) an export the installed vLLM cannot serve for ``target`` (its
    folder or hub id; None: the export's recorded verifier). A target whose config cannot be read is left to vLLM."""
    import json

    from specframe.vllm.export import flat_config, read_manifest

    cfg = json.loads((Path(export_dir) / "config.json").read_text())
    try:
        act = flat_config(cfg).get("hidden_act") if "transformer_layer_config" in cfg else cfg.get("hidden_act")
    except SpecframeError:
        act = None
    verifier = target or read_manifest(export_dir).verifier
    archs = _architectures(verifier) if verifier else []
    found = problems(layout, archs, act)
    if found:
        raise SpecframeError(f"the installed vLLM cannot serve this {layout} export for target {verifier}: "
                             + "; ".join(found))


def _architectures(target: str | os.PathLike) -> list[str]:
    try:
        from transformers import AutoConfig

        return list(AutoConfig.from_pretrained(str(target)).architectures or [])
    except (OSError, ValueError):
        return []


def _model_class(arch: str) -> Any:
    try:
        from vllm.model_executor.models.registry import ModelRegistry
    except ImportError:
        return None
    load = getattr(ModelRegistry, "_try_load_model_cls", None)  # vLLM's own lookup; absent in another version
    return load(arch) if load is not None else None


def _supports_eagle3(cls: Any) -> bool:
    from vllm.model_executor.models.interfaces import supports_eagle3

    return bool(supports_eagle3(cls))
