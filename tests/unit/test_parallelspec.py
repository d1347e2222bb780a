"""ParallelSpec drafter: k distinct mask embeddings with distinct gradients, group-wise visibility, both backbones,
overfitting, checkpoints, cached drafting, the train command."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

from specframe import api, cli, plugins
from specframe.drafting.elements import full_grid
from specframe.drafting.modeling import causal_attention
from tests.drafter_helpers import features, make, overfit, sharp_tiny_target
from tests.train_fixtures import build

K = 4


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    torch.set_num_threads(1)
    return sharp_tiny_target(tmp_path_factory.mktemp("parallelspec"))


def terms_of(drafter, ex, charged):
    elems = full_grid(ex.input_ids.shape[0] - 1, K)
    seg = api.Segment(torch.arange(len(elems)), charged(elems))
    b = plugins.get("mask builder", "dense")()
    return drafter.loss(ex, elems, seg, b.build(elems, elems))


def mask_grad(drafter, ex, charged):
    drafter.model.zero_grad()
    terms_of(drafter, ex, charged).loss_sum.backward()
    return drafter.model.mask_embeddings.grad.clone()


def test_mask_embeddings_are_distinct_parameters_with_distinct_gradients(target):
    drafter, ex = make("parallelspec", target)
    masks = drafter.model.mask_embeddings
    assert masks.shape == (K - 1, target.config.hidden_size) and masks.requires_grad
    assert len(set(drafter.mask_token_ids)) == K - 1
    # initialised from the reserved ids' embedding rows, which differ
    assert torch.equal(masks.detach(), target.model.get_input_embeddings().weight[drafter.mask_token_ids])
    grad = mask_grad(drafter, ex, lambda e: torch.ones(len(e), dtype=torch.bool))
    assert all(float(grad[i].abs().sum()) > 0 for i in range(K - 1))
    for i in range(K - 1):
        for j in range(i + 1, K - 1):
            assert not torch.allclose(grad[i], grad[j])
    # depth d reads [MASK]_d (and its chain [MASK]_1..[MASK]_{d-1}), never a deeper mask
    for d in range(1, K):
        g = mask_grad(drafter, ex, lambda e, d=d: e.depth == d)
        assert float(g[d - 1].abs().sum()) > 0
        assert float(g[d:].abs().sum()) == 0


def test_groups_see_the_prefix_and_their_own_masks_only(target):
    drafter, ex = make("parallelspec", target)
    a, d = 8, 3
    only = lambda e: (e.anchor == a) & (e.depth == d)  # noqa: E731
    with torch.no_grad():
        base = terms_of(drafter, ex, only).loss_sum

        def changed(i, tok=11):
            ids = ex.input_ids.clone()
            ids[i] = tok
            return terms_of(drafter, api.TrainingExample(ids, ex.loss_mask, ex.doc, ex.features), only).loss_sum

        # the group's token inputs beyond its real token (x_{a+1} in the EAGLE shift) are masks
        for later in range(a + 2, a + d + 2):
            torch.testing.assert_close(changed(later), base, rtol=0, atol=0)
        assert not torch.allclose(changed(a + 1), base)
        assert not torch.allclose(changed(a - 2), base)


def test_standalone_backbone_reads_no_target_features(target):
    drafter, ex = make("parallelspec", target, backbone="standalone", layers=2)
    assert not drafter.feature_spec().aux_layers
    assert drafter.model.fc is None
    src = target.model.state_dict()
    assert torch.equal(drafter.model.state_dict()["layers.1.self_attn.q_proj.weight"],
                       src["model.layers.1.self_attn.q_proj.weight"])
    no_aux = api.TrainingExample(ex.input_ids, ex.loss_mask, ex.doc, {"final_hidden": ex.features["final_hidden"]})
    terms = terms_of(drafter, no_aux, lambda e: torch.ones(len(e), dtype=torch.bool))
    assert math.isfinite(float(terms.loss_sum.detach())) and terms.count > 0
    with pytest.raises(api.UsageError):
        plugins.get("drafter", "parallelspec").Options(backbone="medusa")


def test_loss_falls_to_near_zero_on_one_batch(target):
    drafter, ex = make("parallelspec", target, length=16)
    losses = overfit(drafter, ex, K, steps=150, lr=2e-2)
    assert losses[-1] < 0.05 * losses[0], losses[::25]


def _rounds(drafter, target, ids):
    aux = features(target, ids, drafter)["aux_hidden"]
    drafter.start(ids[:8], {"aux_hidden": aux[:8]})
    drafter.accept(ids[8:9], {"aux_hidden": aux[7:8]})
    drafter.propose(K)
    drafter.accept(ids[9:11], {"aux_hidden": aux[8:10]})
    return drafter.propose(K), aux


def test_cached_drafting_equals_one_uncached_forward(target):
    drafter, ex = make("parallelspec", target)
    ids = ex.input_ids
    draft, aux = _rounds(drafter, target, ids)
    model = drafter.model
    depth = torch.cat([torch.zeros(10, dtype=torch.long), torch.arange(1, K)])
    with torch.no_grad():
        embeds = drafter._inputs(torch.cat([ids[1:11], torch.zeros(K - 1, dtype=torch.long)]), depth)
        fused = model.fuse(aux[:10])
        hidden = torch.cat([fused, fused[-1:].expand(K - 1, -1)])
        out, _ = model.run(embeds, hidden, torch.arange(10 + K - 1), causal_attention(0))
        expected = model.to_target(model.logits(out[9:]).argmax(-1))
    assert torch.equal(draft.tokens, expected)
    with pytest.raises(api.UsageError, match="mask tokens"):
        drafter.propose(K + 1)


def test_checkpoint_round_trip(target, tmp_path):
    drafter, ex = make("parallelspec", target)
    overfit(drafter, ex, K, steps=3)
    drafter.save(tmp_path / "ck")
    loaded = plugins.get("drafter", "parallelspec").from_checkpoint(tmp_path / "ck", target.config)
    loaded.prepare(target, [ex])
    loaded.load(tmp_path / "ck")
    assert loaded.mask_token_ids == drafter.mask_token_ids
    every = lambda e: torch.ones(len(e), dtype=torch.bool)  # noqa: E731
    with torch.no_grad():
        torch.testing.assert_close(terms_of(loaded, ex, every).loss_sum, terms_of(drafter, ex, every).loss_sum,
                                   rtol=0, atol=0)
    assert torch.equal(_rounds(loaded, target, ex.input_ids)[0].tokens, _rounds(drafter, target, ex.input_ids)[0].tokens)


def test_train_command(tmp_path):
    target, chat = build(tmp_path / "assets")
    out = tmp_path / "run"
    config = tmp_path / "ps.toml"
    config.write_text('[drafter]\ndraft_vocab_size = 96\nbackbone = "eagle"\n')
    result = CliRunner().invoke(cli.main, [
        "train", "--drafter", "parallelspec", "--target", str(target), "--data", str(chat), "--seq-len", "40",
        "--max-steps", "3", "--batch-size", "1", "--val-examples", "2", "--mask-builder", "precomputed",
        "--partitioner", "peagle", "--partitions", "3", "--config", str(config), "--output", str(out), "--json",
    ])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output[result.output.index("{"):])
    assert summary["steps"] == 3 and len(summary["eval"]["val_accuracy"]) == 5  # default group size k_train 5
    assert (out / "latest").exists()


def test_vllm_export_for_the_plugin_model(target, tmp_path):
    """The eagle backbone exports for specframe's vLLM general plugin model (each slot its own mask embedding)."""
    drafter, _ = make("parallelspec", target)
    manifest = drafter.export_vllm(tmp_path / "vllm", target.tokenizer)
    assert (manifest["layout"], manifest["method"], manifest["parallel_drafting"]) == ("parallelspec", "eagle3", True)
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert config["architectures"] == ["ParallelSpecLlamaForCausalLMEagle3"]
    assert config["parallelspec_mask_token_ids"] == drafter.mask_token_ids
