"""What a training step's peak depends on (``MemoryConfig``), the estimate's answer (``Estimate``) and the run's
resolved plan behind both: a run hands its own (``MemoryConfig.from_run``), a config costed by name is resolved once
per estimate (``resolved_plan``), and a change of name or option drops it (``vary``)."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.define
class MemoryConfig:
    """What a training step's peak depends on: the run's components by name (``TrainConfig``'s fields of the same
    names) or, from a run, by its resolved ``compose.Plan`` (``from_run``), and the shape of its step."""

    drafter: str
    target_config: Any
    seq_len: int
    depth: int | None = None
    mask_builder: str = "chunked"
    partitioner: str = "none"
    partitions: int = 1
    drafter_options: dict[str, Any] = attrs.field(factory=dict)
    mask_builder_options: dict[str, Any] = attrs.field(factory=dict)
    #: online (target in the loop, features memoised), cache (``--cache``), synthetic (no target trunk in memory)
    features: str = "online"
    #: training sequences whose features stay in memory (online memoises every one)
    sequences: int = 1
    device: str = "cpu"
    #: the step's autocast dtype and the target weights' (fp32 / bf16 / fp16); the drafter's master weights,
    #: gradients and AdamW state stay fp32 whatever it is
    dtype: str = "fp32"
    #: ranks the drafter is sharded over (``train --fsdp``): AdamW's moments are split among them, and each keeps a
    #: shard of the weights beside the whole copy a forward gathers (``specframe.engine.sharding``); 1: unsharded
    shards: int = 1
    partitioner_options: dict[str, Any] = attrs.field(factory=dict)
    #: the names above resolved (``compose.plan``): a run's own plan, or resolved once by ``estimate``; a change of
    #: name or options drops it (``vary``)
    plan: Any = attrs.field(default=None, eq=False, repr=False)

    @classmethod
    def from_run(cls, run: Any, target_config: Any, **shape: Any) -> MemoryConfig:
        """The step of a ``compose.ResolvedRun`` (its config, a ``TrainConfig``, costed with its plan): the same
        classes and options (the partitioner's included) the run builds, no name resolved again."""
        cfg, plan = run.config, run.plan
        return cls(drafter=cfg.drafter, target_config=target_config, seq_len=cfg.seq_len, depth=cfg.depth,
                   mask_builder=cfg.mask_builder, partitioner=cfg.partitioner, partitions=cfg.partitions,
                   drafter_options=cfg.drafter_options, mask_builder_options=cfg.mask_builder_options,
                   device=cfg.device, dtype=cfg.dtype, partitioner_options=cfg.partitioner_options, plan=plan,
                   **shape)


#: the fields a plan resolves: a change to one of them needs a new plan
_NAMED = frozenset({"drafter", "drafter_options", "depth", "mask_builder", "mask_builder_options", "partitioner",
                    "partitioner_options", "device"})


def resolved_plan(cfg: MemoryConfig) -> Any:
    """``cfg``'s plan: its own, else its names resolved (``compose.plan``)."""
    if cfg.plan is not None:
        return cfg.plan
    from specframe import compose

    return compose.plan(cfg)


def vary(cfg: MemoryConfig, **changes: Any) -> MemoryConfig:
    """``cfg`` with ``changes``; its plan kept while no name or option changes (a search over lengths resolves
    nothing again)."""
    if _NAMED & set(changes):
        changes["plan"] = None
    if changes.get("partitioner", cfg.partitioner) != cfg.partitioner:
        changes.setdefault("partitioner_options", {})  # the run's options are its own partitioner's
    return attrs.evolve(cfg, **changes)


@attrs.define
class Estimate:
    peak_bytes: int
    fixed_bytes: int
    step_bytes: int
    breakdown: dict[str, int]
    elements: int
    segments: int
    largest_segment: dict[str, int]
    #: what the estimate could not count, one sentence each (a drafter whose layers it cannot see)
    notes: list[str] = attrs.field(factory=list)

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)
