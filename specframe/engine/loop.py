"""The training loop shared by every drafter.

Loss normalisation (docs/design.md section 8): the loss of an optimizer step is the sum over every supervised element of
the global batch (all sequences, segments and ranks) divided by that global count, or, for a drafter that weighs its
elements (``Drafter.element_weights``, API 14), the weighted sum divided by the global sum of the weights. Either
is known before any forward (each element is charged in exactly one segment, and it is supervised iff the drafter's
supervision is set at its reference position), so it is all-reduced first and every segment back-propagates
``loss_sum / normaliser`` at once; gradients are then summed across ranks. One rank and two, S = 1 and S = 4
therefore give the same gradient.

Data order is a seeded permutation per epoch and COD draws from a generator seeded by (seed, step, slot), so a resumed
run sees exactly the sequences and elements the uninterrupted run would have.

The loop's parts live beside it: the run is assembled from its plan in ``engine.assembly``, a sequence's elements,
segments and segment loss in ``engine.segments``, validation and calibration in ``engine.evaluation``, the progress
lines in ``engine.progress``, ``--dtype`` in ``engine.precision``, the run length and learning-rate schedule in
``engine.schedule`` and the process group with the loss module DDP / FSDP wrap in ``engine.sharding``.

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
from specframe.engine import assembly, checkpoint, evaluation, segments, sharding, tracking, validate
from specframe.engine.config import TrainConfig, to_dict
from specframe.engine.precision import Precision
from specframe.engine.progress import ProgressLines, RunSummary, progress_bar
from specframe.engine.schedule import resolve_steps
from specframe.errors import SpecframeError, UsageError
from specframe.interfaces.drafter import charged_weight


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


class Trainer:
    """One training run: set up from its config (``engine.assembly``), then ``run`` to the end.

    ``cfg``: a ``TrainConfig``, resolved here, or a ``compose.ResolvedRun`` (the config with its names already
    resolved beside their plan, as the CLI hands it once for the whole ``train``)."""

    def __init__(self, cfg: TrainConfig | compose.ResolvedRun, *, resume: str | None = None,
                 target: Any = None, log: Callable = print, profile: bool = False, allow_changed: bool = False):
        #: the run as it was handed over resolved (the CLI's), None for a config resolved here
        self.handed = cfg if isinstance(cfg, compose.ResolvedRun) else None
        cfg = cfg.config if isinstance(cfg, compose.ResolvedRun) else cfg
        self.cfg = cfg
        self.allow_changed = allow_changed
        self.log = log
        self.profile_requested = profile
        # until the first optimizer step every plugin's output is checked (engine.validate); set once it has stepped
        self.plugins_checked = False
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
        self.dist = sharding.Dist(self.device)
        if cfg.fsdp and cfg.dtype == "fp16":
            raise UsageError("--fsdp trains in fp32 or bf16 (fp16's gradient scaler does not handle sharded "
                             "gradients): use --dtype bf16")
        if cfg.fsdp and self.dist.world < 2:
            raise UsageError("--fsdp shards the drafter across processes: launch with torchrun --nproc-per-node N "
                             "(N >= 2), or train without --fsdp")
        if cfg.data is not None:  # a --data that names nothing is refused before the target is loaded
            from specframe.data.specs import check_spec

            check_spec(cfg.data)
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
        from specframe.engine import run_config

        directory, saved, changes = run_config.check_resume(resume, self.handed or self.cfg, self.allow_changed)
        # every resume that changed settings stays in the run's record (allow_changed), so a reader of config.json
        # sees the run was not one schedule from start to end
        self.changed_on_resume = list(saved.get(run_config.CHANGED_RECORD) or [])
        self.resume_changes = {name: {"recorded": old, "now": new} for name, old, new in changes}
        return directory

    def _setup(self, target: Any) -> None:
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        loaded = target is None  # a target handed in is the caller's: never changed here
        if loaded:
            target = assembly.load_run_target(cfg)
        # the names in the config become the run's parts once (specframe.compose.plan: the same classes, defaults and
        # errors as --print-config); the parts are built from that plan, which the memory estimate reuses
        run = self.handed if self.handed is not None else compose.ResolvedRun.of(cfg, self.device)
        # small attention calls go to the small-call builder as the run's plan says (sized_attention: a run that
        # named no builder, the CLI's as a Python caller's)
        parts = assembly.build(run, target.config, self.device)
        #: the run as built (its mask builder decided for the device): the resolved config and its plan
        self.resolved_run = parts.run
        self.drafter: api.Drafter = parts.drafter
        self.training = parts.training  # what the drafter declares (API 6), whatever its options call it
        self.depth = parts.depth
        self.builder = parts.builder
        self.attention_builder: Any = parts.attention_builder
        self.partitioner = parts.partitioner
        self.resolved = parts.run.config
        declared = validate.check_target_layers(self.drafter.target_layers(target.num_layers), cfg.drafter,
                                                target.num_layers)
        if loaded and cfg.cache is not None and declared is not None:
            # from a cache the run reads only the target's embedding, head, final norm and the layers the drafter
            # names (Drafter.target_layers, API 15; None: all): the others go before anything moves to the device.
            # Their weights are memory-mapped and were never read (unless a dtype conversion copied them in loading)
            from specframe.targets import keep_layers

            keep_layers(target.model, declared, cfg.target)
        self.target = target
        if getattr(target.model, "hf_device_map", None) is None:  # a device_map placed it already
            target.model.to(self.device)
        self.source: Any = assembly.feature_source(cfg, target, self.drafter.feature_spec())
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
        # refuse a configuration that cannot fit --memory-budget before any feature is computed or file written
        self.memory_guard = assembly.memory_guard(self.resolved_run.on(self.device), target.config, sequences=kept)
        self.drafter.prepare(target, [self.source.tokens(i) for i in self.train_ids])
        if cfg.init_from is not None and self.resume_from is None:
            from specframe.layouts import imports

            imports.warm_start(self.drafter, cfg.init_from, target.config, getattr(target, "tokenizer", None))
        module = self.drafter.module().to(self.device)
        if self.resume_from is not None:
            # the weights before any wrapper: a sharded (--fsdp) module takes them only whole, before it is sharded
            self.drafter.load(self.resume_from)
        self.precision = Precision(cfg.dtype, self.device)
        self.fsdp, self.ddp = assembly.wrap(self.drafter, cfg.fsdp, self.dist.world, self.device)
        self.wrapped = self.fsdp if self.fsdp is not None else self.ddp
        self.params = [p for p in module.parameters() if p.requires_grad]
        if not self.params:
            raise UsageError(f"drafter '{cfg.drafter}' has no trainable parameters: there is nothing to train")
        self.optimizer, self.scheduler = assembly.optimizer(self.params, cfg, self.total_steps)
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
        return segments.elements(self.drafter, self.depth, self.training, example, generator)

    def segments(self, elems: Any) -> list[api.Segment]:
        return segments.segments(self.partitioner, self.cfg.partitions, elems)

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
        local_weight = 0.0  # the normaliser: the charged elements' summed weights (their count without weights)
        local_tokens = 0
        for slot, idx in self.local_slots(step):
            gen = torch.Generator().manual_seed((cfg.seed * 1_000_003 + step) * 4096 + slot)
            with self.timer("data"):
                example = self.source.example(idx)
                elems, sup = self.elements(example, gen)
                # a drafter that caps the anchors a step charges (Training.max_anchors) trains a sample of them
                kept = segments.anchor_sample(elems, sup, self.training.max_anchors, gen)
                if kept is not None:
                    elems = segments.sampled_elements(elems, kept)
                segs = self.segments(elems)
                if kept is not None:
                    segs = segments.uncharge(segs, elems, kept)
            charged = segments.charged(elems, segs, sup)
            local_count += int(charged.sum())
            local_weight += charged_weight(self.drafter, example, elems, sup, charged)
            local_tokens += int(example.input_ids.numel())
            work.append((example, elems, segs, sup))
        if self.prefetch and step + 1 < self.total_steps:
            # the target works on the next step's sequences while the drafter trains on these
            self.source.prefetch([idx for _, idx in self.local_slots(step + 1)])
        count = self.dist.sum_(torch.tensor([float(local_count), float(local_tokens), local_weight],
                                            dtype=torch.float64))
        global_count, global_tokens = float(count[0].item()), int(count[1].item())
        global_weight = float(count[2].item())
        # one all-reduce for the loss and the per-depth top-1 hits / counts: [loss, correct x K, total x K]
        stats = torch.zeros(1 + 2 * self.depth)
        self.optimizer.zero_grad(set_to_none=True)
        jobs = [(example, elems, seg, sup) for example, elems, segs, sup in work for seg in segs]
        # DDP averages the ranks' gradients; scaling by the world size makes that the global sum / global weight
        # (nothing with a weight: nothing trains, as a step with nothing supervised)
        scale = self.dist.world / global_weight if global_weight > 0 else 0.0
        # zero-loss forward / backward passes that keep this rank in the ranks' collectives: under FSDP every forward
        # all-gathers and every backward reduce-scatters, so each rank runs as many as the busiest one; under DDP a
        # rank with no sequence this step still takes part in the one reduction, also when nothing is supervised
        # (global weight 0): a rank with sequences then still runs its synchronising backward
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
            if global_weight > 0:
                # only a step that steps unscales: fp16's GradScaler forgets an unscale_ only in update(), which
                # step() calls, so an unscale_ on a skipped step made the next one raise (the gradients are zero
                # here anyway: the losses were scaled by 0)
                self.precision.unscale(self.optimizer)
            grad_norm = sharding.full(torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip))
            lr = self.scheduler.get_last_lr()[0]
            if global_weight > 0:
                # fp16's scaler skips a step with overflowed gradients by itself (and lowers its scale); a
                # non-finite loss is an error in every precision
                validate.check_finite(step + 1, float(loss_sum.item()),
                                      0.0 if self.precision.scaler is not None else float(grad_norm))
                self.precision.step(self.optimizer)
            self.plugins_checked = True
            self.scheduler.step()
        self.step += 1
        self.tokens_seen += global_tokens
        loss = float(loss_sum.item() / global_weight) if global_weight > 0 else None
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
        check = None if self.plugins_checked else (self.resolved.mask_builder, self.cfg.drafter)
        return segments.segment_loss(self.drafter, self.attention_builder, self.wrapped, example, elems, seg, sup,
                                     training=training, check=check)

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any] | None:
        if not self.val_ids:
            return None
        # under FSDP on whole parameters: a rank's validation forwards then need no collective each
        with self._whole():
            out, self.held_out_confidence = evaluation.evaluate(
                step=self.step, drafter=self.drafter, depth=self.depth, val_ids=self.val_ids, source=self.source,
                dist=self.dist, autocast=self.precision.autocast, elements=self.elements, segments=self.segments,
                loss=lambda example, elems, seg, sup: self._segment_loss(example, elems, seg, sup, training=False))
            return out

    def calibrate(self) -> dict[str, Any] | None:
        """API 8: the drafter's calibration fitted on the last validation's held-out chains
        (``engine.evaluation.calibrate``)."""
        return evaluation.calibrate(self.drafter, self.held_out_confidence, self.step)

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
        from specframe.drafting import modeling

        # the loss kernels report to the run's timer (the "loss" phase, subtracted from the drafter's forward)
        try:
            with modeling.timing(self.timer if self.timer.enabled else None):
                return self._run(progress, log_lines)
        finally:
            self.source.close()

    def summary(self) -> RunSummary:
        """What the first progress line says about the run."""
        gate = getattr(self.source, "gate", None)  # online features from another engine: the check they passed
        return RunSummary(self.cfg.batch_size, self.cfg.seq_len, self.cfg.pack, len(self.source.conversations),
                          len(self.train_ids), len(self.val_ids),
                          None if gate is None else f"features from {self.source.engine.name}: {gate.summary()}")

    def _run(self, progress: bool, log_lines: Callable[[str], None] | None) -> TrainResult:
        cfg, total = self.cfg, self.total_steps
        history: list[dict[str, Any]] = []
        last_eval = None
        last_ckpt = checkpoint.resolve(self.out) if checkpoint.has_checkpoint(self.out) else None
        if self.step in cfg.keep_drafter_at and self.step < total and checkpoint.step_name(self.step) not in {
                p.name for p in checkpoint.kept(self.out)}:
            # a run stopped between this step's checkpoint and its kept copy resumes here: keep it now, or the step's
            # drafter is lost to the next rolling checkpoint (no step of this run comes back to it)
            last_ckpt = self.keep(last_ckpt)
        bar = progress_bar(progress and self.dist.rank == 0)
        lines = ProgressLines(log_lines if self.dist.rank == 0 else None, total, self.step,
                              cfg.log_every or max(1, math.ceil(total / 20)))
        lines.start(self.summary())
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
            lines.calibration(calibration)
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


def train(
    cfg: TrainConfig | compose.ResolvedRun, *, resume: str | None = None, target: Any = None, progress: bool = True,
    log_lines: Callable[[str], None] | None = None, profile: bool = False, allow_changed: bool = False,
) -> TrainResult:
    """Train (or, with ``resume``, continue) a drafter as ``cfg`` says; returns where the last checkpoint is.
    ``log_lines`` receives a plain progress line every ``cfg.log_every`` steps (see ``Trainer.run``); ``profile``
    times every phase and returns the table in ``TrainResult.profile``; ``allow_changed`` resumes under settings
    other than the run's recorded ones (``engine.run_config.check_resume``), recording that it did. ``cfg`` may come
    resolved already (``run_config.resolve_run``: the CLI resolves its names once per ``train``)."""
    trainer = Trainer(cfg, resume=resume, target=target, profile=profile, allow_changed=allow_changed)
    try:
        return trainer.run(progress=progress, log_lines=log_lines)
    finally:
        trainer.close()
