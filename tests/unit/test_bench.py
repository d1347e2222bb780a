"""``specframe.bench``: prompts, verifiers, the interleaved comparison and its ratios (tiny target, in process)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from specframe import bench
from specframe.errors import SpecframeError, UnknownNameError, UsageError
from tests.train_fixtures import build


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from specframe.targets import load_target

    torch.set_num_threads(1)
    folder, _ = build(tmp_path_factory.mktemp("bench"))
    return load_target(folder)


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [
        {"id": "q1", "messages": [{"role": "user", "content": "the quick brown fox the quick brown fox"},
                                  {"role": "assistant", "content": "ignored: the target answers"},
                                  {"role": "user", "content": "and the lazy dog?"}]},
        {"id": "q2", "messages": [{"role": "user", "content": "how many clips sold in april and may"}]},
        {"id": "q3", "messages": [{"role": "user", "content": "not read with --num-prompts 2"}]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_interval_is_a_geometric_mean_with_a_student_t_band():
    same = bench.Interval.of([2.0, 2.0, 2.0])
    assert same.mean == pytest.approx(2.0) and same.low == pytest.approx(2.0) and same.high == pytest.approx(2.0)
    spread = bench.Interval.of([1.0, 4.0])
    assert spread.mean == pytest.approx(2.0) and spread.median == pytest.approx(2.5)
    half = 12.706 * math.log(4.0) / math.sqrt(2) / math.sqrt(2)  # sd of (0, ln 4) is ln4 / sqrt 2
    assert spread.low == pytest.approx(2.0 * math.exp(-half)) and spread.high == pytest.approx(2.0 * math.exp(half))
    one = bench.Interval.of([1.5])
    assert one.mean == pytest.approx(1.5) and one.low is None and one.high is None
    assert math.isnan(bench.Interval.of([1.0, 0.0]).mean)
    assert bench.t975(4) == pytest.approx(2.776) and bench.t975(1000) == pytest.approx(1.96)


def test_prompts_from_a_file_keep_user_turns_in_order(prompt_file):
    prompts = bench.load_prompts(str(prompt_file), 2)
    assert [p.id for p in prompts] == ["q1", "q2"]
    assert prompts[0].turns == ("the quick brown fox the quick brown fox", "and the lazy dog?")


def test_builtin_prompt_sets_follow_the_protocol():
    mt = bench.load_prompts("mt-bench", 2)
    assert len(mt) == 2 and all(len(p.turns) == 2 for p in mt)
    gsm = bench.load_prompts("gsm8k", 3)
    assert [p.id for p in gsm] == ["0", "1", "2"] and len(gsm[0].turns) == 1
    assert len(bench.load_prompts("humaneval", 1)[0].turns) == 1


def test_unknown_names_and_bad_values_are_refused(tmp_path):
    with pytest.raises(UnknownNameError, match="did you mean 'mt-bench'"):
        bench.load_prompts("mt-bnch", 2)
    with pytest.raises(UsageError, match="--num-prompts must be positive"):
        bench.load_prompts("gsm8k", 0)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"id": "x", "messages": [{"role": "assistant", "content": "hi"}]}) + "\n")
    with pytest.raises(SpecframeError, match="no user message"):
        bench.load_prompts(str(empty))
    with pytest.raises(UnknownNameError, match="did you mean 'greedy'"):
        bench.make_verifier("gredy")
    with pytest.raises(UsageError, match="has no temperature option"):
        bench.make_verifier("greedy", temperature=0.7)
    assert bench.make_verifier("sampling", temperature=0.5).options.temperature == 0.5
    with pytest.raises(UsageError, match="k must be positive"):
        bench.plugin_method("ngram", None, k=0)


def test_a_verifier_spec_gives_options_checked_by_the_verifier():
    """``--also-verifier NAME:KEY=VALUE,..``: values read as JSON (a list's commas stay inside it), the options built
    and checked by the verifier's own ``Options``; a bad item, an unknown key or a bad value is one clear error."""
    label, v = bench.verifier_spec("scheduled:skip_drafting=true, max_skip=4,cost_curve=[1.0,2.0]")
    assert label == "scheduled:skip_drafting=true, max_skip=4,cost_curve=[1.0,2.0]"
    assert (v.name, v.options.skip_drafting, v.options.max_skip, v.options.cost_curve) == ("scheduled", True, 4, [1.0, 2.0])
    assert bench.verifier_spec("scheduled")[1].options.skip_drafting is False
    assert bench.verifier_spec("greedy")[1].name == "greedy"
    for bad, message in [("scheduled:max_skip", "is not KEY=VALUE"), ("scheduled:skip=true", "unknown key 'skip'"),
                         ("scheduled:max_skip=0", "'max_skip' must be a positive integer"),
                         ("greedy:x=1", "unknown key 'x'"), ("nosuch", "unknown verifier 'nosuch'")]:
        with pytest.raises((UsageError, UnknownNameError), match=message):
            bench.verifier_spec(bad)


def test_generate_and_bench_take_verifier_and_drafter_options_inline():
    """``--verifier sampling:temperature=0.5`` and ``--drafter ngram:n_max=4`` (issue 55, item 2): the one inline
    syntax, built through compose; a sampling flag and the same inline key both given is refused."""
    assert bench.make_verifier("sampling:temperature=0.5,top_k=4").options.temperature == 0.5
    assert bench.make_verifier("sampling:top_k=4", temperature=0.7).options.top_k == 4
    with pytest.raises(UsageError, match="both set temperature: give it once"):
        bench.make_verifier("sampling:temperature=0.5", temperature=0.7)
    with pytest.raises(UsageError, match="verifier 'sampling' options: unknown key 'temp'"):
        bench.make_verifier("sampling:temp=0.5")
    method = bench.plugin_method("ngram:n_max=4", None, k=3)
    assert (method.label, method.drafter.options.n_max) == ("ngram:n_max=4", 4)
    assert bench.plugin_method("ngram", None, k=3).label == "ngram"
    with pytest.raises(UsageError, match="drafter 'ngram' options: n_max must be an integer"):
        bench.plugin_method("ngram:n_max=x", None)


def test_comparison_is_interleaved_lossless_and_answers_later_turns(target, prompt_file, monkeypatch):
    prompts = bench.load_prompts(str(prompt_file), 2)
    calls: list[tuple[str, tuple[int, ...]]] = []
    budgets: list[int] = []
    real_decode = bench.reference.decode

    def spy(model, ids, verifier, method, **kw):
        calls.append((method.label, tuple(ids.tolist())))
        budgets.append(kw["max_new_tokens"])
        return real_decode(model, ids, verifier, method, **kw)

    monkeypatch.setattr(bench.reference, "decode", spy)  # compare calls the decode of its own module
    methods = [bench.plugin_method("ngram", target.config, k=3, label="ngram3"),
               bench.plugin_method("ngram", target.config, k=5, label="ngram5")]
    result = bench.compare(target.model, target.tokenizer, prompts, methods, bench.make_verifier("greedy"),
                           repeats=3, max_new_tokens=24, max_remeasure=0)  # timing noise must not add repeats

    # first, one short untimed warm-up decode of the first prompt per method, none of it recorded
    assert [label for label, _ in calls[:3]] == ["plain", "ngram3", "ngram5"] and budgets[:3] == [16] * 3
    assert len({ids for _, ids in calls[:3]}) == 1 and budgets[3:] == [24] * (len(budgets) - 3)
    assert sum(len(v) for v in result.records.values()) == len(calls) - 3
    del calls[:3]

    # every prompt turn runs each method back to back; the order rotates per repeat
    orders = [[label for label, _ in calls[i:i + 3]] for i in range(0, len(calls), 3)]
    assert len(orders) == 3 * 3
    assert orders[0] == ["plain", "ngram3", "ngram5"]
    assert orders[3] == ["ngram3", "ngram5", "plain"] and orders[6] == ["ngram5", "plain", "ngram3"]
    assert all(len({ids for _, ids in calls[i:i + 3]}) == 1 for i in range(0, len(calls), 3))

    # the second MT-Bench-style turn follows plain decoding's own first answer
    first = next(r for r in result.records["plain"] if (r.prompt, r.turn, r.repeat) == ("q1", 0, 0))
    answer = target.tokenizer.decode(list(first.tokens), skip_special_tokens=True).strip()
    expected = bench.chat_ids(target.tokenizer, [
        {"role": "user", "content": prompts[0].turns[0]}, {"role": "assistant", "content": answer},
        {"role": "user", "content": prompts[0].turns[1]},
    ])
    assert calls[3][1] == tuple(expected.tolist())

    summary = result.summary()
    assert summary["prompt_turns"] == 3 and summary["repeats"] == 3 and summary["greedy"]
    for label in ("ngram3", "ngram5"):
        m = summary["methods"][label]
        assert m["lossless"] is True and not result.mismatches(label)
        assert 1.0 <= m["acceptance_length"] <= m["k"] + 1
        assert len(m["per_slot"]) == m["k"] and m["draft_seconds_per_round"] > 0
        interval = m["speedup_interval"]
        # a repeat flagged by timing noise (tiny target: a cold first repeat) is left out of the interval
        assert interval["repeats"] + len(m.get("speedup_excluded_repeats", [])) == 3
        assert interval["low"] is None or interval["low"] <= interval["mean"] <= interval["high"]
    # the prompt repeats itself, so prompt lookup must find something
    assert summary["methods"]["ngram5"]["acceptance_length"] > 1.0
    assert set(summary["ratios"]) == {"ngram3 / ngram5"}
    assert summary["methods"]["plain"]["acceptance_length"] == 1.0
    rows = result.per_prompt()
    assert len(rows) == 3 * 3 and all(len(r["otps"]) == 3 for r in rows)


def test_token_budget_reads_the_checkpoint(tmp_path):
    (tmp_path / "state.json").write_text(json.dumps({"step": 7, "data_position": 14}))
    (tmp_path / "config.json").write_text(json.dumps({"batch_size": 2, "seq_len": 48}))
    assert bench.token_budget(tmp_path) == 7 * 2 * 48
    (tmp_path / "state.json").write_text(json.dumps({"step": 7, "tokens_seen": 555}))
    assert bench.token_budget(tmp_path) == 555


def test_drafter_cost_counts_decode_rounds_only(target):
    import time

    method = bench.plugin_method("ngram", target.config, k=3)
    drafter = method.drafter
    real_accept, calls = drafter.accept, []

    def accept(emitted, features):  # the prefill's token is committed before the decode phase starts
        calls.append(len(emitted))
        if len(calls) == 1:
            time.sleep(0.3)
        real_accept(emitted, features)

    drafter.accept = accept
    ids = bench.chat_ids(target.tokenizer, [{"role": "user", "content": "the quick brown fox"}])
    trial = bench.decode(target.model, ids, bench.make_verifier("greedy"), method, max_new_tokens=8)
    assert len(calls) >= 2 and 0 < trial.draft_seconds < 0.3


def test_provenance_names_each_checkpoint_once():
    from types import SimpleNamespace

    target = SimpleNamespace(id="tiny", weights_hash="abc")
    peagle, eagle3 = SimpleNamespace(name="peagle"), SimpleNamespace(name="eagle3")
    one = [bench.Method(f"peagle/k{k}", peagle, k, checkpoint="/r/p", checkpoint_hash="sha256:p", token_budget=96)
           for k in (3, 5)]
    prov = bench.results_provenance(target, [bench.Method("ngram/k5", object()), *one], ["specframe", "bench"])
    assert prov["drafter_checkpoint_hash"] == "sha256:p" and prov["token_budget"] == 96
    assert prov["target"] == {"id": "tiny", "weights_hash": "abc"} and prov["command"] == "specframe bench"
    two = [*one, bench.Method("eagle3/k5", eagle3, 5, checkpoint="/r/e", checkpoint_hash="sha256:e", token_budget=48)]
    prov = bench.results_provenance(target, two)
    assert prov["drafter_checkpoint_hash"] == {"peagle": "sha256:p", "eagle3": "sha256:e"}
    assert prov["token_budget"] == {"peagle": 96, "eagle3": 48}
    assert bench.results_provenance(target, [bench.Method("ngram/k5", object())])["token_budget"] is None


def _fake_comparison(spec_seconds: list[float], al: float = 2.0, tokens: int = 10) -> bench.Comparison:
    """Plain decoding at 1 s per repeat for ``tokens`` tokens; a method emitting the same tokens in tokens / al
    rounds, taking ``spec_seconds[i]`` in repeat i (its speedup there is 1 / spec_seconds[i])."""
    from specframe.metrics import PromptMetrics

    def record(repeat, seconds, forwards):
        accepted = tuple([int(tokens / forwards) - 1] * forwards)
        metrics = PromptMetrics(tokens, forwards, accepted, tuple([3] * forwards), seconds)
        return bench.Record("q", 0, repeat, 4, tuple(range(tokens)), metrics, 0.0)

    rounds = int(tokens / al)
    methods = [bench.Method(bench.PLAIN), bench.Method("fake/k3", None, 3)]
    records = {bench.PLAIN: [record(i, 1.0, tokens) for i in range(len(spec_seconds))],
               "fake/k3": [record(i, s, rounds) for i, s in enumerate(spec_seconds)]}
    return bench.Comparison(methods, records, len(spec_seconds), True)


def test_speed_flags_catch_ratios_above_the_physical_bound_and_outliers():
    # AL 2: a speedup above 2 x 1.05 is impossible (a round costs at least one target forward)
    assert bench.speed_flags([1.5, 1.6, 1.4], [2.0, 2.0, 2.0]) == []
    flags = bench.speed_flags([1.5, 2.2, 1.4], [2.0, 2.0, 2.0])
    assert [f["repeat"] for f in flags] == [1] and "physical bound" in flags[0]["reasons"][0]
    # more than 2x off the median: a slow repeat and a fast one (within the bound) are both flagged
    flags = bench.speed_flags([1.0, 1.0, 0.4, 1.0, 2.05], [3.0] * 5)
    assert [f["repeat"] for f in flags] == [2, 4] and all("off the median" in f["reasons"][0] for f in flags)
    assert bench.speed_flags([float("nan")], [2.0])[0]["reasons"] == ["not a positive finite ratio"]


def test_round_cost_and_break_even_al():
    c = _fake_comparison([0.8, 0.8])  # 5 rounds in 0.8 s against 10 plain steps in 1 s: R = 0.16 / 0.1
    m = c.summary()["methods"]["fake/k3"]
    assert m["round_cost_ratio"] == pytest.approx(1.6) and m["break_even_al"] == pytest.approx(1.6)
    assert m["speedup"] == pytest.approx(1.25) == pytest.approx(m["acceptance_length"] / m["round_cost_ratio"])
    assert m["speed_flags"] == [] and "speedup_excluded_repeats" not in m


def test_flagged_repeats_are_measured_again_and_never_reported():
    # repeat 2 ran 10x faster than physics allows (speedup 5 at AL 2); measuring it again gives a sane 1.25
    c = _fake_comparison([0.8, 0.8, 0.2, 0.8, 0.8])
    assert c.flagged_repeats() == [2]
    reruns = []

    def run_repeat(repeat, seconds=0.8):
        reruns.append(repeat)
        fresh = _fake_comparison([seconds] * (repeat + 1))
        for label in c.records:
            c.records[label] += [r for r in fresh.records[label] if r.repeat == repeat]

    bench.remeasure(c, run_repeat)
    m = c.summary()["methods"]["fake/k3"]
    assert reruns == [2] and c.remeasured == 1 and m["speed_flags"] == []
    assert m["speedup_interval"]["mean"] == pytest.approx(1.25) and m["speedup_interval"]["repeats"] == 5

    # a repeat that stays implausible is measured again a bounded number of times, then left out and listed
    c = _fake_comparison([0.8, 0.8, 0.2, 0.8, 0.8])
    reruns.clear()
    bench.remeasure(c, lambda r: run_repeat(r, seconds=0.2), max_rounds=3)
    summary = c.summary()
    m = summary["methods"]["fake/k3"]
    assert reruns == [2, 2, 2] and summary["remeasured_repeats"] == 3
    assert [f["repeat"] for f in m["speed_flags"]] == [2] and m["speedup_excluded_repeats"] == [2]
    assert m["speedup_interval"]["repeats"] == 4 and max(m["speedup_interval"]["values"]) < 2.0 * 1.05
    assert m["speedup"] == pytest.approx(1.25)


def test_drafters_without_trees_are_measured_and_labelled_as_chains(target):
    from specframe import plugins
    from specframe.inference.engine import TreeShape

    assert plugins.get("drafter", "eagle3").builds_trees
    assert not any(plugins.get("drafter", n).builds_trees for n in ("peagle", "pard", "parallelspec", "ngram"))
    tree = TreeShape(4, 2, 8)
    m = bench.plugin_method("ngram", target.config, k=5, tree=tree)
    assert m.tree is None and m.k == 4  # ngram's propose_tree is its chain of the tree's depth
    from specframe.cli.bench_cmd import _label

    _label([m])
    assert m.label == "ngram/k4"


def test_a_method_under_its_own_verifier_runs_beside_the_same_drafter_under_the_runs(target, prompt_file):
    prompts = bench.load_prompts(str(prompt_file), 2)
    greedy = bench.make_verifier("greedy")

    class OneToken(type(greedy)):
        """Greedy, verifying only the first draft token of each round (a schedule, as DSpark's verifier makes)."""

        name = "one-token"

        def schedule(self, draft):
            return min(1, len(draft))

    base = bench.plugin_method("ngram", target.config, k=4, label="ngram")
    import attrs

    twin = attrs.evolve(base, label="ngram+one-token", verifier=OneToken(greedy.options))
    result = bench.compare(target.model, target.tokenizer, prompts, [base, twin], greedy, repeats=1,
                           max_new_tokens=24, max_remeasure=0)
    summary = result.summary()
    one, whole = summary["methods"]["ngram+one-token"], summary["methods"]["ngram"]
    assert summary["greedy"] and one["lossless"] and whole["lossless"]
    assert one["verifier"] == "one-token" and "verifier" not in whole
    # the twin really ran under its own verifier: never more than one draft token accepted per round
    assert list(one["per_slot"][1:]) == [0.0] * 3 and whole["per_slot"][1] > 0 and one["acceptance_length"] <= 2.0
    # a sampling twin makes the run's outputs free to differ from plain decoding's: no lossless claim is made
    sampled = attrs.evolve(base, label="ngram+sampling", verifier=bench.make_verifier("sampling", temperature=1.0))
    loose = bench.compare(target.model, target.tokenizer, prompts[:1], [base, sampled], greedy, repeats=1,
                          max_new_tokens=8, max_remeasure=0, warmup=0).summary()
    assert not loose["greedy"] and "lossless" not in loose["methods"]["ngram"]
