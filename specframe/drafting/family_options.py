"""The option fields the EAGLE family's drafters share (``FamilyFields``, reached as ``api.eagle.FamilyFields``): one
definition of each shared option (its default, its check, its line of help), which every family drafter's
``Options`` class lists in its own order; the values its lever options take; and ``Architecture``, the layer
architecture options an ``EagleBackbone`` is built with.
"""

from __future__ import annotations

from typing import Any

import attrs

from specframe.declarations import positive_int, positive_int_or_null, unit_interval
from specframe.drafting.vocab import DEFAULT_DRAFT_VOCAB
from specframe.errors import UsageError

__all__ = ["LOSS_KINDS", "LOSS_MASK_BITS", "LOSS_NORMALISATIONS", "Architecture", "FamilyFields"]


#: values of the family's lever options (``FamilyFields``)
LOSS_MASK_BITS = ("predicted", "input")
LOSS_NORMALISATIONS = ("tokens", "sequence")
LOSS_KINDS = ("kl", "ce", "mix")


def _bool(owner: str) -> Any:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not isinstance(value, bool):
            raise UsageError(f"{owner} option '{attribute.name}' must be true or false, got {value!r}")

    return check


class FamilyFields:
    """The option fields the EAGLE family's drafters share (``k_infer``, ``draft_vocab_size``, ``aux_layer_ids``,
    ``train_embedding``, ``cod_ratio``, ``cod_min_ratio``, ``activation_checkpointing``, ``loss_chunk``,
    ``vocab_position_mask`` and issue 54's levers ``train_head``, ``loss_mask_bit``, ``loss_normalisation``,
    ``loss``, ``ce_weight``, ``init_from_target_layers``; the layer architecture of speculators' defaults, ``qk_norm``,
    ``norm_before_residual``, ``norm_before_fc``, ``norm_output``, ``sliding_window``: ``Architecture``), defined
    once: type, validator, default and help. A drafter's ``Options`` class takes
    each with ``fields.loss_chunk()`` where it wants it, after a one-line ``fields = api.eagle.FamilyFields("name")``.

    Why fields and not a base class: attrs puts a base class's fields before the subclass's own, which would reorder
    every drafter's options as the recorded ``config.json``, ``--print-config`` and the bad-input catalogue's "known
    options" lists show them (and the option order users read). ``note`` adds a drafter's own remark to the shared
    help; ``default`` is given where the drafters' papers differ (the COD keep ratio)."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.positive = positive_int(owner)
        self.unit = unit_interval(owner)

    @staticmethod
    def _help(text: str, note: str) -> dict[str, str]:
        return {"help": f"{text}; {note}" if note else text}

    def k_infer(self, note: str = "") -> Any:
        return attrs.field(default=5, validator=self.positive, metadata=self._help(
            "tokens drafted per round at inference", note))

    def draft_vocab_size(self, note: str = "", default: int | None = DEFAULT_DRAFT_VOCAB) -> Any:
        """``default`` None is the target's whole vocabulary: the built-ins' since P-EAGLE's ablations (speculators'
        default since RFC #979, DeepSpec's, NeMo's and the released P-EAGLE heads'; specframe's 16,384 measured no
        better at 261K tokens, deviations row 6). A plugin written for API 15 passes none and keeps 16,384: its code
        may not take None as a size (API 16)."""
        return attrs.field(default=default, validator=positive_int_or_null(self.owner), metadata=self._help(
            "draft vocabulary: the most frequent training tokens, clamped to the target's; null: the target's "
            "whole vocabulary (no mapping)", note))

    def aux_layer_ids(self, note: str = "") -> Any:
        return attrs.field(default=None, metadata=self._help(
            "target aux layer ids (hidden state entering that decoder layer); null: vLLM's (2, L//2, L-3)", note))

    def train_embedding(self, note: str = "") -> Any:
        return attrs.field(default=False, metadata=self._help(
            "train the token embedding (initialised from the target's) instead of keeping it frozen", note))

    def cod_ratio(self, default: float, note: str = "") -> Any:
        return attrs.field(default=default, validator=self.unit, metadata=self._help(
            "COD keep ratio r: depth d keeps a share max(r**d, cod_min_ratio) of the positions (1: full grid)", note))

    def cod_min_ratio(self) -> Any:
        return attrs.field(default=0.2, validator=self.unit, metadata=self._help(
            "COD floor r_min: the least share of positions any depth keeps", ""))

    def activation_checkpointing(self) -> Any:
        return attrs.field(default=False, metadata=self._help(
            "recompute each layer in backward (less activation memory, about one more forward of time)", ""))

    def loss_chunk(self, note: str = "") -> Any:
        return attrs.field(default=256, validator=self.positive, metadata=self._help(
            "rows per chunk of the loss over the drafter's vocabulary (bounds the logits' memory)", note))

    def vocab_position_mask(self) -> Any:
        return attrs.field(default=True, metadata=self._help(
            "leave out of the loss the positions whose target top-1 token lies outside the draft vocabulary, as the "
            "EAGLE-3 / P-EAGLE reference trainers do (t2d[argmax] x mask); evaluation reports the share dropped", ""))

    # The training levers of issue 54 (docs/training/deviations.md): each default is the one the ablation suite
    # decided (a reference's where the references agree and specframe's choice measured no better), the other
    # values the alternatives it measured.

    def _choice(self, choices: tuple[str, ...]) -> Any:
        owner = self.owner

        def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
            if value not in choices:
                raise UsageError(f"{owner} option '{attribute.name}' must be one of {', '.join(choices)}, got {value!r}")

        return check

    def train_head(self, note: str = "") -> Any:
        return attrs.field(default=True, validator=_bool(self.owner), metadata=self._help(
            "train the draft lm_head (initialised from the target's rows of the draft vocabulary); false freezes it "
            "as speculators and DeepSpec do: no gradient, not optimised, not counted as trainable", note))

    def loss_mask_bit(self) -> Any:
        # 'input': speculators' alignment, and SpecForge's since its #885 fix (deviations row 4)
        return attrs.field(default="input", validator=self._choice(LOSS_MASK_BITS), metadata=self._help(
            "whose loss-mask bit gates the element that reads x_{i+1} and predicts x_{i+2}: 'predicted' (x_{i+2}'s) "
            "or 'input' (x_{i+1}'s, speculators' shift_batch); one position apart at assistant-turn boundaries", ""))

    def loss_normalisation(self) -> Any:
        return attrs.field(default="tokens", validator=self._choice(LOSS_NORMALISATIONS), metadata=self._help(
            "'tokens': one mean over the step's charged elements; 'sequence': every document (conversation) weighs "
            "the same, its elements' mean (DeepSpec's per-sequence local mean), counted over all its segments", ""))

    def loss(self) -> Any:
        return attrs.field(default="kl", validator=self._choice(LOSS_KINDS), metadata=self._help(
            "'kl': forward KL to the target over the draft vocabulary; 'ce': hard cross-entropy against the "
            "target's argmax over the draft vocabulary; 'mix': (1 - ce_weight) KL + ce_weight CE", ""))

    def ce_weight(self) -> Any:
        return attrs.field(default=0.1, validator=self.unit, metadata=self._help(
            "the CE share of loss 'mix' (ignored by 'kl' and 'ce')", ""))

    def init_from_target_layers(self) -> Any:
        return attrs.field(default=False, validator=_bool(self.owner), metadata=self._help(
            "initialise draft layer i from target layer L - n + i (the target's last n layers), every tensor whose "
            "shape matches; EAGLE-3's first layer reads 2H, so its q/k/v_proj and hidden_norm stay fresh", ""))

    # Layer architectures of speculators' trainer defaults (issue 54 item 4), so its folders import, train further
    # and export as they are; each default is specframe's architecture until then (Llama layers, full attention).

    def qk_norm(self) -> Any:
        return attrs.field(default=False, validator=_bool(self.owner), metadata=self._help(
            "Qwen3-style layers: an RMSNorm over each head's q and k before RoPE (speculators' default P-EAGLE "
            "draft_arch qwen3; exported as transformer_layer_config model_type qwen3)", ""))

    def norm_before_residual(self) -> Any:
        return attrs.field(default=False, validator=_bool(self.owner), metadata=self._help(
            "the first layer's residual stream starts from hidden_norm(hidden) instead of the raw fused hidden "
            "state (speculators' trainer default)", ""))

    def norm_before_fc(self) -> Any:
        return attrs.field(default=False, validator=_bool(self.owner), metadata=self._help(
            "one RMSNorm (input_norm) over the concatenated aux states before fc (EAGLE 3.1; speculators' EAGLE-3 "
            "default)", ""))

    def norm_output(self) -> Any:
        return attrs.field(default=False, validator=_bool(self.owner), metadata=self._help(
            "each autoregressive step feeds the next the final norm's output instead of the pre-norm state (EAGLE "
            "3.1; speculators' EAGLE-3 default)", ""))

    def sliding_window(self) -> Any:
        return attrs.field(default=None, validator=positive_int_or_null(self.owner), metadata=self._help(
            "every draft layer attends within this many positions (itself and the W - 1 before it) in training and "
            "drafting, as speculators' default layers (2048) do; null: the whole context", ""))


@attrs.frozen
class Architecture:
    """The layer-architecture options of ``FamilyFields`` an ``EagleBackbone`` is built with (defaults: specframe's
    Llama layers with full attention)."""

    qk_norm: bool = False
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    norm_output: bool = False
    sliding_window: int | None = None

    @classmethod
    def of(cls, options: Any) -> Architecture:
        """The architecture a drafter's options ask for (an option the drafter does not offer keeps its default)."""
        return cls(**{f.name: getattr(options, f.name) for f in attrs.fields(cls) if hasattr(options, f.name)})

    def export_fields(self) -> dict[str, Any]:
        """These options under the speculators / vLLM config names (``specframe.layouts.export`` writes them)."""
        return attrs.asdict(self)
