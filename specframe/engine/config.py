"""The resolved configuration of a training run (saved with every checkpoint)."""

from __future__ import annotations

from typing import Any

import attrs

from specframe.devices import TARGET_ENGINES, parse_device
from specframe.errors import UsageError
from specframe.structuring import unstructure
from specframe.values import is_int, is_number


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None:
        return
    if not is_number(value) or value <= 0:
        raise UsageError(f"--{attribute.name.replace('_', '-')} must be positive, got {value!r}")


def _non_negative(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not is_number(value) or value < 0:
        raise UsageError(f"--{attribute.name.replace('_', '-')} must be zero or positive, got {value!r}")


@attrs.define
class TrainConfig:
    """Every setting of a run. ``None`` means "resolve from the drafter / device" (see ``resolve``)."""

    drafter: str
    output: str
    target: str = "default"
    data: str | None = "default"
    cache: str | None = None
    seq_len: int = attrs.field(default=256, validator=_positive)
    depth: int | None = attrs.field(default=None, validator=_positive)
    mask_builder: str | None = None
    partitioner: str = "none"
    partitions: int = attrs.field(default=1, validator=_positive)
    #: peak-memory budget (a size string such as 8GiB): checked by the estimator before training, guarded after every step
    memory_budget: str | None = None
    #: run length: at most one of max_steps and epochs (neither: one epoch); epochs gives
    #: ceil(epochs * train sequences / batch_size) steps
    max_steps: int | None = attrs.field(default=None, validator=_positive)
    epochs: float | None = attrs.field(default=None, validator=_positive)
    batch_size: int = attrs.field(default=2, validator=_positive)
    lr: float = attrs.field(default=3e-4, validator=_positive)
    warmup_steps: int | None = attrs.field(default=None, validator=attrs.validators.optional(_non_negative))
    weight_decay: float = attrs.field(default=0.0, validator=_non_negative)
    grad_clip: float = attrs.field(default=1.0, validator=_positive)
    save_every: int = attrs.field(default=0, validator=_non_negative)
    eval_every: int = attrs.field(default=0, validator=_non_negative)
    val_examples: int = attrs.field(default=4, validator=_non_negative)
    #: conversations read from the data (None: all)
    max_examples: int | None = attrs.field(default=None, validator=_positive)
    #: processes that tokenise --data (datasets' map; None: 1 below 2,048 conversations, else up to 8)
    data_workers: int | None = attrs.field(default=None, validator=_positive)
    #: pack short conversations into seq_len sequences (documents kept apart by the visibility rule)
    pack: bool = True
    #: compute the next step's features in a background thread while this step trains (None: on CUDA, where the
    #: target's kernels overlap the drafter's on a side stream; off on CPU, where both would share the same cores)
    prefetch: bool | None = None
    #: where online features (--data) come from: the target's transformers forward, or vLLM's hidden-state
    #: extraction (an engine in the trainer's process, its states checked against transformers on the first
    #: gate_sequences conversations before training starts); a --cache was filled when it was prepared
    feature_engine: str = attrs.field(default="transformers", validator=lambda i, a, v: _check_feature_engine(v))
    gate_sequences: int = attrs.field(default=4, validator=_positive)
    #: feature_engine = vllm: its KV cache on the CPU (GiB), GPUs per layer, and share of each GPU's memory
    vllm_kv_cache_gib: int = attrs.field(default=2, validator=_positive)
    vllm_tensor_parallel_size: int = attrs.field(default=1, validator=_positive)
    vllm_gpu_memory_utilization: float | None = None
    #: shard the drafter's weights and AdamW state across the torchrun processes with FSDP2
    #: (specframe.engine.sharding) instead of replicating them under DDP
    fsdp: bool = False
    #: a progress line every N steps when there is no progress bar (None: about 20 lines per run)
    log_every: int | None = attrs.field(default=None, validator=_positive)
    #: experiment trackers, a comma list of none / tensorboard / wandb (see specframe.engine.tracking)
    report_to: str = attrs.field(default="none", validator=lambda i, a, v: _check_report_to(v))
    seed: int = attrs.field(default=0, validator=_non_negative)
    #: torch device (auto: CUDA when available, else cpu; under torchrun "cuda" is the process's LOCAL_RANK GPU)
    device: str = attrs.field(default="auto", validator=lambda i, a, v: _check_device(v))
    #: precision of the step (autocast over fp32 master weights; fp16 adds a gradient scaler) and of the target's
    #: weights: fp32, bf16 or fp16
    dtype: str = attrs.field(default="fp32", validator=lambda i, a, v: _check_dtype(v))
    #: run the target repository's own code (transformers' trust_remote_code); off unless asked
    trust_remote_code: bool = False
    #: spread the target over every visible GPU with transformers' device_map (auto, balanced, sequential) instead of
    #: putting it on ``device``: one process only (torchrun ranks would each load it whole across all GPUs)
    device_map: str | None = None
    #: a Jinja chat template file replacing the target tokenizer's
    chat_template: str | None = None
    #: warm start: a drafter folder in one of the formats specframe.layouts.imports reads (FORMATS: speculators
    #: EAGLE-3 / P-EAGLE / DFlash / DSpark, eagle3-flat and peagle-flat from SafeAILab / SpecForge, deepspec and
    #: specforge-dspark DSpark, parallelspec, pard), whose weights are loaded into the drafter after it is built and
    #: prepared, before the first step
    init_from: str | None = None
    drafter_options: dict[str, Any] = attrs.field(factory=dict)
    mask_builder_options: dict[str, Any] = attrs.field(factory=dict)
    partitioner_options: dict[str, Any] = attrs.field(factory=dict)
    #: steps whose drafter is kept as a whole checkpoint in OUTPUT/kept/step-N/ (the rolling checkpoint removes the
    #: previous one), so a learning curve can be measured later on what a served drafter accepts at each of them
    keep_drafter_at: tuple[int, ...] = attrs.field(default=(), converter=tuple, validator=lambda i, a, v: _check_keep(v))
    #: linear warmup as a share of the run's steps (DeepSpec's 0.04), rounded to whole steps: what a run whose
    #: length comes from --epochs cannot say in steps beforehand; at most one of warmup_steps and warmup_ratio
    warmup_ratio: float | None = attrs.field(default=None, validator=lambda i, a, v: _check_warmup_ratio(v))
    #: on the CPU, each attention call small enough (``engine.attention.DENSE_ATTENTION_BYTES``) goes to the builder
    #: declared fastest for small calls (dense) and the rest to ``mask_builder``: every builder builds the same
    #: visibility, so only time changes. None: when the run names no mask builder (the machine chooses), which the
    #: resolved config records as true or false
    sized_attention: bool | None = None

    def __attrs_post_init__(self) -> None:
        if (self.data is None) == (self.cache is None):
            raise UsageError("give exactly one of --data and --cache")
        if self.feature_engine != "transformers" and self.cache is not None:
            raise UsageError(f"--feature-engine {self.feature_engine} computes features online from --data; a --cache "
                             "already holds them (fill one from vLLM with 'specframe prepare --engine vllm')")
        if self.feature_engine != "transformers" and self.memory_budget is not None:
            # the guard reads the process's peak (RSS, or torch's allocator on CUDA), which would hold the engine's
            # weights and KV cache as if they were the drafter's
            raise UsageError(f"--memory-budget cannot be kept with --feature-engine {self.feature_engine}: the engine "
                             "shares the trainer's process and its memory; prepare a cache ('specframe prepare "
                             "--engine vllm') and train from it under the budget")
        if self.max_steps is not None and self.epochs is not None:
            raise UsageError("give at most one of --max-steps and --epochs (one of them decides the run's length)")
        if self.warmup_steps is not None and self.warmup_ratio is not None:
            raise UsageError("give at most one of --warmup-steps and --warmup-ratio (one of them decides the warmup)")


def warmup_steps(cfg: TrainConfig, total_steps: int) -> int:
    """The run's warmup in steps: ``warmup_steps``, else ``warmup_ratio`` of the steps (rounded), else 10% of them
    (at least 1, the default since the first runs)."""
    if cfg.warmup_steps is not None:
        return cfg.warmup_steps
    if cfg.warmup_ratio is not None:
        return round(cfg.warmup_ratio * total_steps)
    return max(1, total_steps // 10)


FEATURE_ENGINES = TARGET_ENGINES  # the engines a target runs on (specframe.devices)


def _check_keep(steps: tuple[int, ...]) -> None:
    bad = [s for s in steps if not is_int(s, 1)]
    if bad:
        raise UsageError(f"--keep-drafter-at takes positive step numbers, got {', '.join(map(repr, bad))}")


def _check_warmup_ratio(value: Any) -> None:
    if value is None:
        return
    if not is_number(value) or not 0.0 <= value < 1.0:
        raise UsageError(f"--warmup-ratio must be in [0, 1) (a share of the run's steps), got {value!r}")


def _check_feature_engine(value: Any) -> None:
    if value not in FEATURE_ENGINES:
        raise UsageError(f"--feature-engine must be one of {', '.join(FEATURE_ENGINES)}, got {value!r}")


def _check_device(value: Any) -> None:
    if value not in ("auto", None, ""):
        parse_device(value)  # whether the machine has it is resolve_device's to say, when the run starts


def _check_dtype(value: Any) -> None:
    from specframe.devices import DTYPES

    if value not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {value!r}")


def _check_report_to(value: Any) -> None:
    from specframe.engine.tracking import parse_report_to

    parse_report_to(value)


def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    return unstructure(cfg)
