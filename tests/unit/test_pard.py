"""PARD drafter: unshifted supervision, mask slots and visibility, COD through the engine, parity with
transformers' LlamaForCausalLM, the vLLM-loadable checkpoint, overfitting, cached drafting, the train command."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner
from transformers import LlamaForCausalLM

from specframe import api, cli, plugins
from specframe.drafting.elements import full_grid
from specframe.engine import TrainConfig
from specframe.engine.loop import Trainer
from specframe.drafting.modeling import causal_attention
from tests.drafter_helpers import make, overfit, sharp_tiny_target
from tests.train_fixtures import build

K = 4


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    torch.set_num_threads(1)
    return sharp_tiny_target(tmp_path_factory.mktemp("pard"))


def loss_of(drafter, ex, charged):
    elems = full_grid(ex.input_ids.shape[0], K)
    seg = api.Segment(torch.arange(len(elems)), charged(elems))
    b = plugins.get("mask builder", "dense")()
    with torch.no_grad():
        return drafter.loss(ex, elems, seg, b.build(elems, elems)).loss_sum


def test_supervision_is_unshifted(target):
    drafter, ex = make("pard", target)
    sup = drafter.supervision(ex)
    assert sup.shape == ex.input_ids.shape
    assert torch.equal(sup[:-1], ex.loss_mask[1:]) and not sup[-1]
    assert drafter.feature_spec().final_hidden is False and not drafter.feature_spec().aux_layers


def test_element_reads_its_prefix_and_masks_only(target):
    """Element (a, d) predicts x_{a+d+1} from x_0..x_a and d mask slots: the tokens between are invisible."""
    drafter, ex = make("pard", target)
    a, d = 9, 3
    only = lambda e: (e.anchor == a) & (e.depth == d)  # noqa: E731
    base = loss_of(drafter, ex, only)

    def with_token(i, tok):
        ids = ex.input_ids.clone()
        ids[i] = tok
        return api.TrainingExample(ids, ex.loss_mask, ex.doc, ex.features)

    for hidden_pos in range(a + 1, a + d + 1):
        torch.testing.assert_close(loss_of(drafter, with_token(hidden_pos, 11), only), base, rtol=0, atol=0)
    assert not torch.allclose(loss_of(drafter, with_token(a, 11), only), base)  # the anchor's own token
    assert not torch.allclose(loss_of(drafter, with_token(a + d + 1, 11), only), base)  # the label
    mask_id = drafter.mask_token_id
    assert mask_id not in ex.input_ids.tolist()
    assert mask_id in target.tokenizer.added_tokens_decoder


def test_engine_samples_cod_elements(tmp_path):
    target_dir, chat = build(tmp_path / "assets")
    cfg = TrainConfig(drafter="pard", output=str(tmp_path / "run"), target=str(target_dir), data=str(chat),
                      seq_len=64, depth=6, mask_builder="dense", drafter_options={"layers": 1})
    trainer = Trainer(cfg)
    try:
        ex = trainer.source.tokens(trainer.train_ids[0])
        elems, sup = trainer.elements(ex, torch.Generator().manual_seed(0))
    finally:
        trainer.close()
    n_sup = int(sup.sum())
    assert int((elems.depth == 0).sum()) == sup.shape[0]
    kept = {(int(a), int(d)) for a, d in zip(elems.anchor, elems.depth)}
    for d in range(1, 6):
        count = int((elems.depth == d).sum())
        assert count <= math.floor(n_sup * max(0.7**d, 0.2))
        assert all((a, dd - 1) in kept for a, dd in kept if dd == d)
    assert len(elems) < len(full_grid(sup.shape[0], 6))


def test_forward_equals_transformers_llama(target):
    drafter, ex = make("pard", target, layers=2)
    hf = LlamaForCausalLM(drafter.hf_config())
    hf.load_state_dict(drafter.model.state_dict(), strict=False)
    hf.eval()
    ids = ex.input_ids
    with torch.no_grad():
        ours, _ = drafter.model(ids, torch.arange(ids.shape[0]), causal_attention(0))
        torch.testing.assert_close(drafter.model.lm_head(ours), hf(ids[None]).logits[0], rtol=1e-4, atol=1e-4)


def test_initialised_from_the_target(target):
    drafter, _ = make("pard", target, layers=2)
    src = target.model.state_dict()
    own = drafter.model.state_dict()
    assert torch.equal(own["model.layers.1.mlp.up_proj.weight"], src["model.layers.1.mlp.up_proj.weight"])
    assert torch.equal(own["model.embed_tokens.weight"], src["model.embed_tokens.weight"])
    with pytest.raises(api.UsageError):
        make("pard", target, layers=target.config.num_hidden_layers + 1)


def test_loss_falls_to_near_zero_on_one_batch(target):
    drafter, ex = make("pard", target, length=16)
    losses = overfit(drafter, ex, K, steps=120, lr=1e-2)
    assert losses[-1] < 0.05 * losses[0], losses[::20]


def _rounds(drafter, ids):
    drafter.start(ids[:8], {})
    drafter.accept(ids[8:9], {})
    drafter.propose(4)
    drafter.accept(ids[9:11], {})
    return drafter.propose(4)


def test_cached_drafting_equals_one_uncached_forward(target):
    drafter, ex = make("pard", target)
    ids = ex.input_ids
    draft = _rounds(drafter, ids).tokens
    block = torch.cat([ids[:11], torch.full((3,), drafter.mask_token_id)])
    with torch.no_grad():
        hidden, _ = drafter.model(block, torch.arange(14), causal_attention(0))
    assert torch.equal(draft, drafter.model.lm_head(hidden[10:]).argmax(-1))


def test_checkpoint_is_a_plain_causal_lm(target, tmp_path):
    drafter, ex = make("pard", target)
    overfit(drafter, ex, K, steps=3)
    drafter.save(tmp_path / "ck")
    folder = tmp_path / "ck" / "causal_lm"
    assert (folder / "model.safetensors").exists()
    config = json.loads((folder / "config.json").read_text())
    assert config["pard_token"] == drafter.mask_token_id and config["num_hidden_layers"] == 1
    hf = LlamaForCausalLM.from_pretrained(str(folder))
    for key, value in drafter.model.state_dict().items():
        assert torch.equal(hf.state_dict()[key], value), key
    loaded = plugins.get("drafter", "pard").from_checkpoint(tmp_path / "ck", target.config)
    assert loaded.mask_token_id == drafter.mask_token_id
    every = lambda e: torch.ones(len(e), dtype=torch.bool)  # noqa: E731
    torch.testing.assert_close(loss_of(loaded, ex, every), loss_of(drafter, ex, every), rtol=0, atol=0)
    assert torch.equal(_rounds(loaded, ex.input_ids).tokens, _rounds(drafter, ex.input_ids).tokens)


def test_train_command(tmp_path):
    target, chat = build(tmp_path / "assets")
    out = tmp_path / "run"
    result = CliRunner().invoke(cli.main, [
        "train", "--drafter", "pard", "--target", str(target), "--data", str(chat), "--seq-len", "40",
        "--depth", "4", "--max-steps", "3", "--batch-size", "1", "--val-examples", "2", "--mask-builder", "chunked",
        "--output", str(out), "--json",
    ])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output[result.output.index("{"):])
    assert summary["steps"] == 3 and math.isfinite(summary["eval"]["val_loss"])
    assert (out / "latest").exists()
    checkpoint = out / (out / "latest").read_text().strip()
    assert json.loads((checkpoint / "causal_lm" / "config.json").read_text())["pard_token"] >= 0


def test_vllm_export_layout(target, tmp_path):
    drafter, _ = make("pard", target)
    manifest = drafter.export_vllm(tmp_path / "vllm", target.tokenizer)
    assert manifest["method"] == "draft_model" and manifest["parallel_drafting"] is True
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert config["pard_token"] == drafter.mask_token_id and config["architectures"] == ["LlamaForCausalLM"]
    hf = LlamaForCausalLM.from_pretrained(str(tmp_path / "vllm"))
    torch.testing.assert_close(hf.state_dict()["model.layers.0.self_attn.q_proj.weight"],
                               drafter.model.state_dict()["model.layers.0.self_attn.q_proj.weight"])
