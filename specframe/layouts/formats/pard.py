"""The ``pard`` and ``parallelspec`` formats: a PARD causal LM (``LlamaForCausalLM`` names) whose config has
``pard_token``, PARD's released layout, and specframe's own ParallelSpec export; both are read as their exports are
checked (``check_layout``), and name no verifier.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specframe.layouts.export_check import check_layout
from specframe.layouts.formats.base import Format
from specframe.layouts.imported import Imported
from specframe.layouts.manifest import PARALLELSPEC_ARCHITECTURE


def _reader(fmt: str):
    def read(directory: Path, target_config: Any) -> Imported:
        manifest, tensors, flat = check_layout(directory)
        return Imported(directory, fmt, manifest.layout, flat, tensors, None, manifest.drafter)

    return read


PARALLELSPEC = Format("parallelspec", lambda cfg: PARALLELSPEC_ARCHITECTURE in (cfg.get("architectures") or []),
                      _reader("parallelspec"), sign=f"architecture {PARALLELSPEC_ARCHITECTURE}")
#: tried after ParallelSpec, whose config carries ``pard_token`` too
PARD = Format("pard", lambda cfg: "pard_token" in cfg, _reader("pard"), sign="pard_token")
