"""The memory budget: size strings, a peak-memory estimator for one training step, and the in-run guard.

Estimator (an analytic model of what the code holds, checked against measured child-process peaks by
``tests/unit/test_memory.py`` and ``benchmarks/memory_context.py``):

    peak = process baseline                           (Python + torch + transformers + specframe, CPU only)
         + target weights                             (the engine holds the whole target; ``synthetic``: lm_head only)
         + drafter weights, gradients, AdamW moments  (4 x trainable parameters)
         + features held in memory                    (online: every training sequence's, memoised)
         + the largest segment's step memory:
             step overhead                            (allocator arenas, autograd graph, index tensors; CPU only)
           + elements forwarded x saved bytes         (every layer's activations; with activation checkpointing only
                                                       each layer's input, plus the embedding, fused input, final norm)
           + the larger of two phases that do not overlap:
               the layers' backward                   (one layer's activations and gradients, elements forwarded x
                                                       backward bytes: with checkpointing, once a segment is longer
                                                       than ``modeling.ROW_CHUNK``, its position-wise parts are
                                                       recomputed in row chunks and only q, k, v, the attention output
                                                       and their gradients are held for every row; plus attention
                                                       scratch: dense / precomputed the [N, N] mask and SDPA's copies,
                                                       chunked a few [heads, chunk, band] score blocks)
               the loss                               (the chunked KL keeps each charged element's hidden state and its
                                                       gradient, formed in the forward, and a few [chunk, draft vocab]
                                                       blocks at a time)

Element counts: up to ``SAMPLED_MAX_LEN`` tokens the estimator runs the real COD sampler on an all-supervised sequence
and the real partitioner, so every segment's forwarded and charged counts are the ones a seeded draw gives. Longer
sequences are counted in closed form (``_closed_segments``), in time and memory that do not grow with L: the full grid
exactly; COD's per-depth counts exactly while a draw keeps fewer than its candidates (at its floor, without the rare
drop-out at the sequence's end), and where the P-EAGLE partitioner cuts from each depth's expected share of a range
(within the spread of draws: ``tests/unit/test_memory_closed_form.py``). A partitioner other than the built-in ones,
or a drafter whose supervision is not "every position but the last few", is run up to ``RUN_MAX_LEN`` and refused
beyond. "Elements forwarded" is the drafter's ``Drafter.forwarded_rows`` of a segment's
elements and anchors: one row per element unless the drafter runs others (DFlash runs each anchor's whole block).
Per-element byte counts were read off the saved-tensor sizes of ``specframe.modeling.DecoderLayer`` (about
10.8 H + 4 I floats per element and layer), the row-chunked regime's from the tensors live at the peak of a
long-context step (a ``TorchDispatchMode`` census), and the constants below (the process baseline and a per-step
overhead) were read off a few measured runs; the tests and the benchmark check configurations that were not used to
fit them (``benchmarks/results/memory_context.json`` has every measured point next to its estimate).

The process pins glibc's mmap threshold (``pin_mmap_threshold``, called by the engine): with glibc's sliding
threshold, freed blocks of a few tens of MiB stayed resident and an 8,192-token step peaked at 11.0 GiB instead of
2.6 GiB. The estimator assumes the pinned threshold.

Assumptions: one sequence per rank in flight (the engine's loop), online features memoised for every training
sequence, the target forward computed without logits (``specframe.features``), activations and target weights in
``dtype`` (fp32 by default; the drafter's weights, gradients and AdamW state are fp32 in every precision). Start-up transients (loading the target) are not estimated; the guard's measured peak includes them.

Guard: ``MemoryGuard`` reads the process's peak (VmHWM / ru_maxrss on CPU, ``torch.cuda.max_memory_allocated`` on
CUDA) after every optimizer step and raises ``MemoryBudgetExceeded`` when it is over the budget; the engine then stops
without writing a checkpoint, so the last complete one is what remains. A check after the step cannot stop a single
step that blows far past the budget (the kernel's OOM killer would get there first), so each step also runs under a
hard ceiling (``MemoryGuard.ceiling``): on CUDA ``torch.cuda.set_per_process_memory_fraction``; on Linux CPU an
``RLIMIT_DATA`` soft limit at the process's current data size plus 1.5x the budget's remaining headroom (address space
runs ahead of resident memory, so the ceiling is looser than the budget; the check after the step is the exact one).
An allocation past the ceiling fails inside the step and becomes the same clean ``MemoryBudgetExceeded``.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import attrs
import torch

from specframe.attention_memory import AttentionShape
from specframe.errors import SpecframeError, UsageError

# segments longer than ROW_CHUNK recompute a layer's position-wise parts in chunks
from specframe.modeling import ROW_CHUNK, LayerShape

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3, "ti": 1024**4,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")

#: resident bytes of a training process before any model tensor: Python, torch, transformers, specframe and its
#: plugins (measured: RSS before the first step minus the model tensors, 550-563 MiB here; CPU only:
#: ``max_memory_allocated`` on CUDA counts tensors alone)
CPU_BASELINE_BYTES = 560 * 2**20
#: saved activation floats per element and decoder layer: A_H * hidden + A_I * intermediate, counted from
#: DecoderLayer's saved tensors (``torch.autograd.graph.saved_tensors_hooks``, distinct storages) at several shapes;
#: ACT_TRANSIENT scales them for what else is alive at the peak (1.0 matched the SmolLM2-shaped dense runs to 5%)
A_H, A_I, ACT_TRANSIENT = 10.8, 4.0, 1.0
#: per-element floats outside the layers, in units of H: embedding, fused input, final norm and the gradients
#: flowing into them (P-EAGLE runs fc once per position, so no per-element [N, 3H] aux gather is kept)
INPUT_FLOATS_PER_H = 5
#: [N, H] rows alive besides the attention tensors in a layer recomputed in row chunks (``row_chunked`` below)
ROW_CHUNKED_H = 1
#: fp32 [chunk, Vd] blocks alive at once in one chunk of the KL loss (logits, log-probs, target probs, gradient)
LOSS_CHUNK_BLOCKS = 6
#: resident growth of any CPU step beyond its tensors (allocator arenas, autograd graph, index tensors), measured
#: as the gap between small-shape steps and their tensor counts
CPU_STEP_OVERHEAD_BYTES = 48 * 2**20
#: AdamW's foreach step briefly holds about one more parameter-sized buffer per trainable parameter
OPTIMIZER_TRANSIENT = 1.0
# the attention's own bytes are the mask builder's to declare (MaskBuilder.attention_bytes, API 6), from the two
# calibrated models in specframe.attention_memory (full mask, query blocks)


class MemoryBudgetExceeded(SpecframeError):
    """Training stopped because the measured peak went over ``--memory-budget`` (the last checkpoint is kept)."""

    exit_code = 3


def parse_size(text: str | int) -> int:
    """Bytes in a size string: ``8GiB``, ``8G`` / ``8GB`` (powers of 1000), ``512MiB``, ``1.5GB``, ``1048576``."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise UsageError(f"memory budget must be positive, got {text!r}")
        return text
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise UsageError(
            f"invalid memory size '{text}': use a number with an optional unit, e.g. 8GiB, 8G, 512MiB, 1.5GB "
            "or plain bytes (KiB/MiB/GiB/TiB are powers of 1024, K/M/G/T and KB/MB/GB/TB powers of 1000)"
        )
    value = float(match.group(1)) * _UNITS[unit]
    if value < 1:
        raise UsageError(f"memory size '{text}' is less than one byte")
    return int(value)


def format_size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


@attrs.define
class MemoryConfig:
    """What a training step's peak depends on: the run's components by name (``TrainConfig``'s fields of the same
    names) or, from a run, by its resolved ``compose.Plan`` (``from_plan``), and the shape of its step."""

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
    #: name or options drops it (``_vary``)
    plan: Any = attrs.field(default=None, eq=False, repr=False)

    @classmethod
    def from_plan(cls, plan: Any, cfg: Any, target_config: Any, **shape: Any) -> MemoryConfig:
        """The step of a resolved run config ``cfg`` (a ``TrainConfig``, ``Plan.resolved``) costed with its ``plan``:
        the same classes and options (the partitioner's included) the run builds, no name resolved again."""
        return cls(drafter=cfg.drafter, target_config=target_config, seq_len=cfg.seq_len, depth=cfg.depth,
                   mask_builder=cfg.mask_builder, partitioner=cfg.partitioner, partitions=cfg.partitions,
                   drafter_options=cfg.drafter_options, mask_builder_options=cfg.mask_builder_options,
                   device=cfg.device, dtype=cfg.dtype, partitioner_options=cfg.partitioner_options, plan=plan,
                   **shape)


#: the fields a plan resolves: a change to one of them needs a new plan
_NAMED = frozenset({"drafter", "drafter_options", "depth", "mask_builder", "mask_builder_options", "partitioner",
                    "partitioner_options", "device"})


def _plan(cfg: MemoryConfig) -> Any:
    """``cfg``'s plan: its own, else its names resolved (``compose.plan``)."""
    if cfg.plan is not None:
        return cfg.plan
    from specframe import compose

    return compose.plan(cfg)


def _vary(cfg: MemoryConfig, **changes: Any) -> MemoryConfig:
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


#: drafters built for an estimate, by (class, options, target config): the advice's searches estimate one configuration
#: at many lengths, and building even a shapes-only drafter (its initialisers on the meta device) costs more than
#: the arithmetic
_BUILT: dict[tuple[type, str, int], tuple[Any, Any, Any]] = {}


def _drafter(cfg: MemoryConfig) -> tuple[Any, Any]:
    """The drafter of ``cfg``'s plan, built for its target with no weight allocated. The estimate's one instance
    besides the run's: it reads the drafter's shapes, supervision and declarations off a meta-device copy."""
    plan = _plan(cfg)
    cls, options = plan.drafter_cls, plan.drafter_options
    key = (cls, repr(options), id(cfg.target_config))
    built = _BUILT.get(key)
    if built is not None and built[2] is cfg.target_config:
        return built[0], built[1]
    try:
        with torch.device("meta"):  # shapes only: no weight is allocated or initialised
            drafter = cls(cfg.target_config, options)
    except (NotImplementedError, RuntimeError):
        drafter = cls(cfg.target_config, options)
    if len(_BUILT) >= 8:
        _BUILT.clear()
    _BUILT[key] = (drafter, options, cfg.target_config)  # the config kept alive, so its id names no other
    return drafter, options


def _numel(tensors: Any) -> int:
    return sum(int(t.numel()) for t in tensors)


def _layers(drafter: Any, module: torch.nn.Module) -> tuple[tuple[Any, ...], bool]:
    """The shapes of the drafter's decoder layers, and whether the drafter declared them. ``Drafter.layer_shapes``
    (API 9) when it gives them; else found by structure: ``modeling.DecoderLayer`` s, and any plugin layer built the
    same way (an ``mlp`` beside a ``self_attn`` that carries a ``LayerShape``, as DFlash's), whose activations per
    row the per-element constants describe as well."""
    declared = drafter.layer_shapes()
    if declared is not None:
        shapes = tuple(declared)
        bad = [s for s in shapes if not isinstance(s, LayerShape)]
        if bad:
            raise SpecframeError(f"drafter '{drafter.name}' layer_shapes() must give api.modeling.LayerShape s, got "
                                 f"{type(bad[0]).__name__}")
        return shapes, True
    layers = [m for m in module.modules() if isinstance(getattr(getattr(m, "self_attn", None), "shape", None),
                                                        LayerShape) and hasattr(m, "mlp")]
    return tuple(m.self_attn.shape for m in layers), False


def _builder(cfg: MemoryConfig) -> Any:
    """The run's mask builder with its options (defaults included): it states its own attention bytes."""
    plan = _plan(cfg)
    return plan.builder_cls(plan.builder_options)


def _segments(cfg: MemoryConfig, drafter: Any, depth: int, training: Any) -> tuple[list[tuple[int, int, int]], int]:
    """(forwarded rows, charged, anchors) of every segment, from the real COD sampler and partitioner under the
    drafter's visibility rule; the rows are the drafter's ``forwarded_rows`` of the segment's elements and of the
    distinct anchors of its charged ones (a segment's other elements are context it recomputes)."""
    from specframe import api
    from specframe.elements import cod_sample, full_grid

    n = cfg.seq_len
    example = api.TrainingExample(
        torch.zeros(n, dtype=torch.long), torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.long)
    )
    sup = drafter.supervision(example).to(torch.bool).cpu()
    if training.cod_ratio < 1.0:
        elems = cod_sample(sup, depth, training.cod_ratio, training.cod_min_ratio,
                           generator=torch.Generator().manual_seed(0))
    else:
        elems = full_grid(sup.shape[0], depth)
    elems = elems.with_visibility(drafter.visibility)  # as the engine stamps it: the partitioner keeps blocks whole
    partitioner = _partitioner(cfg)
    segs = partitioner.partition(elems, cfg.partitions)  # the engine checks the partition itself
    charged_all = sup[elems.position]
    out = []
    for seg in segs:
        idx = seg.elements
        charged_here = seg.loss_mask & charged_all[idx]
        charged = int(charged_here.sum())
        anchors = int(torch.unique(elems.anchor[idx][charged_here]).numel())
        out.append((int(drafter.forwarded_rows(int(idx.numel()), anchors)), charged, anchors))
    return out, len(elems)


# ------------------------------------------------------------------------------------- counting without the sequence
#: sequences up to this length are counted by running the COD sampler and the partitioner on them (``_segments``): a
#: fraction of a second there, and the figures are the sampled ones; longer ones are counted in closed form
SAMPLED_MAX_LEN = 8192
#: a partitioner or a drafter's supervision the closed form does not describe is counted by running it, up to this
#: length (its time and memory grow with the length: refused beyond, instead of growing without bound)
RUN_MAX_LEN = 65536
#: the partitioners the closed form describes (the built-in ones, by class: a subclass may partition otherwise)
_CLOSED_PARTITIONERS = frozenset({"specframe_plugins.partition_none.NoPartitioner",
                                   "specframe_plugins.partition_peagle.PeaglePartitioner"})
_PROBE_LENGTHS = (64, 65, 200)


def _supervision_shape(drafter: Any) -> tuple[int, int] | None:
    """(shift, tail) when the drafter supervises one all-loss document as ``L - shift`` positions of which all but
    the last ``tail`` carry a loss, the same at every probed length (the EAGLE family: 1, 1; PARD: 0, 1); else None."""
    from specframe import api

    seen = set()
    for length in _PROBE_LENGTHS:
        sup = drafter.supervision(api.TrainingExample(
            torch.zeros(length, dtype=torch.long), torch.ones(length, dtype=torch.bool),
            torch.zeros(length, dtype=torch.long))).to(torch.bool).cpu()
        n = int(sup.shape[0]) if sup.dim() == 1 else -1
        tail = n - int(sup.sum())
        if n < 1 or tail >= n or not bool(sup[: n - tail].all()):
            return None
        seen.add((length - n, tail))
    return seen.pop() if len(seen) == 1 else None


@attrs.frozen
class _Depth:
    """One depth of the element grid: ``count`` elements spread over anchors 0 .. ``span`` - 1, charged at anchors up
    to ``charged_to``. The full grid fills its span; COD keeps a uniform random subset, so the closed form counts a
    range's share of them (every anchor of the span is equally likely to be kept: each took part in every draw)."""

    count: int
    span: int
    charged_to: int

    def upto(self, q: int) -> int:
        """Elements at anchors <= q."""
        if q < 0 or self.span <= 0:
            return 0
        return self.count * min(q + 1, self.span) // self.span

    def charged(self, lo: int, hi: int) -> int:
        """Charged elements at anchors lo .. hi."""
        return max(0, self.upto(min(hi, self.charged_to)) - self.upto(lo - 1))


def _grid(n: int, tail: int, depth: int, training: Any) -> list[_Depth]:
    """Every depth's elements over ``n`` positions whose last ``tail`` have no loss: the full grid, or what
    ``elements.cod_sample`` keeps. COD's count at a depth is exact while the draw keeps fewer than its candidates; at
    the floor (``cod_min_ratio``) a candidate can drop out at the sequence's end, and this is the count without that
    (at most one element a depth more than the draw)."""
    last = n - tail - 1  # the last position with a loss
    if training.cod_ratio >= 1.0:
        return [_Depth(max(n - d, 0), max(n - d, 0), last - d) for d in range(depth)]
    n_sup = n - tail
    out = [_Depth(n, n, last)]
    kept = max(last, 0)  # depth 1's candidates: anchors 0 .. last - 1
    for d in range(1, depth):
        keep = math.floor(n_sup * max(training.cod_ratio**d, training.cod_min_ratio) + 1e-9)
        kept = min(keep, kept, max(last + 1 - d, 0))
        if kept <= 0:
            break
        out.append(_Depth(kept, last + 1 - d, last - d))
    return out


def _cut_starts(before: Any, n: int, total: int, num_segments: int) -> list[int]:
    """``partition_peagle.cut_positions`` on a cumulative count given as a function, each target found by bisection."""
    candidates = set()
    for s in range(1, num_segments):
        target = s * total / num_segments
        lo, hi = 0, n  # the first position whose count before it reaches the target (n: none)
        while lo < hi:
            mid = (lo + hi) // 2
            if float(before(mid)) >= target:
                hi = mid
            else:
                lo = mid + 1
        after = min(lo, n - 1)
        below = max(after - 1, 0)
        candidates.add(below if (target - float(before(below))) < (float(before(after)) - target) else after)

    def owned(start: int, stop: int) -> int:
        return before(stop) - before(start) if stop < n else total - before(start)

    starts = [0]
    for cut in sorted(candidates):
        if 0 < cut < n and owned(starts[-1], cut) > 0:
            starts.append(cut)
    if len(starts) > 1 and owned(starts[-1], n) == 0:
        starts.pop()
    return starts


def _closed_segments(cfg: MemoryConfig, drafter: Any, depth: int, training: Any,
                     shape: tuple[int, int]) -> tuple[list[tuple[int, int, int]], int]:
    """``_segments`` without the sequence: the same (forwarded rows, charged, anchors) per segment, counted from the
    grid's per-depth counts and the built-in partitioners' rules (``plugins/partition_none``, ``partition_peagle``:
    a segment [x, y) owns depth-0 elements at anchors x .. y-1 and, under the chain rule, deeper ones at anchors
    x-1 .. y-2, under the block rule at x .. y-1; it forwards what it owns plus every earlier depth-0 element (chain)
    or every earlier element (block)). Cost: the depth times the partitions times log L, whatever L is."""
    shift, tail = shape
    n = cfg.seq_len - shift
    grid = _grid(n, tail, depth, training)
    total = sum(g.count for g in grid)
    block = drafter.visibility == "block"

    def before(p: int) -> int:  # elements owned by positions < p
        if p >= n:
            return total
        return grid[0].upto(p - 1) + sum(g.upto(p - 1 if block else p - 2) for g in grid[1:])

    splits = _plan(cfg).partitioner_cls.splits_sequences  # of the two described: P-EAGLE's cuts
    starts = _cut_starts(before, n, total, cfg.partitions) if splits else [0]
    out = []
    for j, x in enumerate(starts):
        y = starts[j + 1] if j + 1 < len(starts) else n
        charged = grid[0].charged(x, y - 1)
        anchors = max(0, min(y, grid[0].charged_to + 1) - x)  # every depth-0 element with a loss has its anchor
        if block:
            charged += sum(g.charged(x, y - 1) for g in grid[1:])
            forwarded = before(y)
        else:
            charged += sum(g.charged(x - 1, y - 2) for g in grid[1:])
            forwarded = before(y) - before(x) + x
            # the one deeper anchor before the range (its depth-0 element belongs to the previous segment)
            if x >= 1 and len(grid) > 1 and grid[1].charged(x - 1, x - 1) > 0:
                anchors += 1
        out.append((int(drafter.forwarded_rows(int(forwarded), anchors)), charged, anchors))
    return out, total


def _partitioner(cfg: MemoryConfig) -> Any:
    """The run's partitioner with its options (the run's own, defaults included)."""
    plan = _plan(cfg)
    return plan.partitioner_cls(plan.partitioner_options)


def _partitioner_key(cfg: MemoryConfig) -> str:
    cls = _plan(cfg).partitioner_cls
    return f"{cls.__module__}.{cls.__qualname__}"


def _counts(cfg: MemoryConfig, drafter: Any, depth: int, training: Any) -> tuple[list[tuple[int, int, int]], int]:
    """Every segment's counts (``_segments``): sampled up to ``SAMPLED_MAX_LEN``, in closed form beyond where the
    partitioner and the drafter's supervision are ones it describes, else run up to ``RUN_MAX_LEN`` and refused
    beyond with the reason."""
    if cfg.seq_len <= SAMPLED_MAX_LEN:
        return _segments(cfg, drafter, depth, training)
    from specframe.elements import cod_sample, full_grid

    # the checks running them on a tiny sequence makes: a bad COD ratio or partition count fails as it would there
    _partitioner(cfg).partition(full_grid(2, 1, visibility=drafter.visibility), cfg.partitions)
    if training.cod_ratio < 1.0:
        cod_sample(torch.ones(2, dtype=torch.bool), depth, training.cod_ratio, training.cod_min_ratio,
                   generator=torch.Generator())  # never the global generator: training seeds it
    shape = _supervision_shape(drafter)
    known = _partitioner_key(cfg) in _CLOSED_PARTITIONERS
    if shape is not None and known and cfg.seq_len - shape[0] > shape[1]:
        return _closed_segments(cfg, drafter, depth, training, shape)
    if cfg.seq_len <= RUN_MAX_LEN:
        return _segments(cfg, drafter, depth, training)
    why = (f"partitioner '{cfg.partitioner}' is not one it counts without running (none, peagle)" if not known else
           f"drafter '{cfg.drafter}' supervises an all-loss sequence otherwise than every position but the last few")
    raise UsageError(f"cannot estimate --seq-len {cfg.seq_len}: {why}, so its segments are counted by running it on "
                     f"the sequence, which the estimate does up to {RUN_MAX_LEN} tokens; use --seq-len {RUN_MAX_LEN} "
                     "or less")


def estimate(cfg: MemoryConfig) -> Estimate:
    """Predicted peak memory (bytes) of one training step of ``cfg``, with a breakdown."""
    if cfg.features not in ("online", "cache", "synthetic"):
        raise UsageError(f"features must be online, cache or synthetic, got {cfg.features!r}")
    if cfg.plan is None:  # the names resolved once for the whole estimate
        cfg = attrs.evolve(cfg, plan=_plan(cfg))
    drafter, _ = _drafter(cfg)
    training = cfg.plan.training  # what the drafter declares (API 6), whatever its options are called
    depth = cfg.plan.depth
    if not depth:
        raise UsageError(f"drafter '{cfg.drafter}' has no default training depth: pass --depth")
    module = drafter.module()
    from specframe.devices import DTYPE_BYTES

    if cfg.dtype not in DTYPE_BYTES:
        raise UsageError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {cfg.dtype!r}")
    e = DTYPE_BYTES[cfg.dtype]  # activations and the target's weights
    w = 4  # fp32 master weights, their gradients and AdamW's two moments
    trainable = _numel(p for p in module.parameters() if p.requires_grad)
    frozen = _numel(p for p in module.parameters() if not p.requires_grad) + _numel(module.buffers())
    shapes, declared = _layers(drafter, module)
    notes = [] if shapes or declared else [
        f"drafter '{cfg.drafter}' declares no decoder layers (Drafter.layer_shapes, API 9) and none were found by "
        "structure: its layers' activations are not counted, so this estimate is low if it has any"]
    # layers of one shape are charged as count x one layer's floats: exactly what a uniform stack always was
    groups = Counter(shapes)
    n_layers = len(shapes)
    tc = cfg.target_config
    h_t, v_t = int(tc.hidden_size), int(tc.vocab_size)
    if shapes:
        shape = shapes[0]
    else:  # no layer found: one layer the target's size sizes the per-layer terms (and no layer is summed)
        t_heads = int(getattr(tc, "num_attention_heads", 1))
        shape = LayerShape(hidden=h_t, heads=t_heads, kv_heads=t_heads, head_dim=h_t // t_heads,
                           intermediate=int(getattr(tc, "intermediate_size", 4 * h_t)))
    sizing = list(groups) or [shape]  # the shapes the largest-layer terms are taken over
    h, heads = shape.hidden, shape.heads
    vd = int(drafter.draft_vocab_size or v_t)  # api.Drafter.draft_vocab_size: None is the full vocabulary
    spec = drafter.feature_spec()
    n_aux = len(tuple(getattr(spec, "aux_layers", None) or ())) if spec is not None else 0
    final = bool(getattr(spec, "final_hidden", False)) if spec is not None else False
    feature_floats = (n_aux + int(final)) * h_t * cfg.seq_len

    target_params = _target_params(tc)
    cpu = torch.device(cfg.device).type == "cpu"
    fixed = {
        "process_baseline": CPU_BASELINE_BYTES if cpu else 0,
        "target_weights": (v_t * h_t if cfg.features == "synthetic" else target_params) * e,
        "drafter_weights": (trainable + frozen) * w + ((trainable + frozen) * w // cfg.shards if cfg.shards > 1 else 0),
        "drafter_gradients": trainable * w,
        "optimizer_state": 2 * trainable * w // cfg.shards,
        "features": feature_floats * 4 * (cfg.sequences if cfg.features != "cache" else 2),
    }
    builder = _builder(cfg)
    segs, n_elements = _counts(cfg, drafter, depth, training)
    checkpointing = bool(training.activation_checkpointing)
    loss_chunk = int(training.loss_chunk)
    head_dim = shape.head_dim

    def one_layer(s: Any) -> float:  # activation floats one layer saves per row
        return (A_H * s.hidden + A_I * s.intermediate) * ACT_TRANSIENT

    # the largest layer is what one layer's backward holds; the sum over layers is what all of them save
    layer_floats = max(one_layer(s) for s in sizing)
    all_layer_floats = sum(n * one_layer(s) for s, n in groups.items())
    all_layer_inputs = sum(n * s.hidden for s, n in groups.items())
    # what one layer holds while its backward runs when its position-wise parts are recomputed in row chunks:
    # q, k, v, output and log-sum-exp saved by the attention, and about as much again in their gradients, plus
    # a few [N, H] rows (the o_proj input, the layer output, gradients flowing through the residual stream)
    def chunked(q_heads: int, dim: int, kv: int, hidden: int) -> float:
        return (2 * (2 * q_heads * dim + 2 * kv * dim) + q_heads + ROW_CHUNKED_H * hidden) * ACT_TRANSIENT

    # a builder declaring grouped_kv takes grouped k / v as they are; the others get them repeated to every query head
    row_chunked = max(chunked(s.heads, s.head_dim, s.kv_heads if builder.grouped_kv else s.heads, s.hidden)
                      for s in sizing)
    inputs = INPUT_FLOATS_PER_H * h + 2 * head_dim  # + the rotary tables

    def per_element(forwarded: int) -> tuple[float, float]:
        """Bytes per forwarded element (saved through the step, held while one layer's backward runs). With
        checkpointing what is saved is each layer's input, and the layer being recomputed holds its activations
        (its position-wise parts in row chunks once the segment is longer than ``ROW_CHUNK``); without, every
        layer's activations are saved and backward holds about one more layer's worth of gradients."""
        if checkpointing:
            recompute = row_chunked if forwarded > ROW_CHUNK else 2 * layer_floats
            return (inputs + all_layer_inputs) * e, recompute * e
        return (inputs + all_layer_floats) * e, layer_floats * e

    best: tuple[int, dict[str, int], tuple[int, int, int]] | None = None
    for forwarded, charged, roots in segs:
        attention = builder.attention_bytes(AttentionShape(
            rows=forwarded, depth=depth, seq_len=cfg.seq_len, heads=heads,
            saved_copies=1 if checkpointing else n_layers))
        saved, backward = per_element(forwarded)
        step = {
            "step_overhead": CPU_STEP_OVERHEAD_BYTES if cpu else 0,
            "saved_activations": int(forwarded * saved),
            "backward_layer": int(forwarded * backward),
            "attention": int(attention),
            # the chunked KL (modeling.chunked_forward_kl) forms each row chunk's logit gradient in its forward: it
            # holds every charged row's hidden state and its gradient (about H + H_t per row), the teacher of a block
            # of positions and a few [chunk, Vd] fp32 blocks at a time (LOSS_CHUNK_BLOCKS counts both), and the
            # target head's draft rows; a cache's compact top-k teacher needs no head rows, which this still counts
            "loss": int(charged * (h + h_t) * e + LOSS_CHUNK_BLOCKS * min(loss_chunk, max(charged, 1)) * vd * 4
                        + vd * h_t * e),
        }
        # the loss runs (and is differentiated) before the layers' backward starts: the two phases do not overlap
        total = (step["step_overhead"] + step["saved_activations"]
                 + max(step["backward_layer"] + step["attention"], step["loss"]))
        if best is None or total > best[0]:
            best = (total, step, (forwarded, charged, roots))
    assert best is not None
    step_total, step_parts, (forwarded, charged, _) = best
    if cfg.features == "online":
        # the target forward that captures features (no grad; SDPA's causal path keeps no score matrix)
        online = (4 * h_t + 3 * int(getattr(tc, "intermediate_size", 4 * h_t))) * cfg.seq_len * e
        step_total = max(step_total, online)
        step_parts = {**step_parts, "target_forward": online}
    optimizer_peak = int(OPTIMIZER_TRANSIENT * trainable * w)
    fixed_total = sum(fixed.values())
    peak = fixed_total + max(step_total, optimizer_peak)
    return Estimate(
        peak_bytes=int(peak), fixed_bytes=int(fixed_total), step_bytes=int(max(step_total, optimizer_peak)),
        breakdown={**fixed, **step_parts, "optimizer_step_transient": optimizer_peak},
        elements=n_elements, segments=len(segs),
        largest_segment={"forwarded": forwarded, "charged": charged}, notes=notes,
    )


def _target_params(tc: Any) -> int:
    h, v = int(tc.hidden_size), int(tc.vocab_size)
    inter = int(getattr(tc, "intermediate_size", 4 * h))
    heads = int(getattr(tc, "num_attention_heads", 1))
    kv = int(getattr(tc, "num_key_value_heads", None) or heads)
    hd = int(getattr(tc, "head_dim", None) or h // heads)
    layer = h * heads * hd * 2 + 2 * h * kv * hd + 3 * h * inter + 2 * h
    tied = bool(getattr(tc, "tie_word_embeddings", False))
    return int(tc.num_hidden_layers) * layer + v * h * (1 if tied else 2) + h


# ------------------------------------------------------------------------------------------------------ refusal
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
        cfg = attrs.evolve(cfg, plan=_plan(cfg))
    fixed = estimate(_vary(cfg, seq_len=8)).fixed_bytes
    if fixed >= limit:
        return [f"even the fixed part (weights, optimizer state, process) needs {format_size(fixed)}: "
                "use a smaller drafter or a larger budget"]
    longest = largest_seq_len(cfg, limit)
    if longest:
        out.append(f"fits with --seq-len {longest} or less")
    blocks = _query_block_builder(cfg)
    if blocks is not None:
        peak = estimate(_vary(cfg, mask_builder=blocks)).peak_bytes
        if peak <= limit:
            out.append(f"fits with --mask-builder {blocks} (about {format_size(peak)})")
    found = partitions_needed(cfg, limit)
    if found:
        partitioner, parts = found
        builder = f" --mask-builder {blocks}" if blocks is not None else ""
        out.append(f"fits with --partitioner {partitioner} --partitions {parts}{builder}")
    training = cfg.plan.training
    if training.checkpointing_option is not None and not training.activation_checkpointing:
        alt = _vary(cfg, drafter_options={**cfg.drafter_options, training.checkpointing_option: True})
        peak = estimate(alt).peak_bytes
        if peak <= limit:
            out.append(f"fits with {training.checkpointing_option} = true in [drafter] (about {format_size(peak)})")
    return out or ["no --seq-len, partitioning or mask builder tried fits: raise the budget"]


def largest_seq_len(cfg: MemoryConfig, limit: int, multiple: int = 64) -> int | None:
    """The largest ``seq_len`` (a multiple of ``multiple``, below ``cfg.seq_len``) whose estimate fits."""
    lo, hi = 0, cfg.seq_len // multiple
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if mid * multiple >= 16 and estimate(_vary(cfg, seq_len=mid * multiple)).peak_bytes <= limit:
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
    if _plan(cfg).builder_cls.query_blocks:
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
        trial = _vary(cfg, partitioner=partitioner, partitions=s, mask_builder=builder)
        if estimate(trial).peak_bytes <= limit:
            return partitioner, s
        s *= 2
    return None


# -------------------------------------------------------------------------------------------------------- guard
def status_bytes(field: str) -> int | None:
    """A size field of ``/proc/self/status`` (VmHWM, VmRSS, VmData, ...) in bytes; None where there is no procfs."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def peak_bytes(device: str | torch.device = "cpu") -> int:
    """This process's peak memory so far: CUDA tensors on a CUDA device, else the resident-set high-water mark."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.max_memory_allocated(dev))
    hwm = status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


@attrs.define
class MemoryGuard:
    """Checks the measured peak against the budget after every step."""

    budget: int
    device: str = "cpu"

    def check(self, step: int, all_sum: Any = None) -> int:
        """The peak so far; raises ``MemoryBudgetExceeded`` over budget. With ``all_sum`` (a sum all-reduce) every
        rank stops when any rank is over, so no rank is left waiting in a collective."""
        peak = peak_bytes(self.device)
        over = peak > self.budget
        if all_sum is not None:
            over = float(all_sum(torch.tensor([float(over)])).item()) > 0
        if over:
            raise MemoryBudgetExceeded(
                f"memory budget exceeded: peak {format_size(peak)} > --memory-budget {format_size(self.budget)} "
                f"after step {step}; training stopped, the last checkpoint is kept"
            )
        return peak


    @contextlib.contextmanager
    def ceiling(self, step: int) -> Iterator[None]:
        """Run one step under the hard ceiling; an allocation it refuses becomes ``MemoryBudgetExceeded``."""
        with _hard_limit(self.budget, self.device):
            try:
                yield
            except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
                if not _allocation_failure(e):
                    raise
                asked = re.search(r"allocate ([0-9.]+ ?[KMGT]i?B|\d+ bytes)", str(e))
                what = f"an allocation of {asked.group(1)}" if asked else "an allocation"
                raise MemoryBudgetExceeded(
                    f"memory budget exceeded during step {step}: {what} failed under the ceiling set for "
                    f"--memory-budget {format_size(self.budget)}; training stopped, the last checkpoint is kept"
                ) from e


def _allocation_failure(e: BaseException) -> bool:
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        return True
    text = str(e)
    return "can't allocate memory" in text or "Cannot allocate memory" in text or "out of memory" in text


@contextlib.contextmanager
def _hard_limit(budget: int, device: str) -> Iterator[None]:
    dev = torch.device(device)
    if dev.type == "cuda":
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), dev)
        try:
            yield
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, dev)
        return
    data, rss = status_bytes("VmData"), status_bytes("VmRSS")
    try:
        import resource
    except ImportError:  # not a Unix: the check after the step is all there is
        resource = None
    if resource is None or data is None or rss is None or rss >= budget:
        # already over: the check after this step stops the run with the measured peak
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = data + int(1.5 * (budget - rss))
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    if soft != resource.RLIM_INFINITY and soft <= limit:
        yield
        return
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


#: allocations this size or larger get their own mapping, returned to the system when freed (glibc ``M_MMAP_THRESHOLD``)
MMAP_THRESHOLD_BYTES = 4 * 2**20
_M_MMAP_THRESHOLD = -3


def pin_mmap_threshold(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold for this process; True where it was set (glibc only).

    glibc raises its threshold after every large free, up to 32 MiB, so blocks just under that size (a loss chunk's
    [256, 32000] logits, a layer's row chunk) then come from the heap, where freed blocks stay resident between long-
    lived ones. Measured on a SmolLM2-shaped P-EAGLE step at 8,192 tokens: peak RSS 11.0 GiB with the sliding
    threshold, 2.6 GiB with it fixed at 4 MiB (``benchmarks/memory_context.py``), same step time within noise. A
    fixed threshold also turns the dynamic adjustment off, so the budget guard measures tensors, not fragmentation.
    """
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other libcs: no mallopt
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, int(threshold)))


def skip_precheck() -> bool:
    """``SPECFRAME_SKIP_MEMORY_CHECK=1`` skips the start-up estimate (the in-run guard still applies)."""
    return os.environ.get("SPECFRAME_SKIP_MEMORY_CHECK", "") not in ("", "0")
