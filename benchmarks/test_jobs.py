"""Per-drafter jobs (presets with ``per_drafter_jobs``, e.g. ``cpu-large``): each drafter trained, then measured,
then its results written, one drafter after the other, so a run stopped after any drafter has kept that drafter's
whole answer and its checkpoint need not outlive the job.

    make bench PRESET=cpu-large       # continues where it stopped; skips drafters whose results are complete

- ``test_baselines``: plain vLLM's answers to every prompt turn of each set (later turns follow plain's own
  answers; kept in the work folder, the prompts every drafter is asked) and n-gram at each K, whole sets, many
  requests in flight (``specframe.vllm.acceptance``): ``<results>/baselines/acceptance-<set>.json``.
- ``test_drafter_job[drafter]``: in this order, each part reused when its results file has the same key:
  1. training (``harness.Workspace.trained``: resumes from the last checkpoint in the work folder)
     -> ``<results>/<drafter>/training.json`` (learning curve on the shared token axis, throughput, load beside);
  2. whole-set acceptance in vLLM at each K of ``vllm_ks`` that vLLM serves the drafter at -> ``acceptance-<set>.json``
     (DFlash only at block_size - 1: vLLM's proposer runs a block of K + 1 slots; each K refused is skipped, its
     reason in ``job.json``'s ``vllm_refused``, and speed in vLLM at those K too; such a drafter is measured at its
     own K instead, so every drafter has vLLM figures);
     Then the served learning curve: whole-set acceptance at one K of each drafter the run kept before its last
     step (``keep_drafter_at``), on ``curve_datasets`` -> ``curve-<set>.json`` (each point's step, training tokens
     and checkpoint hash in its config; the final point is ``acceptance-<set>.json`` at the same K);
  3. for a drafter that builds trees, the EAGLE-2 tree on the reference engine, on a subset -> ``tree-reference.json``;
  4. speed in vLLM at batch 1 and at each further ``speed_concurrency`` (requests at once): plain, n-gram and the
     drafter at each K, interleaved repeats, MT-Bench turns (``bench.compare_vllm``) -> ``speed-batch1.json``,
     ``speed-concurrent4.json``. A measurement that shared the machine (other processes kept
     more than ``QUIET_CORES`` busy) is written with its load and measured again by the next run, never reported;
  5. ``job.json``: the checkpoint's hash (every file of the drafter carries the same), the commit, and whether the
     job is complete.
  A drafter whose ``job.json`` is complete under the same job key (preset, drafter options, ``job_revisions``) is
  skipped without retraining: bump its revision in the preset when a change alters its training or decoding.
"""

from __future__ import annotations

import json
import resource
import shlex
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import pytest

from harness import (beside_cores, busy_cpu_seconds, command, fingerprint, kept_document, saved_metrics,
                     too_few_tokens)
from presets import exportable, resolve
from specframe import bench

#: a speed measurement with more than this many cores kept busy by other processes is redone, not reported
QUIET_CORES = 0.25
#: what a job measures; part of every job key, so a change here reruns every drafter's job
JOB_SCHEMA = 1


def pytest_generate_tests(metafunc):
    if "drafter" in metafunc.fixturenames:
        metafunc.parametrize("drafter", list(resolve(metafunc.config.getoption("--preset")).drafters))


@pytest.fixture(scope="module")
def target(workspace):
    from specframe.targets import load_target

    return load_target(workspace.target())


def _engine_options(p):
    from specframe.vllm.engine import EngineOptions, cpu_binding

    return EngineOptions(threads_bind=cpu_binding(p.threads), max_num_seqs=p.acceptance_batch,
                         kv_cache_gib=p.acceptance_kv_gib)


def _source(workspace) -> str:
    from specframe.targets import target_source

    return target_source(workspace.target())


def contexts(workspace, dataset: str) -> tuple[dict[str, list[int]], dict[str, Any]]:
    """Every prompt turn's ids for ``dataset`` (later turns after plain vLLM's answers) and plain's generations,
    computed once per preset and set (deterministic: recomputed the same if lost), kept in the work folder and, as
    gzip (about 70 KB a set), beside the baselines' results, so a fresh machine's run reads the committed copy
    instead of answering every set in vLLM again (about 20 minutes on 2 cores)."""
    from specframe.vllm.acceptance import prompt_contexts
    from specframe.vllm.counters import VllmGeneration
    from specframe.vllm.interleaved import Conversation

    p = workspace.preset
    prompts = bench.load_prompts(dataset, p.acceptance_prompts)
    key = fingerprint([dataset, [q.id for q in prompts], p.acceptance_max_new_tokens, p.target, JOB_SCHEMA])
    name = f"contexts-{dataset}-{key}.json"

    def compute() -> dict[str, Any]:
        ctx, plain = prompt_contexts(_source(workspace), [Conversation(q.id, tuple(q.turns)) for q in prompts],
                                     max_new_tokens=p.acceptance_max_new_tokens, options=_engine_options(p))
        return {"contexts": ctx, "plain": {k: g.as_dict() for k, g in plain.items()}}

    saved = kept_document(workspace.root / name, workspace.results / "baselines" / f"{name}.gz", compute)
    return saved["contexts"], {k: VllmGeneration.from_dict(g) for k, g in saved["plain"].items()}


def _acceptance(workspace, target, dataset: str, jobs: dict, path: Path, config: dict, provenance: dict) -> dict:
    """Whole-set acceptance of ``jobs`` (label -> (vLLM job, K)) on ``dataset``, or the saved figures."""
    from specframe.metrics import bootstrap_al
    from specframe.results import write_results
    from specframe.vllm.acceptance import measure, summary

    p = workspace.preset
    ctx, plain = contexts(workspace, dataset)
    key = fingerprint([{k: v for k, v in config.items() if k != "drafters"}, sorted(ctx), JOB_SCHEMA])
    saved = saved_metrics(path, key)
    if saved is not None:
        return saved
    measured = measure(_source(workspace), ctx, jobs, max_new_tokens=p.acceptance_max_new_tokens,
                       options=_engine_options(p))
    methods = {label: summary(result, plain) for label, result in measured.items()}
    base = [g.prompt_metrics() for g in plain.values()]
    lo, hi = bootstrap_al(base)
    methods["plain"] = {"k": 0, "prompt_turns": len(base), "acceptance_length": 1.0,
                        "acceptance_length_interval": {"low": lo, "high": hi, "level": 0.95}}
    rows = [{"method": label, "id": key_.split("#")[0], "turn": int(key_.split("#")[1]) + 1, **turn_metrics}
            for label, m in methods.items() for key_, turn_metrics in m.pop("per_prompt", {}).items()]
    metrics = {"methods": methods, "dataset": dataset, "engine": "vllm", "batched": p.acceptance_batch,
               "max_new_tokens": p.acceptance_max_new_tokens}
    write_results(path, kind="bench.acceptance.whole-set", metrics=bench.json_safe(metrics), per_prompt=rows,
                  provenance=provenance, config={**config, "key": key})
    return metrics


def _with_k(methods: list, source: str, workdir: str, refused: dict[str, str] | None = None,
            manifests: dict[str, Any] | None = None) -> dict:
    """``bench.vllm_jobs`` with each method's K beside its job (label -> (job, K)), as ``acceptance.measure`` takes
    them; a trained checkpoint is exported once into ``workdir``. Given ``refused``, a method vLLM cannot serve (a
    DFlash drafter below its block) is left out with its reason there; given ``manifests``, each checkpoint's export
    manifest (its ``min_speculative_tokens``: the fewest draft tokens vLLM serves it at, DFlash's block_size - 1)."""
    jobs = bench.vllm_jobs(methods, source, Path(workdir), refused, manifests)
    return {m.label: (jobs[m.label], m.k) for m in methods if m.label in jobs}


def _served_curve(workspace, target, record: dict, drafter: str, k: int, workdir: str, out: Path, provenance: dict,
                  final_hash: str) -> dict[str, dict]:
    """Whole-set acceptance in vLLM of the drafters the run kept before its last step (``Preset.keep_drafter_at``),
    at one K, on each of ``Preset.curve_datasets``: the served learning curve's earlier points (the final point is the
    job's own acceptance file at the same K). Each point names its step, training tokens and checkpoint hash."""
    from specframe.engine import checkpoint

    p = workspace.preset
    methods, points = [], []
    for folder in checkpoint.kept(record["run"]):
        state = json.loads((folder / "state.json").read_text())
        if state["step"] >= p.steps:
            continue
        label = f"{drafter}/step{state['step']}/k{k}"
        method = bench.checkpoint_method(folder, target.config, k=k, label=label)
        methods.append(method)
        points.append({"label": label, "step": state["step"], "train_tokens": state.get("tokens_seen"),
                       "checkpoint_hash": method.checkpoint_hash})
    if not methods:
        return {}
    jobs = _with_k(methods, _source(workspace), workdir)
    return {dataset: _acceptance(workspace, target, dataset, jobs, out / f"curve-{dataset}.json",
                                 {"preset": p.name, "drafter": drafter, "dataset": dataset, "k": k, "points": points,
                                  "final_checkpoint_hash": final_hash}, provenance)
            for dataset in p.curve_datasets}


def test_baselines(benchmark, workspace, target):
    from specframe.vllm import vllm_available

    p = workspace.preset
    if not p.vllm or not vllm_available():
        pytest.skip("vLLM is not installed (make setup VLLM=cpu)" if p.vllm else f"preset {p.name} runs no vLLM")
    out = workspace.results / "baselines"
    prov = bench.results_provenance(target, [], command())
    box: dict[str, Any] = {}

    def run():
        ngram = [bench.plugin_method("ngram", target.config, k=k, label=f"ngram/k{k}") for k in p.vllm_ks]
        with tempfile.TemporaryDirectory(prefix="specframe-job-") as tmp:
            jobs = _with_k(ngram, _source(workspace), tmp)
        for dataset in p.datasets:
            # the drafters the run expects: the report names those not yet done
            config = {"preset": p.name, "dataset": dataset, "methods": "plain+ngram", "ks": list(p.vllm_ks),
                      "drafters": list(p.drafters)}
            box[dataset] = _acceptance(workspace, target, dataset, jobs, out / f"acceptance-{dataset}.json", config,
                                       prov)

    benchmark.pedantic(run, rounds=1, iterations=1)
    for dataset, metrics in box.items():
        for label, m in metrics["methods"].items():
            assert 1.0 <= m["acceptance_length"] <= m["k"] + 1, (dataset, label)
    print("\n" + "; ".join(f"{d}: " + ", ".join(f"{k} AL {v['acceptance_length']:.2f}" for k, v in m["methods"].items())
                           for d, m in box.items()))


def job_key(p, drafter: str) -> str:
    """What decides whether a drafter's finished job still stands: the preset, the drafter's options and its
    revision (``Preset.job_revisions``), and what a job measures (``JOB_SCHEMA``)."""
    # the other drafters' entries stay out: adding a drafter, or rerunning another, leaves this one's job standing
    # keep_drafter_at joined the preset later: a preset without kept steps keeps the key it had
    # reference_verifiers: only the drafter's own entry, and only where it has one (the others' keys stay as they were)
    shared = attrs.asdict(p, filter=lambda a, v: a.name not in ("drafters", "plugin_drafters", "job_revisions",
                                                                "reference_verifiers")
                          and not (a.name == "keep_drafter_at" and not v))
    verifiers = list(p.reference_verifiers.get(drafter, ()))
    return fingerprint([shared, drafter, p.train_options(drafter), p.job_revisions.get(drafter, 0), JOB_SCHEMA,
                        *([verifiers] if verifiers else [])])


def finished_job(results: Path, key: str) -> dict | None:
    path = results / "job.json"
    if not path.exists():
        return None
    document = json.loads(path.read_text())
    metrics = document.get("metrics", {})
    return metrics if document.get("config", {}).get("key") == key and metrics.get("complete") else None


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def speed_file(concurrency: int) -> str:
    return "speed-batch1.json" if concurrency == 1 else f"speed-concurrent{concurrency}.json"


def _speed(workspace, target, record: dict, drafter: str, path: Path, provenance: dict, concurrency: int,
           ks: list[int]) -> dict:
    """Speed in vLLM at ``concurrency`` requests at once, interleaved (``bench.compare_vllm``), the drafter at each K
    of ``ks`` (those vLLM serves it at), with the load beside it; saved figures are reused only if they were measured
    quietly."""
    from specframe.results import write_results

    p = workspace.preset
    # MT-Bench's questions come in blocks of ten per category: the first ten would time "writing" alone
    prompts = bench.spread_over_categories(bench.load_prompts("mt-bench"), p.speed_prompts)
    # n-gram at every K the drafter is timed at (and the reference engine's), so each K has its baseline
    ngram_ks = sorted({*ks, p.speed_k})
    methods = [bench.plugin_method("ngram", target.config, k=k, label=f"ngram/k{k}") for k in ngram_ks]
    methods += [bench.checkpoint_method(record["run"], target.config, k=k, label=f"{drafter}/k{k}") for k in ks]
    config = {"preset": p.name, "drafter": drafter, "dataset": "mt-bench", "prompts": [q.id for q in prompts],
              "ks": list(ks), "ngram_ks": ngram_ks, "repeats": p.vllm_repeats, "max_new_tokens": p.speed_max_new_tokens,
              "concurrency": concurrency, "verifier": "greedy"}
    key = fingerprint([config, methods[-1].checkpoint_hash, JOB_SCHEMA])
    saved = saved_metrics(path, key)
    if saved is not None and saved.get("quiet"):
        return saved
    busy, cpu, started = busy_cpu_seconds(), _cpu_seconds(), time.perf_counter()
    served = bench.compare_vllm(workspace.target(), prompts, methods, repeats=p.vllm_repeats,
                                max_new_tokens=p.speed_max_new_tokens, threads=p.threads, concurrency=concurrency)
    seconds = time.perf_counter() - started
    load = beside_cores(busy, busy_cpu_seconds(), _cpu_seconds() - cpu, seconds)
    metrics = {**bench.json_safe(served.summary()), "beside_cores": load, "quiet": load is not None and load <= QUIET_CORES,
               "concurrency": concurrency, "engine": "vllm"}
    write_results(path, kind="bench.speed", metrics=metrics, per_prompt=bench.json_safe(served.per_prompt()),
                  provenance=provenance, config={**config, "key": key})
    return metrics


def _reference_methods(record: dict, target, drafter: str, verifiers: tuple[str, ...]) -> list:
    """The trained drafter at its own K (the block it was trained with), verified greedily, then once more through
    each of ``verifiers`` (``--also-verifier`` names, options inline), side by side in one comparison."""
    drafted = bench.checkpoint_method(record["run"], target.config, label=drafter).drafter
    # its training depth (``Drafter.training``): DSpark's and DFlash's block less the anchor, what a schedule cuts
    block = type(drafted).training(drafted.options).depth
    whole = bench.checkpoint_method(record["run"], target.config, k=block, label=f"{drafter}/k{block}")
    others = dict(bench.verifier_spec(text) for text in dict.fromkeys(verifiers))
    return [whole, *(attrs.evolve(whole, label=f"{whole.label}+{name}", verifier=v) for name, v in others.items())]


def _reference_config(workspace, drafter: str, methods: list, dataset: str, prompts: list) -> dict:
    p = workspace.preset
    return {"preset": p.name, "drafter": drafter, "dataset": dataset, "prompts": [q.id for q in prompts],
            "k": methods[0].k, "verifier": "greedy", "also_verifiers": [m.label for m in methods[1:]],
            "max_new_tokens": p.speed_max_new_tokens, "engine": "reference", "threads": p.threads}


def _reference_acceptance(workspace, target, drafter: str, dataset: str, methods: list, path: Path,
                          provenance: dict) -> dict:
    """Acceptance on the reference engine on ``Preset.speed_prompts`` prompts of ``dataset`` (spread over its
    categories), once: greedy decoding is deterministic, so one pass gives the AL; the interval is a bootstrap over
    prompt turns. Kind ``bench.acceptance.subset``: the report ranks it beside the whole sets served in vLLM, saying
    the engine and the number of prompt turns of each row."""
    from specframe.metrics import bootstrap_al
    from specframe.results import write_results

    p = workspace.preset
    every = bench.load_prompts(dataset)
    prompts = bench.spread_over_categories(every, p.speed_prompts)
    config = {**_reference_config(workspace, drafter, methods, dataset, prompts), "subset_of": len(every)}
    key = fingerprint([config, methods[0].checkpoint_hash, JOB_SCHEMA])
    saved = saved_metrics(path, key)
    if saved is not None:
        return saved
    result = bench.compare(target.model, target.tokenizer, prompts, methods, bench.make_verifier("greedy"),
                           repeats=1, max_new_tokens=p.speed_max_new_tokens)
    metrics = bench.json_safe(result.summary())
    for label, m in metrics["methods"].items():
        lo, hi = bootstrap_al([r.metrics for r in result.by_repeat(label, 0)])
        m["acceptance_length_interval"] = {"low": lo, "high": hi, "level": 0.95}
        m["prompt_turns"] = metrics["prompt_turns"]
    metrics.update(dataset=dataset, engine="reference", subset_of=len(every))
    write_results(path, kind="bench.acceptance.subset", metrics=bench.json_safe(metrics),
                  per_prompt=bench.json_safe(result.per_prompt()), provenance=provenance,
                  config={**config, "key": key})
    return metrics


def _reference_speed(workspace, target, drafter: str, methods: list, path: Path, provenance: dict) -> dict:
    """Batch-1 speed on the reference engine: plain, n-gram at the drafter's K and the drafter under each verifier,
    interleaved repeats (``bench.compare``) on the MT-Bench turns vLLM speed is timed on, with the load beside it;
    saved figures are reused only if they were measured quietly."""
    from specframe.results import write_results

    p = workspace.preset
    prompts = bench.spread_over_categories(bench.load_prompts("mt-bench"), p.speed_prompts)
    k = methods[0].k
    timed = [bench.plugin_method("ngram", target.config, k=k, label=f"ngram/k{k}"), *methods]
    config = {**_reference_config(workspace, drafter, methods, "mt-bench", prompts), "repeats": p.vllm_repeats,
              "concurrency": 1, "ngram_ks": [k]}
    key = fingerprint([config, methods[0].checkpoint_hash, JOB_SCHEMA])
    saved = saved_metrics(path, key)
    if saved is not None and saved.get("quiet"):
        return saved
    busy, cpu, started = busy_cpu_seconds(), _cpu_seconds(), time.perf_counter()
    result = bench.compare(target.model, target.tokenizer, prompts, timed, bench.make_verifier("greedy"),
                           repeats=p.vllm_repeats, max_new_tokens=p.speed_max_new_tokens)
    seconds = time.perf_counter() - started
    load = beside_cores(busy, busy_cpu_seconds(), _cpu_seconds() - cpu, seconds)
    metrics = {**bench.json_safe(result.summary()), "beside_cores": load,
               "quiet": load is not None and load <= QUIET_CORES, "concurrency": 1, "engine": "reference"}
    write_results(path, kind="bench.speed", metrics=metrics, per_prompt=bench.json_safe(result.per_prompt()),
                  provenance=provenance, config={**config, "key": key})
    return metrics


def _tree(workspace, target, record: dict, drafter: str, path: Path, provenance: dict) -> dict:
    from specframe.inference.engine import TreeShape
    from specframe.results import write_results

    p = workspace.preset
    prompts = bench.load_prompts("mt-bench", p.tree_prompts)
    tree = TreeShape(*p.tree)
    methods = [bench.checkpoint_method(record["run"], target.config, tree=tree, label=f"{drafter}/tree")]
    config = {"preset": p.name, "drafter": drafter, "dataset": "mt-bench", "prompts": [q.id for q in prompts],
              "tree": attrs.asdict(tree), "max_new_tokens": p.max_new_tokens, "engine": "reference"}
    key = fingerprint([config, methods[0].checkpoint_hash, JOB_SCHEMA])
    saved = saved_metrics(path, key)
    if saved is not None:
        return saved
    result = bench.compare(target.model, target.tokenizer, prompts, methods, bench.make_verifier("greedy"),
                           repeats=1, max_new_tokens=p.max_new_tokens)
    summary = bench.json_safe(result.summary())
    write_results(path, kind="bench.acceptance", metrics=summary, per_prompt=bench.json_safe(result.per_prompt()),
                  provenance=provenance, config={**config, "key": key})
    return summary


def test_drafter_job(benchmark, workspace, target, drafter):
    from specframe import plugins
    from specframe.results import git_commit, write_results
    from specframe.vllm import vllm_available

    p = workspace.preset
    out = workspace.results / drafter
    key = job_key(p, drafter)
    done = finished_job(out, key)
    if done is not None:
        benchmark.pedantic(lambda: None, rounds=1, iterations=1)
        benchmark.extra_info.update({"reused": str(out / "job.json")})
        print(f"\n{drafter}: complete in {out} (checkpoint {done['checkpoint_hash']}), skipped")
        return
    box: dict[str, Any] = {}
    for text in p.reference_verifiers.get(drafter, ()):  # a bad name fails here, not after hours of training
        bench.verifier_spec(text)

    def job():
        record = workspace.trained(drafter)
        box["record"] = record
        short = too_few_tokens(p, record)
        if short:  # before anything is measured: a job below the preset's budget answers nothing
            raise RuntimeError(short)
        if "refused" in record:
            return
        from test_training import row

        method = bench.checkpoint_method(record["run"], target.config, label=drafter)
        ckpt = method.checkpoint_hash
        prov = bench.results_provenance(target, [method], command())
        write_results(out / "training.json", kind="bench.training",
                      metrics={"methods": {drafter: row(record)}, "memory_budget": p.memory_budget},
                      per_prompt=[], config={"preset": p.name, "drafter": drafter, "command": record["command"]},
                      provenance=prov)
        files = ["training.json"]
        quiet = True
        # label -> why vLLM cannot serve the drafter at that K (DFlash below its block), or at all (DSpark on a vLLM
        # without its V2 runner): those parts are skipped with the reason, kept in job.json's vllm_refused
        refused: dict[str, str] = {}
        ks: list[int] = []
        if exportable(drafter) and p.vllm and vllm_available():
            served = [bench.checkpoint_method(record["run"], target.config, k=k, label=f"{drafter}/k{k}")
                      for k in p.vllm_ks]
            with tempfile.TemporaryDirectory(prefix="specframe-job-") as tmp:
                manifests: dict[str, Any] = {}
                jobs = _with_k(served, _source(workspace), tmp, refused, manifests)
                own = manifests[served[0].checkpoint].min_speculative_tokens if refused else None
                if own is not None and own not in [k for _, k in jobs.values()]:
                    # a drafter vLLM serves only at its own K (DFlash: its full block) is measured there too, so
                    # every drafter has vLLM figures; the others' K are the preset's alone
                    # (a drafter the installed vLLM serves at no K, DSpark on vLLM's CPU build, is refused there too)
                    jobs.update(_with_k([bench.checkpoint_method(record["run"], target.config, k=own,
                                                                 label=f"{drafter}/k{own}")], _source(workspace), tmp,
                                        refused))
                ks = [k for _, k in jobs.values()]
                for dataset in p.datasets if jobs else ():
                    config = {"preset": p.name, "drafter": drafter, "dataset": dataset, "ks": ks,
                              "checkpoint_hash": ckpt, **({"refused": refused} if refused else {})}
                    box[dataset] = _acceptance(workspace, target, dataset, jobs, out / f"acceptance-{dataset}.json",
                                               config, prov)
                    files.append(f"acceptance-{dataset}.json")
                if jobs and p.keep_drafter_at:
                    # one K along the curve: the reference engine's, or the only one vLLM serves the drafter at
                    curve_k = own if own is not None else min(p.speed_k, p.depth)
                    for dataset, metrics in _served_curve(workspace, target, record, drafter, curve_k, tmp, out,
                                                          prov, ckpt).items():
                        box[f"curve-{dataset}"] = metrics
                        files.append(f"curve-{dataset}.json")
            for label, reason in refused.items():
                print(f"\n{label}: not served in vLLM: {reason}")
            if plugins.get("drafter", drafter).builds_trees:
                box["tree"] = _tree(workspace, target, record, drafter, out / "tree-reference.json", prov)
                files.append("tree-reference.json")
            for concurrency in p.speed_concurrency if ks else ():
                name = speed_file(concurrency)
                box[name] = _speed(workspace, target, record, drafter, out / name, prov, concurrency, ks)
                files.append(name)
                quiet = quiet and bool(box[name]["quiet"])
        if refused and not ks:
            # the installed vLLM serves the drafter at no K (DSpark on vLLM's CPU build): its acceptance and batch-1
            # speed on the reference engine instead, its whole block verified greedily and through each of the
            # preset's reference_verifiers, on the prompts speed is timed on (a subset: plain decoding of every set on
            # the reference engine would take hours); the files say so, and the report names the engine of each row
            methods = _reference_methods(record, target, drafter, p.reference_verifiers.get(drafter, ()))
            for dataset in p.datasets:
                name = f"reference-{dataset}.json"
                box[f"reference-{dataset}"] = _reference_acceptance(workspace, target, drafter, dataset, methods,
                                                                    out / name, prov)
                files.append(name)
            box["speed-reference.json"] = _reference_speed(workspace, target, drafter, methods,
                                                           out / "speed-reference.json", prov)
            files.append("speed-reference.json")
            quiet = quiet and bool(box["speed-reference.json"]["quiet"])
        state = {"drafter": drafter, "checkpoint_hash": ckpt, "files": files, "commit": git_commit(),
                 "train_tokens": record.get("train_tokens"), "complete": quiet, "vllm_refused": refused,
                 "waiting": None if quiet else "speed measured beside other load: the next run measures it again"}
        write_results(out / "job.json", kind="bench.job", metrics=state, per_prompt=[],
                      config={"preset": p.name, "drafter": drafter, "key": key,
                              "job_revision": p.job_revisions.get(drafter, 0), "command": shlex.join(command())},
                      provenance=prov)
        box["state"] = state

    benchmark.pedantic(job, rounds=1, iterations=1)
    record = box["record"]
    if "refused" in record:
        pytest.skip(f"{drafter} does not fit {p.memory_budget}: {record['refused']}")
    assert record["steps"] == p.steps
    assert record["first_train_loss"] > record["last_train_loss"], "training did not lower the loss"
    for concurrency in p.speed_concurrency:
        for label, m in box.get(speed_file(concurrency), {}).get("methods", {}).items():
            if label != "plain":
                assert m["lossless"], f"{label} changed plain vLLM's greedy output at {concurrency} at once"
    for dataset in p.datasets:
        for label, m in box.get(dataset, {}).get("methods", {}).items():
            assert 1.0 <= m["acceptance_length"] <= m["k"] + 1, (dataset, label)
    for name in [f"reference-{dataset}" for dataset in p.datasets] + ["speed-reference.json"]:
        for label, m in box.get(name, {}).get("methods", {}).items():
            assert 1.0 <= m["acceptance_length"] <= m["k"] + 1, (name, label)
            # greedy: the whole block verified greedily must give plain decoding's tokens; a scheduled verifier
            # with a greedy rule too (it only chooses how much of the block to verify)
            assert m.get("lossless", True), f"{label} changed plain decoding's greedy output ({name})"
    benchmark.extra_info.update({"job": box["state"]})
