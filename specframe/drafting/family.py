"""What the EAGLE family's drafter classes declare and record alike (exposed as ``api.eagle``, beside the options they
share, ``api.eagle.FamilyFields`` from ``specframe.drafting.family_options``).

``family_training`` is their ``Drafter.training`` (API 6), read from the shared option fields. ``FamilyTraining`` is a
mixin holding that and ``comparison_options`` once, for EAGLE-3, P-EAGLE and ParallelSpec; ``FamilyDrafter`` adds the
checkpoint record (``describe``) and its check (``check_checkpoint``) of the drafters on the EAGLE-3 backbone that
vLLM serves from a speculators folder (EAGLE-3, P-EAGLE). ParallelSpec records its own (it has two backbones and no
``d2t``), so it takes ``FamilyTraining`` only. A mixin goes first in the bases, before ``api.Drafter``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from specframe.declarations import Training
from specframe.errors import SpecframeError

__all__ = ["FamilyDrafter", "FamilyTraining", "family_training"]


def family_training(options: Any, depth: int) -> Training:
    """``Drafter.training`` (API 6) for the EAGLE family's drafters (P-EAGLE, EAGLE-3, PARD, ParallelSpec), whose
    options carry the family's shared fields (``FamilyFields``) ``k_infer``, ``cod_ratio``, ``cod_min_ratio``,
    ``activation_checkpointing`` and ``loss_chunk``; ``depth`` is the drafter's default training depth, which each
    spells its own way (EAGLE-3's is its number of test-time-training passes)."""
    return Training(depth=depth, k=options.k_infer, cod_ratio=options.cod_ratio, cod_min_ratio=options.cod_min_ratio,
                    activation_checkpointing=options.activation_checkpointing,
                    checkpointing_option="activation_checkpointing", loss_chunk=options.loss_chunk)


class FamilyTraining:
    """``training`` and ``comparison_options`` (API 6) of a family drafter over a draft vocabulary."""

    #: the option holding the default training depth (EAGLE-3 spells it ``ttt_steps``: one depth per TTT pass)
    depth_option: ClassVar[str] = "k_train"

    @classmethod
    def training(cls, options: Any) -> Training:
        return family_training(options, getattr(options, cls.depth_option))

    def target_layers(self, num_layers: int) -> list[int]:
        """API 15: what ``prepare`` reads of the target's body: its last ``options.layers`` layers with
        ``init_from_target_layers`` (``copy_target_layers``, which refuses more layers than the target has), else
        none (the embedding and head rows only)."""
        if not self.options.init_from_target_layers:
            return []
        return list(range(max(num_layers - self.options.layers, 0), num_layers))

    @classmethod
    def comparison_options(cls, depth: int, draft_vocab_size: int, k: int) -> dict[str, Any]:
        return {"draft_vocab_size": draft_vocab_size, cls.depth_option: depth, "k_infer": k}


class FamilyDrafter(FamilyTraining):
    """``FamilyTraining`` and the checkpoint record of a drafter on the EAGLE-3 backbone (``aux_layer_ids``,
    ``draft_vocab_size``, ``vocab_size``, ``shape`` and ``options.layers`` set by its ``__init__``)."""

    #: attributes recorded first, before the family's fields (P-EAGLE's ``mask_token_id``)
    recorded: ClassVar[tuple[str, ...]] = ()

    def describe(self) -> dict[str, Any]:
        """What inference and vLLM export need besides the tensors."""
        s = self.shape
        return {
            **super().describe(),
            **{name: getattr(self, name) for name in self.recorded},
            "aux_layer_ids": list(self.aux_layer_ids),
            "draft_vocab_size": self.draft_vocab_size,
            "vocab_size": self.vocab_size,
            **s.config_fields(),
            "target_hidden_size": s.hidden,
            "num_hidden_layers": self.options.layers,
            "d2t": "offsets: target id = draft id + d2t[draft id]",
        }

    def check_checkpoint(self, directory: Path, info: dict[str, Any]) -> None:
        if list(info["aux_layer_ids"]) != list(self.aux_layer_ids) or info["draft_vocab_size"] != self.draft_vocab_size:
            raise SpecframeError(
                f"{directory} was trained with aux layers {info['aux_layer_ids']} and draft vocabulary "
                f"{info['draft_vocab_size']}; this drafter has {self.aux_layer_ids} and {self.draft_vocab_size}"
            )
