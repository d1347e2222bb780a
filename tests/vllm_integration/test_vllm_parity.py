"""Train/serve parity through a real drafter plugin: the reference engine and vLLM, same prompts, same drafter.

The ``pard`` drafter is initialised from the target with every target layer copied, so its first draft slot is the
target's own prediction (always accepted) and the mask slots accept sometimes: a non-trivial acceptance pattern that
an off-by-one in export, mask token or positions would change. Both engines must emit the same tokens (up to target
near-ties) and accept the same number of drafts round by round.
"""

from __future__ import annotations

import pytest
import torch

from specframe.layouts import export
from specframe.vllm import vllm_available

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (make setup VLLM=cpu|gpu installs it)"),
]

K = 3
MAX_NEW = 24
TEXTS = ["def add(a, b):\n    return a + b\n", "The quick brown fox", "Natalia sold 48 clips in April"]


def test_pard_plugin_matches_reference_engine_round_by_round(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specframe import api, plugins
    from specframe.inference import generate
    from specframe.vllm import parity
    from specframe.vllm.jobs import run_in_subprocess
    from tests.vllm_fixtures import LAYERS, build_target

    target_dir = build_target(tmp_path / "target")
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(target_dir)
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    examples = [
        api.TrainingExample(input_ids=torch.tensor(p), loss_mask=torch.ones(len(p)), doc=torch.zeros(len(p), dtype=torch.long))
        for p in prompts
    ]
    cls = plugins.get("drafter", "pard")
    drafter = cls(model.config, cls.Options(layers=LAYERS, init_from_target=True))
    drafter.prepare(type("Target", (), {"model": model, "tokenizer": tok})(), examples)
    manifest = drafter.export_vllm(tmp_path / "pard", tok)
    assert manifest["layout"] == "pard"

    verifier = plugins.get("verifier", "greedy")()
    reference = [
        generate(model, torch.tensor(p), verifier, drafter, k=K, max_new_tokens=MAX_NEW, eos_token_id=())
        for p in prompts
    ]
    served = run_in_subprocess(
        target_dir, prompts, export.speculative_config(tmp_path / "pard", K), max_new_tokens=MAX_NEW, ignore_eos=True
    )

    total_accepted = 0
    for prompt, ref, got in zip(prompts, reference, served.generations):
        gaps = parity.top2_gaps(model, prompt, ref.tokens)
        tokens = parity.compare_tokens(ref.tokens, got.tokens, gaps)
        assert tokens.equal, (tokens, ref.tokens, got.tokens)
        rounds = parity.compare_rounds(ref.rounds, got.rounds, tokens)
        assert rounds.compared >= 3
        assert rounds.identical, rounds
        total_accepted += sum(rounds.reference)
    # the copied target makes slot 1 always right: acceptance far from zero on both sides
    assert total_accepted >= sum(len(g.rounds) for g in served.generations) // 2
    slots = parity.compare_per_slot(
        [r for g in reference for r in g.rounds], served.counters.accepted_per_pos, served.counters.drafts, K
    )
    assert slots["vllm"][0] > 0.9 and slots["reference"][0] > 0.9, slots
