"""The target's output head as the target model applies it: final hidden states in, the target's logits out.

Every place that turns a target's final hidden state into its next-token distribution goes through
``TargetHead.logits``: the dense KL teacher and its full-vocabulary top-1 (``specframe.drafting.eagle``, ``modeling``), the
feature cache's compact top-k teacher (``specframe.cache``) and ``features.target_logits``. A model may do more after
its lm_head matmul than a Llama does, and a teacher that skips it teaches another distribution: an lm_head bias
(Phi), Cohere's ``logit_scale`` (multiplied), Granite's ``logits_scaling`` (divided) and Gemma-2 / Gemma-3's
``final_logit_softcapping`` (``cap * tanh(z / cap)``), applied in that order with the same operations as
transformers' forwards. ``target_head(target)`` also runs the target once on a few tokens and refuses a model whose own
logits are not what its head gives (a transform this module does not know), so no teacher is silently wrong.
"""

from __future__ import annotations

import contextlib
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from specframe.dropped_layers import loaded_layers_only
from specframe.errors import SpecframeError

#: tokens of the start-up check: enough positions for a transform that varies along them to show
_PROBE_TOKENS = 8


@attrs.frozen
class TargetHead:
    """The target's lm_head ``weight`` [V, H] (or some of its rows) with what its forward applies after the matmul:
    ``bias`` [V] or None, ``multiplier`` (Cohere's ``logit_scale``), ``divisor`` (Granite's ``logits_scaling``) and
    ``softcap`` (Gemma-2's ``final_logit_softcapping``), each None when the model has none."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    multiplier: float | None = None
    divisor: float | None = None
    softcap: float | None = None

    @classmethod
    def of(cls, target: Any) -> TargetHead:
        """The head of ``target`` (a ``specframe.targets.Target`` or a transformers causal LM), read from its modules
        and config, detached (the target is frozen)."""
        model = _model(target)
        head = model.get_output_embeddings()
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        bias = getattr(head, "bias", None)
        # Cohere keeps its scale on the module (``self.logit_scale = config.logit_scale``), the others read the config
        multiplier = getattr(model, "logit_scale", getattr(config, "logit_scale", None))
        return cls(weight=head.weight.detach(), bias=None if bias is None else bias.detach(),
                   multiplier=_number(multiplier), divisor=_number(getattr(config, "logits_scaling", None)),
                   softcap=_number(getattr(config, "final_logit_softcapping", None)))

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    @property
    def plain(self) -> bool:
        """True for a head that is only the matmul (Llama, Qwen, Mistral, ...)."""
        return self.bias is None and self.multiplier is None and self.divisor is None and self.softcap is None

    def describe(self) -> dict[str, Any]:
        """What the head applies after its matmul (recorded with a compact teacher, so a cache made without it is
        told apart)."""
        return {"bias": self.bias is not None, "multiplier": self.multiplier, "divisor": self.divisor,
                "softcap": self.softcap}

    def rows(self, ids: torch.Tensor) -> TargetHead:
        """The head restricted to the target ids ``ids`` (e.g. a draft vocabulary), sliced where the head is: the
        transforms are elementwise, so its logits are the full logits' entries at ``ids``."""
        ids = torch.as_tensor(ids, dtype=torch.long).to(self.weight.device)
        return attrs.evolve(self, weight=self.weight.index_select(0, ids),
                            bias=None if self.bias is None else self.bias.index_select(0, ids))

    def to(self, *args: Any, **kwargs: Any) -> TargetHead:
        """Weight and bias moved / cast as ``Tensor.to`` would (a copy only where something changes)."""
        return attrs.evolve(self, weight=self.weight.to(*args, **kwargs),
                            bias=None if self.bias is None else self.bias.to(*args, **kwargs))

    def float(self) -> TargetHead:
        return self.to(torch.float32)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's logits [..., V] of final hidden states ``hidden`` [..., H] (already on the head's device and
        in its dtype, as the target's own lm_head gets them), in the head's dtype, computed as the model's forward
        computes them."""
        z = F.linear(hidden, self.weight, self.bias)
        if self.multiplier is not None:
            z = z * self.multiplier
        if self.divisor is not None:
            z = z / self.divisor
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z


def as_target_head(head: TargetHead | torch.Tensor) -> TargetHead:
    """``head`` itself, or a bare lm_head weight [V, H] taken as a head that is only the matmul."""
    return head if isinstance(head, TargetHead) else TargetHead(weight=head)


def find_decoder(model: Any) -> Any:
    """A transformers causal LM's decoder, the module holding its ``layers`` and final ``norm`` that returns
    ``last_hidden_state``: ``get_decoder()`` where the model has one, else its ``base_model`` or ``.model``; None when
    none of them holds layers. The one finder: the loader drops layers in it (``targets.keep_layers``), the head check
    and the feature capture run it."""
    candidates = []
    if hasattr(model, "get_decoder"):
        with contextlib.suppress(AttributeError, NotImplementedError):  # a model that names none of its own
            candidates.append(model.get_decoder())
    base = getattr(model, "base_model", None)
    candidates += [None if base is model else base, getattr(model, "model", None)]
    return next((c for c in candidates if c is not None and c is not model and hasattr(c, "layers")), None)


def decoder(model: Any) -> Any:
    """``find_decoder``, or a ``SpecframeError`` naming the model's class when it has none."""
    found = find_decoder(model)
    if found is None:
        raise SpecframeError(f"{type(model).__name__}: cannot find the decoder layers (expected .model.layers)")
    return found


def target_head(target: Any) -> TargetHead:
    """``TargetHead.of(target)``, checked once against the target's own forward on a few tokens: the logits the head
    gives from the final hidden state (what ``capture_features`` stores) must be the model's. A model that transforms
    its logits in a way this module does not apply is refused, since every teacher built on the head would be wrong."""
    model = _model(target)
    head = TargetHead.of(model)
    entry = model.get_input_embeddings().weight
    if entry.device.type == "meta":  # a skeleton (no weights): nothing to run, nothing a teacher could read either
        return head
    ids = (torch.arange(1, _PROBE_TOKENS + 1) % entry.shape[0]).to(entry.device)[None]
    with torch.no_grad(), loaded_layers_only(decoder(model)):
        final = decoder(model)(input_ids=ids, use_cache=False).last_hidden_state
        theirs = model(input_ids=ids, use_cache=False).logits.float()
        ours = head.logits(final.to(device=head.device, dtype=head.dtype)).float().to(theirs.device)
    # the same operations in the same dtype: equal up to the rounding of a differently shaped product
    tolerance = (1e-4 if head.dtype in (torch.float32, torch.float64) else 2e-2) * (float(theirs.abs().max()) + 1.0)
    if ours.shape != theirs.shape or not float((ours - theirs).abs().max()) <= tolerance:
        worst = float((ours - theirs).abs().max()) if ours.shape == theirs.shape else float("nan")
        raise SpecframeError(
            f"target {type(model).__name__}: its forward's logits are not its lm_head's over the final hidden state "
            f"(largest difference {worst:.3g}; specframe applies {head.describe()}); a teacher built on the head "
            "would be wrong, so this target is not supported")
    return head


def _model(target: Any) -> Any:
    return target.model if hasattr(target, "model") and hasattr(target, "tokenizer") else target


def _number(value: Any) -> float | None:
    return None if value is None else float(value)
