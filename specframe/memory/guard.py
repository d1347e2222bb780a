"""The in-run memory guard and the process's own memory.

Guard: ``MemoryGuard`` reads the process's peak (VmHWM / ru_maxrss on CPU, ``torch.cuda.max_memory_allocated`` on
CUDA) after every optimizer step and raises ``MemoryBudgetExceeded`` when it is over the budget; the engine then stops
without writing a checkpoint, so the last complete one is what remains. A check after the step cannot stop a single
step that blows far past the budget (the kernel's OOM killer would get there first), so each step also runs under a
hard ceiling (``MemoryGuard.ceiling``): on CUDA ``torch.cuda.set_per_process_memory_fraction``; on Linux CPU an
``RLIMIT_DATA`` soft limit at the process's current data size plus 1.5x the budget's remaining headroom (address space
runs ahead of resident memory, so the ceiling is looser than the budget; the check after the step is the exact one).
An allocation past the ceiling fails inside the step and becomes the same clean ``MemoryBudgetExceeded``.

The process pins glibc's mmap threshold (``pin_mmap_threshold``, called by the engine): with glibc's sliding
threshold, freed blocks of a few tens of MiB stayed resident and an 8,192-token step peaked at 11.0 GiB instead of
2.6 GiB. The estimator assumes the pinned threshold.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from typing import Any

import attrs
import torch

from specframe.errors import SpecframeError
from specframe.memory.sizes import format_size


class MemoryBudgetExceeded(SpecframeError):
    """Training stopped because the measured peak went over ``--memory-budget`` (the last checkpoint is kept)."""

    exit_code = 3


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
