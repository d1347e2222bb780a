"""``specframe.vllm.interleaved.run_interleaved`` without vLLM: fake engines stand in for ``EngineProcesses``, so the
protocol is checked in milliseconds: every engine warms up before any timed trial, the engine order rotates, later
turns follow the plain engine's answer, fixed contexts are reused; and which engines may share a process."""

from __future__ import annotations

import pytest

from specframe.vllm import counters as vcounters
from specframe.vllm import engine as vengine
from specframe.vllm import interleaved as vinterleaved
from specframe.vllm import jobs as vjobs


class FakeEngines:
    """Greedy 'decoding' that answers each prompt with its last ids reversed; the engine 'bad' answers something
    else, so a history built from the wrong engine shows in the next turn's prompt."""

    calls: list[tuple[str, int, tuple[int, ...]]] = []
    batches: list[tuple[str, int]] = []
    jobs: list[str] = []

    def __init__(self, jobs, options=None):
        FakeEngines.jobs = list(jobs)
        self.startup_seconds = {label: 1.0 for label in jobs}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def generate(self, label, ids, max_new_tokens):
        (generation,) = self.generate_together(label, [ids], max_new_tokens)
        return generation

    def generate_together(self, label, prompts, max_new_tokens):
        FakeEngines.batches.append((label, len(prompts)))
        out = []
        for ids in prompts:
            FakeEngines.calls.append((label, max_new_tokens, tuple(ids)))
            tokens = tuple(reversed(ids[-3:])) if label != "bad" else (7, 7, 7)
            out.append(vcounters.VllmGeneration(tokens=tokens, rounds=tuple(vcounters.Round(0, 0, 1) for _ in tokens),
                                              decode_seconds=0.01, total_seconds=0.02))
        return out


@pytest.fixture()
def fake(monkeypatch, tiny, tmp_path):
    FakeEngines.calls, FakeEngines.batches, FakeEngines.jobs = [], [], []
    monkeypatch.setattr(vinterleaved, "EngineProcesses", FakeEngines)
    folder = tmp_path / "tok"
    tiny.tokenizer.save_pretrained(folder)
    return tiny, folder


JOBS = {"plain": vjobs.Job("t"), "good": vjobs.Job("t", {"method": "eagle3"}),
        "bad": vjobs.Job("t", {"method": "eagle3"})}
CONVERSATIONS = [vinterleaved.Conversation("a", ("hello there", "and then")), vinterleaved.Conversation("b", ("fox",))]


def _run(folder, **kwargs):
    options = {"plain": "plain", "repeats": [0, 1], "warmup": 1, "max_new_tokens": 40, **kwargs}
    return vinterleaved.run_interleaved(JOBS, CONVERSATIONS, str(folder), **options)


def test_every_engine_warms_up_before_any_trial(fake):
    lines = []
    out = _run(fake[1], progress=lines.append)
    # a line when the engines are up, then one per prompt turn and repeat (a log shows the run moving)
    assert len(lines) == 1 + 2 * 3 and "engines up" in lines[0] and "repeat 2 prompt b turn 1" in lines[-1]
    warm = FakeEngines.calls[:3]
    assert {name for name, _, _ in warm} == {"plain", "good", "bad"} and all(n == 16 for _, n, _ in warm)
    assert all(n == 40 for _, n, _ in FakeEngines.calls[3:])
    # 2 repeats x 3 prompt turns x 3 engines, every one recorded
    assert len(out.trials) == 18 and set(out.startup_seconds) == {"plain", "good", "bad"}


def test_engine_order_rotates_so_no_engine_always_runs_first(fake):
    out = _run(fake[1])
    firsts = [out.trials[i].label for i in range(0, len(out.trials), 3)]
    assert set(firsts) == {"plain", "good", "bad"}
    for i in range(0, len(out.trials), 3):  # each prompt turn: every engine exactly once
        assert sorted(t.label for t in out.trials[i:i + 3]) == ["bad", "good", "plain"]


def test_second_turn_follows_the_plain_engines_answer_in_every_repeat(fake):
    from specframe.data.chat import encode_prompt

    tiny, folder = fake
    out = _run(folder)
    first = out.contexts["a#0"]
    answer = tiny.tokenizer.decode(list(reversed(first[-3:])), skip_special_tokens=True).strip()
    expected = encode_prompt(tiny.tokenizer, [{"role": "user", "content": "hello there"},
                                              {"role": "assistant", "content": answer},
                                              {"role": "user", "content": "and then"}])
    assert out.contexts["a#1"] == expected
    asked = {(t.repeat, t.label): t.prompt_tokens for t in out.trials if (t.conversation, t.turn) == ("a", 1)}
    assert set(asked.values()) == {len(expected)} and len(asked) == 6


def test_given_contexts_are_asked_as_they_are(fake):
    contexts = {"a#0": [5, 6, 7], "a#1": [5, 6, 7, 8, 9], "b#0": [4]}
    out = _run(fake[1], contexts=contexts, repeats=[1], warmup=0)
    assert out.contexts == contexts
    assert {ids for _, _, ids in FakeEngines.calls} == {(5, 6, 7), (5, 6, 7, 8, 9), (4,)}
    assert {t.repeat for t in out.trials} == {1}


CONCURRENT = [vinterleaved.Conversation(c, ("hello there", "and then")) for c in "abc"] + [
    vinterleaved.Conversation("d", ("fox",))]


def test_concurrent_requests_go_to_each_engine_together_and_later_turns_follow_plain(fake):
    tiny, folder = fake
    options = vengine.EngineOptions(max_num_seqs=2)
    together = vinterleaved.run_interleaved(JOBS, CONCURRENT, str(folder), plain="plain", repeats=[0], warmup=0,
                                       max_new_tokens=40, options=options, concurrency=2)
    # groups (a, b) and (c, d): two turns of two requests, then one of two and one of one, per engine
    assert [n for label, n in FakeEngines.batches if label == "good"] == [2, 2, 2, 1]
    assert len(together.trials) == 3 * 7
    FakeEngines.calls, FakeEngines.batches = [], []
    alone = vinterleaved.run_interleaved(JOBS, CONCURRENT, str(folder), plain="plain", repeats=[0], warmup=0,
                                    max_new_tokens=40)
    assert {n for _, n in FakeEngines.batches} == {1}
    # the same prompts are asked either way: every later turn follows plain's own answer to its conversation
    assert together.contexts == alone.contexts
    assert {(t.label, t.conversation, t.turn) for t in together.trials} == {
        (t.label, t.conversation, t.turn) for t in alone.trials}


def test_concurrency_above_the_engines_batch_is_refused(fake):
    from specframe.errors import SpecframeError

    with pytest.raises(SpecframeError, match="max_num_seqs"):
        vinterleaved.run_interleaved(JOBS, CONCURRENT, str(fake[1]), plain="plain", repeats=[0], concurrency=2)


def test_ngram_engines_start_last_and_never_two_in_one_process():
    ngram = lambda k: vjobs.Job("t", {"method": "ngram", "num_speculative_tokens": k})  # noqa: E731
    jobs = {"plain": vjobs.Job("t"), "ngram/k2": ngram(2), "peagle/k2": vjobs.Job("t", {"method": "eagle3"}),
            "ngram/k3": ngram(3), "peagle/k3": vjobs.Job("t", {"method": "eagle3"})}
    groups = vjobs.process_groups(jobs)
    assert [list(g) for g in groups] == [["plain", "peagle/k2", "peagle/k3", "ngram/k2"], ["ngram/k3"]]
    assert [list(g) for g in vjobs.process_groups({"ngram/k2": ngram(2)})] == [["ngram/k2"]]


def test_cpu_binding_takes_the_first_cpus_this_process_may_use():
    import os

    from specframe.errors import SpecframeError

    cpus = sorted(os.sched_getaffinity(0))
    assert vengine.cpu_binding() == ",".join(map(str, cpus))
    assert vengine.cpu_binding(1) == str(cpus[0])
    with pytest.raises(SpecframeError, match="may only run on"):
        vengine.cpu_binding(len(cpus) + 1)
    with pytest.raises(SpecframeError, match="must be positive"):
        vengine.cpu_binding(0)


def test_an_explicit_binding_overrides_the_environment_and_the_default_pins_every_cpu(monkeypatch):
    import os

    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="auto")
    monkeypatch.setattr(os, "environ", env)  # configure_environment writes the process environment
    vengine.configure_environment(vengine.EngineOptions(threads_bind="0"))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    env.pop("VLLM_CPU_OMP_THREADS_BIND")
    vengine.configure_environment(vengine.EngineOptions())
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == vengine.cpu_binding()
