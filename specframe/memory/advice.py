"""A configuration that cannot fit its budget: the refusal (``check_budget``, ``refusal``) and what would fit
(``advice``: the largest ``--seq-len``, the partitions needed, another mask builder, activation checkpointing)."""

from __future__ import annotations

import attrs

from specframe.errors import SpecframeError
from specframe.memory.config import Estimate, MemoryConfig, resolved_plan, vary
from specframe.memory.estimate import estimate
from specframe.memory.sizes import format_size, parse_size


def check_budget(cfg: MemoryConfig, budget: int | str) -> Estimate:
    """The estimate, or one ``SpecframeError`` saying the configuration cannot fit ``budget`` and what would."""
    limit = parse_size(budget)
    est = estimate(cfg)
    if est.peak_bytes <= limit:
        return est
    raise SpecframeError(refusal(cfg, est, limit))


def refusal(cfg: MemoryConfig, est: Estimate, limit: int) -> str:
    what = (f"{cfg.drafter} at --seq-len {cfg.seq_len} with mask builder '{cfg.mask_builder}', partitioner "
            f"'{cfg.partitioner}' ({cfg.partitions} partition{'s' if cfg.partitions != 1 else ''})")
    head = (f"memory budget {format_size(limit)} is too small: {what} needs about {format_size(est.peak_bytes)} "
            f"(fixed {format_size(est.fixed_bytes)} + step {format_size(est.step_bytes)})")
    return head + "; " + "; ".join(advice(cfg, limit)) + " (nothing was written)"


def advice(cfg: MemoryConfig, limit: int) -> list[str]:
    """What would fit ``limit``: the largest --seq-len, the partitions needed, another mask builder."""
    out = []
    if cfg.plan is None:
        cfg = attrs.evolve(cfg, plan=resolved_plan(cfg))
    fixed = estimate(vary(cfg, seq_len=8)).fixed_bytes
    if fixed >= limit:
        return [f"even the fixed part (weights, optimizer state, process) needs {format_size(fixed)}: "
                "use a smaller drafter or a larger budget"]
    longest = largest_seq_len(cfg, limit)
    if longest:
        out.append(f"fits with --seq-len {longest} or less")
    blocks = _query_block_builder(cfg)
    if blocks is not None:
        peak = estimate(vary(cfg, mask_builder=blocks)).peak_bytes
        if peak <= limit:
            out.append(f"fits with --mask-builder {blocks} (about {format_size(peak)})")
    found = partitions_needed(cfg, limit)
    if found:
        partitioner, parts = found
        builder = f" --mask-builder {blocks}" if blocks is not None else ""
        out.append(f"fits with --partitioner {partitioner} --partitions {parts}{builder}")
    training = cfg.plan.training
    if training.checkpointing_option is not None and not training.activation_checkpointing:
        alt = vary(cfg, drafter_options={**cfg.drafter_options, training.checkpointing_option: True})
        peak = estimate(alt).peak_bytes
        if peak <= limit:
            out.append(f"fits with {training.checkpointing_option} = true in [drafter] (about {format_size(peak)})")
    return out or ["no --seq-len, partitioning or mask builder tried fits: raise the budget"]


def largest_seq_len(cfg: MemoryConfig, limit: int, multiple: int = 64) -> int | None:
    """The largest ``seq_len`` (a multiple of ``multiple``, below ``cfg.seq_len``) whose estimate fits."""
    lo, hi = 0, cfg.seq_len // multiple
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if mid * multiple >= 16 and estimate(vary(cfg, seq_len=mid * multiple)).peak_bytes <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo * multiple if lo else None


def _query_block_builder(cfg: MemoryConfig) -> str | None:
    """When the run's builder holds a full mask: the most preferred registered builder that works in query blocks
    (``MaskBuilder.query_blocks``) and trains on the run's device, else None."""
    from specframe import plugins
    from specframe.masks import ranked_mask_builders

    registry = plugins.load()
    if resolved_plan(cfg).builder_cls.query_blocks:
        return None
    return next((n for n in ranked_mask_builders(cfg.device) if registry.get("mask builder", n).query_blocks), None)


def partitions_needed(cfg: MemoryConfig, limit: int, most: int = 256) -> tuple[str, int] | None:
    """(partitioner, S): the first registered partitioner that splits sequences (``Partitioner.splits_sequences``)
    and the smallest power-of-two S with which it fits (with a query-block builder in place of one holding a full
    mask), if any."""
    from specframe import plugins

    registry = plugins.load()
    partitioner = next((n for n in registry.names("partitioner") if registry.get("partitioner", n).splits_sequences),
                       None)
    if partitioner is None:
        return None
    builder = _query_block_builder(cfg) or cfg.mask_builder
    s = 2
    while s <= most:
        trial = vary(cfg, partitioner=partitioner, partitions=s, mask_builder=builder)
        if estimate(trial).peak_bytes <= limit:
            return partitioner, s
        s *= 2
    return None
