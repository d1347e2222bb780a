"""A drafter folder read and validated (``Imported``: its layout, the format it came in, its flat config, its tensors
under the layout's names, the verifier it names), and what a drafter's ``import_weights`` does with it: its options,
its state dict (the target's embedding or heads filled in where the folder shares them), its shape against the run's.
The readers that build one are ``specframe.layouts.formats``; ``specframe.layouts.imports`` picks the reader.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from specframe.errors import SpecframeError
from specframe.layouts import table
from specframe.layouts.target_checks import check_target, target_embedding, target_lm_head


@attrs.frozen
class Imported:
    """A foreign drafter folder, read and validated: ``layout`` (eagle3 / peagle / pard), the ``format`` it came in,
    its flat ``config``, its ``tensors`` under the layout's names and the ``verifier`` it names (if any)."""

    directory: Path
    format: str
    layout: str
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    verifier: str | None = None
    drafter: str | None = None
    speculative_tokens: int | None = None

    @property
    def plugin(self) -> str:
        """The drafter plugin that serves this layout (the one recorded by specframe, else the layout's)."""
        return self.drafter or self.layout

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def aux_layer_ids(self) -> list[int]:
        # the EAGLE layouts' key, and the DFlash layout's (vLLM's update_dflash reads it, as write_dflash writes it)
        ids = self.config.get("eagle_aux_hidden_state_layer_ids") or self.config.get("aux_hidden_state_layer_ids")
        return [int(i) for i in ids or []]

    @property
    def draft_vocab_size(self) -> int:
        head = self.tensors.get("lm_head.weight")  # a DFlash folder may share the target's head (vLLM does)
        if head is not None:
            return int(head.shape[0])
        return int(self.config.get("draft_vocab_size") or self.config["vocab_size"])

    @property
    def architecture(self) -> dict[str, Any]:
        """The EAGLE layer architecture the folder's config asks for, under the drafter option names (``qk_norm``,
        ``norm_before_residual``, ``norm_before_fc``, ``norm_output``, ``sliding_window``; ``layouts.flat_config``
        reads them from a speculators config); absent ones are specframe's defaults."""
        defaults = {"qk_norm": False, "norm_before_residual": False, "norm_before_fc": False, "norm_output": False,
                    "sliding_window": None}
        record = table.get(self.layout)
        if record is None or not record.eagle_architecture:
            return defaults
        # a foreign flat EAGLE config carries none of these (its reader refuses the variants: imports'
        # ``refuse_layer_variants``), so its absent ones read as the defaults
        return {k: self.config.get(k, v) for k, v in defaults.items()}

    @property
    def mask_token_id(self) -> int | None:
        record = table.get(self.layout)
        key = record.mask_token_key if record is not None else "mask_token_id"
        value = self.config.get(key)
        return None if value is None else int(value)

    # What a drafter's ``import_weights`` needs, as methods, so a plugin reaches them through the object it is
    # handed and imports nothing past ``specframe.api`` (API 5).

    def check_target(self, target_config: Any, tokenizer: Any = None) -> None:
        """``check_target``: refuse a folder made for another target (one line naming the field)."""
        check_target(self, target_config, tokenizer)

    def check_shape(self, drafter: str, **expected: Any) -> None:
        """``check_shape``: refuse a folder whose layers / aux layer ids / draft vocabulary differ from ``expected``."""
        check_shape(self, drafter, **expected)

    def block_state(self, own: Mapping[str, torch.Tensor], *, own_shared_are_target: bool) -> dict[str, torch.Tensor]:
        """``block_state``: the folder's DFlash / DSpark tensors as a full state dict for a module whose state dict is
        ``own``, in its dtypes. A missing ``embed_tokens`` / ``lm_head`` (vLLM shares the target's; the reader filled
        them from the target's files where it found them) is ``own``'s when ``own_shared_are_target`` (a prepared
        drafter's are the target's); an extra, missing or misshapen tensor is one error naming it."""
        where = f"cannot import {self.directory}"
        tensors = dict(self.tensors)
        for shared in ("embed_tokens.weight", "lm_head.weight"):
            if shared not in tensors and own_shared_are_target:
                tensors[shared] = own[shared]
        extra, missing = sorted(set(tensors) - set(own)), sorted(set(own) - set(tensors))
        if extra:
            raise SpecframeError(f"{where}: tensor {extra[0]!r} has no place in the drafter")
        if missing:
            why = (" (the folder shares the target's, which was not found in a local safetensors folder)"
                   if missing[0] in ("embed_tokens.weight", "lm_head.weight") else "")
            raise SpecframeError(f"{where}: missing tensor {missing[0]!r}{why}")
        for name, value in own.items():
            if tuple(tensors[name].shape) != tuple(value.shape):
                raise SpecframeError(f"{where}: tensor {name!r} has shape {list(tensors[name].shape)}, the "
                                     f"drafter's is {list(value.shape)}")
        return {k: tensors[k].to(own[k].dtype) for k in own}

    def eagle_state(self, own: Mapping[str, torch.Tensor], target_config: Any, *,
                    own_embedding_is_target: bool = False) -> dict[str, torch.Tensor]:
        """``eagle_state``: the folder's EAGLE tensors as a full state dict for a module whose state dict is ``own``."""
        return eagle_state(self, own, target_config, own_embedding_is_target=own_embedding_is_target)


def with_shared_target_weights(imported: Imported, target_config: Any) -> Imported:
    """A folder of a layout that may share the target's ``embed_tokens`` / ``lm_head`` (DFlash, DSpark: speculators
    writes neither, and vLLM shares the target's) with the target's, read from its local files; left without them when
    those are not found (the drafter names it)."""
    record = table.get(imported.layout)
    if record is None or not record.fills_target_weights:
        return imported
    tensors = dict(imported.tensors)
    for name, read_target in (("embed_tokens.weight", target_embedding), ("lm_head.weight", target_lm_head)):
        if name not in tensors:
            value = read_target(target_config)
            if value is not None:
                tensors[name] = value
    return attrs.evolve(imported, tensors=tensors)



# -------------------------------------------------------------------------------------------- into a drafter


def missing_embedding(imported: Imported, target_config: Any) -> torch.Tensor:
    """The embedding an EAGLE folder without ``embed_tokens`` shares with the target (vLLM does the same)."""
    emb = target_embedding(target_config)
    if emb is None:
        raise SpecframeError(
            f"cannot import {imported.directory}: it has no embed_tokens.weight (it shares the target's) and the "
            "target's embedding was not found in a local safetensors folder"
        )
    return emb


def eagle_state(
    imported: Imported, own: Mapping[str, torch.Tensor], target_config: Any, *, own_embedding_is_target: bool = False
) -> dict[str, torch.Tensor]:
    """The folder's EAGLE tensors as a full state dict for a module whose state dict is ``own``: a missing
    ``embed_tokens`` is the target's (from its files, or ``own``'s when ``own_embedding_is_target``: a prepared
    drafter), a full draft vocabulary gets identity ``d2t`` / all-true ``t2d``; an unexpected or missing tensor is
    named."""
    tensors = dict(imported.tensors)
    if "embed_tokens.weight" not in tensors:
        emb = target_embedding(target_config)
        if emb is None and own_embedding_is_target:
            emb = own["embed_tokens.weight"]
        tensors["embed_tokens.weight"] = emb if emb is not None else missing_embedding(imported, target_config)
    if "d2t" not in tensors and "d2t" in own:
        tensors["d2t"] = torch.zeros(imported.draft_vocab_size, dtype=torch.long)
        tensors["t2d"] = torch.ones(int(imported.config["vocab_size"]), dtype=torch.bool)
    extra = sorted(set(tensors) - set(own))
    missing = sorted(set(own) - set(tensors))
    if extra:
        raise SpecframeError(f"cannot import {imported.directory}: tensor {extra[0]!r} has no place in the drafter")
    if missing:
        raise SpecframeError(f"cannot import {imported.directory}: missing tensor {missing[0]!r}")
    for name, value in own.items():
        if tuple(tensors[name].shape) != tuple(value.shape):
            raise SpecframeError(
                f"cannot import {imported.directory}: tensor {name!r} has shape {list(tensors[name].shape)}, the "
                f"drafter's is {list(value.shape)}"
            )
    return {k: tensors[k].to(own[k].dtype) for k in own}


def check_shape(imported: Imported, drafter: str, **expected: Any) -> None:
    """Refuse a folder whose shape differs from a drafter built from the run's options (``--init-from``)."""
    actual = {"layers": imported.num_layers, "aux_layer_ids": imported.aux_layer_ids,
              "draft_vocab_size": imported.draft_vocab_size, **imported.architecture}
    for key, value in expected.items():
        if actual[key] != value:
            raise SpecframeError(
                f"cannot import {imported.directory}: its {key} is {actual[key]}, this {drafter} drafter's is {value} "
                f"(set drafter.{key} to match)"
            )
