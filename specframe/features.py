"""Target feature capture: what a drafter declared it needs, computed in one target forward.

Conventions (docs/design.md section 8, as vLLM counts): aux layer id ``i`` is the hidden state *entering* decoder layer
``i``; id 0 is the embedding output; ids run 0..L-1. The final hidden state is the last layer's output after the
final norm, i.e. exactly what ``lm_head`` reads. Full logits are never cached: ``target_logits`` recomputes them
(optionally only over draft-vocabulary ids) from the final hidden state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from specframe.errors import SpecframeError
# the head and the decoder trunk as the target's forward runs them (one way: target_head imports nothing of this)
from specframe.target_head import TargetHead, decoder


def low_mid_high_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's default low/mid/high picks ``(2, L//2, L-3)`` for a target with ``L`` decoder layers.

    Where that gives ids outside ``0..L-1`` or duplicates (L < 7, tiny test targets), the top three layer inputs
    ``(L-3, L-2, L-1)`` are used instead; below 3 layers ids repeat (the drafter input stays 3H wide).
    """
    L = num_layers
    if L < 1:
        raise SpecframeError("target has no decoder layers")
    ids = (2, L // 2, L - 3)
    if all(0 <= i < L for i in ids) and len(set(ids)) == 3:
        return ids
    return tuple(min(max(i, 0), L - 1) for i in (L - 3, L - 2, L - 1))


@attrs.define(frozen=True)
class FeatureSpec:
    """What a drafter needs from the target per token.

    ``aux_layers``: aux hidden-state layer ids (None = no aux states; ``"default"`` is resolved by
    ``resolve(num_layers)`` to ``low_mid_high_layers``); ``final_hidden``: the post-norm last hidden state.
    """

    aux_layers: tuple[int, ...] | None = None
    final_hidden: bool = False

    @classmethod
    def eagle(cls, num_layers: int) -> FeatureSpec:
        """The EAGLE-3 / P-EAGLE needs: default aux layers and the final hidden state."""
        return cls(aux_layers=low_mid_high_layers(num_layers), final_hidden=True)

    def validate(self, num_layers: int) -> None:
        for i in self.aux_layers or ():
            if not 0 <= int(i) < num_layers:
                raise SpecframeError(f"aux layer id {i} out of range for a target with {num_layers} layers (0..{num_layers - 1})")


@attrs.define
class Features:
    """Captured features for a batch: ``aux`` [B, T, len(aux_layers) * H] (layers concatenated in the declared
    order, as the EAGLE-3 fc expects) and ``final`` [B, T, H]; either may be None if not declared."""

    aux: Any = None
    final: Any = None


def capture_features(
    target: Any,
    input_ids: Any,
    spec: FeatureSpec,
    *,
    attention_mask: Any = None,
    dtype: Any = None,
) -> Features:
    """Run the target over ``input_ids`` [B, T] and return the declared features (``dtype`` to cast them, e.g.
    ``torch.float16`` for caches) on ``input_ids``' device, wherever the target's weights are (one device, or spread
    over several by a ``device_map``: the inputs go to its embedding's device, each captured state comes back).
    Uses forward pre-hooks on the decoder layers and the base model's ``last_hidden_state``; never computes the
    lm_head."""
    import torch

    model = target.model if hasattr(target, "model") and hasattr(target, "tokenizer") else target
    base = decoder(model)
    layers = base.layers
    spec.validate(len(layers))
    aux_ids = tuple(spec.aux_layers or ())
    grabbed: dict[int, Any] = {}
    hooks = []

    def make_hook(i: int):
        def hook(module, args, kwargs):
            grabbed[i] = args[0] if args else kwargs["hidden_states"]

        return hook

    for i in sorted(set(aux_ids)):
        hooks.append(layers[i].register_forward_pre_hook(make_hook(i), with_kwargs=True))
    home = input_ids.device
    entry = model.get_input_embeddings().weight.device
    try:
        with torch.no_grad():  # not inference_mode: callers use these tensors in autograd graphs
            out = base(input_ids=input_ids.to(entry), use_cache=False,
                       attention_mask=None if attention_mask is None else attention_mask.to(entry))
    finally:
        for h in hooks:
            h.remove()
    feats = Features()
    if aux_ids:
        feats.aux = torch.cat([grabbed[i].to(home) for i in aux_ids], dim=-1)
    if spec.final_hidden:
        feats.final = out.last_hidden_state.to(home)
    if dtype is not None:
        feats.aux = feats.aux.to(dtype) if feats.aux is not None else None
        feats.final = feats.final.to(dtype) if feats.final is not None else None
    return feats


def target_logits(target: Any, final_hidden: Any, vocab_ids: Sequence[int] | Any | None = None) -> Any:
    """Target logits from the final hidden state as the target's forward makes them (``specframe.target_head``: the
    lm_head with its bias, logit scale and soft-capping), in float32, on the head's device (under ``--device-map`` the
    head may sit on another GPU than ``final_hidden``, which is moved there).

    ``vocab_ids``: restrict to these target ids (e.g. the draft vocabulary, in draft order), computing only those
    rows of lm_head. Result [..., len(vocab_ids)] or [..., V].
    """
    head = TargetHead.of(target)
    if vocab_ids is not None:
        head = head.rows(vocab_ids)
    return head.logits(final_hidden.to(device=head.device, dtype=head.dtype)).float()


def apply_final_norm(target: Any, last_layer_output: Any) -> Any:
    """The post-norm final hidden state (what ``capture_features`` returns as ``final``) from the last decoder layer's
    output [..., H] (id L, before the norm: what an engine such as vLLM hands out), through the target's own final
    norm, in its dtype and on its device; returned on ``last_layer_output``'s device."""
    import torch

    model = target.model if hasattr(target, "model") and hasattr(target, "tokenizer") else target
    norm = getattr(decoder(model), "norm", None)
    if norm is None:
        raise SpecframeError(f"{type(model).__name__}: cannot find the final norm (expected .model.norm), so the "
                             "final hidden state cannot be formed from the last layer's output")
    weight = next(norm.parameters(), None)
    device = weight.device if weight is not None else last_layer_output.device
    dtype = weight.dtype if weight is not None else last_layer_output.dtype
    with torch.no_grad():
        return norm(last_layer_output.to(device=device, dtype=dtype)).to(last_layer_output.device)
