"""The vLLM integration: what runs vLLM (an in-process engine, metrics conversion, parity checks, its plugin).

- The layouts vLLM loads (speculators, PARD, ParallelSpec), their writers and the ``speculative_config`` built from an
  export, are files, not vLLM: ``specframe.layouts`` (no vLLM import), below the engine and this package.
- ``specframe.vllm.vllm_plugin``: the ``vllm.general_plugins`` entry point registering the ParallelSpec drafter model.
- ``specframe.vllm.engine``: starts vLLM on a target (optionally with an exported drafter) and generates greedily
  from token ids; ``specframe.vllm.counters`` turns vLLM's spec-decode counters into specframe's metrics
  (``specframe.metrics``); ``specframe.vllm.jobs`` runs engines in child processes, and ``specframe.vllm.interleaved``
  measures several side by side on the same prompts.
- ``specframe.vllm.answer``: the target's greedy answers to many prompts at once (``regenerate --engine vllm``).
- ``specframe.vllm.parity``: compares vLLM's greedy tokens and acceptance with the reference engine's.
- ``specframe.vllm.states``: the target's hidden states at given layer ids from vLLM's ``extract_hidden_states``
  method (``prepare --engine vllm``), written per request by ``specframe.vllm.states_connector`` (a KV connector vLLM
  loads by module path; it imports vLLM at import time); the parity gate they must pass is ``specframe.feature_gate``.

vLLM is optional (``make setup VLLM=cpu|gpu``); only ``engine``, ``answer``, ``states`` and ``states_connector`` need
it, and ``vllm_available`` says whether it imports.
"""

from __future__ import annotations

import importlib.util


def vllm_available() -> bool:
    """Whether the ``vllm`` package is installed (without importing it: that takes seconds)."""
    return importlib.util.find_spec("vllm") is not None
