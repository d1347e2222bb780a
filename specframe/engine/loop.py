"""The training loop shared by every drafter.

Loss normalisation (docs/design.md section 8): the loss of an optimizer step is the sum over every supervised element of
the global batch (all sequences, segments and ranks) divided by that global count. The count is known before any
forward (each element is charged in exactly one segment, and it is supervised iff the drafter's supervision is set
at its reference position), so it is all-reduced first and every segment back-propagates ``loss_sum / count`` at
once; gradients are then summed across ranks. One rank and two, S = 1 and S = 4 therefore give the same gradient.

Data order is a seeded permutation per epoch and COD draws from a generator seeded by (seed, step, slot), so a resumed
run sees exactly the sequences and elements the uninterrupted run would have.

Run length: ``--max-steps`` steps, or with ``--epochs E`` ceil(E * train sequences / batch size) steps (one epoch
when neither is given); the train sequences are counted after packing, so the same data, ``--seq-len`` and
``--pack`` give the same length (and learning-rate schedule) to a resumed run.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

from specframe import api, compose, memory
from specframe.elements import full_grid, position_docs
from specframe.engine import checkpoint, sharding, tracking, validate
from specframe.engine.config import TrainConfig, to_dict, warmup_steps
from specframe.errors import SpecframeError, UsageError
from specframe.metrics import chain_acceptance


@attrs.define
class TrainResult:
    steps: int
    checkpoint: Path
    metrics: list[dict[str, Any]]
    final_train_loss: float | None
    last_eval: dict[str, Any] | None
    #: ``--profile``: the time-per-phase table (``specframe.engine.profile``), else None
    profile: str | None = None
    #: ``--profile``: the raw seconds per phase behind that table (unrounded), else None
    profile_seconds: dict[str, float] | None = None


def expected_acceptance_length(accuracy: list[float]) -> float:
    """1 + sum_k prod_{i<=k} acc_i: the per-depth product estimate of a chain draft's acceptance length.

    Exact only when a depth's hits are independent of the shallower depths'; ``evaluate`` reports it as
    ``val_product_al`` and, whenever the drafter returns per-element hits (``LossTerms.hit``), ``val_expected_al`` is
    the measured chain mean instead (``specframe.metrics.chain_acceptance``)."""
    total, prod = 1.0, 1.0
    for acc in accuracy:
        prod *= acc
        total += prod
    return total


def record_hits(
    hits: torch.Tensor, elems: Any, segment: api.Segment, supervision: torch.Tensor, hit: torch.Tensor
) -> torch.Tensor:
    """Write a segment's per-element verdicts (``LossTerms.hit``, charged elements in segment order) into ``hits``
    [anchors, K] at their (anchor, depth); ``specframe.metrics.chain_acceptance`` reads the result. The same for
    any per-element value (``LossTerms.confidence``) into a matrix of its dtype."""
    sub = elems.subset(segment.elements)
    charged = segment.loss_mask.to(torch.bool).cpu() & supervision.to(torch.bool).cpu()[sub.position.cpu()]
    hits[sub.anchor.cpu()[charged], sub.depth.cpu()[charged]] = hit.detach().cpu().to(hits.dtype)
    return hits


def lr_lambda(warmup: int, total: int) -> Callable[[int], float]:
    """Linear warmup to 1, then cosine decay to 0 at ``total`` steps."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return f


class _Dist:
    """torch.distributed when launched by torchrun (WORLD_SIZE > 1), else a single process: NCCL between GPUs, gloo
    on the CPU. Multi-node runs are torchrun's business (``--nnodes``, ``--rdzv-endpoint``); each process only needs
    its ``LOCAL_RANK`` to pick its GPU (``specframe.devices.resolve_device``)."""

    def __init__(self, device: torch.device) -> None:
        import torch.distributed as dist

        from specframe.devices import backend, world_size

        self.dist = dist
        self.world = world_size(rendezvous=not dist.is_initialized())
        if self.world > 1 and not dist.is_initialized():
            if device.type == "cuda":
                torch.cuda.set_device(device)
            dist.init_process_group(backend(device))
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


class Trainer:
    def __init__(self, cfg: TrainConfig, *, resume: str | None = None, target: Any = None, log: Callable = print,
                 profile: bool = False, allow_changed: bool = False):
        self.cfg = cfg
        self.allow_changed = allow_changed
        self.log = log
        self.profile_requested = profile
        memory.pin_mmap_threshold()
        from specframe.devices import resolve_device

        self.device = resolve_device(cfg.device)
        from specframe.engine.profile import PhaseTimer

        # time per phase (``--profile``); disabled, every phase is a no-op context
        self.timer = PhaseTimer(self.device, enabled=profile)
        if cfg.device_map is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise UsageError("--device-map spreads one target over every GPU of one process; under torchrun each "
                             "rank would load it whole: prepare a feature cache with `specframe prepare --device-map "
                             "auto` in one process, then train from it (--cache) on many")
        self.dist = _Dist(self.device)
        if cfg.fsdp and cfg.dtype == "fp16":
            raise UsageError("--fsdp trains in fp32 or bf16 (fp16's gradient scaler does not handle sharded "
                             "gradients): use --dtype bf16")
        if cfg.fsdp and self.dist.world < 2:
            raise UsageError("--fsdp shards the drafter across processes: launch with torchrun --nproc-per-node N "
                             "(N >= 2), or train without --fsdp")
        self.out = Path(cfg.output)
        # a tracker whose library is missing is refused before anything is written
        self.report_to = tracking.parse_report_to(cfg.report_to)
        tracking.check_available(self.report_to)
        self.trackers: tracking.Tracker | None = None
        self.resume_from = self._check_output(resume)
        created = not self.out.exists()
        self.lock = checkpoint.OutputLock(self.out) if self.dist.rank == 0 else None
        try:
            self._setup(target)
        except BaseException:
            self.close()
            if created and self.lock is not None:  # a run refused before writing anything leaves no trace
                (self.out / checkpoint.LOCK).unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    self.out.rmdir()
            raise

    def _check_output(self, resume: str | None) -> Path | None:
        self.changed_on_resume: list[dict[str, Any]] = []
        self.resume_changes: dict[str, dict[str, Any]] = {}
        if resume is None:
            if checkpoint.has_checkpoint(self.out):
                raise SpecframeError(
                    f"{self.out} already holds a checkpoint; pass --resume {self.out} to continue it or choose "
                    "another --output (nothing was overwritten)"
                )
            return None
        from specframe import run_config

        directory, saved, changes = run_config.check_resume(resume, self.cfg, self.allow_changed)
        # every resume that changed settings stays in the run's record (allow_changed), so a reader of config.json
        # sees the run was not one schedule from start to end
        self.changed_on_resume = list(saved.get(run_config.CHANGED_RECORD) or [])
        self.resume_changes = {name: {"recorded": old, "now": new} for name, old, new in changes}
        return directory

    def _setup(self, target: Any) -> None:
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        if target is None:
            target = compose.load_target(cfg)
        self.target = target
        if getattr(target.model, "hf_device_map", None) is None:  # a device_map placed it already
            target.model.to(self.device)
        # the names in the config become the run's parts in one place (specframe.compose): the same classes,
        # defaults and errors as --print-config and the memory estimate
        parts = compose.build(cfg, target.config, self.device)
        self.drafter: api.Drafter = parts.drafter
        self.training = parts.training  # what the drafter declares (API 6), whatever its options call it
        self.depth = parts.depth
        self.builder = parts.builder
        self.attention_builder: Any = parts.attention_builder
        self.partitioner = parts.partitioner
        self.resolved = parts.resolved
        self.source: Any = compose.feature_source(cfg, target, self.drafter.feature_spec())
        n = len(self.source)
        n_val = min(cfg.val_examples, n - 1)
        self.train_ids = list(range(n - n_val))
        self.val_ids = list(range(n - n_val, n))
        self.total_steps = resolve_steps(cfg, len(self.train_ids))
        late = [step for step in cfg.keep_drafter_at if step > self.total_steps]
        if late:
            raise UsageError(f"--keep-drafter-at {','.join(map(str, late))}: the run has only {self.total_steps} steps")
        # online features stay in memory only for the training sequences the run visits more than once (and the
        # validation ones, visited at every evaluation); the others are computed on use and let go, so one epoch
        # over a dataset of any size holds a step's features, not the dataset's
        revisited = self.revisited()
        if cfg.cache is None:
            self.source.keep_features(None if revisited is None else [*revisited, *self.val_ids])
        kept = (len(self.train_ids) if revisited is None else len(revisited) + min(cfg.batch_size, len(self.train_ids))) \
            + len(self.val_ids)
        self.prefetch = cfg.prefetch if cfg.prefetch is not None else self.device.type == "cuda"
        if self.prefetch:
            kept += min(cfg.batch_size, len(self.train_ids))  # the next step's, computed while this one trains
        from specframe.memory import engine_guard

        # refuse a configuration that cannot fit --memory-budget before any feature is computed or file written
        self.memory_guard = engine_guard(attrs.evolve(self.resolved, device=str(self.device)), target.config,
                                         sequences=kept)
        self.drafter.prepare(target, [self.source.tokens(i) for i in self.train_ids])
        if cfg.init_from is not None and self.resume_from is None:
            from specframe.layouts import imports

            imports.warm_start(self.drafter, cfg.init_from, target.config, getattr(target, "tokenizer", None))
        module = self.drafter.module().to(self.device)
        if self.resume_from is not None:
            # the weights before any wrapper: a sharded (--fsdp) module takes them only whole, before it is sharded
            self.drafter.load(self.resume_from)
        self.precision = Precision(cfg.dtype, self.device)
        # a multi-process run's gradients are reduced by torch's DDP, or with --fsdp the drafter is sharded by FSDP2
        # (specframe.engine.sharding); either wraps the loss as a module (_DrafterLoss). One process needs neither.
        self.ddp = None
        self.fsdp: torch.nn.Module | None = None
        if cfg.fsdp:
            self.fsdp = _DrafterLoss(self.drafter, every_parameter=True)
            sharding.shard(self.fsdp, self.device)
        elif self.dist.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.ddp = DistributedDataParallel(_DrafterLoss(self.drafter), find_unused_parameters=True)
        self.wrapped = self.fsdp if self.fsdp is not None else self.ddp
        self.params = [p for p in module.parameters() if p.requires_grad]
        if not self.params:
            raise UsageError(f"drafter '{cfg.drafter}' has no trainable parameters: there is nothing to train")
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        warmup = warmup_steps(cfg, self.total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(warmup, self.total_steps))
        self.step = 0
        # the last validation's held-out chains (confidence logits, verdicts, validation sequence of each), API 8
        self.held_out_confidence: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.tokens_seen = 0  # training tokens (all ranks) so far: the drafter's token budget, kept across resumes
        if self.resume_from is not None:
            state = checkpoint.load_training_state(self.resume_from, self.optimizer, self.scheduler,
                                                   self.precision.scaler)
            if self.fsdp is not None:
                sharding.shard_optimizer_state(self.optimizer)
            self.step = int(state["step"])
            self.tokens_seen = int(state.get("tokens_seen", 0))
            if self.resume_changes:
                self.changed_on_resume.append({"step": self.step, "changed": self.resume_changes})
        self.metrics_path = self.out / "metrics.jsonl"
        if self.dist.rank == 0:
            self._trim_metrics()
            checkpoint.atomic_write_text(self.out / "config.json", json.dumps(self.config_dict(), indent=1))
        if self.dist.rank == 0 and self.report_to:
            self.trackers = tracking.open_trackers(self.report_to, self.out, self.config_dict(), self.step)

    def config_dict(self) -> dict[str, Any]:
        d = to_dict(self.resolved)
        d["memory_budget_enforced"] = self.memory_guard is not None
        d["world_size"] = self.dist.world
        d["target_id"] = getattr(self.target, "id", None)
        d["target_weights_hash"] = getattr(self.target, "weights_hash", None)
        d["train_sequences"] = len(self.train_ids)
        d["val_sequences"] = len(self.val_ids)
        d["conversations"] = len(self.source.conversations)
        d["steps"] = self.total_steps
        if self.changed_on_resume:
            d["changed_on_resume"] = self.changed_on_resume
        return d

    def _trim_metrics(self) -> None:
        # a killed run may have logged steps past its last checkpoint; the resumed run logs them again
        if not self.metrics_path.exists():
            return
        keep = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                entry = json.loads(line) if line.strip() else None
            except json.JSONDecodeError:  # the last line of a run killed while writing it: logged again
                entry = None
            if isinstance(entry, dict) and entry.get("step", 0) <= self.step:
                keep.append(line)
        checkpoint.atomic_write_text(self.metrics_path, "".join(k + "\n" for k in keep))

    def close(self) -> None:
        if getattr(self, "trackers", None) is not None:
            self.trackers.close()
            self.trackers = None
        if self.lock is not None:
            self.lock.release()

    # ------------------------------------------------------------------------------------------------- elements
    def elements(self, example: api.TrainingExample, generator: torch.Generator | None) -> tuple[Any, torch.Tensor]:
        sup = self.drafter.supervision(example).to(torch.bool)
        n = sup.shape[0]
        # the drafter's positions are the last n data positions (EAGLE's shift drops the first); in a packed
        # sequence a position that straddles two documents gets one of its own
        doc = position_docs(example.doc, n)
        ratio = self.training.cod_ratio
        if ratio < 1.0 and generator is not None:
            from specframe.elements import cod_sample

            elems = cod_sample(sup, self.depth, ratio, self.training.cod_min_ratio, generator=generator, doc=doc)
        else:
            elems = full_grid(n, self.depth, doc)
        # the drafter's declared visibility rule (api 2) travels with its elements to the partitioner and builder
        return elems.with_visibility(self.drafter.visibility), sup

    def segments(self, elems: Any) -> list[api.Segment]:
        from specframe.elements import check_partition

        segs = self.partitioner.partition(elems, self.cfg.partitions)
        check_partition(elems, segs, self.partitioner.name)
        return [seg for seg in segs if seg.elements.numel()]  # an empty segment has nothing to forward

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The seeded permutation of the training sequences in ``epoch`` (indices into ``train_ids``)."""
        n = len(self.train_ids)
        return torch.randperm(n, generator=torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + epoch))

    def batch_indices(self, step: int) -> list[int]:
        n = len(self.train_ids)
        out = []
        for slot in range(self.cfg.batch_size):
            position = step * self.cfg.batch_size + slot
            epoch, offset = divmod(position, n)
            out.append(self.train_ids[int(self.epoch_order(epoch)[offset])])
        return out

    def local_slots(self, step: int) -> list[tuple[int, int]]:
        """(slot, sequence) pairs of step ``step`` this rank trains: slot s goes to rank s mod world."""
        return [(slot, idx) for slot, idx in enumerate(self.batch_indices(step))
                if slot % self.dist.world == self.dist.rank]

    def revisited(self) -> set[int] | None:
        """The training sequences the whole run visits more than once (None: every one, from two epochs on). A run
        of one epoch plus part of a batch revisits only that part's sequences, not the dataset."""
        n = len(self.train_ids)
        visits = self.total_steps * self.cfg.batch_size
        if visits >= 2 * n:
            return None
        order = self.epoch_order(1)
        return {self.train_ids[int(order[offset])] for offset in range(max(0, visits - n))}

    # ------------------------------------------------------------------------------------------------ one step
    def train_step(self) -> dict[str, Any]:
        cfg, step = self.cfg, self.step
        started = time.perf_counter()
        module = self.drafter.module()
        module.train()
        work = []
        local_count = 0
        local_tokens = 0
        for slot, idx in self.local_slots(step):
            gen = torch.Generator().manual_seed((cfg.seed * 1_000_003 + step) * 4096 + slot)
            with self.timer("data"):
                example = self.source.example(idx)
                elems, sup = self.elements(example, gen)
                segs = self.segments(elems)
            local_count += int(sup[elems.position].sum())
            local_tokens += int(example.input_ids.numel())
            work.append((example, elems, segs, sup))
        if self.prefetch and step + 1 < self.total_steps:
            # the target works on the next step's sequences while the drafter trains on these
            self.source.prefetch([idx for _, idx in self.local_slots(step + 1)])
        count = self.dist.sum_(torch.tensor([float(local_count), float(local_tokens)]))
        global_count, global_tokens = float(count[0].item()), int(count[1].item())
        # one all-reduce for the loss and the per-depth top-1 hits / counts: [loss, correct x K, total x K]
        stats = torch.zeros(1 + 2 * self.depth)
        self.optimizer.zero_grad(set_to_none=True)
        jobs = [(example, elems, seg, sup) for example, elems, segs, sup in work for seg in segs]
        # DDP averages the ranks' gradients; scaling by the world size makes that the global sum / global count
        scale = self.dist.world / global_count if global_count > 0 else 0.0
        # zero-loss forward / backward passes that keep this rank in the ranks' collectives: under FSDP every forward
        # all-gathers and every backward reduce-scatters, so each rank runs as many as the busiest one; under DDP a
        # rank with no sequence this step still takes part in the one reduction, also when nothing is supervised
        # (global count 0): a rank with sequences then still runs its synchronising backward
        if self.fsdp is not None:
            idle = self.dist.max_(len(jobs)) - len(jobs)
        else:
            idle = int(not jobs and self.ddp is not None)
        for j, (example, elems, seg, sup) in enumerate(jobs):
            # gradients accumulate locally over segments and sequences; only the last backward reduces across ranks
            last = j == len(jobs) - 1
            with contextlib.nullcontext() if self.ddp is None or last else self.ddp.no_sync():
                with self.precision.autocast(), self.timer("forward"):
                    terms = self._segment_loss(example, elems, seg, sup, training=True)
                with self.timer("backward"):
                    self.precision.backward(terms.loss_sum.float() * scale)
            stats[0] += terms.loss_sum.detach().float().cpu().reshape(())
            stats[1 : 1 + self.depth] += terms.correct.float().cpu()
            stats[1 + self.depth :] += terms.total.float().cpu()
        for _ in range(idle):
            self._idle_backward()
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.dist.sum_(stats)
        loss_sum = stats[:1]
        correct, total = stats[1 : 1 + self.depth], stats[1 + self.depth :]
        with self.timer("optimizer"):
            if global_count > 0:
                # only a step that steps unscales: fp16's GradScaler forgets an unscale_ only in update(), which
                # step() calls, so an unscale_ on a skipped step made the next one raise (the gradients are zero
                # here anyway: the losses were scaled by 0)
                self.precision.unscale(self.optimizer)
            grad_norm = sharding.full(torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip))
            lr = self.scheduler.get_last_lr()[0]
            if global_count > 0:
                # fp16's scaler skips a step with overflowed gradients by itself (and lowers its scale); a
                # non-finite loss is an error in every precision
                validate.check_finite(step + 1, float(loss_sum.item()),
                                      0.0 if self.precision.scaler is not None else float(grad_norm))
                self.precision.step(self.optimizer)
            self.plugins_checked = True
            self.scheduler.step()
        self.step += 1
        self.tokens_seen += global_tokens
        loss = float(loss_sum.item() / global_count) if global_count > 0 else None
        seconds = time.perf_counter() - started
        # tokens and seconds per step let a benchmark compute training throughput without eval or checkpoint time;
        # train_accuracy: per-depth top-1 agreement with the target over the draft vocabulary (training mode)
        return {"step": self.step, "train_loss": loss, "elements": int(global_count), "tokens": global_tokens,
                "lr": lr, "grad_norm": float(grad_norm), "step_seconds": seconds,
                "tokens_per_second": global_tokens / seconds if seconds > 0 else None,
                "train_accuracy": [float(c / t) if t > 0 else 0.0 for c, t in zip(correct, total, strict=True)]}

    def _idle_backward(self) -> None:
        assert self.wrapped is not None
        loss, _ = self.wrapped(None)
        loss.backward()

    def guarded_step(self) -> dict[str, Any]:
        """``train_step`` under the memory budget: the hard ceiling during the step, the measured peak after it
        (``MemoryBudgetExceeded`` either way, before anything is saved, so the last checkpoint stays)."""
        if self.memory_guard is None:
            entry = self.train_step()
            entry["peak_memory_bytes"] = memory.peak_bytes(self.device)
            return entry
        with self.memory_guard.ceiling(self.step + 1):
            entry = self.train_step()
        entry["peak_memory_bytes"] = self.memory_guard.check(self.step, self.dist.sum_)
        return entry

    def _segment_loss(
        self, example: api.TrainingExample, elems: Any, seg: api.Segment, sup: torch.Tensor, *, training: bool
    ) -> api.LossTerms:
        sub = elems.subset(seg.elements)
        attention = api.SegmentAttention.build(self.attention_builder, sub)
        # under DDP / FSDP a training loss runs through the wrapper's forward, which arms the gradient reduction (and
        # under FSDP gathers the parameters)
        loss = self.wrapped if training and self.wrapped is not None else _DrafterLoss.call(self.drafter)
        if getattr(self, "plugins_checked", False):
            return loss(example, elems, seg, attention)[1]
        # the first step checks every plugin's output so a broken plugin is named, not a shape error deep in autograd
        attention = validate.CheckedAttention(attention, self.resolved.mask_builder)
        terms = loss(example, elems, seg, attention)[1]
        validate.check_loss_terms(terms, self.cfg.drafter, elems, seg, sup, training=training)
        return terms

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any] | None:
        if not self.val_ids:
            return None
        # under FSDP on whole parameters: a rank's validation forwards then need no collective each
        with self._whole():
            return self._evaluate()

    def _evaluate(self) -> dict[str, Any]:
        module = self.drafter.module()
        module.eval()
        loss_sum = torch.zeros(1)
        count = torch.zeros(1)
        correct = torch.zeros(self.depth)
        total = torch.zeros(self.depth)
        # chain acceptance: anchors with a full chain, their accepted depths, and per depth reached / accepted
        chain = torch.zeros(2 + 2 * self.depth)
        chained = True  # every segment returned per-element hits
        # [elements the draft-vocabulary position mask left out, elements of segments that report it]
        masked = torch.zeros(2)
        held_out: list[tuple[torch.Tensor, ...]] = []  # (confidence logits, verdicts, sequence) of full chains
        # [present, validation index, anchors, accepted sum] per sequence: what a bootstrap over held-out sequences
        # resamples. One row per validation sequence, filled by the rank that evaluates it and summed over ranks with
        # the other figures (a plain all-reduce, as every other figure here travels)
        per_sequence = torch.zeros(len(self.val_ids), 4, dtype=torch.float64)
        for j, idx in enumerate(self.val_ids):
            if j % self.dist.world != self.dist.rank:
                continue
            example = self.source.example(idx)
            elems, sup = self.elements(example, None)
            # verdict of element (anchor, depth): -1 none (not charged or not returned), else 0 / 1
            hits = torch.full((elems.seq_len, self.depth), -1, dtype=torch.long)
            # the drafter's confidence logit of each element (API 8), NaN where it gives none
            logits = torch.full((elems.seq_len, self.depth), math.nan, dtype=torch.float64)
            # its chance of acceptance under the rule the confidence is calibrated for (API 12), NaN where none
            acceptance = torch.full((elems.seq_len, self.depth), math.nan, dtype=torch.float64)
            for seg in self.segments(elems):
                with self.precision.autocast():
                    terms = self._segment_loss(example, elems, seg, sup, training=False)
                loss_sum += terms.loss_sum.float()
                count += terms.count
                correct += terms.correct.float()
                total += terms.total.float()
                if getattr(terms, "masked", None) is not None:
                    masked += torch.tensor([float(terms.masked), float(terms.count)])
                if terms.hit is None:
                    chained = False
                    continue
                record_hits(hits, elems, seg, sup, terms.hit)
                if getattr(terms, "confidence", None) is not None:
                    record_hits(logits, elems, seg, sup, terms.confidence.double())
                if getattr(terms, "acceptance", None) is not None:
                    record_hits(acceptance, elems, seg, sup, terms.acceptance.double())
            if chained:
                c = chain_acceptance(hits)
                chain += torch.tensor([c.anchors, c.accepted_sum, *c.reached, *c.accepted], dtype=chain.dtype)
                per_sequence[j] = torch.tensor([1.0, float(idx), float(c.anchors), float(c.accepted_sum)])
                full = hits.ge(0).all(1) & logits.isfinite().all(1)  # anchors with a full chain and its confidence
                if full.any():
                    observed = torch.where(acceptance.isnan(), hits.clamp(min=0).double(), acceptance)
                    held_out.append((logits[full], observed[full], torch.full((int(full.sum()),), j)))
        flag = torch.tensor([0.0 if chained else 1.0])
        for t in (loss_sum, count, correct, total, chain, flag, masked, per_sequence):
            self.dist.sum_(t)
        module.train()
        self.held_out_confidence = self._gather_confidence(held_out) if flag.item() == 0 else None
        acc = [float(c / t) if t > 0 else 0.0 for c, t in zip(correct, total, strict=True)]
        product = expected_acceptance_length(acc)
        out: dict[str, Any] = {
            "step": self.step,
            "val_loss": float(loss_sum.item() / max(count.item(), 1.0)),
            "val_elements": int(count.item()),
            "val_accuracy": acc,
            "val_product_al": product,
        }
        if masked[1] > 0:  # share of validation elements whose target top-1 lies outside the draft vocabulary
            out["val_vocab_masked"] = float(masked[0] / masked[1])
        anchors = int(chain[0].item())
        if flag.item() == 0 and anchors:
            k = self.depth
            reached, accepted = chain[2 : 2 + k], chain[2 + k :]
            out["val_expected_al"] = 1.0 + float(chain[1].item()) / anchors
            out["val_expected_al_method"] = "chain"
            out["val_chain_anchors"] = anchors
            out["val_chain_per_sequence"] = [[int(i), int(a), int(acc)] for present, i, a, acc in per_sequence.tolist()
                                             if present > 0]
            out["val_conditional_accuracy"] = [float(a / r) if r > 0 else 0.0 for a, r in zip(accepted, reached)]
        else:  # the drafter reports per-depth counts only
            out["val_expected_al"] = product
            out["val_expected_al_method"] = "per-depth product"
        if self.held_out_confidence is not None:
            out.update(self._confidence_figures(*self.held_out_confidence[:2]))
        return out

    def _gather_confidence(self, held_out: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...] | None:
        """Every rank's held-out (confidence logits, verdicts, sequence) together, on every rank (a calibration
        fitted on them is then the same everywhere), or None when the drafter gave no confidence."""
        parts = held_out
        if self.dist.world > 1:
            gathered: list[Any] = [None] * self.dist.world
            self.dist.dist.all_gather_object(gathered, held_out)
            parts = [pair for rank in gathered for pair in rank]
        if not parts:
            return None
        return tuple(torch.cat([p[i] for p in parts]) for i in range(3))

    def _confidence_figures(self, logits: torch.Tensor, accepted: torch.Tensor) -> dict[str, Any]:
        from specframe.calibration import prefix_ece

        ece = prefix_ece(self.drafter.calibrated_confidence(logits), accepted)
        return {"val_confidence_ece": ece["mean"], "val_confidence_ece_by_position": ece["per_position"],
                "val_confidence_anchors": ece["anchors"]}

    def calibrate(self) -> dict[str, Any] | None:
        """API 8: fit the drafter's calibration on the last validation's held-out chains; the calibration record when
        it fitted something, else None.

        The ECE it reports is out of sample: the validation sequences are split in two (alternate sequences, so the
        anchors of one sequence stay together), the drafter calibrates on one half and the other half is measured
        before and after; the drafter then calibrates on every chain, which is the fit it keeps. With one validation
        sequence there is no second half, and the figures are the fitted chains' own (``in_sample`` says which)."""
        if self.held_out_confidence is None:
            return None
        logits, accepted, sequence = self.held_out_confidence
        check = (sequence % 2) == 1
        in_sample = not bool(check.any()) or bool(check.all())
        fit_rows, check_rows = (slice(None), slice(None)) if in_sample else (~check, check)
        before = self._confidence_figures(logits[check_rows], accepted[check_rows])
        if not self.drafter.calibrate(logits[fit_rows], accepted[fit_rows]):
            return None
        after = self._confidence_figures(logits[check_rows], accepted[check_rows])
        if not in_sample:
            self.drafter.calibrate(logits, accepted)  # the fit kept: on every held-out chain
        return {"step": self.step, "calibrated": True, "calibration_anchors": int(logits.shape[0]),
                "calibration_in_sample": in_sample, "calibration_checked_anchors": before["val_confidence_anchors"],
                "confidence_ece_before": before["val_confidence_ece"],
                "confidence_ece_after": after["val_confidence_ece"],
                "confidence_ece_after_by_position": after["val_confidence_ece_by_position"]}

    def save(self) -> Path:
        path = Path()
        # under FSDP every rank gathers the full weights and optimizer state (collectives); rank 0 writes them in
        # the one-process format, so any world size resumes from it
        with self._whole():
            optimizer_state = sharding.full_optimizer_state(self.optimizer) if self.fsdp is not None else None
            if self.dist.rank == 0:
                path = checkpoint.save(
                    self.out, self.step, self.drafter, self.optimizer, self.scheduler, self.config_dict(),
                    {"data_position": self.step * self.cfg.batch_size, "tokens_seen": self.tokens_seen},
                    self.precision.scaler, optimizer_state=optimizer_state,
                )
        self.dist.barrier()
        return path

    def keep(self, last: Path | None) -> Path:
        """This step's checkpoint (written now unless it is ``last``), also copied whole to OUTPUT/kept/step-N, which
        later checkpoints never remove. Returns the step's checkpoint."""
        if last is None or last.name != checkpoint.step_name(self.step):
            last = self.save()
        if self.dist.rank == 0:
            checkpoint.keep(self.out, last)
        self.dist.barrier()
        return last

    def _whole(self) -> contextlib.AbstractContextManager:
        """The drafter's parameters whole on every rank for the block (FSDP), else nothing to do."""
        return sharding.gathered(self.fsdp) if self.fsdp is not None else contextlib.nullcontext()

    def record(self, entry: dict[str, Any]) -> None:
        if self.dist.rank != 0:
            return
        entry = {"time": time.time(), **entry}
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
        if self.trackers is not None:
            self.trackers.log(entry, entry["step"])

    def run(self, progress: bool = True, log_lines: Callable[[str], None] | None = None) -> TrainResult:
        """Train to the end. ``progress``: a rich progress bar; ``log_lines``: where to send a plain progress line
        every ``--log-every`` steps (for logs and pipes; the CLI uses it when stdout is not a terminal)."""
        from specframe import modeling

        # the loss kernels report to the run's timer (the "loss" phase, subtracted from the drafter's forward)
        modeling.phase_timer = self.timer if self.timer.enabled else None
        try:
            return self._run(progress, log_lines)
        finally:
            modeling.phase_timer = None
            self.source.close()

    def _run(self, progress: bool, log_lines: Callable[[str], None] | None) -> TrainResult:
        cfg, total = self.cfg, self.total_steps
        history: list[dict[str, Any]] = []
        last_eval = None
        last_ckpt = checkpoint.resolve(self.out) if checkpoint.has_checkpoint(self.out) else None
        bar = _progress(progress and self.dist.rank == 0)
        lines = ProgressLines(log_lines if self.dist.rank == 0 else None, total, self.step,
                              cfg.log_every or max(1, math.ceil(total / 20)))
        lines.start(self)
        with bar:
            task = bar.add_task("training", total=total, completed=self.step)
            while self.step < total:
                entry = self.guarded_step()
                self.record(entry)
                history.append(entry)
                bar.update(task, completed=self.step, description=f"loss {entry['train_loss'] or 0:.4f}")
                lines.step(entry)
                if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < total:
                    with self.timer("eval"):
                        last_eval = self.evaluate()
                    if last_eval:
                        self.record(last_eval)
                        lines.evaluation(last_eval)
                if cfg.save_every and self.step % cfg.save_every == 0 and self.step < total:
                    with self.timer("checkpoint"):
                        last_ckpt = self.save()
                if self.step in cfg.keep_drafter_at and self.step < total:
                    with self.timer("checkpoint"):
                        last_ckpt = self.keep(last_ckpt)
        with self.timer("eval"):
            final_eval = self.evaluate()
        if final_eval:
            self.record(final_eval)
            lines.evaluation(final_eval)
            last_eval = final_eval
        # fitted on the held-out sequences once, at the end (API 8); the checkpoint is then written with it
        calibration = self.calibrate()
        if calibration is not None:
            self.record(calibration)
            lines.emit_line(f"calibrated the confidence on {calibration['calibration_anchors']} held-out anchors: "
                            f"prefix ECE {calibration['confidence_ece_before']:.4f} -> "
                            f"{calibration['confidence_ece_after']:.4f}"
                            + (" (on the chains it was fitted on)" if calibration["calibration_in_sample"] else
                               f" (on {calibration['calibration_checked_anchors']} anchors of other sequences)"))
            if last_eval is not None:
                last_eval = {**last_eval, "val_confidence_ece_calibrated": calibration["confidence_ece_after"]}
        if calibration is not None or last_ckpt is None or last_ckpt.name != checkpoint.step_name(self.step):
            with self.timer("checkpoint"):
                last_ckpt = self.save()
        if self.step in cfg.keep_drafter_at:
            with self.timer("checkpoint"):
                last_ckpt = self.keep(last_ckpt)
        losses = [h["train_loss"] for h in history if h["train_loss"] is not None]
        profile = profile_seconds = None
        if self.timer.enabled:
            profile = self.timer.report(len(history), sum(int(h.get("tokens") or 0) for h in history))
            profile_seconds = self.timer.as_dict()
        return TrainResult(self.step, last_ckpt, history, losses[-1] if losses else None, last_eval, profile,
                           profile_seconds)


class _DrafterLoss(torch.nn.Module):
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
        loss, terms = _split(self.drafter.loss(*args))
        if self.every_parameter and loss is not None:
            terms = attrs.evolve(terms, loss_sum=terms.loss_sum + self._zero())
            loss = terms.loss_sum
        return loss, terms

    @staticmethod
    def call(drafter: api.Drafter) -> Callable[..., tuple[torch.Tensor | None, Any]]:
        return lambda *args: _split(drafter.loss(*args))


def _split(terms: Any) -> tuple[torch.Tensor | None, Any]:
    # a broken plugin may return something else: validate.check_loss_terms names it, not an AttributeError here
    return (terms.loss_sum if isinstance(terms, api.LossTerms) else None), terms


class Precision:
    """``--dtype`` of training: autocast to bf16 / fp16 over fp32 master weights (AdamW state stays fp32, and the
    drafters' losses take log-softmax in fp32); fp16 adds torch's gradient scaler. fp32 changes nothing."""

    def __init__(self, name: str, device: torch.device) -> None:
        from specframe.devices import torch_dtype

        self.name = name
        self.device = device
        self.dtype = torch_dtype(name)
        self.scaler = torch.amp.GradScaler(device.type) if name == "fp16" else None

    def autocast(self) -> Any:
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)
            self.scaler.update()


def resolve_steps(cfg: TrainConfig, train_sequences: int) -> int:
    """The run's optimizer steps: ``max_steps``, else ceil(epochs * train sequences / batch size), epochs 1 when
    neither is set (``TrainConfig`` refuses both)."""
    if cfg.max_steps is not None:
        return cfg.max_steps
    epochs = cfg.epochs if cfg.epochs is not None else 1.0
    # the epsilon keeps a float product such as 0.1 * 30 = 3.0000000000000004 from adding a step
    return max(1, math.ceil(epochs * train_sequences / cfg.batch_size - 1e-9))


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class ProgressLines:
    """Plain progress lines (no terminal needed): one every ``every`` steps and at the last step, with the loss,
    the training throughput since the previous line and the time left at the run's average pace so far."""

    def __init__(self, emit: Callable[[str], None] | None, total: int, first_step: int, every: int) -> None:
        self.emit, self.total, self.every = emit, total, every
        self.first_step = first_step
        self.started = self.last_time = time.perf_counter()
        self.tokens = 0

    def start(self, trainer: Trainer) -> None:
        if self.emit is None:
            return
        packed = "packed into" if trainer.cfg.pack else "as"
        resumed = f", resuming at step {self.first_step}" if self.first_step else ""
        self.emit(
            f"training {self.total} steps of {trainer.cfg.batch_size} sequences: {len(trainer.source.conversations)} "
            f"conversations {packed} {len(trainer.train_ids)} training + {len(trainer.val_ids)} validation "
            f"sequences of at most {trainer.cfg.seq_len} tokens{resumed}"
        )
        gate = getattr(trainer.source, "gate", None)
        if gate is not None:  # online features from another engine: the check they passed
            self.emit(f"features from {trainer.source.engine.name}: {gate.summary()}")

    def step(self, entry: dict[str, Any]) -> None:
        if self.emit is None:
            return
        self.tokens += int(entry.get("tokens") or 0)
        step = int(entry["step"])
        if step % self.every and step != self.total:
            return
        now = time.perf_counter()
        rate = self.tokens / max(now - self.last_time, 1e-9)
        done = step - self.first_step
        eta = (now - self.started) / max(done, 1) * (self.total - step)
        loss = entry.get("train_loss")
        self.emit(
            f"step {step}/{self.total}  loss {'n/a' if loss is None else f'{loss:.4f}'}  {rate:,.0f} tokens/s  "
            f"elapsed {_duration(now - self.started)}  ETA {_duration(eta)}"
        )
        self.last_time, self.tokens = now, 0

    def emit_line(self, line: str) -> None:
        if self.emit is not None:
            self.emit(line)

    def evaluation(self, ev: dict[str, Any]) -> None:
        if self.emit is None:
            return
        accs = " ".join(f"{a:.3f}" for a in ev["val_accuracy"])
        self.emit(f"eval step {ev['step']}  val loss {ev['val_loss']:.4f}  top-1 by depth {accs}  "
                  f"expected AL {ev['val_expected_al']:.3f}")


def _progress(enabled: bool) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), disable=not enabled
    )


def train(
    cfg: TrainConfig, *, resume: str | None = None, target: Any = None, progress: bool = True,
    log_lines: Callable[[str], None] | None = None, profile: bool = False, allow_changed: bool = False,
) -> TrainResult:
    """Train (or, with ``resume``, continue) a drafter as ``cfg`` says; returns where the last checkpoint is.
    ``log_lines`` receives a plain progress line every ``cfg.log_every`` steps (see ``Trainer.run``); ``profile``
    times every phase and returns the table in ``TrainResult.profile``; ``allow_changed`` resumes under settings
    other than the run's recorded ones (``run_config.check_resume``), recording that it did."""
    trainer = Trainer(cfg, resume=resume, target=target, profile=profile, allow_changed=allow_changed)
    try:
        return trainer.run(progress=progress, log_lines=log_lines)
    finally:
        trainer.close()
