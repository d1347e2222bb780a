"""What the comparison suites share: the work folder of a preset, its target, its one feature cache and the trained
drafters, each built once through the real CLI and reused when a run is resumed.

Everything expensive is kept under the work folder (``default_work``: ``$SPECFRAME_HOME/bench/<preset>``, or
``runs/bench/<preset>`` for the ci presets) and reused: the target (ci:
built; otherwise the cached default), the feature cache (``specframe prepare`` resumes a half-written one), and each
drafter's training run (``specframe train --resume`` continues a killed one from its last checkpoint; a finished one is
recognised by its ``bench-run.json``). A stopped suite run therefore loses at most the part in flight.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs

import claims
from presets import Preset

ROOT = Path(__file__).resolve().parents[1]


def default_work(preset: Preset) -> Path:
    """A preset's work folder: outside the checkout for a preset whose results are committed (a long run must survive
    a fresh checkout of the same machine), ``runs/bench/<name>`` for the ci presets."""
    from specframe.home import specframe_home

    return specframe_home() / "bench" / preset.name if preset.committed else ROOT / "runs" / "bench" / preset.name


def busy_cpu_seconds() -> float | None:
    """CPU-seconds the whole machine has spent busy since boot (Linux ``/proc/stat``), or None where it cannot say."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        # cpu user nice system idle iowait irq softirq steal ...; guest time is already inside user and nice
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def beside_cores(busy_before: float | None, busy_after: float | None, child_cpu: float, seconds: float) -> float | None:
    """How many cores other processes kept busy, on average, while a child ran: the machine's busy CPU time over
    the interval less the child's own, per wall second (None where the machine's CPU time is unknown). A throughput
    measured with this near a whole core shared the machine and is not comparable with a quiet one."""
    if busy_before is None or busy_after is None or seconds <= 0:
        return None
    return max(0.0, (busy_after - busy_before - child_cpu) / seconds)


@attrs.frozen
class ChildRun:
    exit: int
    #: the child's peak RSS in bytes (``os.wait4``)
    peak_rss_bytes: float
    seconds: float
    #: cores other processes kept busy meanwhile (``beside_cores``)
    beside_cores: float | None


def run_cli(args: list[str], *, threads: int, log: Path) -> ChildRun:
    """``specframe ARGS`` in a child process, with its exit code, peak RSS, wall time and the load beside it.
    stdout and stderr go to ``log`` (appended), so a failure can be read after the fact."""
    return run_module("specframe", args, threads=threads, log=log)


def run_module(module: str, args: list[str], *, threads: int, log: Path, env: dict[str, str] | None = None,
               shown: str = "") -> ChildRun:
    """``python -m MODULE ARGS`` in a child process (``run_cli``'s measurement for any module): ``env`` is added to
    this process's environment, ``shown`` is written before the command in the log (e.g. the PYTHONPATH it ran with)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), **(env or {})}
    cmd = [sys.executable, "-m", module, *args]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as out:
        out.write(f"$ {shown}{shlex.join(cmd)}\n")
        out.flush()
        busy = busy_cpu_seconds()
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        beside = beside_cores(busy, busy_cpu_seconds(), usage.ru_utime + usage.ru_stime, seconds)
    return ChildRun(os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024.0, seconds, beside)


def last_error(log: Path) -> str:
    lines = [line for line in log.read_text().splitlines() if line.startswith("error: ")]
    return lines[-1] if lines else log.read_text()[-2000:]


def fingerprint(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


@attrs.define
class Workspace:
    """A preset's work folder: ``target()``, ``cache()`` and ``trained(drafter)`` build what is missing, once."""

    preset: Preset
    root: Path
    results: Path
    _aux_layers: list[int] | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.results.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------------------------------------ target
    def target(self) -> str:
        """The ``--target`` value every command of this preset uses."""
        if self.preset.target != "tiny":
            return self.preset.target
        path = self.root / "tiny-target"
        if not (path / "config.json").exists():
            from specframe.targets import tiny_target

            # head_dim 32: the smallest vLLM's CPU attention kernels take
            tiny_target(path, vocab=320, layers=4, hidden=64, heads=2, kv_heads=1, intermediate=128, seed=0)
        return str(path)

    # ------------------------------------------------------------------------------------------------ cache
    def aux_layers(self) -> list[int]:
        """The union of the aux layers the preset's drafters read (each drafter picks its own out of the one cache:
        EAGLE-3 and P-EAGLE read 3 layers, DFlash one per draft layer, PARD none)."""
        if self._aux_layers is not None:
            return self._aux_layers
        from transformers import AutoConfig

        from specframe import compose
        from specframe.targets import target_source

        config = AutoConfig.from_pretrained(target_source(self.target()))
        layers: set[int] = set()
        for name in self.preset.drafters:
            spec = compose.component("drafter", name, self.preset.train_options(name), config).feature_spec()
            layers.update(getattr(spec, "aux_layers", None) or ())
        self._aux_layers = sorted(layers)
        return self._aux_layers

    def cache_args(self) -> list[str]:
        p = self.preset
        layers = self.aux_layers()
        return ["prepare", "--target", self.target(), "--data", p.data, "--limit", str(p.train_examples + p.val_examples),
                "--aux-layers", ",".join(map(str, layers)) if layers else "none",
                "--draft-vocab", str(p.draft_vocab), "--max-length", str(max(2048, p.seq_len)),
                "--threads", str(p.threads)]

    def cache(self) -> Path:
        """One feature cache for every drafter (``specframe prepare``; resumed if a previous run was stopped)."""
        # one folder per settings: `specframe prepare` rightly refuses to extend a cache made with others
        key = fingerprint(self.cache_args())
        path = self.root / f"cache-{key}"
        done = self.root / f"cache-{key}.done.json"
        args = [*self.cache_args(), "--output", str(path)]
        if done.exists() and json.loads(done.read_text()).get("args") == args:
            return path
        log = self.root / f"cache-{key}.log"
        child = run_cli(args, threads=self.preset.threads, log=log)
        if child.exit != 0:
            raise RuntimeError(f"specframe prepare failed ({child.exit}): {last_error(log)}")
        done.write_text(json.dumps({"args": args, **attrs.asdict(child)}))
        return path

    # ------------------------------------------------------------------------------------------------ training
    def train_args(self, drafter: str, out: Path) -> list[str]:
        p = self.preset
        config = self.root / f"{drafter}.toml"
        config.write_text("[drafter]\n" + "".join(
            f"{key} = {json.dumps(value)}\n" for key, value in sorted(p.train_options(drafter).items())
        ))
        return ["train", "--drafter", drafter, "--target", self.target(), "--cache", str(self.cache()),
                "--seq-len", str(p.seq_len), "--depth", str(p.depth), "--max-steps", str(p.steps),
                "--batch-size", str(p.batch_size), "--lr", str(p.lr),
                "--max-examples", str(p.train_examples + p.val_examples), "--val-examples", str(p.val_examples),
                # cpu: one conversation per sequence, as its committed results were measured; cpu-large: packed
                "--pack" if p.pack else "--no-pack", "--eval-every", str(p.eval_every),
                *(["--mask-builder", p.mask_builder] if p.mask_builder else []),
                "--partitioner", p.partitioner, "--partitions", str(p.partitions),
                "--memory-budget", p.memory_budget, "--save-every", str(p.eval_every or max(1, p.steps // 4)), "--seed", "0",
                *(["--keep-drafter-at", ",".join(map(str, p.keep_drafter_at))] if p.keep_drafter_at else []),
                "--device", p.device, "--config", str(config), "--output", str(out), "--json"]

    def trained(self, drafter: str) -> dict[str, Any]:
        """Train ``drafter`` under the preset (or reuse the finished run) and return its record: the run folder,
        ``refused`` (the engine's message when the budget cannot fit it), peak RSS, throughput and the validation
        figures of the final evaluation."""
        out = self.root / "train" / drafter
        record_path = self.root / "train" / f"{drafter}.bench-run.json"
        args = self.train_args(drafter, out)
        key = fingerprint(args)
        if record_path.exists():
            record = json.loads(record_path.read_text())
            if record.get("key") == key:
                return record
        log = self.root / "train" / f"{drafter}.log"
        attempts = []
        from specframe.engine import checkpoint

        # a run folder is resumed only under the key it was started with: `train --resume` refuses a folder left by
        # other settings (more steps: another learning-rate schedule), which would stop the job, and the key also
        # covers what the refusal lets change (eval / save frequency, kept steps, threads). Such a folder is set
        # aside, not deleted, and the job starts its run afresh.
        stale = claims.claim(out, self.root / "train" / f"{drafter}.bench-key", key, set_aside=True)
        if stale:
            print(f"\n{drafter}: {out} was started under other settings (now key {key}); moved to {stale}")

        while True:
            resume = ["--resume", str(out)] if checkpoint.has_checkpoint(out) else []
            child = run_cli([*args, *resume], threads=self.preset.threads, log=log)
            code = child.exit
            attempts.append({**attrs.asdict(child), "resumed": bool(resume)})
            if code == 0 or len(attempts) >= 2 or not checkpoint.has_checkpoint(out):
                break
        record: dict[str, Any] = {"drafter": drafter, "key": key, "run": str(out), "command": shlex.join(
            ["specframe", *args]), "attempts": attempts, "options": self.preset.train_options(drafter)}
        if code != 0:
            message = last_error(log)
            if "memory budget" not in message:
                raise RuntimeError(f"training {drafter} failed ({code}): {message}")
            record["refused"] = message
        else:
            record.update(training_metrics(out))
            record["peak_rss_bytes"] = max(a["peak_rss_bytes"] for a in attempts)
            # the throughput above is only as quiet as the machine was: the most load any attempt had beside it
            loads = [a["beside_cores"] for a in attempts]
            record["beside_cores"] = None if None in loads else max(loads)
        record_path.write_text(json.dumps(record, indent=1))
        return record


def too_few_tokens(preset: Preset, record: dict[str, Any]) -> str | None:
    """Why a finished training run falls short of the preset's ``min_train_tokens`` (None: it does not, or was
    refused by the budget and trained nothing)."""
    if not preset.min_train_tokens or "refused" in record:
        return None
    seen = int(record.get("train_tokens") or 0)
    if seen >= preset.min_train_tokens:
        return None
    return (f"{record.get('drafter')} trained on {seen:,} tokens, fewer than the {preset.name} preset's "
            f"{preset.min_train_tokens:,}: its {preset.steps} steps x {preset.batch_size} x {preset.seq_len} slots are "
            "only partly filled by packing; raise the preset's steps")


def training_metrics(out: Path) -> dict[str, Any]:
    """Throughput from the per-step log (eval and checkpoint time excluded), the final evaluation, and the learning
    curve: validation AL at every evaluation against the training tokens seen by then."""
    steps: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    final_eval = None
    for line in (out / "metrics.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if "val_loss" in entry:
            final_eval = entry
            evals[int(entry["step"])] = entry
        elif "train_loss" in entry:
            steps[int(entry["step"])] = entry  # a resumed run rewrites the steps after its checkpoint
    entries = [steps[k] for k in sorted(steps)]
    tokens = sum(int(e.get("tokens", 0)) for e in entries)
    seen, curve = 0, []
    by_step = {k: int(steps[k].get("tokens", 0)) for k in steps}
    for step in sorted(evals):
        seen = sum(t for k, t in by_step.items() if k <= step)
        curve.append({"step": step, "train_tokens": seen, "val_expected_al": evals[step].get("val_expected_al"),
                      "val_loss": evals[step].get("val_loss")})
    seconds = sum(float(e.get("step_seconds", 0.0)) for e in entries)
    return {
        "steps": len(entries),
        "train_tokens": tokens,
        "train_seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds else None,
        "supervised_elements": sum(int(e.get("elements", 0)) for e in entries),
        "first_train_loss": entries[0]["train_loss"] if entries else None,
        "last_train_loss": entries[-1]["train_loss"] if entries else None,
        "val_loss": final_eval and final_eval["val_loss"],
        "val_accuracy": final_eval and final_eval["val_accuracy"],
        "val_expected_al": final_eval and final_eval["val_expected_al"],
        # how val_expected_al was measured: "chain" (mean accepted chain) or "per-depth product" (older estimate)
        "val_expected_al_method": (final_eval or {}).get("val_expected_al_method", "per-depth product"),
        "val_product_al": (final_eval or {}).get("val_product_al"),
        # share of validation elements left out of the loss: target top-1 outside the draft vocabulary
        "val_vocab_masked": (final_eval or {}).get("val_vocab_masked"),
        "learning_curve": curve,
    }


def kept_document(path: Path, kept: Path, compute: Any) -> dict[str, Any]:
    """A deterministic document kept twice: ``path`` in the work folder, and a gzip copy ``kept`` beside the
    committed results (small enough to commit), so a run on a fresh machine, whose work folder is gone, reads the
    committed copy instead of recomputing it. Read from whichever exists (the work folder first), else ``compute()``;
    each missing copy is then written atomically (the gzip copy byte-for-byte reproducible: no name, no time)."""
    import gzip

    document = None
    if path.exists():
        document = json.loads(path.read_text())
    elif kept.exists():
        document = json.loads(gzip.decompress(kept.read_bytes()))
    else:
        document = compute()
    text = json.dumps(document)
    if not path.exists():
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    if not kept.exists():
        kept.parent.mkdir(parents=True, exist_ok=True)
        tmp = kept.with_name(kept.name + ".tmp")
        tmp.write_bytes(gzip.compress(text.encode(), compresslevel=9, mtime=0))
        os.replace(tmp, kept)
    return document


def saved_metrics(path: Path, key: str) -> dict[str, Any] | None:
    """The metrics of the results file at ``path`` if it was written for exactly ``key`` (its ``config.key``): a
    restarted suite reuses a finished measurement instead of repeating it."""
    if not path.exists():
        return None
    saved = json.loads(path.read_text())
    return saved["metrics"] if saved.get("config", {}).get("key") == key else None


def target_provenance(target: str) -> dict[str, Any]:
    from specframe.targets import load_target

    loaded = load_target(target)
    return {"id": loaded.id, "weights_hash": loaded.weights_hash}


def command() -> list[str]:
    """How this suite run was started (pytest's own argv)."""
    return ["pytest", *sys.argv[1:]]
