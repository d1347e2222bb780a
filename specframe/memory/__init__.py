"""The memory budget: size strings, a peak-memory estimate of one training step, and the in-run guard.

One module per idea: ``sizes`` (``8GiB`` read and written), ``config`` (what a step's peak depends on, by name or by
a run's resolved plan), ``counts`` (every segment's element counts: sampled, or in closed form for long sequences),
``estimate`` (the analytic model of what a step holds), ``advice`` (the refusal and what would fit) and ``guard``
(the measured peak after each step, the hard ceiling during it, the process's mmap threshold). ``specframe.memory``
keeps every name its callers use; the engine costs a run from its plan (``specframe.engine.assembly.memory_guard``).
"""

from specframe.memory.advice import advice, check_budget, largest_seq_len, partitions_needed, refusal
from specframe.memory.config import Estimate, MemoryConfig
from specframe.memory.counts import RUN_MAX_LEN, SAMPLED_MAX_LEN
from specframe.memory.estimate import (
    A_H,
    A_I,
    ACT_TRANSIENT,
    CPU_BASELINE_BYTES,
    CPU_STEP_OVERHEAD_BYTES,
    INPUT_FLOATS_PER_H,
    LOSS_CHUNK_BLOCKS,
    OPTIMIZER_TRANSIENT,
    ROW_CHUNKED_H,
    _layers,  # noqa: F401 - specframe.testing reads a drafter's layer shapes as the estimate does
    estimate,
)
from specframe.memory.guard import (
    MMAP_THRESHOLD_BYTES,
    MemoryBudgetExceeded,
    MemoryGuard,
    peak_bytes,
    pin_mmap_threshold,
    skip_precheck,
    status_bytes,
)
from specframe.memory.sizes import format_size, parse_size

__all__ = [
    "A_H", "A_I", "ACT_TRANSIENT", "CPU_BASELINE_BYTES", "CPU_STEP_OVERHEAD_BYTES", "INPUT_FLOATS_PER_H",
    "LOSS_CHUNK_BLOCKS", "MMAP_THRESHOLD_BYTES", "OPTIMIZER_TRANSIENT", "ROW_CHUNKED_H", "RUN_MAX_LEN",
    "SAMPLED_MAX_LEN", "Estimate", "MemoryBudgetExceeded", "MemoryConfig", "MemoryGuard", "advice", "check_budget",
    "estimate", "format_size", "largest_seq_len", "parse_size", "partitions_needed", "peak_bytes",
    "pin_mmap_threshold", "refusal", "skip_precheck", "status_bytes",
]
