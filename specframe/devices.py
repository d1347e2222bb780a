"""Devices and precisions, resolved once the same way by every command that runs a model.

``--device auto`` (the default) is CUDA when a GPU is visible, else the CPU. Under ``torchrun`` every process reads its
``LOCAL_RANK`` and takes that GPU of its node (``cuda`` without an index means "this process's GPU"), so a multi-GPU
run never piles every rank onto ``cuda:0``. An explicit index (``cuda:3``) is taken as given.

``--dtype`` names the precision of the heavy arithmetic: for the target, the dtype its weights are loaded in; for
training, the autocast dtype (master weights, AdamW state and the loss's softmax stay fp32; fp16 adds a gradient
scaler). fp32 is the default: on the reference engine it is what makes speculative output equal plain output token
for token (bf16 kernels may round a K+1-token forward differently from K+1 one-token forwards).
"""

from __future__ import annotations

import os
from typing import Any

from specframe.errors import UsageError

#: command-line name -> torch dtype name
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
#: bytes per element of each
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
#: what can run the target's forward (features for training, answers for the data): transformers, the reference,
#: or vLLM's offline engine; the --engine / --feature-engine choices of prepare, regenerate and train
TARGET_ENGINES = ("transformers", "vllm")


def torch_dtype(name: str) -> Any:
    import torch

    if name not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return getattr(torch, DTYPES[name])


def local_rank() -> int:
    """This process's rank on its node (torchrun's ``LOCAL_RANK``; 0 outside torchrun)."""
    value = os.environ.get("LOCAL_RANK", "0")
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"LOCAL_RANK must be an integer, got {value!r}") from None


#: what torch.distributed's env:// rendezvous reads besides WORLD_SIZE (torchrun sets them all)
RENDEZVOUS_ENV = ("RANK", "MASTER_ADDR", "MASTER_PORT")


def world_size(rendezvous: bool = True) -> int:
    """The number of processes of this run (torchrun's ``WORLD_SIZE``; 1 outside torchrun). Above 1 and with
    ``rendezvous`` (the process group is still to be formed), the rest of the env:// rendezvous must be set too:
    checked here, so an incomplete environment is one clear line and not torch's ``ValueError`` from inside
    ``init_process_group``."""
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        world = int(value)
    except ValueError:
        raise UsageError(f"WORLD_SIZE must be an integer, got {value!r}") from None
    missing = [name for name in RENDEZVOUS_ENV if not os.environ.get(name)]
    if world > 1 and rendezvous and missing:
        raise UsageError(f"WORLD_SIZE={world} asks for a distributed run, but {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} not set: launch with torchrun --nproc-per-node N "
                         "(it sets them all), or unset WORLD_SIZE for one process")
    return world


def resolve_device(spec: str | None = "auto") -> Any:
    """The torch device ``spec`` means for this process (see the module doc); a clear error for one that is absent."""
    import torch

    if spec in (None, "", "auto"):
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    device = parse_device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {spec}: no CUDA device is available on this machine (use --device cpu)")
        if device.index is None:
            device = torch.device("cuda", local_rank())
        if device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s) "
                             f"(LOCAL_RANK {local_rank()})")
    return device


def parse_device(spec: Any) -> Any:
    """``spec`` as a torch device, whether or not this machine has it; one clear error for a string torch does not
    read as a device (a run's config checks this before anything is resolved or loaded)."""
    import torch

    try:
        return torch.device(spec)
    except (RuntimeError, TypeError):
        raise UsageError(f"--device {spec!r} is not a torch device (cpu, cuda, cuda:N, auto)") from None


def backend(device: Any) -> str:
    """The torch.distributed backend for ``device``: NCCL between GPUs, gloo on the CPU. A GPU run also gets gloo
    for CPU tensors: the engine all-reduces its small step counters and statistics on the CPU."""
    return "cpu:gloo,cuda:nccl" if getattr(device, "type", str(device)) == "cuda" else "gloo"
