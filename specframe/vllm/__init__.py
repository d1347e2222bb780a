"""The vLLM integration: checkpoint layouts vLLM loads, an in-process engine, metrics conversion and parity checks.

- ``specframe.vllm.export``: writers for the speculators EAGLE-3 / P-EAGLE format, the PARD causal LM and the
  ParallelSpec layout (drafter plugins call them from ``Drafter.export_vllm``), the manifest read from an export's
  ``config.json`` and the ``speculative_config`` built from it. Imports no vLLM.
- ``specframe.vllm.imports``: reads speculators, SafeAILab / SpecForge EAGLE-3, PARD and ParallelSpec folders into
  the drafter plugins (``Drafter.import_weights``; ``train --init-from``, ``generate`` / ``bench --checkpoint``).
- ``specframe.vllm.vllm_plugin``: the ``vllm.general_plugins`` entry point registering the ParallelSpec drafter model.
- ``specframe.vllm.engine``: starts vLLM on a target (optionally with an exported drafter), generates greedily
  from token ids and turns vLLM's spec-decode counters into specframe's metrics (``specframe.metrics``).
- ``specframe.vllm.answer``: the target's greedy answers to many prompts at once (``regenerate --engine vllm``).
- ``specframe.vllm.parity``: compares vLLM's greedy tokens and acceptance with the reference engine's.

vLLM is optional (``make setup VLLM=cpu|gpu``); only ``engine`` and ``answer`` need it, and ``vllm_available`` says whether it
imports.
"""

from __future__ import annotations

import importlib.util


def vllm_available() -> bool:
    """Whether the ``vllm`` package is installed (without importing it: that takes seconds)."""
    return importlib.util.find_spec("vllm") is not None
