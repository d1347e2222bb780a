"""A run's parts, assembled from its plan beside the engine that trains them.

``specframe.compose.ResolvedRun`` holds a run config's names resolved once (classes, typed options, the drafter's
training declaration) beside the config they were written into; the engine is handed that run and builds here what
it trains with: the target, the drafter, mask builder and partitioner for the target and device (``build``), the
source of features (``feature_source``), the memory budget's guard (``memory_guard``), the DDP / FSDP wrapper and the
optimizer. The composition root stays below
the engine and never reaches up into it.
"""

from __future__ import annotations

import os
from typing import Any

import attrs
import torch

from specframe import api, compose, memory
from specframe.engine.config import TrainConfig, warmup_steps
from specframe.engine.schedule import lr_lambda
from specframe.engine.sharding import DrafterLoss, shard
from specframe.errors import UsageError


@attrs.define
class Components:
    """A training run's parts, built for its target and device."""

    #: the run as built: its mask builder decided for the device, and the full resolved config (every plugin option,
    #: defaults included), what OUTPUT/config.json records
    run: compose.ResolvedRun
    drafter: api.Drafter
    depth: int
    builder: Any
    #: what the engine's attention calls use: ``builder``, or with no builder named on the CPU the builder declared
    #: fastest for small calls in front of it for the small calls (``engine.attention.SizedMaskBuilder``)
    attention_builder: Any
    partitioner: Any

    @property
    def training(self) -> api.Training:
        return self.run.plan.training


def load_run_target(cfg: TrainConfig) -> Any:
    """The run's target, as its config asks (dtype, chat template, device map; remote code only when allowed):
    ``specframe.targets.load_target`` with the run config's settings."""
    from specframe.targets import load_target

    return load_target(cfg.target, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code,
                       chat_template=cfg.chat_template, device_map=cfg.device_map)


def build(run: compose.ResolvedRun, target_config: Any, device: torch.device) -> Components:
    """The drafter, mask builder and partitioner of ``run`` for a target of ``target_config`` training on ``device``,
    each refused here when it cannot train so (before any data is read or file written). With the run's
    ``sized_attention`` (a run that names no builder, unless its config says otherwise), on the CPU, the builder
    declared fastest for small calls is put in front of the run's for the calls it fits (``SizedMaskBuilder``)."""
    run = run.for_device(device)
    p, cfg = run.plan, run.config
    if not p.depth:
        raise UsageError(f"drafter '{cfg.drafter}' has no default training depth: pass --depth")
    if device.type not in p.builder_cls.devices:
        raise UsageError(f"mask builder '{p.builder_name}' does not train on {device.type}")
    made = p.drafter_cls(target_config, p.drafter_options)
    builder = p.builder_cls(p.builder_options)
    attention_builder: Any = builder
    if p.sized_attention and not p.builder_cls.small_calls and device.type == "cpu":
        from specframe.engine.attention import SizedMaskBuilder
        from specframe.masks import small_call_builder

        small = small_call_builder(device)
        if small is not None:
            small_cls, small_options = compose.mask_builder(small, {})
            attention_builder = SizedMaskBuilder(small_cls(small_options), builder,
                                                 int(target_config.num_attention_heads))
    parts = p.partitioner_cls(p.partitioner_options)
    made.check_training(p.depth, p.builder_name, cfg.partitioner)
    return Components(run, made, p.depth, builder, attention_builder, parts)


def feature_source(cfg: TrainConfig, target: Any, spec: Any) -> Any:
    """Where the run's features come from: the feature cache (``--cache``), else the target run online over the
    data."""
    from specframe.engine.data import CacheSource, OnlineSource

    if cfg.cache is not None:
        return CacheSource(cfg.cache, target, spec, cfg.seq_len, cfg.max_examples, cfg.pack)
    engine = feature_engine(cfg, target, spec)
    try:
        return OnlineSource(cfg.data, target, spec, cfg.seq_len, cfg.max_examples, cfg.pack, cfg.data_workers,
                            engine=engine, gate_sequences=cfg.gate_sequences)
    except BaseException:
        if engine is not None:  # a refused source (a failed gate, no usable data) releases the engine it started
            engine.close()
        raise


def feature_engine(cfg: TrainConfig, target: Any, spec: Any) -> Any:
    """The engine computing the online features in place of the target's transformers forward (None: that
    forward). vLLM is imported only when asked for."""
    if cfg.feature_engine == "transformers":
        return None
    from specframe.feature_engines import engine_layer_ids
    from specframe.vllm.answer import AnswerOptions
    from specframe.vllm.states import VllmStates, model_len

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("--feature-engine vllm starts one engine in the trainer's process; under torchrun every rank "
                         "would start its own: prepare a feature cache with `specframe prepare --engine vllm` in one "
                         "process, then train from it (--cache) on many")
    if target.path is None:
        raise UsageError("--feature-engine vllm needs the target as a model folder vLLM can load")
    return VllmStates(target.path, engine_layer_ids(spec, target.num_layers), AnswerOptions(
        dtype=cfg.dtype, max_model_len=model_len(target.config, cfg.seq_len, "--seq-len"), max_num_seqs=32,
        tensor_parallel_size=cfg.vllm_tensor_parallel_size, gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
        kv_cache_gib=cfg.vllm_kv_cache_gib))


def memory_guard(run: compose.ResolvedRun, target_config: Any,
                 sequences: int | None = None) -> memory.MemoryGuard | None:
    """The training engine's memory budget: refuse a run whose estimate cannot fit its ``memory_budget`` (unless
    ``SPECFRAME_SKIP_MEMORY_CHECK`` is set), and return the in-run guard. The estimate costs the drafter, mask builder
    and partitioner with the run's own plan and options, resolving no name again. ``sequences``: how many sequences'
    online features the run keeps in memory (default: from the config)."""
    resolved = run.config
    if resolved.memory_budget is None:
        return None
    budget = memory.parse_size(resolved.memory_budget)
    if not memory.skip_precheck():
        if sequences is None:
            sequences = (resolved.max_steps or 1) * resolved.batch_size
            if resolved.max_examples is not None:
                sequences = min(sequences, resolved.max_examples)
        memory.check_budget(memory.MemoryConfig.from_run(
            run, target_config, features="cache" if resolved.cache is not None else "online",
            sequences=sequences,
            shards=int(os.environ.get("WORLD_SIZE", "1")) if resolved.fsdp else 1,
        ), budget)
    return memory.MemoryGuard(budget, resolved.device)


def wrap(drafter: api.Drafter, fsdp: bool, world: int, device: torch.device,
         ) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
    """(the FSDP root, the DDP module) the drafter's loss runs through: a multi-process run's gradients are reduced by
    torch's DDP, or with ``--fsdp`` the drafter is sharded by FSDP2 (``specframe.engine.sharding``); either wraps the
    loss as a module (``DrafterLoss``). One process needs neither."""
    if fsdp:
        root = DrafterLoss(drafter, every_parameter=True)
        shard(root, device)
        return root, None
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        return None, DistributedDataParallel(DrafterLoss(drafter), find_unused_parameters=True)
    return None, None


def optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig, total_steps: int,
              ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over ``params`` and its schedule: warmup, then cosine decay over the run's steps."""
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    warmup = warmup_steps(cfg, total_steps)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(warmup, total_steps))
