"""The DFlash draft network: the core's block backbone (``api.block.BlockModel``, API 7).

It was defined here until DSpark, a second block drafter, needed the same network; it moved into the core as
``api.block`` so both packages share one copy. Its names follow vLLM's ``DFlashQwen3Model`` (``fc``, ``hidden_norm``,
``layers.i.self_attn.{q,k,v,o}_proj``, ``q_norm`` / ``k_norm``, ``mlp``, ``norm``), so the export is a rename-free
copy of the state dict.
"""

from __future__ import annotations

from specframe import api

DFlashModel = api.block.BlockModel
RMSNorm = api.block.RMSNorm
