"""vLLM suite: each exportable drafter served by vLLM (in process, greedy) against vLLM without speculation, with the
reference engine's figures for the same checkpoint, prompts and K beside them, in one run.

    .venv/bin/pytest benchmarks/test_vllm.py --preset cpu --benchmark-only -p no:cacheprovider

vLLM side: ``specframe.bench.compare_vllm`` (the code behind `specframe bench acceptance --engine vllm`): the
checkpoint is exported (`specframe export`), vLLM serves plain and speculative decoding, both engines started once and
warmed up, the MT-Bench prompt turns interleaved between them; AL and per-position acceptance come from vLLM's
per-request spec-decode counters, speedup is OTPS(speculative) / OTPS(plain) per repeat. Reference side: ``specframe.bench.compare`` on the same prompts at the same K. EAGLE-3 and P-EAGLE are
exported in the speculators format, PARD as a causal LM, ParallelSpec (eagle backbone) for specframe's vLLM general
plugin model (each draft slot its own mask embedding; docs/guide/serving-vllm.md, "ParallelSpec"); every one is served beside the target with an
explicit speculative config.
"""

from __future__ import annotations

import pytest

from harness import command, fingerprint, saved_metrics
from specframe import bench
from specframe.stats import mean_text

def pytest_generate_tests(metafunc):
    if "drafter" in metafunc.fixturenames:
        from presets import exportable, resolve

        p = resolve(metafunc.config.getoption("--preset"))
        metafunc.parametrize("drafter", [d for d in p.drafters if exportable(d)])


def test_vllm_against_reference(benchmark, workspace, trained, drafter):
    from specframe.targets import target_source
    from specframe.results import write_results
    from specframe.targets import load_target
    from specframe.vllm import vllm_available

    p = workspace.preset
    if not p.vllm:
        pytest.skip(f"preset {p.name} does not run vLLM")
    if not vllm_available():
        pytest.skip("vLLM is not installed (make setup VLLM=cpu)")
    record = trained[drafter]
    if "refused" in record:
        pytest.skip(f"{drafter} did not fit the memory budget")
    target = load_target(workspace.target())
    prompts = bench.load_prompts("mt-bench", p.prompts)
    assert p.speed_k in p.vllm_ks, f"preset {p.name}: speed_k must be one of vllm_ks (the reference's K)"
    served_methods = [bench.checkpoint_method(record["run"], target.config, k=k, label=f"{drafter}/k{k}")
                      for k in p.vllm_ks]
    method = served_methods[p.vllm_ks.index(p.speed_k)]
    # a K vLLM cannot serve the drafter at (DFlash below its block: vLLM's proposer runs K + 1 slots) is skipped with
    # the reason; without the reference engine's K there is nothing to compare
    refused = bench.vllm_refusals(served_methods, target_source(workspace.target()))
    if method.label in refused:
        pytest.skip(f"{drafter} at K={p.speed_k} is not served in vLLM: {refused[method.label]}")
    served_methods = [m for m in served_methods if m.label not in refused]
    ks = [m.k for m in served_methods]
    config = {"preset": p.name, "drafter": drafter, "dataset": "mt-bench", "prompts": [q.id for q in prompts],
              "k": p.speed_k, "ks": ks, "repeats": p.vllm_repeats, "max_new_tokens": p.max_new_tokens,
              "verifier": "greedy", **({"refused": refused} if refused else {})}
    key = fingerprint([config, method.checkpoint_hash])
    path = workspace.results / f"vllm-{drafter}.json"
    box = {}

    def once():
        served = bench.compare_vllm(workspace.target(), prompts, served_methods, repeats=p.vllm_repeats,
                                    max_new_tokens=p.max_new_tokens, threads=p.threads)
        vllm_summary, rows = bench.json_safe(served.summary()), served.per_prompt()
        reference = bench.compare(target.model, target.tokenizer, prompts, [method], bench.make_verifier("greedy"),
                                  repeats=p.vllm_repeats, max_new_tokens=p.max_new_tokens)
        ref = bench.json_safe(reference.summary())
        box["metrics"] = {"methods": {
            "vllm": vllm_summary["methods"][method.label], "vllm/plain": vllm_summary["methods"]["plain"],
            **{f"vllm/k{m.k}": vllm_summary["methods"][m.label] for m in served_methods},
            "reference": ref["methods"][method.label], "reference/plain": ref["methods"]["plain"],
        }, "engine": "vllm+reference", "vllm_threads_bind": vllm_summary.get("vllm_threads_bind")}
        box["rows"] = rows

    saved = saved_metrics(path, key)
    if saved is not None:
        box["metrics"] = saved
        benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    else:
        benchmark.pedantic(once, rounds=1, iterations=1)
        write_results(path, kind="bench.vllm", metrics=bench.json_safe(box["metrics"]), per_prompt=box["rows"],
                      provenance=bench.results_provenance(target, [method], command()), config={**config, "key": key})
    m = box["metrics"]["methods"]
    for k in ks:
        assert m[f"vllm/k{k}"]["lossless"], f"vLLM with {drafter} at K={k} changed plain vLLM's greedy output"
    assert m["reference"]["lossless"]
    al_v, al_r = m["vllm"]["acceptance_length"], m["reference"]["acceptance_length"]
    gap = abs(al_v - al_r) / al_r
    benchmark.extra_info.update({"results": str(path), "vllm_al": al_v, "reference_al": al_r, "al_gap": gap,
                                 "vllm_speedup": m["vllm"]["speedup_interval"],
                                 "reference_speedup": m["reference"]["speedup_interval"]})
    for label, reason in refused.items():
        print(f"\n{label}: not served in vLLM: {reason}")
    for k in ks:
        row = m[f"vllm/k{k}"]
        print(f"\n{drafter} in vLLM at K={k}: AL {row['acceptance_length']:.3f}, speedup "
              f"{bench.Interval(**{**row['speedup_interval'], 'values': tuple(row['speedup_interval']['values'])})}")
    print(f"\n{drafter} K={p.speed_k}: vLLM AL {al_v:.3f} speedup {mean_text(m['vllm']['speedup_interval'])} | "
          f"reference AL {al_r:.3f} speedup {mean_text(m['reference']['speedup_interval'])} (AL gap {gap:.1%})")
