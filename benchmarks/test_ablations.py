"""Ablations at one small budget (issue 54, item 3): P-EAGLE and EAGLE-3 trained on the same data, seed and tokens,
once at today's defaults (``baseline``) and once per lever (``presets.VARIANTS``), then with every lever that won
together (``winners``). Runs only under an ablation preset (``presets.ABLATIONS``: ``ablations``, ``ablations-ci``)::

    .venv/bin/pytest benchmarks --preset ablations --results-dir benchmarks/results/ablations --benchmark-only \\
        -p no:cacheprovider -q -s

Each (drafter, variant) is one resumable job, ``test_ablation[<drafter>-<variant>]``:

1. training through ``harness.Workspace.trained`` in its own folder under the work folder
   (``<work>/variants/<drafter>-<variant>-<options hash>``): a killed run resumes from its last checkpoint, a finished
   one is reused. The feature cache is the one ``cache_from``'s preset built (``ablations``: cpu-large's, the same
   ``cache_args`` and so the same key: never a second cache; refused while unfinished, never prepared here);
2. the final evaluation's per-sequence chain acceptance (``val_chain_per_sequence`` in the run's metrics.jsonl) gives
   the validation AL with a bootstrap interval over held-out sequences;
3. where the preset asks for it and vLLM is installed, whole-set acceptance in vLLM on ``served_dataset`` at K =
   ``served_k``, on the prompt contexts the per-drafter jobs committed (``contexts_from``);
4. ``<results>/<drafter>/<variant>.json`` (kind ``bench.ablation``), written last: a variant whose file holds its
   job key is skipped by the next run. ``specframe report <results>`` renders the table, with each variant's
   difference against the baseline paired over the same sequences (``specframe.report.ablations``).

``reseeded`` is a control, not a lever: the baseline retrained with another seed. The paired interval holds which
held-out sequences were drawn but not the training's own randomness, which every lever also moves; the control
measures it once. ``winners`` runs once every single lever and the control of that drafter are finished, with the
options of each lever whose validation difference's interval lies above 0 and whose difference exceeds the control's
(options two winners both set go to the larger gain); until then, or when fewer than two levers win, it is skipped
with the reason.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import attrs
import pytest

from harness import ROOT, Workspace, command, default_work, fingerprint, too_few_tokens
from presets import ABLATIONS, FULL_VOCAB, PRESETS, VARIANTS, WINNERS, Preset, Variant, exportable, resolve

#: what a variant measures; part of every key, so a change here reruns every variant
SCHEMA = 1


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        name = metafunc.config.getoption("--preset")
        cases = [(d, v.name) for d, v in cases_of(name)]
        metafunc.parametrize("case", cases, ids=[f"{d}-{v}" for d, v in cases])


def cases_of(preset: str) -> list[tuple[str, Variant]]:
    """Every (drafter, variant) of an ablation preset, in run order (per drafter: baseline, levers, winners)."""
    ablation = ABLATIONS.get(preset)
    if ablation is None:
        return []
    return [(d, v) for d in PRESETS[preset].drafters for v in ablation.variants_for(d)]


@pytest.fixture(scope="module")
def ablation(workspace) -> Workspace:
    """The preset's own workspace: its drafters only (no installed plugin drafter joins an ablation)."""
    return Workspace(PRESETS[workspace.preset.name], workspace.root, workspace.results)


@pytest.fixture(scope="module")
def target(ablation):
    from specframe.targets import load_target

    return load_target(ablation.target())


@attrs.define
class VariantWorkspace(Workspace):
    """A workspace whose training runs one variant: the preset's drafter options and lr already set to the
    variant's, its warmup added, and the feature cache taken from ``base`` (one cache for every variant)."""

    base: Workspace | None = None
    warmup_ratio: float | None = None
    seed: int | None = None

    def target(self) -> str:
        return self.base.target()

    def cache(self) -> Path:
        return self.base.cache()

    def train_args(self, drafter: str, out: Path) -> list[str]:
        args = super().train_args(drafter, out)
        if self.warmup_ratio is not None:  # as a whole number of steps, which every specframe train takes
            args += ["--warmup-steps", str(max(1, round(self.warmup_ratio * self.preset.steps)))]
        if self.seed is not None:  # the control: the harness's seed replaced, everything else as the baseline's
            args[args.index("--seed") + 1] = str(self.seed)
        return args


@attrs.define
class BorrowedCache(Workspace):
    """Another preset's work folder, whose finished feature cache is read and never built here: its own run builds
    it, and two ``specframe prepare`` runs writing one folder at once would interleave their shards."""

    def cache(self) -> Path:
        key = fingerprint(self.cache_args())
        done = self.root / f"cache-{key}.done.json"
        if not done.exists():
            raise RuntimeError(f"the {self.preset.name} feature cache {self.root / f'cache-{key}'} is not finished "
                               f"(no {done.name}): let `make bench PRESET={self.preset.name}` build it first; the "
                               "ablations read it and never build it")
        return super().cache()


def cache_workspace(ablation: Workspace) -> Workspace:
    """Where the cache comes from: ``cache_from``'s work folder and settings (resolved as its own run resolves
    them, installed plugin drafters included, so its cache key is the one that run built), else this preset's."""
    source = ABLATIONS[ablation.preset.name].cache_from
    if source is None:
        return ablation
    return BorrowedCache(resolve(source), default_work(PRESETS[source]), ablation.results)


def resolved_options(options: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    return {k: (vocab_size if v == FULL_VOCAB else v) for k, v in options.items()}


def variant_preset(p: Preset, drafter: str, options: dict[str, Any], schedule: dict[str, Any]) -> Preset:
    pinned = ABLATIONS[p.name].pinned.get(drafter, {})
    return attrs.evolve(p, drafters={drafter: {**pinned, **p.drafters[drafter], **options}},
                        lr=schedule.get("lr", p.lr), memory_budget=schedule.get("memory_budget", p.memory_budget))


def variant_key(p: Preset, drafter: str, schedule: dict[str, Any]) -> str:
    """What decides whether a variant's finished results still stand: the preset (the variant's options and lr
    already in it), the drafter, the schedule, the ablation's revision and ``SCHEMA``."""
    ablation = ABLATIONS[p.name]
    shared = attrs.asdict(p, filter=lambda a, v: a.name not in ("drafters", "plugin_drafters", "job_revisions",
                                                                "reference_verifiers"))
    # a pinned value is the default the suite's finished variants ran at: stating it changes no run
    pinned = ablation.pinned.get(drafter, {})
    options = {k: v for k, v in p.train_options(drafter).items() if k not in pinned or pinned[k] != v}
    return fingerprint([shared, drafter, options, sorted(schedule.items()),
                        attrs.asdict(ablation, filter=lambda a, v: a.name not in ("variants", "pinned")), SCHEMA])


def variant_workspace(ablation: Workspace, drafter: str, name: str, options: dict[str, Any],
                      schedule: dict[str, Any]) -> VariantWorkspace:
    p = variant_preset(ablation.preset, drafter, options, schedule)
    # the options in the folder's name: train --resume continues any checkpoint of the drafter, so a variant whose
    # options changed must not find the old one's run
    folder = ablation.root / "variants" / f"{drafter}-{name}-{fingerprint([options, schedule])[:8]}"
    return VariantWorkspace(p, folder, ablation.results, base=cache_workspace(ablation),
                            warmup_ratio=schedule.get("warmup_ratio"), seed=schedule.get("seed"))


def finished(path: Path, key: str) -> dict[str, Any] | None:
    """The metrics of a variant's results file if it was written for ``key``."""
    if not path.exists():
        return None
    document = json.loads(path.read_text())
    return document["metrics"] if document.get("config", {}).get("key") == key else None


def plan(ablation: Workspace, drafter: str, variant: Variant, vocab_size: int) -> tuple[dict, dict] | str:
    """The variant's (drafter options, schedule), or why it cannot run yet (``winners`` before its levers)."""
    if variant.name != WINNERS:
        return resolved_options(variant.options, vocab_size), dict(variant.schedule)
    return winners(ablation, drafter, vocab_size)


def winners(ablation: Workspace, drafter: str, vocab_size: int) -> tuple[dict, dict] | str:
    """The options of every lever that beat the baseline (``report.ablations.wins``: its validation difference's
    interval above 0 and, where the suite runs the reseeded control, larger than the control's), or why there is no
    such run."""
    from specframe.report.ablations import differences, training_noise, wins

    ran = [v for v in ABLATIONS[ablation.preset.name].variants_for(drafter) if v.name != WINNERS]
    done: dict[str, dict[str, Any]] = {}
    for v in ran:
        options, schedule = resolved_options(v.options, vocab_size), dict(v.schedule)
        key = variant_key(variant_preset(ablation.preset, drafter, options, schedule), drafter, schedule)
        metrics = finished(ablation.results / drafter / f"{v.name}.json", key)
        if metrics is not None:
            done[v.name] = metrics
    waiting = [v.name for v in ran if v.name not in done]
    if waiting:
        return f"winners: waiting for {drafter}'s {', '.join(waiting)} to finish"
    noise = training_noise(done)
    gains = []
    for v in ran:
        if v.name == "baseline" or v.control:
            continue
        diff = differences(done[v.name], done["baseline"])["validation"]
        if wins(diff, noise):
            gains.append((diff["estimate"], v))
    if len(gains) < 2:
        won = ", ".join(v.name for _, v in gains)
        return (f"winners: only {won} beat {drafter}'s baseline, already measured alone" if gains
                else f"winners: no lever's interval beats {drafter}'s baseline")
    options: dict[str, Any] = {}
    schedule: dict[str, Any] = {}
    for _, v in sorted(gains, key=lambda g: -g[0]):  # a setting two winners both change goes to the larger gain
        for k, value in resolved_options(v.options, vocab_size).items():
            options.setdefault(k, value)
        for k, value in v.schedule.items():
            schedule.setdefault(k, value)
    return options, schedule


def final_evaluation(run: Path) -> dict[str, Any]:
    """The run's last evaluation entry (metrics.jsonl; a resumed run's later lines replace earlier ones)."""
    last = None
    for line in (run / "metrics.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if "val_loss" in entry:
            last = entry
    if last is None:
        raise RuntimeError(f"{run}: no evaluation in metrics.jsonl")
    return last


def _served(ablation: Workspace, target, run: str, drafter: str, name: str) -> dict[str, Any]:
    """Whole-set acceptance in vLLM of the trained variant on the committed contexts (test_jobs' helpers)."""
    from test_jobs import _engine_options, _source, _with_k, contexts

    from specframe import bench
    from specframe.vllm.acceptance import measure, summary

    ab, p = ABLATIONS[ablation.preset.name], ablation.preset
    committed = ROOT / "benchmarks" / "results" / ab.contexts_from if ab.contexts_from else ablation.results
    ctx, plain = contexts(Workspace(p, ablation.root, committed), ab.served_dataset)
    label = f"{drafter}/{name}/k{ab.served_k}"
    method = bench.checkpoint_method(run, target.config, k=ab.served_k, label=label)
    with tempfile.TemporaryDirectory(prefix="specframe-ablation-") as tmp:
        jobs = _with_k([method], _source(ablation), tmp)
        measured = measure(_source(ablation), ctx, jobs, max_new_tokens=p.acceptance_max_new_tokens,
                           options=_engine_options(p))
    metrics = summary(measured[label], plain)
    return {"dataset": ab.served_dataset, **bench.json_safe(metrics)}


def test_ablation(benchmark, ablation, target, case):
    from specframe import bench
    from specframe.report.ablations import KIND, interval
    from specframe.results import write_results
    from specframe.vllm import vllm_available

    drafter, name = case
    variant = next(v for v in VARIANTS if v.name == name)
    p, ab = ablation.preset, ABLATIONS[ablation.preset.name]
    planned = plan(ablation, drafter, variant, int(target.config.vocab_size))
    if isinstance(planned, str):
        pytest.skip(planned)
    options, schedule = planned
    ws = variant_workspace(ablation, drafter, name, options, schedule)
    key = variant_key(ws.preset, drafter, schedule)
    out = ablation.results / drafter / f"{name}.json"
    if finished(out, key) is not None:
        benchmark.pedantic(lambda: None, rounds=1, iterations=1)
        print(f"\n{drafter} {name}: complete in {out}, skipped")
        return
    box: dict[str, Any] = {}

    def job():
        record = ws.trained(drafter)
        box["record"] = record
        short = too_few_tokens(p, record)
        if short:
            raise RuntimeError(short)
        if "refused" in record:
            return
        last = final_evaluation(Path(record["run"]))
        per_sequence = last.get("val_chain_per_sequence") or []
        rows = {int(i): (float(acc), float(n)) for i, n, acc in per_sequence}
        band = interval(rows, offset=1.0) if rows else None
        served = None
        if ab.served and p.vllm and exportable(drafter) and vllm_available():
            served = _served(ablation, target, record["run"], drafter, name)
        method = bench.checkpoint_method(record["run"], target.config, label=f"{drafter}/{name}")
        metrics = {
            "drafter": drafter, "variant": name, "why": variant.why, "options_changed": options,
            "schedule": schedule, "val_expected_al": record.get("val_expected_al"),
            "val_expected_al_method": record.get("val_expected_al_method"),
            "val_expected_al_interval": band and {k: band[k] for k in ("low", "high", "level")} | {
                "method": "bootstrap over held-out sequences", "sequences": band["units"]},
            "val_per_sequence": per_sequence, "val_loss": record.get("val_loss"),
            "train_tokens": record.get("train_tokens"), "steps": record.get("steps"),
            "tokens_per_second": record.get("tokens_per_second"), "peak_rss_bytes": record.get("peak_rss_bytes"),
            "beside_cores": record.get("beside_cores"), "variant_learning_curve": record.get("learning_curve"),
            "served": served, "checkpoint_hash": method.checkpoint_hash, "complete": True,
        }
        write_results(out, kind=KIND, metrics=bench.json_safe(metrics), per_prompt=[],
                      provenance=bench.results_provenance(target, [method], command()),
                      config={"preset": p.name, "drafter": drafter, "variant": name, "key": key,
                              "command": record["command"]})
        box["metrics"] = metrics

    benchmark.pedantic(job, rounds=1, iterations=1)
    record = box["record"]
    if "refused" in record:
        pytest.skip(f"{drafter} {name} does not fit {ws.preset.memory_budget}: {record['refused']}")
    assert record["steps"] == p.steps
    served = box["metrics"]["served"]
    if served:
        assert 1.0 <= served["acceptance_length"] <= ab.served_k + 1
