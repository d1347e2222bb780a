"""The files layer for drafter folders: the layouts specframe writes and reads, and nothing that runs them.

- ``specframe.layouts.export``: writers for the speculators EAGLE-3 / P-EAGLE / DFlash / DSpark format, the PARD
  causal LM and the ParallelSpec layout (drafter plugins call them through ``api.vllm_layouts`` from
  ``Drafter.export_vllm``), the manifest read back from an export's ``config.json`` and the vLLM
  ``speculative_config`` built from it.
- ``specframe.layouts.imports``: reads speculators, SafeAILab / SpecForge EAGLE-3 / P-EAGLE, PARD and ParallelSpec
  folders and checks them against the target, for ``Drafter.import_weights`` and ``train --init-from``.

Neither imports the API, the engine, the plugin registry or vLLM (an import-linter contract in pyproject.toml):
which drafter a folder holds is decided above, in ``specframe.drafter_folders``; running an export is
``specframe.vllm``'s.
"""
