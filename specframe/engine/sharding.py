"""``--fsdp``: the drafter's parameters, gradients and AdamW state sharded across the ranks with torch's FSDP2
(``torch.distributed.fsdp.fully_shard``), for a drafter whose optimizer state does not fit one device.

The whole drafter is one FSDP unit, sharded at the root (``DrafterLoss``), except its frozen parameters (EAGLE-3's
target embedding, DFlash's embedding and lm_head, anything with ``requires_grad`` False): those are replicated, each
rank holding the full tensor as under DDP, and never all-gathered, since they never change and hold no gradient or
optimizer state to shard (a [V, H] embedding gathered in fp32 every forward was most of a step's traffic). One unit,
because a drafter computes its loss by calling its submodules in its own order and number (EAGLE-3 runs its layer
once per depth, a segment may forward nothing), and per-layer units would all-gather once per call, which ranks
holding different sequences would not match. So the trainable parameters are gathered whole for each forward and
its backward (as under DDP) and resharded after; what stays sharded is AdamW's two moments (2 of the 4 fp32 copies per
trainable parameter: ``specframe.memory`` divides them by the world size), the master weights between steps and the
gradients accumulated between backwards (each backward reduce-scatters). Every rank runs the same number of forwards
per step (ranks with fewer segments run zero-loss ones), because each forward all-gathers.

Checkpoints stay in the one-process format (full weights in safetensors, the optimizer state keyed by parameter
index), so a run resumes with another world size, with or without ``--fsdp``: saving gathers the full tensors on every
rank (collectives) and rank 0 writes them; loading reads the full state on every rank and keeps each rank's shard.
Evaluation runs on the gathered parameters (``gathered``), one sequence at a time, with no collective per forward.

Beside FSDP, what every multi-process run shares: ``Dist`` (the process group, or one process) and ``DrafterLoss`` (a
drafter's loss as a module, which DDP and FSDP wrap).
"""

from __future__ import annotations

import atexit
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch
from torch import nn

from specframe import api


class Dist:
    """torch.distributed when launched by torchrun (WORLD_SIZE > 1), else a single process: NCCL between GPUs, gloo
    on the CPU. Multi-node runs are torchrun's business (``--nnodes``, ``--rdzv-endpoint``); each process only needs
    its ``LOCAL_RANK`` to pick its GPU (``specframe.devices.resolve_device``)."""

    def __init__(self, device: torch.device) -> None:
        import torch.distributed as dist

        from specframe.devices import backend, world_size

        self.dist = dist
        self.world = world_size(rendezvous=not dist.is_initialized())
        self.owner = self.world > 1 and not dist.is_initialized()  # this object forms the process's group
        if self.owner:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            dist.init_process_group(backend(device))
            # The group outlives this run: a process may train again (every later run finds it formed and keeps it;
            # forming a second one in the same torchrun rendezvous is not possible). Left to the interpreter's own
            # teardown, a gloo group can abort a process that finished ("terminate called without an active
            # exception", SIGABRT, so torchrun reports a failed rank), so it is destroyed at exit, before that.
            atexit.register(destroy_at_exit)
        self.rank = dist.get_rank() if self.world > 1 else 0

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            self.dist.all_reduce(t, op=self.dist.ReduceOp.SUM)
        return t

    def max_(self, n: int) -> int:
        if self.world == 1:
            return n
        t = torch.tensor([n], dtype=torch.long)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return int(t.item())

    def barrier(self) -> None:
        if self.world > 1:
            self.dist.barrier()


def destroy_at_exit() -> None:
    """Destroy the default process group if it is still formed (registered by the ``Dist`` that formed it)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class DrafterLoss(torch.nn.Module):
    """A drafter's loss as a module, so torch's ``DistributedDataParallel`` can wrap it: DDP arms its gradient
    reduction in ``forward``, and a drafter computes its loss in ``Drafter.loss``, not in its module's forward.
    ``forward`` returns (loss tensor, ``LossTerms``): DDP looks for tensors in the output to find unused parameters.
    ``forward(None)``: a zero loss over every trainable parameter, for a rank that holds no sequence this step."""

    def __init__(self, drafter: api.Drafter, *, every_parameter: bool = False) -> None:
        super().__init__()
        self.drafter = drafter
        self.inner = drafter.module()  # registered, so DDP sees (and broadcasts, and reduces) its parameters
        # FSDP reduce-scatters the gradients a backward produced: a parameter a segment did not use (P-EAGLE's mask
        # state where no mask slot is charged) must still get its zero, or the ranks' collectives differ in size
        self.every_parameter = every_parameter

    def _zero(self) -> torch.Tensor:
        return sum(p.reshape(-1)[0] * 0.0 for p in self.inner.parameters() if p.requires_grad)

    def forward(self, *args: Any) -> tuple[torch.Tensor, Any]:
        if len(args) == 1 and args[0] is None:
            return self._zero(), None
        loss, terms = loss_and_terms(self.drafter.loss(*args))
        if self.every_parameter and loss is not None:
            terms = attrs.evolve(terms, loss_sum=terms.loss_sum + self._zero())
            loss = terms.loss_sum
        return loss, terms

    @staticmethod
    def call(drafter: api.Drafter) -> Callable[..., tuple[torch.Tensor | None, Any]]:
        return lambda *args: loss_and_terms(drafter.loss(*args))


def loss_and_terms(terms: Any) -> tuple[torch.Tensor | None, Any]:
    """(the loss tensor, the terms) of what ``Drafter.loss`` returned."""
    # a broken plugin may return something else: validate.check_loss_terms names it, not an AttributeError here
    return (terms.loss_sum if isinstance(terms, api.LossTerms) else None), terms


def shard(root: nn.Module, device: torch.device) -> None:
    """Shard ``root``'s trainable parameters over every rank (one FSDP unit; frozen ones stay whole on every rank, see
    the module doc)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    # fully_shard keeps of each parameter this rank's shard of this rank's own tensor: every rank starts from rank
    # 0's weights and buffers, as DDP's constructor makes it, so the ranks agree even when their initialisations
    # drew differently from the RNG
    with torch.no_grad():
        for t in [*root.parameters(), *root.buffers()]:
            torch.distributed.broadcast(t, src=0)
    frozen = {p for p in root.parameters() if not p.requires_grad}
    fully_shard(root, mesh=mesh, ignored_params=frozen or None)


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor shard (a collective: every rank calls it in the same order); others as they are."""
    return t.full_tensor() if _is_dtensor(t) else t


@contextlib.contextmanager
def gathered(root: nn.Module) -> Iterator[None]:
    """Within the block every parameter of ``root`` is a plain tensor holding its full value (on every rank), so a
    drafter's ``save``, ``state_dict`` and evaluation read it as in one process; the shards are put back after."""
    originals: list[tuple[nn.Module, str, nn.Parameter]] = []
    try:
        for module in root.modules():
            for name, param in list(module._parameters.items()):
                if param is None or not _is_dtensor(param):
                    continue
                whole = nn.Parameter(param.detach().full_tensor(), requires_grad=param.requires_grad)
                originals.append((module, name, param))
                module._parameters[name] = whole
        yield
    finally:
        # the same Parameter objects FSDP holds go back, so its own bookkeeping never saw the swap
        for module, name, param in originals:
            module._parameters[name] = param


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every sharded tensor gathered whole (collective): the one-process format."""
    sd = optimizer.state_dict()
    state = {pid: {key: full(value) if isinstance(value, torch.Tensor) else value for key, value in entry.items()}
             for pid, entry in sd["state"].items()}
    return {"state": state, "param_groups": sd["param_groups"]}


def shard_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """After ``optimizer.load_state_dict`` of a one-process state: keep of each moment this rank's shard, placed as
    its parameter is (a plain tensor the shape of a sharded parameter becomes a DTensor like it)."""
    from torch.distributed.tensor import distribute_tensor

    for group in optimizer.param_groups:
        for param in group["params"]:
            if not _is_dtensor(param):
                continue
            entry = optimizer.state.get(param, {})
            for key, value in list(entry.items()):
                if isinstance(value, torch.Tensor) and not _is_dtensor(value) and value.shape == param.shape:
                    # every rank holds the full value: each keeps its own part, no communication
                    entry[key] = distribute_tensor(value.to(param.device), param.device_mesh, param.placements,
                                                   src_data_rank=None)
