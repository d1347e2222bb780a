"""What the installed vLLM can serve, checked before an engine starts: an export whose target or drafter vLLM cannot
run is refused with the reason, instead of failing minutes later deep in vLLM's start-up (``RuntimeError: Model does
not support EAGLE3 interface``, ``Unsupported activation``).

EAGLE-family drafters (``eagle3``, ``peagle``, ``parallelspec``, and DFlash, which also reads the target's aux hidden
states) need a target model class implementing vLLM's ``SupportsEagle3`` (it hands its aux hidden states to the
drafter); vLLM's Llama-based EAGLE-3 drafter (``llama_eagle3``) builds its MLP for ``silu`` only, while specframe's
drafter takes the target's ``hidden_act`` (so a Gemma drafter is tanh-GELU). PARD is a standalone draft model: any
target vLLM serves.

DSpark (vLLM 0.32): only the V2 model runner serves method ``dspark`` (``DSparkSpeculator`` in
``vllm/v1/worker/gpu/spec_decode/dspark``: the DFlash block plus the sequential Markov sampling), and vLLM picks that
runner only where Triton (with a backend for the device) is installed (``VllmConfig.use_v2_model_runner``). The CPU
build has none, so vLLM falls back to the V1 runner, and its config validation then refuses the engine ("Model
Runner V1 does not support: dspark speculative decoding"), after a couple of minutes of start-up here (measured:
128 s, the export already resolved as ``Qwen3DSparkModel``). The refusal below says so before any of that.

``prestart`` is the one check every command that starts vLLM runs first; an export's own config is read as written
(its ``hidden_act``, its RoPE), since that is what vLLM builds the drafter from.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specframe.errors import SpecframeError

def problems(layout: str, target_architectures: Sequence[str], drafter_hidden_act: str | None) -> list[str]:
    """Why the installed vLLM cannot serve a ``layout`` drafter for a target of ``target_architectures`` (empty: no
    known reason). What the layout needs of vLLM is its row of the layout table (``specframe.layouts.table``)."""
    from specframe.layouts import table

    record = table.get(layout)
    if record is None:
        return []
    probe = _METHOD_PROBES.get(record.method)
    found = probe() if probe is not None else []
    if record.silu_only and drafter_hidden_act not in (None, "silu"):
        found.append(f"vLLM's EAGLE-3 drafter model (llama_eagle3) builds only silu layers, and this drafter's "
                     f"activation is the target's {drafter_hidden_act}")
    if record.aux_hidden_states:
        for arch in target_architectures:
            cls = _model_class(arch)
            if cls is not None and not _supports_eagle3(cls):
                found.append(f"vLLM's {arch} does not implement SupportsEagle3, so it cannot hand its aux hidden "
                             "states to the drafter")
    return found


def prestart(target: str | os.PathLike | None, export_dir: str | os.PathLike | None = None, *,
             extract_states: bool = False, config: Mapping[str, Any] | None = None) -> None:
    """The one check every command runs before it starts vLLM (``bench acceptance --engine vllm`` and the engines of
    ``specframe.vllm.engine``, ``serve``, ``prepare`` / ``regenerate --engine vllm``, ``regenerate --capture``,
    ``train --feature-engine vllm``): refuse, in one line naming every reason, what the installed vLLM is known not
    to start, instead of its traceback minutes into start-up. ``target``: the target's folder or hub id (None: the
    verifier the export names); ``export_dir``: the exported drafter served beside it (``check``; ``config`` its
    ``config.json`` when the caller read it already); ``extract_states``: the target hands out its hidden states
    (vLLM's ``extract_hidden_states`` method)."""
    if export_dir is not None:
        from specframe.layouts.export import manifest_of, read_config

        # the folder is read once: its manifest is what its config.json says, and check reads that same config
        config = config if config is not None else read_config(Path(export_dir))
        check(export_dir, manifest_of(config, export_dir).layout, target, config=config)
    if extract_states:
        problem = extraction_problem(str(target))
        if problem:
            raise SpecframeError(f"--engine vllm cannot prepare features for {target}: {problem}")


def check(export_dir: str | os.PathLike, layout: str, target: str | os.PathLike | None, *,
          config: Mapping[str, Any] | None = None) -> None:
    """Refuse (``SpecframeError``, every reason named) an export the installed vLLM cannot serve for ``target`` (its
    folder or hub id; None: the export's recorded verifier). A target whose config cannot be read is left to vLLM.
    The activation and RoPE are read from the drafter's layer config as written: what vLLM builds the drafter from.
    ``config``: the export's ``config.json`` already read (``prestart``); None reads it here, once."""
    import json

    from specframe.layouts.export import manifest_of, split_rope

    cfg = config if config is not None else json.loads((Path(export_dir) / "config.json").read_text())
    layer = cfg.get("transformer_layer_config")
    layer = layer if isinstance(layer, dict) else cfg
    verifier = target or manifest_of(cfg, export_dir).verifier
    target_config = _target_config(verifier) if verifier else None
    found = [reason] if (reason := split_rope(layer)) else []
    act = layer.get("hidden_act")
    if act is None:
        own = _activation(target_config)
        if own not in (None, "silu"):
            # vLLM builds a layer config without hidden_act with silu; the drafter computed the target's activation
            found.append(f"the export names no hidden_act, so vLLM would build its layers with silu, while the drafter "
                         f"computes the target's {own} (export it again)")
    archs = list(getattr(target_config, "architectures", None) or [])
    found += problems(layout, archs, act)
    if found:
        raise SpecframeError(f"the installed vLLM cannot serve this {layout} export for target {verifier}: "
                             + "; ".join(found))


def extraction_problem(target: str | os.PathLike) -> str | None:
    """Why the installed vLLM cannot extract hidden states from ``target`` here (None: nothing known against it)."""
    try:
        from vllm.config.speculative import SpeculativeConfig  # noqa: F401
        from vllm.distributed.kv_transfer.kv_connector.v1 import (
            example_hidden_states_connector,  # noqa: F401
        )
    except ImportError as exc:
        return (f"vLLM is not usable here ({exc}); install it with `make setup VLLM=cpu` (CPU) or `VLLM=gpu`")
    import typing

    from vllm.config import speculative

    methods = set()
    for alias in ("SpeculativeMethod", "EagleModelTypes"):
        methods |= _literal_values(getattr(speculative, alias, None), typing)
    if "extract_hidden_states" not in methods:
        import vllm

        return f"vLLM {vllm.__version__} has no extract_hidden_states speculative method (vLLM 0.18 added it)"
    for arch in _architectures(target):
        cls = _model_class(arch)
        if cls is not None and not _supports_eagle3(cls):
            return (f"vLLM's {arch} does not implement SupportsEagle3, the interface through which it hands out its "
                    "aux hidden states")
    return None


def _literal_values(alias: Any, typing: Any) -> set[str]:
    out: set[str] = set()
    if alias is None:
        return out
    for arg in typing.get_args(alias):
        if isinstance(arg, str):
            out.add(arg)
        else:
            out |= _literal_values(arg, typing)
    return out


def dspark_runner_problem() -> str | None:
    """Why the installed vLLM cannot run its DSpark speculator here (module docstring), None if it can (or when vLLM
    is absent: nothing is started then)."""
    try:
        from vllm.triton_utils import HAS_TRITON
    except ImportError:
        return None
    forced = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if HAS_TRITON and forced not in ("0", "false", "False"):
        return None
    why = ("it has no Triton (the CPU build)" if not HAS_TRITON else "VLLM_USE_V2_MODEL_RUNNER turns that runner off")
    return ("vLLM serves method dspark only in its V2 model runner (DSparkSpeculator), and " + why + ", so it would "
            "start its V1 runner, which refuses dspark speculative decoding")


def dspark_anchor_problem(algos: str | os.PathLike | None = None) -> str | None:
    """Why the installed vLLM would serve a ``sample_from_anchor`` DSpark export one slot off (None: it reads the
    field, or vLLM / its DSpark config reader is absent). Builds between vLLM 0.25.2 and PR #48639 set
    ``dspark_bonus_anchor`` true in ``update_dspark`` whatever the config says, so every slot is served shifted by
    one with no error. The installed reader is asked itself: ``update_dspark`` is run on an anchor-first config, from
    its source file (``algos``: that file; default the installed vLLM's), without importing vLLM (a minute here)."""
    import importlib.util

    if algos is None:
        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.submodule_search_locations:
            return None
        algos = Path(list(spec.submodule_search_locations)[0], "transformers_utils", "configs", "speculators",
                     "algos.py")
    algos = Path(algos)
    if not algos.is_file():
        return None
    namespace: dict[str, Any] = {"__name__": "specframe_probe_vllm_algos"}
    try:
        exec(compile(algos.read_text(), str(algos), "exec"), namespace)  # the module defines functions only
        update = namespace.get("update_dspark")
        if update is None:
            return None  # a vLLM without DSpark: its own refusal names it
        read: dict[str, Any] = {}
        update({"architectures": ["Qwen3DSparkModel"], "sample_from_anchor": True, "aux_hidden_state_layer_ids": [1],
                "mask_token_id": 0, "block_size": 2}, read)
    except Exception:  # noqa: BLE001 - a reader that cannot run alone is left to vLLM (nothing known against it)
        return None
    if read.get("sample_from_anchor") is True and not read.get("dspark_bonus_anchor"):
        return None
    return ("this vLLM's update_dspark serves every DSpark export as a bonus-anchor block (dspark_bonus_anchor "
            "hard-coded true; fixed by vllm-project/vllm PR #48639), so the anchor-first export would be served one "
            "slot off; install a vLLM with that fix")


def _dspark_problems() -> list[str]:
    return [reason for reason in (dspark_runner_problem(), dspark_anchor_problem()) if reason]


#: what the installed vLLM is probed for before it serves a speculative method (by vLLM's method name)
_METHOD_PROBES = {"dspark": _dspark_problems}


def _architectures(target: str | os.PathLike) -> list[str]:
    return list(getattr(_target_config(target), "architectures", None) or [])


def _target_config(target: str | os.PathLike) -> Any:
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(target))
    except (OSError, ValueError):
        return None


def _activation(config: Any) -> str | None:
    """The target's activation, however its family names it (Gemma's ``hidden_activation``, a multimodal config's
    text part)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "hidden_act", None) or getattr(text, "hidden_activation", None)


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
