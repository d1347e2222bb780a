"""The composition root: where the names in a run config become components.

A run config names its target, data, drafter, mask builder and partitioner. Their classes come from the plugin
registry and their options are structured (``specframe.structuring``: one converter, one error format) here and
nowhere else, so a name means the same component with the same defaults, and a bad option the same message, whether a
config is checked without a target (``run_config.resolve``, ``--print-config``), a run is built (``Trainer``), costed
(``specframe.memory``) or a checkpoint reopened (``specframe.drafter_folders``). ``Trainer`` takes what ``build``
gives and is the loop.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from specframe import api, plugins
from specframe.errors import UsageError
from specframe.structuring import structure_options, unstructure


def _prefix(where: str | None) -> str:
    return f"{where}: " if where else ""


def drafter(name: str, table: dict[str, Any], where: str | None = None) -> tuple[type, Any]:
    """The drafter class registered as ``name`` and its typed options (every default filled in)."""
    cls = plugins.get("drafter", name)
    return cls, structure_options(table, cls.Options, f"{_prefix(where)}drafter '{name}'")


def mask_builder(name: str, table: dict[str, Any], where: str | None = None) -> tuple[type, Any]:
    cls = plugins.get("mask builder", name)
    return cls, structure_options(table, cls.Options, f"{_prefix(where)}mask builder '{name}'")


def partitioner(name: str, table: dict[str, Any], where: str | None = None) -> tuple[type, Any]:
    cls = plugins.get("partitioner", name)
    return cls, structure_options(table, cls.Options, f"{_prefix(where)}partitioner '{name}'")


def verifier(name: str, table: dict[str, Any], where: str | None = None) -> tuple[type, Any]:
    """The verifier class registered as ``name`` and its typed options (``bench acceptance --also-verifier``)."""
    cls = plugins.get("verifier", name)
    if not attrs.has(cls.Options):
        if table:
            raise UsageError(f"{_prefix(where)}verifier '{name}' has no options, got {', '.join(table)}")
        return cls, cls.Options()
    return cls, structure_options(table, cls.Options, f"{_prefix(where)}verifier '{name}'")


def mask_builder_name(name: str | None, device: torch.device | str | None) -> str | None:
    """The run's mask builder: the one named, else the most preferred one that trains on ``device``; None while the
    device is still ``auto`` (the machine decides when the run starts)."""
    if name is not None:
        return name
    if device is None or str(device) == "auto":
        return None
    from specframe.masks import default_mask_builder

    return default_mask_builder(device)


@attrs.frozen
class Plan:
    """What a run config's names resolve to before any target is loaded: classes, typed options with their defaults,
    the drafter's training declaration (API 6) and the run's depth."""

    drafter_cls: type
    drafter_options: Any
    training: api.Training
    #: the depth given, else the drafter's declared default; None when it declares none
    depth: int | None
    #: None only while the device is ``auto``
    builder_name: str | None
    builder_cls: type | None
    #: typed, or the table as given while the builder is undecided
    builder_options: Any
    partitioner_cls: type
    partitioner_options: Any

    def resolved(self, cfg: Any) -> Any:
        """``cfg`` with every decided value written in, as OUTPUT/config.json records it (and reads back as is)."""
        return attrs.evolve(
            cfg, depth=self.depth, mask_builder=self.builder_name,
            drafter_options=unstructure(self.drafter_options),
            mask_builder_options=(self.builder_options if self.builder_cls is None
                                  else unstructure(self.builder_options)),
            partitioner_options=unstructure(self.partitioner_options),
        )


def plan(cfg: Any, device: torch.device | str | None = None, where: str | None = None) -> Plan:
    """Resolve ``cfg``'s names for ``device`` (default: ``cfg.device``; ``auto`` leaves the mask builder undecided);
    an unknown name or option is a ``UsageError`` prefixed with ``where``."""
    drafter_cls, drafter_options = drafter(cfg.drafter, cfg.drafter_options, where)
    training = drafter_cls.training(drafter_options)
    builder_name = mask_builder_name(cfg.mask_builder, cfg.device if device is None else device)
    builder_cls, builder_options = None, cfg.mask_builder_options
    if builder_name is not None:
        builder_cls, builder_options = mask_builder(builder_name, cfg.mask_builder_options, where)
    partitioner_cls, partitioner_options = partitioner(cfg.partitioner, cfg.partitioner_options, where)
    return Plan(drafter_cls, drafter_options, training, cfg.depth or training.depth, builder_name, builder_cls,
                builder_options, partitioner_cls, partitioner_options)


@attrs.define
class Components:
    """A training run's parts, built for its target and device."""

    plan: Plan
    drafter: api.Drafter
    depth: int
    builder: Any
    #: what the engine's attention calls use: ``builder``, or with no builder named on the CPU the builder declared
    #: fastest for small calls in front of it for the small calls (``engine.attention.SizedMaskBuilder``)
    attention_builder: Any
    partitioner: Any
    #: the full resolved config (every plugin option, defaults included), what OUTPUT/config.json records
    resolved: Any

    @property
    def training(self) -> api.Training:
        return self.plan.training


def load_target(cfg: Any) -> Any:
    """The run's target, as its config asks (dtype, chat template, device map; remote code only when allowed)."""
    from specframe.targets import load_target as load

    return load(cfg.target, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code,
                chat_template=cfg.chat_template, device_map=cfg.device_map)


def build(cfg: Any, target_config: Any, device: torch.device) -> Components:
    """The drafter, mask builder and partitioner of ``cfg`` for a target of ``target_config`` training on
    ``device``, each refused here when it cannot train so (before any data is read or file written)."""
    p = plan(cfg, device)
    if not p.depth:
        raise UsageError(f"drafter '{cfg.drafter}' has no default training depth: pass --depth")
    if device.type not in p.builder_cls.devices:
        raise UsageError(f"mask builder '{p.builder_name}' does not train on {device.type}")
    made = p.drafter_cls(target_config, p.drafter_options)
    builder = p.builder_cls(p.builder_options)
    attention_builder: Any = builder
    if cfg.mask_builder is None and not p.builder_cls.small_calls and device.type == "cpu":
        from specframe.engine.attention import SizedMaskBuilder
        from specframe.masks import small_call_builder

        small = small_call_builder(device)
        if small is not None:
            small_cls, small_options = mask_builder(small, {})
            attention_builder = SizedMaskBuilder(small_cls(small_options), builder,
                                                 int(target_config.num_attention_heads))
    parts = p.partitioner_cls(p.partitioner_options)
    made.check_training(p.depth, p.builder_name, cfg.partitioner)
    return Components(p, made, p.depth, builder, attention_builder, parts, p.resolved(cfg))


def feature_source(cfg: Any, target: Any, spec: Any) -> Any:
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


def feature_engine(cfg: Any, target: Any, spec: Any) -> Any:
    """The engine computing the online features in place of the target's transformers forward (None: that
    forward). vLLM is imported only when asked for."""
    if cfg.feature_engine == "transformers":
        return None
    import os

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
