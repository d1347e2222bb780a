"""Any HF causal-LM target: the drafter's RoPE and activation come from the target's config through transformers'
own functions, and every drafter trains on, and decodes losslessly with, tiny Llama-3-RoPE, Qwen2 and Gemma targets."""

from __future__ import annotations

import pytest
import torch

from specframe import plugins

from specframe.drafting import modeling
from specframe.drafter_folders import load_drafter
from specframe.engine import TrainConfig, train
from specframe.inference.engine import generate
from specframe.targets import load_target, tiny_target
from tests.drafter_helpers import DRAFTERS, SMALL
from tests.train_fixtures import write_chat

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
FAMILIES = {
    "llama3-rope": {"family": "llama", "rope_parameters": LLAMA3_ROPE},
    "qwen2": {"family": "qwen2"},
    "gemma": {"family": "gemma"},
}
ROPES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "llama3": LLAMA3_ROPE,
}


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("families")
    return {name: tiny_target(root / name, seed=1, **spec) for name, spec in FAMILIES.items()}


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_drafter_rotary_is_the_targets(tmp_path, rope):
    """cos / sin at the drafter's positions equal the target model's own rotary embedding (and are not plain
    theta: the bug this guards against trained every drafter with default frequencies)."""
    target = load_target(tiny_target(tmp_path / rope, layers=1, rope_parameters=ROPES[rope]))
    shape = modeling.LayerShape.from_config(target.config)
    assert shape.rope_parameters()["rope_type"] == ROPES[rope]["rope_type"]
    position = torch.arange(0, 5000, 97)  # past max_position_embeddings (2,048), where dynamic RoPE rescales
    cos, sin = modeling.rotary(position, shape, torch.float32)
    probe = torch.zeros(1, dtype=torch.float32)
    want_cos, want_sin = target.model.model.rotary_emb(probe, position[None])
    torch.testing.assert_close(cos, want_cos[0])
    torch.testing.assert_close(sin, want_sin[0])
    plain = modeling.LayerShape(shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate)
    plain_cos, _ = modeling.rotary(position, plain, torch.float32)
    assert not torch.allclose(cos, plain_cos, atol=1e-3)


def test_drafter_activation_is_the_targets(targets):
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    gemma = load_target(targets["gemma"])
    shape = modeling.LayerShape.from_config(gemma.config)
    assert shape.act == gemma.config.hidden_act != "silu"
    ours = modeling.MLP(shape)
    theirs = GemmaMLP(gemma.config)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(5, shape.hidden)
    torch.testing.assert_close(ours(x), theirs(x))
    assert modeling.LayerShape.from_config(load_target(targets["qwen2"]).config).act == "silu"


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_drafter_trains_and_decodes_losslessly(tmp_path, targets, family, drafter):
    target = load_target(targets[family])
    chat = write_chat(tmp_path / "chat.jsonl", n=6)
    options = {k: v for k, v in SMALL[drafter].items() if k != "draft_vocab_size"}
    if "draft_vocab_size" in SMALL[drafter]:
        options["draft_vocab_size"] = 64
    result = train(
        TrainConfig(drafter=drafter, output=str(tmp_path / "run"), target=str(targets[family]), data=str(chat),
                    seq_len=48, max_steps=3, batch_size=2, val_examples=1, lr=1e-2, drafter_options=options),
        target=target, progress=False,
    )
    assert result.steps == 3 and result.final_train_loss is not None
    losses = [m["train_loss"] for m in result.metrics]
    assert all(torch.isfinite(torch.tensor(losses)))
    model = target.model.eval()
    prompt = torch.tensor(target.tokenizer.encode("the quick brown fox jumps over"))
    greedy = plugins.get("verifier", "greedy")()
    plain = generate(model, prompt, greedy, max_new_tokens=24, eos_token_id=())
    spec = generate(model, prompt, greedy, load_drafter(result.checkpoint, target.config), k=3, max_new_tokens=24,
                    eos_token_id=())
    assert spec.tokens == plain.tokens
    assert spec.target_forwards <= plain.target_forwards
