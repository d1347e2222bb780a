"""What an export's ``config.json`` says it is: the ``Manifest`` (layout, vLLM method, the plugin and version that
wrote it, the verifier and draft tokens a speculators folder names, the draft-token limits vLLM serves it at), read
back from a folder or from the config a writer is about to write, and the explicit vLLM ``speculative_config`` built
from it; and the ``Serving`` choice (verifier, draft tokens) an export is written with (API 14).

Which layout a config is in, and its limits, are the layout table's (``specframe.layouts.table``); the constants of
the format every layout shares are here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from specframe import __version__
from specframe.errors import SpecframeError
from specframe.layouts import table
from specframe.values import is_int

WEIGHTS = "model.safetensors"
#: the architecture of specframe's vLLM general plugin model for ParallelSpec (``specframe.vllm.vllm_plugin``)
PARALLELSPEC_ARCHITECTURE = "ParallelSpecLlamaForCausalLMEagle3"
DEFAULT_SPECULATIVE_TOKENS = 5
#: the config.json entry recording which drafter plugin and specframe version wrote an export
PROVENANCE = "specframe"
#: the key in that entry under which a block drafter declares the fewest draft tokens vLLM serves it at
MIN_TOKENS = "min_speculative_tokens"


@attrs.frozen
class Serving:
    """API 14: what the user chose to serve an export with, handed to ``Drafter.export_vllm`` and on to the layout's
    writer, which writes it into ``config.json`` once (a speculators layout names the verifier and its default draft
    tokens there; the others record neither, vLLM taking both from the command line). None: the drafter's own
    choice (the target it was built for, its default number of draft tokens)."""

    #: the verifier vLLM starts for ``vllm serve EXPORT`` (a local folder's absolute path or a hub id)
    verifier: str | None = None
    #: the default number of draft tokens per step, checked against the export's limits (``Manifest.refusal``)
    speculative_tokens: int | None = None


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
        record = table.get(self.layout)
        return record is not None and record.speculators is not None

    def refusal(self, num_speculative_tokens: Any) -> str | None:
        """Why vLLM cannot serve this export drafting ``num_speculative_tokens`` per step (one line), None if it can.
        The benchmark suites read it to skip such a K with its reason; ``check_tokens`` raises it."""
        k = num_speculative_tokens
        if not is_int(k, 1):
            return f"num_speculative_tokens must be a positive integer, got {k!r}"
        record = table.get(self.layout)
        if self.max_speculative_tokens is not None and k > self.max_speculative_tokens:
            why = record.over_limit if record is not None else ""
            return (f"this {self.layout} export drafts at most {self.max_speculative_tokens} tokens per step ({why}), "
                    f"not {k}")
        low = self.min_speculative_tokens
        if low is not None and k < low:
            high = self.max_speculative_tokens
            serves = f"K = {low}" if high == low else f"K = {low}..{high}" if high is not None else f"K >= {low}"
            slots = record.block_slots if record is not None else "K + 1 slots"
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

    def as_dict(self) -> dict[str, Any]:
        """The manifest as the dict the writers returned up to API 13 (every field, in order)."""
        return attrs.asdict(self)

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> Manifest:
        """The manifest a dict gives (``as_dict``'s, or what an API 13 plugin's ``export_vllm`` returned); keys that
        are no field are left out."""
        names = {f.name for f in attrs.fields(cls)}
        values = {k: v for k, v in mapping.items() if k in names}
        values.setdefault("layout", None)
        values.setdefault("parallel_drafting", False)
        return cls(**values)

    # An API 13 caller indexed the dict a writer returned (``export_vllm(...)["layout"]``): it still can.
    def __getitem__(self, key: str) -> Any:
        if key not in attrs.fields_dict(type(self)):
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        """``self[key]``, or ``default`` when the manifest has no such field (as the API 13 dict's ``get``)."""
        return getattr(self, key) if key in attrs.fields_dict(type(self)) else default

    def keys(self) -> list[str]:
        """The field names (so ``dict(manifest)`` and ``{**manifest}`` give ``as_dict()``, as the API 13 dict did)."""
        return list(attrs.fields_dict(type(self)))

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


def read_config(directory: Path) -> dict[str, Any]:
    """The ``config.json`` of an export folder as a dict (one ``SpecframeError`` when it is missing or not a JSON
    object)."""
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
    """The layout a drafter ``config.json`` is in (``table.names()``: ``eagle3``, ``peagle``, ``pard``, ...), or None:
    a speculators config by its ``speculators_model_type``, another by the layout that recognises it."""
    kind = cfg.get("speculators_model_type")
    if kind is not None:
        record = table.get(kind)
        return kind if record is not None and record.speculators is not None else None
    claims = [r for r in table.layouts() if r.recognise is not None and r.recognise(cfg)]
    chosen = [r for r in claims if not r.fallback] or claims
    return chosen[0].name if chosen else None


def read_manifest(directory: str | os.PathLike) -> Manifest:
    """The manifest of a drafter export (``SpecframeError`` if ``directory`` is not one vLLM and specframe know)."""
    return manifest_of(read_config(Path(directory)), directory)


def manifest_of(cfg: Mapping[str, Any], directory: str | os.PathLike) -> Manifest:
    """The manifest of the ``config.json`` ``cfg`` of the export at ``directory`` (named in a refusal): what
    ``read_manifest`` reads back, and what a writer returns for the config it writes there without reading it."""
    layout = layout_of(cfg)
    if layout is None:
        kind = cfg.get("speculators_model_type")
        what = f"speculators_model_type {kind!r}" if kind is not None else "neither speculators_config nor pard_token"
        raise SpecframeError(
            f"{directory} is not a vLLM drafter export specframe knows ({what}; known layouts: "
            f"{', '.join(table.names())})"
        )
    record = table.get(layout)
    provenance = cfg.get(PROVENANCE) if isinstance(cfg.get(PROVENANCE), dict) else {}
    verifier = tokens = None
    if record.speculators is not None:
        spec = cfg.get("speculators_config") if isinstance(cfg.get("speculators_config"), dict) else {}
        verifier = (spec.get("verifier") or {}).get("name_or_path") if isinstance(spec.get("verifier"), dict) else None
        methods = spec.get("proposal_methods")
        if isinstance(methods, list) and methods and isinstance(methods[0], dict):
            tokens = methods[0].get("speculative_tokens")
    limit, floor, block = record.limits(cfg, provenance)
    return Manifest(
        layout=layout, method=record.method, parallel_drafting=record.parallel_drafting,
        drafter=provenance.get("drafter"), verifier=verifier, speculative_tokens=tokens,
        specframe_version=provenance.get("version", "unknown"),
        max_speculative_tokens=limit, min_speculative_tokens=floor, block_size=block,
    )


def speculative_config(directory: str | os.PathLike, num_speculative_tokens: int) -> dict[str, Any]:
    """vLLM's explicit ``speculative_config`` for the export at ``directory``."""
    return read_manifest(directory).speculative_config(directory, num_speculative_tokens)
