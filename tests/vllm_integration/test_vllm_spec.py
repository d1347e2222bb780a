"""vLLM serves every exported layout losslessly, and its counters convert to specframe's metrics.

One child process runs every engine in turn (vLLM imports once; see ``specframe.vllm.jobs.run_jobs``): plain
decoding and each layout on a random tiny target, then the same on a degenerate pair where every draft is accepted.
Each layout is served with an explicit ``speculative_config`` (target as vLLM's model); the speculators exports
(EAGLE-3, P-EAGLE) also from the folder alone, ``LLM(model=EXPORT)`` with no speculative config at all: vLLM reads
the verifier (a local folder path), the method and the number of draft tokens from the folder.
Skipped where vLLM is not installed (``make setup VLLM=none``).
"""

from __future__ import annotations

import math

import pytest

from specframe.layouts import export
from specframe.vllm import vllm_available

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (make setup VLLM=cpu|gpu installs it)"),
]

# drafter kind -> (layout, drafter layers): P-EAGLE's released depth is 4; vLLM's eagle3 model stacks plain Llama
# layers after the first (cat(embedding, hidden)) one, so a deeper autoregressive EAGLE-3 loads too
KINDS = {"eagle3": ("eagle3", 1), "eagle3-2layers": ("eagle3", 2), "peagle": ("peagle", 4), "pard": ("pard", 1)}
# one degenerate (all-accepting) drafter per vLLM drafting path: autoregressive EAGLE-3, parallel EAGLE-3, PARD
CONST_KINDS = ("eagle3", "peagle", "pard")
# served from the export folder alone (speculators format)
FOLDER_KINDS = ("eagle3 folder", "peagle folder")
ALL = [*KINDS, *FOLDER_KINDS]
K = 3
# 1 prefill token + 4 fully accepted rounds of K + 1: no round is cut at max_tokens on the degenerate pair
MAX_NEW = 1 + 4 * (K + 1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from specframe.vllm.jobs import Job, run_jobs
    from tests.vllm_fixtures import build_drafter, build_target, target_parts

    root = tmp_path_factory.mktemp("vllm")
    target = build_target(root / "target")
    const = build_target(root / "const", degenerate=True)
    _, tok = target_parts(target)
    jobs = {"plain": Job(str(target)), "const plain": Job(str(const))}
    for kind, (layout, layers) in KINDS.items():
        d = build_drafter(layout, target, root / kind, layers=layers, k=K)
        jobs[kind] = Job(str(target), export.speculative_config(d, K))
        if f"{kind} folder" in FOLDER_KINDS:
            jobs[f"{kind} folder"] = Job(str(d))  # LLM(model=EXPORT): no speculative config
        if kind in CONST_KINDS:
            c = build_drafter(layout, const, root / f"const-{kind}", degenerate=True, layers=layers, k=K)
            jobs[f"const {kind}"] = Job(str(const), export.speculative_config(c, K))
            if f"{kind} folder" in FOLDER_KINDS:
                jobs[f"const {kind} folder"] = Job(str(c))
    prompts = [tok("def add(a, b):\n    return a + b\n")["input_ids"], tok("The quick brown fox")["input_ids"]]
    results = run_jobs(list(jobs.values()), prompts, max_new_tokens=MAX_NEW, ignore_eos=True)
    out = dict(zip(jobs, results))
    out["_target"], out["_prompts"] = target, prompts
    return out


def tokens(run):
    return [g.tokens for g in run.generations]


@pytest.mark.parametrize("kind", ALL)
def test_speculative_output_equals_plain(runs, kind):
    assert tokens(runs[kind]) == tokens(runs["plain"])
    assert all(len(t) == MAX_NEW for t in tokens(runs[kind]))
    assert runs[kind].counters.drafts > 0


@pytest.mark.parametrize("kind", ALL)
def test_rounds_agree_with_vllm_counters(runs, kind):
    run = runs[kind]
    counters = run.counters
    rounds = [r for g in run.generations for r in g.rounds]
    drafting = [r for r in rounds if r.drafted]
    assert len(drafting) == counters.drafts
    assert sum(r.drafted for r in drafting) == counters.draft_tokens
    # vLLM counts before the output is cut at max_tokens; specframe's rounds after
    assert sum(r.accepted for r in rounds) <= counters.accepted_tokens
    assert sum(r.emitted for r in rounds) == sum(len(g.tokens) - 1 for g in run.generations)
    assert len(counters.accepted_per_pos) == K
    m = run.metrics(K)
    assert 1.0 <= m.acceptance_length <= K + 1
    assert m.acceptance_length == pytest.approx(m.emitted / m.forwards)
    assert m.forwards >= counters.drafts


@pytest.mark.parametrize("kind", [*CONST_KINDS, *FOLDER_KINDS])
def test_degenerate_pair_accepts_every_draft(runs, kind):
    run = runs[f"const {kind}"]
    assert tokens(run) == tokens(runs["const plain"])
    c = run.counters
    assert c.accepted_tokens == c.draft_tokens == K * c.drafts > 0
    assert c.accepted_per_pos == (c.drafts,) * K
    assert c.drafting_acceptance_length() == K + 1
    m = run.metrics(K, baseline=runs["const plain"])
    assert m.acceptance_length == K + 1
    assert m.per_slot == (1.0,) * K
    assert m.conditional == (1.0,) * K
    assert m.speedup is not None and math.isfinite(m.speedup) and m.speedup > 0


def test_vllm_plain_matches_transformers_greedy_up_to_near_ties(runs):
    import torch
    from transformers import AutoModelForCausalLM

    from specframe.vllm import parity

    model = AutoModelForCausalLM.from_pretrained(runs["_target"]).eval()
    for prompt, gen in zip(runs["_prompts"], runs["plain"].generations):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
        reference = out[0, len(prompt) :].tolist()
        gaps = parity.top2_gaps(model, prompt, reference)
        result = parity.compare_tokens(reference, gen.tokens, gaps)
        assert result.equal, (result, reference, gen.tokens)
        assert result.compared >= 1
