"""Invariants that a plausible one-line slip broke while the whole fast suite still passed (issue 56, item 4): each
test here fails with that slip planted back, without vLLM or speculators (those suites skip themselves where they
are not installed, so they cannot be what catches it).

- the ``scheduled`` verifier's ``skip_drafting`` converts drafting seconds to the cost curve's unit by the forward the
  target actually ran (the verified length), not the drafted one, and the engine reports that length as verified;
- ``regenerate --capture``'s fallback pairs each conversation that has no staged states with its own states;
- the captured cache is in the order ``specframe prepare`` reads the same answers (the sources round-robin), not in
  the answers file's order;
- a DSpark export carries every key vLLM 0.32's ``update_dspark`` reads, each with the drafter's value (and the
  EAGLE-3, P-EAGLE and DFlash exports every key their readers take).
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from specframe import api, plugins
from specframe.cache import FeatureCache, prepare_cache
from specframe.data.regenerate import conversation, prompt_messages
from specframe.features import FeatureSpec
from tests.target_fixtures import chat_records

SPEC = FeatureSpec(aux_layers=(1, 2, 3), final_hidden=True)


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


needs_dspark = pytest.mark.skipif(not _installed("specframe-dspark"), reason="specframe-dspark is not installed")


# ------------------------------------------------------------------------------------- scheduled: skip_drafting


@needs_dspark
def test_skip_drafting_prices_drafting_by_the_forward_that_verified_not_the_draft_length():
    """``observe`` turns drafting seconds into curve units by the round's own target forward, which verified only
    the scheduled prefix: T(verified) / target_seconds. The curve here is cheap up to 3 tokens and steep at 4, and
    the schedule keeps 3 of a 4-token draft, so drafting as long as that forward is T(3) = 1.6 units and the draft
    pays (best E(3) / (1.6 + T(3)) = 3.439 / 3.2 > 1 / T(0)); priced by the drafted length it would be T(4) = 8
    units and drafting would be skipped."""
    cls = plugins.get("verifier", "scheduled")
    v = cls(cls.Options(cost_curve=[1.0, 1.2, 1.4, 1.6, 8.0], skip_drafting=True))
    v.bind(None)
    draft = api.Draft(tokens=torch.arange(4), confidence=torch.tensor([0.9, 0.9, 0.9, 0.1]))
    kept = v.schedule(draft)
    assert kept == 3  # the steep fourth token is not verified
    v.observe(api.RoundCost(drafted=4, verified=kept, accepted=0, draft_seconds=0.02, target_seconds=0.02))
    assert v.draft_budget(4) == 4
    # the same round with drafting at five times the forward (8 units) does not pay: the rule is live here
    w = cls(cls.Options(cost_curve=[1.0, 1.2, 1.4, 1.6, 8.0], skip_drafting=True))
    w.bind(None)
    w.schedule(draft)
    w.observe(api.RoundCost(drafted=4, verified=kept, accepted=0, draft_seconds=0.1, target_seconds=0.02))
    assert w.draft_budget(4) == 0


def test_the_engine_reports_the_scheduled_length_as_verified():
    """API 11's ``RoundCost`` as the reference engine fills it: ``drafted`` what the drafter proposed, ``verified`` what
    the target read after ``schedule`` cut the chain. The other budget test's verifier never schedules, so the two
    are equal there and a report of the drafted length as verified passed it; here the schedule keeps 1 of 3 and
    scheduled's ``skip_drafting`` prices drafting by that length (the test above)."""
    from specframe.inference import generate
    from tests.decoding_helpers import OracleDrafter, naive_greedy, random_llama

    greedy = plugins.get("verifier", "greedy")

    class Cutting(greedy):
        def __init__(self):
            super().__init__()
            self.seen = []

        def schedule(self, draft):
            return 1

        def observe(self, cost):
            self.seen.append(cost)

    model, prompt = random_llama(), [5, 9, 200, 7]
    v = Cutting()
    gen = generate(model, torch.tensor(prompt), v, OracleDrafter(naive_greedy(model, prompt, 12), 256), k=3,
                   max_new_tokens=12, eos_token_id=())
    assert len(v.seen) == len(gen.rounds) > 1
    for cost, r in zip(v.seen[:-1], gen.rounds[:-1], strict=True):  # the last round may be cut by max_new_tokens
        assert (cost.drafted, cost.verified, r.nodes) == (3, 1, 1)


# ------------------------------------------------------------------------------------- regenerate --capture


def _hf_states(target, layer_ids):
    from tests.vllm_integration.test_feature_engines import HFStates

    return HFStates(target, layer_ids)


def _staged(tmp_path, target):
    from specframe.feature_engines import engine_layer_ids
    from specframe.vllm.capture import StagedStates, staging_folder

    staged = StagedStates(staging_folder(tmp_path / "cache"), engine_layer_ids(SPEC, target.num_layers))
    staged.start({"engine": "hf-stand-in", "dtype": "fp32"})
    return staged


def _answers(records):
    """Answer rows as regenerate writes them (sorted by source, then id), one distinct answer per prompt."""
    rows = [{"source": r["source"], "id": r["id"], "answer": f"answer {r['source']} {r['id']}: the fox jumps " * 2}
            for r in records]
    return sorted(rows, key=lambda r: (r["source"], int(r["id"]) if r["id"].isdigit() else r["id"]))


def _by_conversation(cache):
    return {(x.source, x.id): x for x in cache}


def test_the_capture_fallback_gives_each_missing_conversation_its_own_states(tmp_path, tiny):  # noqa: F811
    """Conversations answered before ``--capture`` have no staged states; the live engine computes them at the end.
    Each must get its own: with the first conversations staged and the last ones missing, every conversation's
    stored states equal what the transformers path computes for that conversation (prepare's cache). The gate
    checks only the first ``gate_sequences`` (staged here), so it cannot catch states attached to the wrong answer."""
    from specframe.vllm.capture import stage_conversations, write_captured_cache

    recs = chat_records(6, turns=1)
    rows = _answers(recs)
    prompts = {(r["source"], r["id"]): prompt_messages(r["messages"]) for r in recs}
    convs = [conversation(prompts[(r["source"], r["id"])], r) for r in rows]
    staged = _staged(tmp_path, tiny)
    engine = _hf_states(tiny, staged.layer_ids)
    stage_conversations(convs[:2], tiny.tokenizer, 512, staged, engine)  # the rest was answered without capture
    staged.fallback = engine
    write_captured_cache(tiny, recs, rows, tmp_path / "cache", staged, SPEC, data_name="x", max_length=512,
                         dtype="float32", draft_vocab=None, gate_sequences=1)
    assert engine.calls[-1] == 4  # the four missing conversations went to the fallback, once
    prepare_cache(tiny, convs, tmp_path / "ref", spec=SPEC, dtype="float32", max_length=512, draft_vocab=None)
    got, ref = _by_conversation(FeatureCache(tmp_path / "cache")), _by_conversation(FeatureCache(tmp_path / "ref"))
    assert sorted(got) == sorted(ref) and len(got) == len(recs)
    for key, x in got.items():
        y = ref[key]
        assert torch.equal(x.tokens, y.tokens), key
        assert x.aux_hidden.shape == y.aux_hidden.shape and torch.allclose(x.aux_hidden, y.aux_hidden, atol=1e-5), key
        assert torch.allclose(x.final_hidden, y.final_hidden, atol=1e-5), key


def test_the_captured_cache_is_in_prepares_order_for_a_set_of_several_sources(tmp_path, tiny):  # noqa: F811
    """``specframe prepare`` reads a set of answers round-robin over its sources (``load_default``, so that a prefix
    of the set mixes them), while regenerate writes the answers file sorted by source. With two sources of unequal
    size the two orders differ, and the captured cache must follow prepare's: the same conversations in the same
    order, each with the same states."""
    from specframe.data.default import default_prompt_records, load_default
    from specframe.vllm.capture import stage_conversations, write_captured_cache

    recs = default_prompt_records(n_sharegpt=2, n_gsm8k=3)
    rows = _answers(recs)
    path = tmp_path / "answers.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    file_order = [(r["source"], r["id"]) for r in rows]
    prepared = list(load_default(path=path))  # what `specframe prepare` trains on for this answers file
    order = [(c["source"], str(c["id"])) for c in prepared]
    assert sorted(order) == sorted(file_order) and order != file_order  # the case where the orders differ
    assert [s for s, _ in order] == ["gsm8k", "sharegpt", "gsm8k", "sharegpt", "gsm8k"]

    staged = _staged(tmp_path, tiny)
    prompts = {(r["source"], r["id"]): prompt_messages(r["messages"]) for r in recs}
    stage_conversations([conversation(prompts[(r["source"], r["id"])], r) for r in rows], tiny.tokenizer, 512, staged,
                        _hf_states(tiny, staged.layer_ids))
    write_captured_cache(tiny, recs, rows, tmp_path / "cache", staged, SPEC, data_name="x", max_length=512,
                         dtype="float32", draft_vocab=32, gate_sequences=1)
    prepare_cache(tiny, [dict(c) for c in prepared], tmp_path / "ref", spec=SPEC, dtype="float32", max_length=512,
                  draft_vocab=32)
    got, ref = list(FeatureCache(tmp_path / "cache")), list(FeatureCache(tmp_path / "ref"))
    assert [(x.source, x.id) for x in got] == [(y.source, y.id) for y in ref] == order
    for x, y in zip(got, ref, strict=True):
        assert torch.equal(x.tokens, y.tokens)
        assert torch.allclose(x.aux_hidden, y.aux_hidden, atol=1e-5)


# ------------------------------------------------------------------------------------- DSpark export keys

#: the keys vLLM 0.32's speculators reader takes from a DSpark config.json, in
#: vllm/transformers_utils/configs/speculators/algos.py, ``update_dspark``: ``architectures`` (absent or unknown:
#: Qwen3DSparkModel), ``config_dict["aux_hidden_state_layer_ids"]``, ``config_dict.get("sample_from_anchor", False)``
#: and the loop over the tuple of the rest (each read only when not None, so a misspelt key is silently a vLLM
#: default). Checked against the installed vLLM's source below.
VLLM_DSPARK_KEYS = frozenset({
    "architectures", "aux_hidden_state_layer_ids", "sample_from_anchor", "draft_vocab_size", "target_hidden_size",
    "mask_token_id", "markov_rank", "markov_head_type", "block_size", "enable_confidence_head",
    "confidence_head_with_markov", "use_aux_hidden_state",
})


def _keys_read(source: str, function: str) -> set[str]:
    """The string keys ``function`` reads from its ``config_dict``: subscripts, ``.get`` calls, and the constants of a
    tuple it loops over to read each."""
    tree = ast.parse(source)
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    keys: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "config_dict" \
                and isinstance(node.slice, ast.Constant):
            keys.add(node.slice.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "config_dict" and node.args \
                and isinstance(node.args[0], ast.Constant):
            keys.add(node.args[0].value)
        elif isinstance(node, ast.For) and isinstance(node.iter, ast.Tuple) and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.iter.elts):
            keys.update(e.value for e in node.iter.elts)
    return keys


#: the same for the other exports vLLM reads through the speculators reader (same file; ``update_dflash`` also reads
#: ``sample_from_anchor`` and ``sliding_window_non_causal``, whose defaults, the anchor a bonus token and non-causal
#: attention, are DFlash's own, so its export leaves them to vLLM)
VLLM_KEYS = {
    "update_dspark": VLLM_DSPARK_KEYS,
    "update_dflash": frozenset({"draft_vocab_size", "target_hidden_size", "mask_token_id",
                                "aux_hidden_state_layer_ids"}),
    "update_eagle3": frozenset({"draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids",
                                "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"}),
    "update_peagle": frozenset({"draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids",
                                "mask_token_id", "norm_before_residual", "norm_before_fc"}),
}
LEFT_TO_VLLM = {"update_dflash": frozenset({"sample_from_anchor", "sliding_window_non_causal"})}


@pytest.mark.parametrize("function", sorted(VLLM_KEYS))
def test_the_pinned_keys_are_what_the_installed_vllm_reads(function):
    """The lists above stay vLLM's: read from the installed vLLM's source text (never imported: it takes a minute and
    raises the test process's memory for good)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed: the pinned lists are checked against its source where it is")
    algos = Path(next(iter(spec.submodule_search_locations))) / "transformers_utils/configs/speculators/algos.py"
    if not algos.exists():
        pytest.skip(f"this vLLM has no {algos.name} (another version than the 0.32 the lists were read from)")
    read = _keys_read(algos.read_text(encoding="utf-8"), function)
    assert read == VLLM_KEYS[function] | LEFT_TO_VLLM.get(function, frozenset())


@needs_dspark
def test_a_dspark_export_writes_every_key_vllm_reads_with_the_drafters_value(tmp_path, tiny):  # noqa: F811
    cls = plugins.get("drafter", "dspark")
    torch.manual_seed(0)
    drafter = cls(tiny.config, cls.Options(layers=1, block_size=4, aux_layer_ids=[1, 3], markov_rank=8))
    ids = torch.randint(7, tiny.config.vocab_size, (12,))
    example = api.TrainingExample(ids, torch.ones(12, dtype=torch.bool), torch.zeros(12, dtype=torch.long))
    drafter.prepare(tiny, [example])
    drafter.export_vllm(tmp_path / "out", tiny.tokenizer)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    missing = sorted(VLLM_DSPARK_KEYS - set(cfg))
    assert not missing, f"the DSpark export lacks keys vLLM's update_dspark reads: {missing}"
    o = drafter.options
    assert cfg["architectures"] == ["Qwen3DSparkModel"]
    assert cfg["aux_hidden_state_layer_ids"] == list(drafter.aux_layer_ids) == [1, 3]
    assert (cfg["block_size"], cfg["markov_rank"], cfg["markov_head_type"]) == (4, 8, o.markov_head_type)
    assert cfg["mask_token_id"] == drafter.mask_token_id
    assert cfg["draft_vocab_size"] == tiny.config.vocab_size and cfg["target_hidden_size"] == tiny.config.hidden_size
    assert cfg["enable_confidence_head"] is o.confidence_head
    assert cfg["confidence_head_with_markov"] is (o.confidence_head and o.confidence_head_with_markov)
    assert cfg["use_aux_hidden_state"] is True and isinstance(cfg["sample_from_anchor"], bool)


@pytest.mark.parametrize("drafter_name, function, options", [
    ("eagle3", "update_eagle3", {}),
    ("peagle", "update_peagle", {"layers": 1}),
    ("dflash", "update_dflash", {"layers": 1, "block_size": 4, "aux_layer_ids": [1, 3]}),
])
def test_an_export_writes_every_key_vllm_reads(tmp_path, tiny, drafter_name, function, options):  # noqa: F811
    """A misspelt key is a vLLM default, silently, unless each key the reader takes is checked for here."""
    if drafter_name not in plugins.load().names("drafter"):
        pytest.skip(f"the {drafter_name} drafter is not installed")
    cls = plugins.get("drafter", drafter_name)
    torch.manual_seed(0)
    drafter = cls(tiny.config, cls.Options(**options))
    ids = torch.randint(7, tiny.config.vocab_size, (12,))
    example = api.TrainingExample(ids, torch.ones(12, dtype=torch.bool), torch.zeros(12, dtype=torch.long))
    drafter.prepare(tiny, [example])
    drafter.export_vllm(tmp_path / "out", tiny.tokenizer)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    missing = sorted(VLLM_KEYS[function] - set(cfg))
    assert not missing, f"the {drafter_name} export lacks keys vLLM's {function} reads: {missing}"
    aux = "aux_hidden_state_layer_ids" if drafter_name == "dflash" else "eagle_aux_hidden_state_layer_ids"
    assert cfg[aux] == list(drafter.aux_layer_ids)
    assert cfg["target_hidden_size"] == tiny.config.hidden_size
    assert cfg["draft_vocab_size"] == (getattr(drafter, "draft_vocab_size", None) or tiny.config.vocab_size)
    if "mask_token_id" in VLLM_KEYS[function]:
        assert cfg["mask_token_id"] == drafter.mask_token_id
