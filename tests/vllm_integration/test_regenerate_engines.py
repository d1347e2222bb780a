"""`specframe regenerate` with either engine: the shared prompt plan, stop rule and resume; vLLM against the
transformers reference on the same prompts (fp32 greedy: the share of identical answers is reported and bounded)."""

from __future__ import annotations

import json

import pytest

from specframe.data.regenerate import RegenerateReport, plan_prompts, read_done, regenerate, stop_token_ids
from specframe.errors import SpecframeError
from specframe.vllm import vllm_available
from tests.target_fixtures import chat_records

needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (make setup VLLM=cpu|gpu)")


class ScriptedAnswerer:
    """An engine that answers from a script: prompt length -> (new tokens, stopped); records what it was asked."""

    name = "scripted"

    def __init__(self, script):
        self.script, self.calls = script, []

    def answer(self, prompts, max_new_tokens, stop_ids):
        self.calls.append(([len(p) for p in prompts], max_new_tokens, list(stop_ids)))
        return [self.script(p) for p in prompts]


def test_the_answer_ends_at_the_first_stop_id_and_counts_as_finished(tmp_path, tiny):  # noqa: F811
    stop = stop_token_ids(tiny)
    assert stop == [tiny.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    a, b = 40, 41  # two ordinary ids
    # an engine that keeps the stop id and runs on (padding) after it, one that drops it but says it stopped, and one
    # cut at the length cap
    answers = {0: ([a, b, stop[0], a, a], False), 1: ([b, a], True), 2: ([a, a, a], False)}
    recs = chat_records(3, turns=1)
    fake = ScriptedAnswerer(lambda p: answers[order.index(len(p))])
    order = sorted(len(x[3]) for x in plan_prompts(tiny.tokenizer, recs, 512, RegenerateReport()))
    regenerate(tiny, recs, tmp_path / "a.jsonl", batch_size=8, max_new_tokens=5, answerer=fake)
    rows = sorted((json.loads(x) for x in (tmp_path / "a.jsonl").read_text().splitlines()), key=lambda r: r["prompt_tokens"])
    assert [r["answer_tokens"] for r in rows] == [2, 2, 3]
    assert [r["finished"] for r in rows] == [True, True, False]
    assert fake.calls[0][1:] == (5, stop)


def test_both_engines_get_the_same_batches_whatever_was_done_before(tmp_path, tiny):  # noqa: F811
    recs = chat_records(9, turns=1)
    first = ScriptedAnswerer(lambda p: ([40], True))
    regenerate(tiny, recs, tmp_path / "x.jsonl", batch_size=4, max_new_tokens=3, answerer=first)
    plan = [len(x[3]) for x in plan_prompts(tiny.tokenizer, recs, 512, RegenerateReport())]
    assert [c[0] for c in first.calls] == [plan[0:4], plan[4:8], plan[8:9]]
    # a resumed run asks only for the batches not yet written, cut exactly where the full run cut them
    lines = (tmp_path / "x.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "y.jsonl").write_text("".join(lines[:4]))
    second = ScriptedAnswerer(lambda p: ([40], True))
    rep = regenerate(tiny, recs, tmp_path / "y.jsonl", batch_size=4, max_new_tokens=3, answerer=second)
    assert [c[0] for c in second.calls] == [plan[4:8], plan[8:9]]
    assert rep.already_done == 4 and rep.generated == 5
    assert len(read_done(tmp_path / "y.jsonl")) == 9


def test_an_engine_that_loses_an_answer_stops_the_run_before_anything_is_written(tmp_path, tiny):  # noqa: F811
    short = ScriptedAnswerer(lambda p: ([40], True))
    short.answer = lambda prompts, n, s: [([40], True)] * (len(prompts) - 1)
    with pytest.raises(ValueError):
        regenerate(tiny, chat_records(3, turns=1), tmp_path / "z.jsonl", batch_size=4, max_new_tokens=3, answerer=short)
    assert (tmp_path / "z.jsonl").read_text() == ""


def test_vllm_options_pass_parallelism_through_and_refuse_nonsense():
    from specframe.vllm.answer import AnswerOptions

    kw = AnswerOptions(tensor_parallel_size=4, pipeline_parallel_size=2, gpu_memory_utilization=0.8,
                       max_num_seqs=64, dtype="bf16").llm_kwargs()
    assert (kw["tensor_parallel_size"], kw["pipeline_parallel_size"], kw["gpu_memory_utilization"]) == (4, 2, 0.8)
    assert kw["max_num_seqs"] == 64 and kw["dtype"] == "bfloat16"
    assert "gpu_memory_utilization" not in AnswerOptions().llm_kwargs()  # vLLM's own default unless given
    assert AnswerOptions(distributed_executor_backend="ray").llm_kwargs()["distributed_executor_backend"] == "ray"
    assert "distributed_executor_backend" not in AnswerOptions().llm_kwargs()
    for bad, match in [({"gpu_memory_utilization": 1.5}, "gpu-memory-utilization"), ({"tensor_parallel_size": 0},
                       "tensor-parallel-size"), ({"dtype": "int8"}, "dtype"), ({"kv_cache_gib": 0}, "kv-cache-gib"),
                       ({"distributed_executor_backend": "slurm"}, "distributed-executor-backend")]:
        with pytest.raises(SpecframeError, match=match):
            AnswerOptions(**bad)


def test_vllm_engine_refuses_a_device_map_with_the_reason(tmp_path, tiny):  # noqa: F811
    from click.testing import CliRunner

    from specframe.cli import main

    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps(chat_records(1, turns=1)[0]) + "\n")
    res = CliRunner().invoke(main, ["regenerate", "--target", str(tiny.path), "--data", str(data), "--output",
                                    str(tmp_path / "o.jsonl"), "--engine", "vllm", "--device-map", "auto"])
    assert res.exit_code == 2 and "--tensor-parallel-size" in res.output
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.slow
@needs_vllm
def test_vllm_answers_equal_the_reference_and_resume_to_the_same_file(tmp_path):
    """The tiny target (head 32, which vLLM's CPU attention takes): the same prompts through both engines, fp32
    greedy; then a vLLM run killed after one batch and resumed gives the uninterrupted run's bytes."""
    from specframe.targets import load_target
    from specframe.vllm.answer import AnswerOptions, VllmAnswerer
    from tests.vllm_fixtures import build_target

    path = build_target(tmp_path / "t")
    target = load_target(path)
    recs = chat_records(24, turns=1)
    regenerate(target, recs, tmp_path / "hf.jsonl", batch_size=8, max_new_tokens=24)
    engine = VllmAnswerer(str(path), AnswerOptions(max_model_len=512, max_num_seqs=8, kv_cache_gib=1, threads=1))
    regenerate(target, recs, tmp_path / "vllm.jsonl", batch_size=8, max_new_tokens=24, answerer=engine)
    hf = [json.loads(x) for x in (tmp_path / "hf.jsonl").read_text().splitlines()]
    vl = [json.loads(x) for x in (tmp_path / "vllm.jsonl").read_text().splitlines()]
    assert [(r["source"], r["id"]) for r in hf] == [(r["source"], r["id"]) for r in vl]
    same = sum(a == b for a, b in zip(hf, vl)) / len(hf)
    print(f"identical answers, tiny target: {same:.3f} of {len(hf)}")
    assert same >= 0.9

    class Kill(Exception):
        pass

    def kill_after_one(i, n):
        if i == 1:
            raise Kill

    with pytest.raises(Kill):
        regenerate(target, recs, tmp_path / "part.jsonl", batch_size=8, max_new_tokens=24, answerer=engine,
                   progress=kill_after_one)
    assert len(read_done(tmp_path / "part.jsonl")) == 8
    rep = regenerate(target, recs, tmp_path / "part.jsonl", batch_size=8, max_new_tokens=24, answerer=engine)
    assert rep.already_done == 8 and rep.generated == 16
    assert (tmp_path / "part.jsonl").read_bytes() == (tmp_path / "vllm.jsonl").read_bytes()


@pytest.mark.slow
@needs_vllm
def test_vllm_answers_smollm2_as_transformers_does(tmp_path, default_target):  # noqa: F811
    """SmolLM2-135M-Instruct, fp32 greedy, 16 prompts of the large set: most answers are identical token for token
    (where they are not, the engines' sums differ in the last bits at a near tie, and the answers part there)."""
    from specframe.data.large import large_prompt_records
    from specframe.vllm.answer import AnswerOptions, VllmAnswerer

    recs = large_prompt_records()
    recs = recs[:8] + recs[-8:]  # ShareGPT and GSM8K
    regenerate(default_target, recs, tmp_path / "hf.jsonl", batch_size=8, max_new_tokens=48)
    engine = VllmAnswerer(str(default_target.path), AnswerOptions(max_model_len=1024, max_num_seqs=16, kv_cache_gib=1))
    regenerate(default_target, recs, tmp_path / "vllm.jsonl", batch_size=16, max_new_tokens=48, answerer=engine)
    hf = {(r["source"], r["id"]): r for r in map(json.loads, (tmp_path / "hf.jsonl").read_text().splitlines())}
    vl = {(r["source"], r["id"]): r for r in map(json.loads, (tmp_path / "vllm.jsonl").read_text().splitlines())}
    assert hf.keys() == vl.keys() and len(hf) == 16
    same = sum(hf[k]["answer"] == vl[k]["answer"] for k in hf) / len(hf)
    print(f"identical answers, SmolLM2: {same:.3f} of {len(hf)}")
    assert same >= 0.75


@pytest.mark.parametrize("command", ["regenerate", "prepare"])
def test_the_cli_hands_vllm_its_parallelism_and_executor(tmp_path, tiny, monkeypatch, command):  # noqa: F811
    from click.testing import CliRunner

    from specframe.cli import main
    from specframe.vllm import answer, states

    seen = {}

    def stop(self, model, *args, **kwargs):  # the options the engine would start with; nothing is started
        seen["options"] = next(a for a in (*args, *kwargs.values()) if isinstance(a, answer.AnswerOptions))
        raise SpecframeError("stopped before vLLM starts")

    monkeypatch.setattr(answer.VllmAnswerer, "__init__", stop)
    monkeypatch.setattr(states.VllmStates, "__init__", stop)
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps(chat_records(1)[0]) + "\n")
    out = ["--output", str(tmp_path / "o.jsonl")] if command == "regenerate" else \
        ["--output", str(tmp_path / "cache"), "--max-length", "512"]
    res = CliRunner().invoke(main, [command, "--target", str(tiny.path), "--data", str(data), *out, "--engine", "vllm",
                                    "--tensor-parallel-size", "4", "--pipeline-parallel-size", "2",
                                    "--gpu-memory-utilization", "0.7", "--distributed-executor-backend", "ray"])
    assert "stopped before vLLM starts" in res.output, res.output
    o = seen["options"]
    assert (o.tensor_parallel_size, o.pipeline_parallel_size, o.gpu_memory_utilization,
            o.distributed_executor_backend) == (4, 2, 0.7, "ray")
