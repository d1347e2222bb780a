"""Tiny random targets and drafters in every vLLM layout, for the vLLM tests.

vLLM's CPU attention supports head sizes 32, 64, 80, ...: the tiny target uses hidden 64 with 2 heads (head 32).
``degenerate=True`` zeroes the final norm of the target (``degenerate_target``) or the drafter, so every logit is
equal and greedy argmax is always token 0 on both sides: every draft is accepted, which pins the metrics exactly.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specframe.targets import tiny_target
from specframe.layouts import export

HIDDEN, HEADS, KV_HEADS, INTER, LAYERS = 64, 2, 1, 128, 4
AUX = [1, 2, 3]


def build_target(path: Path, degenerate: bool = False, family: str = "llama") -> Path:
    """A 4-layer target (vocab about 320) with its tokenizer: Llama, or another ``tiny_target`` family."""
    tiny_target(path, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, intermediate=INTER, layers=LAYERS, seed=0,
                family=family)
    if degenerate:
        from safetensors.torch import load_file, save_file

        weights = load_file(str(path / "model.safetensors"))
        weights["model.norm.weight"] = torch.zeros_like(weights["model.norm.weight"])
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def target_parts(path: Path):
    from transformers import AutoConfig, AutoTokenizer

    return AutoConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def _rand(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * 0.05


def eagle3_weights(
    config, layers: int, draft_vocab: int, *, parallel: bool = False, degenerate: bool = False, seed: int = 1
) -> dict[str, torch.Tensor]:
    """Random EAGLE-3 (or P-EAGLE with ``parallel``) weights in the vLLM layout for ``config``'s target."""
    g = torch.Generator().manual_seed(seed)
    h, v = config.hidden_size, config.vocab_size
    hd = h // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    w = {
        "embed_tokens.weight": _rand(g, v, h),
        "fc.weight": _rand(g, h, len(AUX) * h),
        "norm.weight": torch.zeros(h) if degenerate else torch.ones(h),
        "lm_head.weight": _rand(g, draft_vocab, h),
    }
    for i in range(layers):
        width = 2 * h if i == 0 else h
        p = f"layers.{i}."
        w |= {
            p + "self_attn.q_proj.weight": _rand(g, q, width),
            p + "self_attn.k_proj.weight": _rand(g, kv, width),
            p + "self_attn.v_proj.weight": _rand(g, kv, width),
            p + "self_attn.o_proj.weight": _rand(g, h, q),
            p + "mlp.gate_proj.weight": _rand(g, config.intermediate_size, h),
            p + "mlp.up_proj.weight": _rand(g, config.intermediate_size, h),
            p + "mlp.down_proj.weight": _rand(g, h, config.intermediate_size),
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
        }
        if i == 0:
            w[p + "hidden_norm.weight"] = torch.ones(h)
    if draft_vocab < v:
        # the draft vocabulary: token 0 (what a degenerate target always emits) and every other target id
        ids = torch.arange(0, v, 2)[:draft_vocab]
        w["d2t"] = ids - torch.arange(draft_vocab)
    if parallel:
        w["mask_hidden"] = _rand(g, 1, 1, len(AUX) * h)
    return w


def pard_weights(config, layers: int, *, degenerate: bool = False, seed: int = 2) -> tuple[dict, dict]:
    """A random Llama draft model sharing the target's vocabulary: (weights, config dict)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**config.to_dict(), "num_hidden_layers": layers})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if degenerate:
        weights["model.norm.weight"].zero_()
    config_dict = export.llama_config(config, layers, architectures=["LlamaForCausalLM"], model_type="llama")
    config_dict["tie_word_embeddings"] = False
    return weights, config_dict


def mask_token(tokenizer) -> int:
    """A reserved special token of the tiny target (never produced from text)."""
    return int(tokenizer.convert_tokens_to_ids("<|reserved_0|>"))


def build_drafter(
    kind: str, target: Path, out: Path, *, degenerate: bool = False, layers: int | None = None, k: int = 3
) -> Path:
    """Export a random drafter of ``kind`` (eagle3, peagle, pard) for the target at ``target`` into ``out``
    (EAGLE-3 / P-EAGLE in the speculators format, naming ``target`` as the verifier and drafting ``k`` tokens)."""
    config, tok = target_parts(target)
    if kind == "pard":
        weights, cfg = pard_weights(config, layers or 1, degenerate=degenerate)
        export.write_pard(out, weights, config=cfg, pard_token=mask_token(tok), tokenizer=tok)
        return out
    n = layers or (4 if kind == "peagle" else 1)
    weights = eagle3_weights(config, n, config.vocab_size // 2, parallel=kind == "peagle", degenerate=degenerate)
    common = dict(
        config=export.llama_config(config, n),
        aux_layer_ids=AUX,
        target_hidden_size=config.hidden_size,
        target_num_layers=config.num_hidden_layers,
        tokenizer=tok,
        verifier=export.verifier_name(target),
        speculative_tokens=k,
    )
    if kind == "peagle":
        export.write_peagle(out, weights, mask_token_id=mask_token(tok), **common)
    else:
        export.write_eagle3(out, weights, **common)
    return out
