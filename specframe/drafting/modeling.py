"""The drafters' building blocks as plugins reach them (``api.modeling``): the decoder layers over element sets
(``specframe.drafting.decoder``, re-exported here) and the losses over a drafter's head that never hold a [rows x vocabulary]
logits matrix: the chunked forward KL against the target's distribution (dense, or a feature cache's top-k teacher)
and the chunked cross-entropy, each forming its gradient chunk by chunk in the forward.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch
import torch.nn.functional as F

# The decoder trunk, re-exported so ``api.modeling`` keeps every name it had (same objects).
from specframe.drafting.decoder import (KV, MLP, ROW_CHUNK, Attention, DecoderLayer, LayerShape, RMSNorm,  # noqa: F401
                               SelfAttention, apply_rotary, causal_attention, expand_kv, rope_parameters, rope_theta,
                               rotary, run_layers)
from specframe.target_head import TargetHead, as_target_head

#: the engine's phase timer while ``specframe train --profile`` runs (``specframe.engine.profile``), else None: the
#: loss kernels below time themselves as the "loss" phase. A context variable set only by ``timing``, so no module
#: assigns this one's globals and an exception cannot leave a run's timer installed
_phase_timer: contextvars.ContextVar[Callable[[str], Any] | None] = contextvars.ContextVar("phase_timer",
                                                                                         default=None)


@contextlib.contextmanager
def timing(timer: Callable[[str], Any] | None) -> Iterator[None]:
    """Inside the block, the loss kernels report their "loss" phase to ``timer`` (None: they are not timed); the
    previous timer is back when the block exits, however it exits."""
    token = _phase_timer.set(timer)
    try:
        yield
    finally:
        _phase_timer.reset(token)


def _phase(name: str) -> Any:
    timer = _phase_timer.get()
    return timer(name) if timer is not None else contextlib.nullcontext()


@attrs.frozen
class TopKTeacher:
    """A compact teacher in place of ``target_hidden``: the target's top-k next-token ids over its whole vocabulary
    (``ids`` [P, k], best first) and their log-probabilities (``logp`` [P, k]) per position, as a feature cache stores
    them (``specframe prepare --teacher-top-k``). ``to_draft`` [V] maps a target id to its draft-vocabulary id, -1
    outside; ``draft_size`` is Vd. The teacher over the draft vocabulary is the top-k entries inside it, renormalised:
    exact when the target's draft-vocabulary mass lies in its top k (with k = V it equals the dense teacher). A
    position with no top-k entry inside the draft vocabulary teaches nothing. ``position_mask`` and
    ``reference_top1`` receive the positions' full-vocabulary top-1 ids (``ids[:, 0]``) instead of hidden rows."""

    ids: torch.Tensor
    logp: torch.Tensor
    to_draft: torch.Tensor
    draft_size: int

    @property
    def device(self) -> torch.device:
        return self.ids.device

    def __getitem__(self, rows: Any) -> TopKTeacher:
        return TopKTeacher(self.ids[rows], self.logp[rows], self.to_draft, self.draft_size)


@attrs.frozen
class KLResult:
    loss_sum: torch.Tensor
    correct: torch.Tensor  # bool [N]: draft top-1 equals the reference top-1
    dropped: int = 0  # rows ``position_mask`` left out of the loss


def chunked_forward_kl(
    hidden: torch.Tensor,
    head: torch.Tensor,
    target_hidden: torch.Tensor,
    target_head: TargetHead | torch.Tensor | None,
    reference_top1: Callable[[torch.Tensor], torch.Tensor] | None = None,
    chunk: int = 256,
    position_mask: Callable[[torch.Tensor], torch.Tensor] | None = None,
    target_index: torch.Tensor | None = None,
    row_weight: torch.Tensor | None = None,
    ce_weight: float = 0.0,
) -> KLResult:
    """Sum over rows of KL(p_target || q_draft) over the draft vocabulary, in row chunks.

    ``hidden`` [N, H] are the drafter's normalised final states and ``head`` [Vd, H] its lm_head; the target
    distribution is softmax(target_head.logits(target_hidden)) with ``target_head`` the target's head
    (``specframe.target_head.TargetHead``: lm_head, bias, logit scale, soft-capping) restricted to the draft
    vocabulary's rows; a bare [Vd, H] weight is taken as a head that is only the matmul. ``target_index`` [N]
    (optional): ``target_hidden`` then holds one row per *position* and row i is taught by
    ``target_hidden[target_index[i]]``. The teacher (its log-probabilities, ``position_mask`` and
    ``reference_top1``) is computed once per distinct position, in blocks of ``chunk`` positions, and shared by every
    row that reads it: the target's distribution at a position is the same for every depth that predicts it, and a
    parallel drafter has up to K rows per position. Without ``target_index`` every row has a teacher row of its own.
    ``row_weight`` [N] (optional) scales each row's term (EAGLE-3's per-depth weights, in one call for all depths).

    The gradient of a row's KL with respect to its draft logits is w (q sum(p) - p) (log-softmax's backward), so it
    is formed right in the forward chunk by chunk and only the gradients of ``hidden`` [N, H] and ``head`` [Vd, H] are
    kept for backward: no chunk's logits are recomputed and no teacher is held across the step. Memory is
    O(N x H + Vd x H), plus O(chunk x Vd) while a chunk is being worked on.
    ``target_hidden`` may instead be a ``TopKTeacher`` (``target_head`` then unused): the cache's compact teacher,
    so the target's head never runs.
    ``reference_top1(target_hidden_rows)`` gives the draft-vocabulary id a hit must match (default: the target's
    argmax within the draft vocabulary); rows where it returns -1 can never be hit.
    ``position_mask(target_hidden_rows)`` (bool per row) keeps only the rows it marks in the loss, as the EAGLE-3 and
    P-EAGLE reference trainers do with ``t2d[target argmax]``: a row whose target top-1 lies outside the draft
    vocabulary contributes nothing (its hit verdict is still reported); ``dropped`` counts the rows left out.
    ``ce_weight`` w in [0, 1] mixes in hard cross-entropy: each row's term is (1 - w) KL + w CE, the CE label being
    the teacher's own argmax over the draft vocabulary (the target's greedy token as the renormalised teacher ranks
    it, not the data token); w = 1 is plain CE against that argmax. The teacher p is replaced by
    (1 - w) p + w onehot(argmax), whose gradient q sum(p) - p the same loop forms (a position whose teacher has no
    mass in the draft vocabulary, possible with a top-k teacher, keeps teaching nothing).
    """
    n = hidden.shape[0]
    if not 0.0 <= ce_weight <= 1.0:
        raise ValueError(f"ce_weight must be in [0, 1], got {ce_weight!r}")
    if n == 0:
        return KLResult(hidden.new_zeros(()) + 0.0 * head.sum(), torch.zeros(0, dtype=torch.bool))
    with _phase("loss"):
        teacher = _PositionTeacher(target_hidden, target_head, target_index, n, chunk, reference_top1, position_mask,
                                   ce_weight)
        return _kl(hidden, head, teacher, chunk, row_weight)


class _PositionTeacher:
    """The target's side of the KL: the rows grouped by the position that teaches them, and per block of ``chunk``
    positions its log-probabilities over the draft vocabulary, keep mask and reference top-1."""

    def __init__(self, target_hidden, target_head, target_index, n, chunk, reference_top1, position_mask,
                 ce_weight: float = 0.0) -> None:
        self.target_hidden = target_hidden
        self.ce_weight = float(ce_weight)
        self.target_head = None if target_head is None else as_target_head(target_head)
        self.reference_top1, self.position_mask = reference_top1, position_mask
        device = target_hidden.device
        if target_index is None:  # one teacher row per row, in order
            self.positions = None
            self.inverse = torch.arange(n, device=device)
            self.order = self.inverse
            count = n
        else:
            self.positions, self.inverse = torch.unique(target_index.to(device), return_inverse=True)
            # rows sorted by their teacher (stable: the rows of one position keep their order)
            self.order = torch.argsort(self.inverse, stable=True)
            count = int(self.positions.numel())
        starts = torch.arange(0, count, chunk, device=device)
        # first sorted row of each block of positions, and the end
        sorted_inverse = self.inverse[self.order]
        self.row_bounds = [*torch.searchsorted(sorted_inverse, starts).tolist(), n]
        self.blocks = [(int(s), min(int(s) + chunk, count)) for s in starts.tolist()]

    @torch.no_grad()
    def block(self, b: int) -> tuple[torch.Tensor, ...]:
        """Block ``b``'s teacher probabilities p [positions, Vd], sum(p log p) and sum(p) per position, keep mask
        (None: keep all) and reference top-1: what every row the position teaches needs, computed once."""
        lo, hi = self.blocks[b]
        th = self.target_hidden[lo:hi] if self.positions is None else self.target_hidden[self.positions[lo:hi]]
        if isinstance(th, TopKTeacher):
            return self._mix(*self._top_k_block(th))
        t_logp = torch.log_softmax(self.target_head.logits(th).float(), dim=-1)
        p = t_logp.exp()
        plogp = (p * t_logp).sum(-1)
        keep = self.position_mask(th).to(torch.bool) if self.position_mask is not None else None
        ref = self.reference_top1(th) if self.reference_top1 is not None else t_logp.argmax(-1)
        return self._mix(p, plogp, p.sum(-1), keep, ref)

    def _mix(self, p, plogp, psum, keep, ref) -> tuple[torch.Tensor, ...]:
        """(1 - w) KL + w CE as one teacher: p -> (1 - w) p + w onehot(argmax p); the one-hot has no entropy, so
        sum(p log p) scales by (1 - w) and the KL loop's value and gradient are the mix's."""
        w = self.ce_weight
        if w == 0.0:
            return p, plogp, psum, keep, ref
        has = (psum > 0).to(p.dtype)
        onehot = torch.zeros_like(p).scatter_(1, p.argmax(-1, keepdim=True), has[:, None])
        return (1.0 - w) * p + w * onehot, (1.0 - w) * plogp, (1.0 - w) * psum + w * has, keep, ref

    def _top_k_block(self, t: TopKTeacher) -> tuple[torch.Tensor, ...]:
        ids = t.ids.long()
        draft = t.to_draft[ids]
        inside = draft >= 0
        mass = torch.where(inside, t.logp.float().exp(), 0.0)
        total = mass.sum(-1, keepdim=True)
        p = torch.zeros(ids.shape[0], t.draft_size, dtype=torch.float32, device=ids.device)
        # entries outside the draft vocabulary carry zero mass: adding it at id 0 changes nothing
        p.scatter_add_(1, draft.clamp(min=0), mass / total.clamp(min=torch.finfo(torch.float32).tiny))
        plogp = torch.where(p > 0, p * p.clamp(min=torch.finfo(torch.float32).tiny).log(), 0.0).sum(-1)
        top1 = ids[:, 0]
        keep = self.position_mask(top1).to(torch.bool) if self.position_mask is not None else None
        ref = self.reference_top1(top1) if self.reference_top1 is not None else p.argmax(-1)
        return p, plogp, p.sum(-1), keep, ref


class _PrecomputedGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss, grads, *inputs):
        ctx.save_for_backward(*[torch.empty(0) if g is None else g for g in grads])
        ctx.present = [g is not None for g in grads]
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        out = [(g * grad).to(g.dtype) if present else None for g, present in zip(ctx.saved_tensors, ctx.present)]
        return (None, None, *out)


def precomputed_grad(loss: torch.Tensor, pairs: Sequence[tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
    """``loss`` (computed under no_grad) as a differentiable value whose gradient with respect to each ``input`` of
    ``pairs`` is the ``gradient`` formed beside it in the forward (None: that input gets none): backward only scales
    each by the incoming gradient, in the gradient's own dtype. How the chunked losses (``chunked_forward_kl``,
    ``chunked_cross_entropy``, DSpark's) run each chunk's vocabulary products once instead of again in backward."""
    return _PrecomputedGrad.apply(loss, [g for _, g in pairs], *[x for x, _ in pairs])


def _kl(hidden: torch.Tensor, head: torch.Tensor, teacher: _PositionTeacher, chunk: int,
        row_weight: torch.Tensor | None) -> KLResult:
    n = hidden.shape[0]
    grad_on = torch.is_grad_enabled()
    need_h = grad_on and hidden.requires_grad
    need_head = grad_on and head.requires_grad
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    correct = torch.zeros(n, dtype=torch.bool, device=hidden.device)
    dropped = 0
    grad_h = torch.zeros_like(hidden) if need_h else None
    grad_head = torch.zeros(head.shape, dtype=torch.float32, device=head.device) if need_head else None
    head_in = CastOnce(head)
    with torch.no_grad():
        for b in range(len(teacher.blocks)):
            p_block, plogp_block, psum_block, keep_block, ref_block = teacher.block(b)
            lo = teacher.blocks[b][0]
            for start in range(teacher.row_bounds[b], teacher.row_bounds[b + 1], chunk):
                rows = teacher.order[start : min(start + chunk, teacher.row_bounds[b + 1])]
                local = teacher.inverse[rows] - lo
                p = p_block[local]
                h = hidden[rows]
                # under autocast the matmul runs in the autocast dtype, as ``h @ head.T`` did under autograd
                z = h @ head.T
                # the [rows, Vd] work is elementwise passes over memory: logq and then q are made in place, and
                # KL = sum p log p - sum p log q takes the first sum from the teacher's block
                logq = z.float()
                logq = logq.sub_(torch.logsumexp(logq, dim=-1, keepdim=True))
                kl = plogp_block[local] - torch.linalg.vecdot(p, logq)
                weight = None
                if keep_block is not None:
                    keep = keep_block[local]
                    dropped += int((~keep).sum())
                    weight = keep.to(kl.dtype)
                if row_weight is not None:
                    w = row_weight[rows].to(kl.dtype)
                    weight = w if weight is None else weight * w
                loss += kl.sum() if weight is None else (kl * weight).sum()
                correct[rows] = logq.argmax(-1) == ref_block[local]
                if need_h or need_head:
                    # d KL / d z = w (q sum(p) - p); subnormal entries are zeroed (see flush_subnormal)
                    g = logq.exp_().mul_(psum_block[local, None]).sub_(p)
                    if weight is not None:
                        g = g.mul_(weight[:, None])
                    gd = grad_dtype(z.dtype)
                    g = flush_subnormal(g.to(gd))
                    with _no_autocast(z.device):
                        if need_h:
                            grad_h[rows] = (g @ head_in(gd)).to(hidden.dtype)
                        if need_head:
                            grad_head += (g.T @ h.to(gd)).float()
    if need_h or need_head:
        loss = precomputed_grad(loss, [(hidden, grad_h),
                                       (head, None if grad_head is None else grad_head.to(head.dtype))])
    return KLResult(loss, correct, dropped)


def chunked_cross_entropy(
    hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, chunk: int = 256,
    row_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over rows of the hard cross-entropy of softmax(hidden @ head.T) at ``labels`` (each row times
    ``row_weight``, when given), and each row's top-1 hit, in row chunks. As in ``chunked_forward_kl`` the logits'
    gradient (q - onehot) is formed in the forward, so each chunk's logits are computed once, not again in backward,
    and no [N, V] tensor is ever alive: memory O(N x H + V x H), O(chunk x V) per chunk. Softmax runs in at least
    fp32 (float64 stays float64, for the exactness tests)."""
    n = hidden.shape[0]
    if n == 0:
        return hidden.sum() * 0.0 + head.sum() * 0.0, torch.zeros(0, dtype=torch.bool)
    with _phase("loss"):
        return _cross_entropy(hidden, head, labels, chunk, row_weight)


def _cross_entropy(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, chunk: int,
                   row_weight: torch.Tensor | None):
    grad_on = torch.is_grad_enabled()
    need_h, need_head = grad_on and hidden.requires_grad, grad_on and head.requires_grad
    wide = torch.promote_types(torch.promote_types(hidden.dtype, head.dtype), torch.float32)
    loss = torch.zeros((), dtype=wide, device=hidden.device)
    hits = []
    grad_h = torch.zeros_like(hidden) if need_h else None
    grad_head = torch.zeros(head.shape, dtype=wide, device=head.device) if need_head else None
    head_in = CastOnce(head)
    with torch.no_grad():
        for start in range(0, hidden.shape[0], chunk):
            h, y = hidden[start : start + chunk], labels[start : start + chunk]
            z = h @ head.T
            logq = z.to(wide)  # log-softmax in place: the [rows, V] passes over memory are most of this loop
            logq = logq.sub_(torch.logsumexp(logq, dim=-1, keepdim=True))
            nll = -logq.gather(1, y[:, None])[:, 0]
            w = None if row_weight is None else row_weight[start : start + chunk].to(device=z.device, dtype=wide)
            loss += nll.sum() if w is None else (nll * w).sum()
            hits.append(logq.argmax(-1) == y)
            if need_h or need_head:
                g = logq.exp_()
                g[torch.arange(len(y), device=g.device), y] -= 1.0
                if w is not None:
                    g = g.mul_(w[:, None])
                gd = grad_dtype(z.dtype)
                g = flush_subnormal(g.to(gd))
                with _no_autocast(z.device):
                    if need_h:
                        grad_h[start : start + chunk] = (g @ head_in(gd)).to(hidden.dtype)
                    if need_head:
                        grad_head += (g.T @ h.to(gd)).to(wide)
    if need_h or need_head:
        loss = precomputed_grad(loss, [(hidden, grad_h),
                                       (head, None if grad_head is None else grad_head.to(head.dtype))])
    return loss, torch.cat(hits)


class CastOnce:
    """``tensor.to(dtype)``, cast once per dtype and kept for the call: the chunked losses ask for the draft head in the
    gradient's dtype on every row chunk, and under bf16 a [Vd, H] fp32 head cast for each chunk (32K x 4096: 0.25 GB
    a chunk, hundreds of chunks a step) was memory traffic the loss did not need. Where the dtype is the tensor's own,
    ``to`` returns the tensor itself, as before."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self._cast: dict[torch.dtype, torch.Tensor] = {}

    def __call__(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._cast:
            self._cast[dtype] = self.tensor.to(dtype)
        return self._cast[dtype]


def grad_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    """The dtype the chunked losses form the logits' gradient and its two matmuls in: the logits' own, except fp16.

    The gradient is formed in the forward, before the GradScaler's loss scale reaches it (``precomputed_grad`` applies
    the incoming, scaled gradient afterwards), and fp16's smallest normal is 6.1e-5: over a 32K draft vocabulary a
    near-uniform q is ~3e-5, so in fp16 almost every push-down entry would be flushed to zero and the hidden state's
    gradient would become -E_p[head] in place of E_q[head] - E_p[head]. float32 holds it (bf16 has float32's range).
    """
    return torch.float32 if logits_dtype == torch.float16 else logits_dtype


def _no_autocast(device: torch.device):
    # the gradient's matmuls run in the dtype grad_dtype chose: fp16 autocast would cast them back to fp16 (under
    # bf16 autocast the operands are bf16 already, so nothing changes)
    return torch.autocast(device.type, enabled=False)


def flush_subnormal(x: torch.Tensor) -> torch.Tensor:
    """``x`` with entries whose magnitude is below its dtype's smallest normal number set to zero.

    Applied to the logits' gradient (q - p over the draft vocabulary): once either distribution is peaked (a gap of
    ~87 nats in float32) most entries are subnormal, and the two matmuls that consume it ran about 200x slower on x86
    CPUs (microcode assists; ``torch.set_flush_denormal`` only reaches the calling thread, not the OpenMP workers).
    Entries below the smallest normal number move the gradient by less than that number times a weight, so zeroing
    them changes nothing a float can hold.
    """
    if not x.is_floating_point():
        return x
    # hardshrink: one pass and one output, no mask or abs() temporaries of the [chunk, Vd] size
    return F.hardshrink(x, torch.finfo(x.dtype).tiny)
