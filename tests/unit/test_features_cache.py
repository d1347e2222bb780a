"""Feature capture conventions and the feature cache: build, reload, resume after SIGKILL, refusal, online parity."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specframe.cache import FeatureCache, OnlineFeatures, prepare_cache
from specframe.errors import SpecframeError
from specframe.features import FeatureSpec, capture_features, low_mid_high_layers, target_logits
from specframe.targets import load_target, tiny_target
from tests.target_fixtures import chat_records

REPO = Path(__file__).resolve().parents[2]


def test_low_mid_high_layers():
    assert low_mid_high_layers(30) == (2, 15, 27)  # SmolLM2, as vLLM picks
    assert low_mid_high_layers(32) == (2, 16, 29)
    assert low_mid_high_layers(4) == (1, 2, 3)  # tiny: made valid and distinct
    assert low_mid_high_layers(1) == (0, 0, 0)
    with pytest.raises(SpecframeError, match=r"aux layer id 4 out of range for a target with 4 layers \(0..3\)"):
        FeatureSpec(aux_layers=(0, 4)).validate(4)


def test_capture_matches_hidden_state_convention(tiny):  # noqa: F811
    ids = torch.randint(10, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    spec = FeatureSpec(aux_layers=(0, 3, 1), final_hidden=True)
    f = capture_features(tiny, ids, spec)
    with torch.no_grad():
        out = tiny.model(ids, output_hidden_states=True)
    hs = out.hidden_states  # hs[i] = input of decoder layer i (hs[0] = embeddings); hs[-1] = after the final norm
    h = tiny.hidden_size
    assert f.aux.shape == (2, 12, 3 * h)
    for j, layer in enumerate((0, 3, 1)):
        assert torch.equal(f.aux[..., j * h : (j + 1) * h], hs[layer])
    assert torch.equal(f.aux[..., :h], tiny.model.get_input_embeddings()(ids))
    assert torch.allclose(f.final, hs[-1])
    assert torch.allclose(target_logits(tiny, f.final), out.logits, atol=1e-5)
    sub = [7, 3, 100]
    assert torch.allclose(target_logits(tiny, f.final, sub), out.logits[..., sub], atol=1e-5)
    assert capture_features(tiny, ids, FeatureSpec(aux_layers=None, final_hidden=False)).aux is None


def test_target_logits_move_the_hidden_state_to_the_heads_device(tiny):  # noqa: F811
    """Under --device-map the head may sit on another device than the final hidden state (GPU-path review item 15);
    the meta device stands in for that other GPU here."""
    import copy

    model = copy.deepcopy(tiny.model)
    model.get_output_embeddings().to("meta")
    final = torch.randn(2, 5, tiny.hidden_size)
    logits = target_logits(model, final)
    assert logits.device.type == "meta" and logits.shape == (2, 5, model.config.vocab_size)
    assert logits.dtype == torch.float32 and target_logits(model, final, [7, 3, 100]).shape == (2, 5, 3)


def _sharegpt_20():
    """The first 20 ShareGPT conversations, first exchange, clipped to 300 characters per turn (the tiny target's
    tokenizer spends about a token per character)."""
    from specframe.data.sources import load_sharegpt

    out = []
    for r in load_sharegpt(limit=20):
        msgs = [{"role": m["role"], "content": m["content"][:300]} for m in r["messages"][:2]]
        out.append({"source": r["source"], "id": r["id"], "messages": msgs})
    return out


def test_cache_for_20_sharegpt_conversations_builds_and_reloads(tmp_path, tiny):  # noqa: F811
    recs = _sharegpt_20()
    rep = prepare_cache(tiny, recs, tmp_path / "c", dtype="float32", max_length=1024, shard_size=8, draft_vocab=64)
    assert rep.examples == 20 and rep.shards == 3 and rep.encode.skipped == 0
    cache = FeatureCache(tmp_path / "c", target=tiny)
    assert len(cache) == 20 and cache.aux_layers == (1, 2, 3)
    assert cache.vocab.size == 64 and 0 < cache.vocab.coverage <= 1
    online = OnlineFeatures(tiny, recs, max_length=1024)
    assert len(online) == 20
    for a, b, r in zip(cache, online, recs):
        assert (a.source, a.id) == ("sharegpt", r["id"]) == (b.source, b.id)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.loss_mask, b.loss_mask)
        assert a.loss_mask.any() and a.aux_hidden.shape == (len(a.tokens), 3 * tiny.hidden_size)
        # batched (right-padded) vs one-by-one forward: same features up to float noise
        assert torch.allclose(a.aux_hidden, b.aux_hidden, atol=1e-4)
        assert torch.allclose(a.final_hidden, b.final_hidden, atol=1e-4)
    assert cache[-1].id == recs[-1]["id"]


def _prepare_cmd(data, out, kill_after=None):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("SPECFRAME_TEST_KILL_AFTER_SHARD", None)
    if kill_after is not None:
        env["SPECFRAME_TEST_KILL_AFTER_SHARD"] = str(kill_after)
    return subprocess.run(
        [sys.executable, "-c", "from specframe.cli import main; main()", "prepare", "--target", str(data["target"]),
         "--data", str(data["file"]), "--output", str(out), "--shard-size", "4", "--draft-vocab", "32", "--json"],
        env=env, capture_output=True, text=True, timeout=600,
    )


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_failed_prepare_resumes_to_the_same_bytes(tmp_path, tiny):  # noqa: F811
    """In-process version (an injected failure after the first shard); the SIGKILL version is marked slow."""
    recs = chat_records(10)

    class Boom(Exception):
        pass

    def fail_after_first(k):
        if k == 0:
            raise Boom

    with pytest.raises(Boom):
        prepare_cache(tiny, recs, tmp_path / "a", shard_size=4, draft_vocab=32, _after_shard=fail_after_first)
    assert not json.loads((tmp_path / "a" / "manifest.json").read_text())["complete"]
    assert prepare_cache(tiny, recs, tmp_path / "a", shard_size=4, draft_vocab=32).shards_reused == 1
    prepare_cache(tiny, recs, tmp_path / "b", shard_size=4, draft_vocab=32)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    assert not [p for p in (tmp_path / "a").iterdir() if ".tmp-" in p.name]


@pytest.mark.slow
def test_killed_prepare_resumes_to_the_same_bytes(tmp_path, tiny):  # noqa: F811
    data_file = tmp_path / "chats.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in chat_records(10)))
    data = {"target": tiny.path, "file": data_file}
    killed = _prepare_cmd(data, tmp_path / "a", kill_after=0)
    assert killed.returncode == -9, killed.stderr
    man = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert not man["complete"] and [s["file"] for s in man["shards"]] == ["shard-00000.safetensors"]
    with pytest.raises(SpecframeError, match=r"is incomplete \(1/3 shards\); rerun the same `specframe prepare`"):
        FeatureCache(tmp_path / "a")
    resumed = _prepare_cmd(data, tmp_path / "a")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["shards_reused"] == 1
    fresh = _prepare_cmd(data, tmp_path / "b")
    assert fresh.returncode == 0, fresh.stderr
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    assert len(FeatureCache(tmp_path / "a")) == 10


def test_cache_for_another_target_or_config_is_refused(tmp_path, tiny):  # noqa: F811
    recs = chat_records(4)
    prepare_cache(tiny, recs, tmp_path / "c", shard_size=2, draft_vocab=16)
    with pytest.raises(SpecframeError, match=r"holds a feature cache made for another target/data/config \(aux_layers: "
                                             r"cache has \[1, 2, 3\], asked \[0, 1, 2\]\)"):
        prepare_cache(tiny, recs, tmp_path / "c", spec=FeatureSpec((0, 1, 2), True), shard_size=2, draft_vocab=16)
    other = load_target(tiny_target(tmp_path / "other", seed=1))
    with pytest.raises(SpecframeError, match="target_weights_hash: cache has"):
        prepare_cache(other, recs, tmp_path / "c", shard_size=2, draft_vocab=16)
    with pytest.raises(SpecframeError, match="was made for target .* not "):
        FeatureCache(tmp_path / "c", target=other)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "notes.txt").write_text("mine")
    with pytest.raises(SpecframeError, match="exists and is not a specframe feature cache"):
        prepare_cache(tiny, recs, tmp_path / "x")
    with pytest.raises(SpecframeError, match="no usable conversation in the data"):
        prepare_cache(tiny, [{"source": "t", "id": "0", "messages": []}], tmp_path / "y")


def test_one_cache_serves_drafters_that_read_different_layers(tmp_path, tiny):  # noqa: F811
    """A comparison prepares the union of its drafters' aux layers once; each drafter reads its own layers, in its own
    order and with repeats (DFlash on a shallow target), equal to a cache prepared with exactly those layers."""
    from specframe.engine.data import CacheSource

    recs = chat_records(4)
    prepare_cache(tiny, recs, tmp_path / "union", spec=FeatureSpec((0, 1, 2, 3), True), dtype="float32",
                  shard_size=2, draft_vocab=16)
    for want in [(1, 2, 3), (3, 1), (2, 2, 2)]:
        prepare_cache(tiny, recs, tmp_path / "own", spec=FeatureSpec(tuple(sorted(set(want))), True),
                      dtype="float32", shard_size=2, draft_vocab=16)
        spec = FeatureSpec(want, True)
        union = CacheSource(str(tmp_path / "union"), tiny, spec, seq_len=64, limit=None, pack=False)
        own = CacheSource(str(tmp_path / "own"), tiny, spec, seq_len=64, limit=None, pack=False)
        online = capture_features(tiny, union.tokens(1).input_ids[None], spec, dtype=torch.float32)
        a, b = union.example(1).features, own.example(1).features
        assert a["aux_hidden"].shape == (union.tokens(1).input_ids.shape[0], len(want) * tiny.hidden_size)
        assert torch.allclose(a["aux_hidden"], online.aux[0], atol=1e-4), want
        assert torch.equal(a["aux_hidden"], b["aux_hidden"]) and torch.equal(a["final_hidden"], b["final_hidden"])
        import shutil

        shutil.rmtree(tmp_path / "own")
    with pytest.raises(SpecframeError, match=r"holds aux layers \[1, 2, 3\] but the drafter needs \[0, 2\] \(missing \[0\]\)"):
        prepare_cache(tiny, recs, tmp_path / "eagle", shard_size=2, draft_vocab=16)
        CacheSource(str(tmp_path / "eagle"), tiny, FeatureSpec((0, 2), True), seq_len=64, limit=None)


@pytest.mark.slow
def test_default_target_cache_for_sharegpt(tmp_path, default_target):  # noqa: F811
    from specframe.data.sources import load_sharegpt

    recs = list(load_sharegpt(limit=20))
    rep = prepare_cache(default_target, recs, tmp_path / "c", max_length=1024, shard_size=8, draft_vocab=8192)
    cache = FeatureCache(tmp_path / "c", target=default_target)
    assert len(cache) == rep.examples > 0
    ex = cache[0]
    assert ex.aux_hidden.dtype == torch.float16 and ex.aux_hidden.shape[1] == 3 * 576
    # logits recomputed from the cached final hidden state predict the next data token where the target is sure
    logits = target_logits(default_target, ex.final_hidden.float())
    assert logits.shape == (len(ex.tokens), 49152)
