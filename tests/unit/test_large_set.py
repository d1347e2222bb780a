"""The large self-distilled set: its prompts never include an evaluation prompt (MT-Bench, HumanEval, the GSM8K
evaluation slice), and what is committed is what its provenance says."""

from __future__ import annotations

import gzip
import json

import pytest

from specframe.data import large
from specframe.data.evalsets import EVAL_SETS, eval_prompts


@pytest.fixture(scope="module")
def plan():
    return large.large_prompt_records()


def test_no_prompt_of_the_large_set_is_an_evaluation_prompt(plan):
    evaluation = {" ".join(t.split()).lower() for name in EVAL_SETS for p in eval_prompts(name) for t in p.turns}
    assert len(evaluation) > 400  # all three sets were read
    for r in plan:
        text = " ".join(r["messages"][-1]["content"].split()).lower()
        assert text not in evaluation, (r["source"], r["id"])
        assert not any(e in text for e in evaluation if len(e) >= 32), (r["source"], r["id"])
    gsm8k = [int(r["id"]) for r in plan if r["source"] == "gsm8k"]
    assert min(gsm8k) >= 200 and len(gsm8k) == 7273  # every training question, none of the evaluation slice
    assert len(plan) >= 10_000


def test_a_prompt_holding_an_evaluation_question_is_left_out(monkeypatch):
    """Plant an MT-Bench question (other case and spacing, inside a longer message) and a HumanEval prompt among the
    ShareGPT records: both must go, the ordinary record stays."""
    from specframe.data import sources

    question = eval_prompts("mt-bench", limit=1)[0].turns[0]
    problem = eval_prompts("humaneval", limit=1)[0].turns[0]
    fake = [{"source": "sharegpt", "id": "planted-1",
             "messages": [{"role": "user", "content": "Please help:\n\n" + "  ".join(question.upper().split())}]},
            {"source": "sharegpt", "id": "planted-2", "messages": [{"role": "user", "content": problem}]},
            {"source": "sharegpt", "id": "ordinary", "messages": [{"role": "user", "content": "Write a haiku about rain."}]}]
    monkeypatch.setattr(sources, "load_sharegpt", lambda limit=None: fake)
    ids = {r["id"] for r in large.large_prompt_records() if r["source"] == "sharegpt"}
    assert ids == {"ordinary"}


def test_the_committed_large_set_answers_only_its_planned_prompts(plan):
    if not large.ANSWERS.exists():
        pytest.skip("the large set is not committed yet (make data-large)")
    with gzip.open(large.ANSWERS, "rt", encoding="utf-8") as f:
        answers = [json.loads(line) for line in f]
    planned = {(r["source"], r["id"]) for r in plan}
    assert {(a["source"], a["id"]) for a in answers} <= planned
    prov = json.loads(large.PROVENANCE.read_text())
    assert prov["counts"]["records"] == len(answers) >= 10_000
    assert prov["counts"]["answer_tokens"] == sum(a["answer_tokens"] for a in answers) >= 2_000_000
    assert prov["generation"]["engine"] == "vllm" and prov["generation"]["greedy"]
