"""The drafter interface (``specframe.api.Drafter``): a draft model and everything that makes it trainable and
servable, with the data it trains on (``TrainingExample``) and returns (``LossTerms``).

``Drafter``'s members fall in five roles, in this order: declarations the core reads before any weight exists,
training, inference, checkpoints and serving. How a checkpoint is written and read is ``specframe.interfaces.checkpoint``
(the methods here delegate to it, so a subclass still overrides them one by one).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import attrs
import torch

from specframe.drafting import modeling
from specframe.declarations import Training, legacy_comparison_options, legacy_import_options, legacy_training
from specframe.drafting.drafts import Draft
from specframe.drafting.elements import ElementSet
from specframe.errors import PluginError, SpecframeError
from specframe.features import FeatureSpec
from specframe.interfaces import checkpoint
from specframe.interfaces.component import Component
from specframe.interfaces.mask_builder import Attention
from specframe.interfaces.partitioner import Segment
from specframe.layouts import export as vllm_layouts
from specframe.layouts.manifest import Manifest, Serving


@attrs.frozen
class TrainingExample:
    """One training sequence as the target sees it (docs/design.md section 8 indexing).

    ``input_ids`` / ``loss_mask`` / ``doc`` are per data token [L]. ``features`` holds what the drafter declared
    (e.g. ``"aux_hidden"`` [L, n_aux * H], ``"final_hidden"`` [L, H]) computed by the target at each position.
    Shifting into a drafter's own indexing is the drafter's job.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    doc: torch.Tensor
    features: dict[str, torch.Tensor] = attrs.field(factory=dict)


@attrs.define
class LossTerms:
    """What a drafter returns for one segment.

    ``loss_sum``: sum of the losses over the elements the segment is charged with, each times its weight
    (``Drafter.element_weights``, 1 without the hook); the engine divides by the step's global sum of those weights
    (``charged_weight``), which without the hook is the global supervised count. ``count``: number of those
    elements (the weight-0 ones included). ``correct`` / ``total`` [K]: per-depth top-1
    hits and element counts, for validation accuracy.

    ``hit`` (optional, bool [count]): the top-1 verdict of each charged element, in the order of
    ``elements.subset(segment.elements)`` restricted to the charged ones (the same elements ``correct`` counts). With
    it the engine knows every verdict's (anchor, depth) and reports the validation AL as the mean accepted chain
    (consecutive hits from depth 0, plus the bonus token) over anchors with a full chain, the figure greedy decoding
    measures; without it only the per-depth product estimate is available.

    ``masked`` (optional): how many of the charged elements the loss left out because the target's top-1 token lies
    outside the draft vocabulary (the reference trainers' position mask); the engine reports the share.

    ``confidence`` (optional, API 8): the drafter's own acceptance estimate of each charged element, as a logit.
    """

    loss_sum: torch.Tensor
    count: int
    correct: torch.Tensor
    total: torch.Tensor
    hit: torch.Tensor | None = None
    masked: int | None = None
    #: API 8 (optional, float [count]): the drafter's raw confidence logit that each charged element's draft token is
    #: accepted, in ``hit``'s order; with ``hit`` the engine measures its calibration (``val_confidence_ece``) and
    #: hands the held-out figures to ``Drafter.calibrate`` at the end of training
    confidence: torch.Tensor | None = None
    #: API 12 (optional, float [count] in [0, 1]): the chance that the rule the drafter's confidence is calibrated
    #: for accepts each charged element's draft token (teacher-forced), in ``hit``'s order: a verdict, or the
    #: expected acceptance of speculative sampling (1 - TV). Given, the engine measures the confidence's
    #: calibration against it and hands it to ``Drafter.calibrate`` instead of ``hit``.
    acceptance: torch.Tensor | None = None

    @staticmethod
    def zero(like: torch.Tensor) -> torch.Tensor:
        """A zero loss inside ``like``'s graph (``like.sum() * 0.0``; API 14): a segment charged with nothing (context
        only) still returns a loss that reaches the drafter's parameters, so its backward runs and DDP's gradient
        hooks fire as on any other rank."""
        return like.sum() * 0.0

    @classmethod
    def empty(cls, k: int, like: torch.Tensor) -> LossTerms:
        """The terms of a segment charged with nothing (API 14): the ``zero`` loss of ``like`` (a parameter or an
        output of the drafter), no element, ``k`` depths with no hit and no count, no verdict."""
        return cls(cls.zero(like), 0, torch.zeros(k, dtype=torch.long), torch.zeros(k, dtype=torch.long),
                   hit=torch.zeros(0, dtype=torch.bool))


def charged_weight(drafter: Drafter, example: TrainingExample, elements: ElementSet,
                   supervision: torch.Tensor, charged: torch.Tensor | None = None) -> float:
    """The loss normaliser of one sequence: the sum of ``drafter.element_weights`` over the elements it is charged
    with (``supervision`` set at the element's position, or ``charged``, one bool per element, when a step charges
    fewer: an anchor sample), or their count when the drafter gives no weights. Each element is charged in exactly
    one segment, so summed over a step's sequences (and ranks) this is the denominator every segment's backward
    divides by (checked here: a weight that is not finite and >= 0 is a PluginError)."""
    if charged is None:
        charged = supervision.to(torch.bool)[elements.position]
    weights = drafter.element_weights(example, elements)
    if weights is None:
        return float(int(charged.sum()))
    who = f"drafter '{getattr(drafter, 'name', type(drafter).__name__)}'"
    if not isinstance(weights, torch.Tensor) or tuple(weights.shape) != (len(elements),):
        shape = tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights).__name__
        raise PluginError(f"{who}: element_weights() returned {shape}, not a tensor [{len(elements)}]")
    weights = weights.detach().to(device="cpu", dtype=torch.float64)
    if not bool(torch.isfinite(weights).all()) or bool((weights < 0).any()):
        raise PluginError(f"{who}: element_weights() returned a weight that is negative or not finite")
    return float(weights[charged].sum())


class Drafter(Component, ABC):
    """A draft model and everything that makes it trainable and servable.

    Training: ``supervision`` says which of the drafter's own positions carry a loss, the engine builds the element
    set from it (full grid or COD), a partitioner cuts it into segments, and ``loss`` computes one segment's loss with
    the attention a mask builder made (possibly in several sequential passes, as EAGLE-3 does).
    Inference (batch size 1): ``start`` on a prompt, then rounds of ``propose`` and ``accept``.
    """

    #: True when one forward drafts every depth (P-EAGLE, PARD, ParallelSpec); False for autoregressive drafting
    parallel: ClassVar[bool] = False
    #: True when ``propose_tree`` builds a real tree (several candidates per level); False when it falls back to the
    #: chain ``propose`` (benchmarks then report the drafter at chain K only, never as a tree)
    builds_trees: ClassVar[bool] = False
    #: how the drafter's elements see each other in training (``VISIBILITY_RULES``, API 2): ``chain``, causal along
    #: each anchor's chain, or ``block``, bidirectional inside each anchor's block (DFlash). Both see the context
    #: (depth-0 elements up to the anchor). The engine stamps it on the element sets, so every mask builder and
    #: partitioner applies it (``specframe.drafting.elements`` states both rules).
    visibility: ClassVar[str] = "chain"
    #: API 6: the tokens the drafter's head scores (set by a drafter with a draft vocabulary, once the target's
    #: vocabulary has clamped it); None: the full target vocabulary. The memory estimate charges its logits.
    draft_vocab_size: int | None = None

    def __init__(self, target_config: Any, options: Any = None) -> None:
        super().__init__(options)
        self.target_config = target_config

    # -- declarations (API 6): read by the core from the class and its options, before any weight exists
    @classmethod
    def training(cls, options: Any) -> Training:
        """How this drafter trains and drafts under ``options`` unless the run says otherwise (``Training``).
        Default, for a plugin written for API 5 or earlier: read from the option names the built-ins used then
        (``k_train``, ``k_infer``, ``cod_ratio``, ``cod_min_ratio``, ``activation_checkpointing``, ``loss_chunk``)."""
        return legacy_training(options)

    @classmethod
    def comparison_options(cls, depth: int, draft_vocab_size: int, k: int) -> dict[str, Any]:
        """The option values that make this drafter train at ``depth``, draft over ``draft_vocab_size`` target
        tokens (where it has a draft vocabulary) and draft ``k`` tokens per round by default: how an equal-budget
        comparison sets what it holds equal (``benchmarks/presets.py``), whatever this drafter calls those settings.
        They are defaults there: an option the comparison states for this drafter wins. Default, for a plugin
        written for API 5 or earlier: the option names the built-ins used then, where ``Options`` has them."""
        return legacy_comparison_options(cls.Options, depth, draft_vocab_size, k)

    @abstractmethod
    def feature_spec(self) -> FeatureSpec:
        """The target features this drafter trains and drafts from (aux hidden states, final hidden state, none)."""

    @abstractmethod
    def module(self) -> torch.nn.Module:
        """The trainable model (its ``parameters()`` are optimised, its ``state_dict()`` checkpointed)."""

    def layer_shapes(self) -> tuple[modeling.LayerShape, ...] | None:
        """API 9: the decoder layers each forwarded row runs through, with their sizes (``api.modeling.LayerShape``):
        what the memory estimate charges per-row activations for. Default None: the estimate finds them by structure
        (``api.modeling.DecoderLayer`` s, or any layer with an ``mlp`` beside a ``self_attn`` that carries a
        ``LayerShape``). A drafter with a layer type of its own declares them here, else it is costed without their
        activations (the estimate says so in its notes, and the drafter contract fails); one with no decoder layers
        returns ``()``."""
        return None

    # -- training
    def forwarded_rows(self, elements: int, anchors: int) -> int:
        """Rows this drafter's layers run for a training segment of ``elements`` grid elements (charged ones and
        the context the segment recomputes) whose charged elements have ``anchors`` distinct anchors: what
        ``specframe.memory``'s estimate multiplies its per-row activation bytes by (and squares, for a dense mask).
        Default: one row per element. A drafter that runs other rows states it here (DFlash runs every slot of each
        charged anchor's block, whatever the training depth); an estimate that counts too few rows proposes a
        context length the in-run guard then stops."""
        return elements

    def check_training(self, depth: int, mask_builder: str, partitioner: str) -> None:
        """Refuse (``UsageError``) a training configuration this drafter cannot train: called by the engine at
        start-up, after the depth, mask builder and partitioner are resolved and before any data is read, so a
        combination the drafter does not support fails at once, never mid-run. Default: everything is supported."""

    def prepare(self, target: Any, examples: Any) -> None:
        """Called once by the trainer before training or resuming, with the loaded target (``.model``,
        ``.tokenizer``) and an iterable of the training ``TrainingExample`` s: the place to initialise weights from
        the target, choose a draft vocabulary or a mask token, and keep the frozen target pieces the loss needs.
        On resume the checkpoint is loaded after this call, so choices made here must not depend on randomness
        that the checkpoint does not restore. Default: nothing."""

    def target_layers(self, num_layers: int) -> Sequence[int] | None:
        """API 15: the target's decoder layers (indices in ``0..num_layers - 1``) that ``prepare`` reads, besides the
        embedding, the final norm and the head. A run that trains from a feature cache loads only these (the others
        are dropped once it has loaded, ``specframe.targets.keep_layers``: reading one raises), so the training device
        and the rest of the run hold only these of a large target's body; a run that computes features online keeps
        the whole target whatever this says. Default None: every layer, as before this hook existed."""
        return None

    @abstractmethod
    def supervision(self, example: TrainingExample) -> torch.Tensor:
        """Bool [L'] over the drafter's own positions: True where the element at that reference position has a loss."""

    @abstractmethod
    def loss(self, example: TrainingExample, elements: ElementSet, segment: Segment, attention: Attention) -> LossTerms:
        """The loss of the segment's charged elements (``elements.subset(segment.elements)`` are forwarded).
        ``attention`` is a ``SegmentAttention`` when the engine calls (tests may pass a plain ``Attention``)."""

    def element_weights(self, example: TrainingExample, elements: ElementSet) -> torch.Tensor | None:
        """API 14: the weight of each element of ``elements`` (float [len(elements)], finite, >= 0) in the loss's
        normaliser. The engine divides a step's summed loss by the sum of these weights over the step's charged
        elements (``charged_weight``: every sequence and rank, computed before the first segment's forward, so each
        segment's backward already knows it), and ``loss`` must weigh each charged element's loss by the same value
        (its ``loss_sum`` is the sum of weight x loss): the step's loss is then the weighted mean the reference
        trainers of a weighted loss take (e.g. DFlash's ``sum(w * CE) / sum(w)``). Default None: every charged
        element weighs 1, the loss is the mean over the charged count. ``LossTerms.count`` and the accuracy figures
        count the elements whatever their weight."""
        return None

    # -- inference
    @abstractmethod
    def start(self, prompt_ids: torch.Tensor, features: dict[str, torch.Tensor]) -> None:
        """Reset the drafter's state to a new prompt, with the target's features at every prompt position."""

    @abstractmethod
    def propose(self, k: int, generator: torch.Generator | None = None) -> Draft:
        """Draft a chain of up to ``k`` tokens beyond the committed sequence (an empty draft is allowed)."""

    def propose_tree(
        self, depth: int, top_k: int, total_tokens: int, generator: torch.Generator | None = None
    ) -> Draft:
        """Draft a tree of at most ``total_tokens`` nodes and ``depth`` levels for a tree verifier.

        Drafters that can score candidates build an EAGLE-2 dynamic tree with ``dynamic_tree`` (``top_k`` children
        per expanded node). Default: the chain ``propose(depth)``, a one-branch tree, so every drafter can be served
        with a tree verifier. A drafter that overrides this with a real tree sets ``builds_trees = True``.
        """
        return self.propose(depth, generator)

    @abstractmethod
    def accept(self, emitted: torch.Tensor, features: dict[str, torch.Tensor]) -> None:
        """Commit ``emitted`` (the verifier's emitted tokens) and drop any state the rejected draft left behind.

        ``features[name][j]`` is the target's feature at the position that *predicted* ``emitted[j]`` (the token
        before it), the EAGLE pairing of token x_{t+1} with feature g_t (docs/design.md section 8). The first call after
        ``start`` commits the token the prefill produced, paired with the last prompt position's features."""

    # -- checkpoints
    #: the JSON file beside the weights that says which drafter wrote them and with what options
    CHECKPOINT_INFO: ClassVar[str] = "drafter.json"
    CHECKPOINT_WEIGHTS: ClassVar[str] = "model.safetensors"

    def calibrated_confidence(self, logits: torch.Tensor) -> torch.Tensor:
        """API 8. The acceptance probabilities this drafter's raw confidence ``logits`` [anchors, K] stand for (column
        j: draft position j), with whatever calibration ``calibrate`` fitted. Default: the sigmoid."""
        return torch.sigmoid(torch.as_tensor(logits).double())

    def calibrate(self, logits: torch.Tensor, accepted: torch.Tensor) -> bool:
        """API 8. Fit the drafter's confidence calibration on held-out data: called by the engine after the final
        validation and before the final checkpoint, with the raw ``LossTerms.confidence`` logits and the top-1
        verdicts (float 0 / 1; API 12: the drafter's ``LossTerms.acceptance`` when it gives one, values in [0, 1]) of
        held-out anchors with a full chain, as matrices [anchors, K]. The engine calls it on half
        of the validation sequences first (to measure the calibration on the other half), then on all of them: a
        call replaces what an earlier one fitted. Keep the fit in ``describe()`` / ``restore_checkpoint`` (or the
        weights), so it travels with the checkpoint. Return True when something was fitted (the engine then reports
        the calibration and saves the checkpoint with it). Default: nothing to fit."""
        return False

    def describe(self) -> dict[str, Any]:
        """What ``save`` records beside the weights (``drafter`` and ``options`` at least; add what inference and
        export need)."""
        from specframe.structuring import unstructure

        return {"drafter": self.name, "options": unstructure(self.options)}

    def save(self, directory: Path) -> None:
        """Write the module's weights (safetensors) and ``describe()`` (JSON) into ``directory``."""
        checkpoint.save(self, directory)

    def load(self, directory: Path) -> None:
        """Load what ``save`` wrote (safetensors only: nothing is unpickled): ``check_checkpoint`` vets the recorded
        description before any weight is read, ``restore_checkpoint`` takes back the non-tensor state after."""
        checkpoint.load(self, directory)

    def check_checkpoint(self, directory: Path, info: dict[str, Any]) -> None:
        """Refuse (``SpecframeError``) a checkpoint whose recorded shape does not match this drafter. Default: none."""

    def restore_checkpoint(self, info: dict[str, Any]) -> None:
        """Take back state kept in ``describe()`` rather than in tensors (mask token ids, ...). Default: nothing."""

    @classmethod
    def read_checkpoint_info(cls, directory: Path) -> dict[str, Any]:
        """The checkpoint's ``describe()`` record, refused unless this drafter wrote it."""
        return checkpoint.read_info(cls, directory)

    @classmethod
    def from_checkpoint(cls, directory: Path, target_config: Any) -> Drafter:
        """A drafter rebuilt from ``save``'s files (options included) for the given target config."""
        return checkpoint.rebuild(cls, directory, target_config)

    # -- serving
    def vllm_speculative_config(self, k: int) -> dict[str, Any] | None:
        """API 6: the ``speculative_config`` vLLM serves this drafter with as it is, drafting ``k`` tokens, without
        exported weights: a weightless method vLLM implements itself (prompt lookup is vLLM's ``ngram``). None, the
        default: vLLM serves only this drafter's trained checkpoints, written by ``export_vllm``."""
        return None

    def export_vllm(self, directory: Path, tokenizer: Any, serving: Serving | None = None) -> Manifest:
        """Write this (trained) drafter into ``directory`` in a checkpoint layout vLLM loads, with ``tokenizer`` (the
        target's) saved beside it, and return the ``Manifest`` the ``vllm_layouts`` writer returned (``layout``,
        ``method``, ``parallel_drafting``, ...). ``specframe export --format vllm`` calls it; ``specframe export`` and
        ``specframe serve`` pass the manifest on to build vLLM's ``speculative_config``.

        ``serving`` (API 14): the verifier and default draft tokens the user chose (``specframe export --verifier``,
        ``--k``; None, or a field None: the drafter's own choice). Hand it to the writer as ``serving=``, which
        writes it into ``config.json`` once. An API 13 drafter, whose ``export_vllm`` takes no ``serving``, still
        exports with the user's choice: the core sees its signature and re-targets the folder after it was written
        (``vllm_layouts.set_serving``).

        Implementations gather their tensors under the layout's names and call the writer of their layout, one per
        row of the layout table (``specframe.layouts.table``): ``vllm_layouts.write_eagle3``, ``write_peagle``,
        ``write_dflash``, ``write_dspark``, ``write_pard`` or ``write_parallelspec`` (they validate shapes and ids and
        write atomically). Default: refuse, for drafters vLLM has no model for (those belong in a vLLM general
        plugin, as ``specframe.vllm.vllm_plugin`` does for ParallelSpec).
        """
        raise SpecframeError(
            f"drafter '{self.name}' cannot be exported to vLLM: it does not implement Drafter.export_vllm "
            f"(layouts vLLM loads: {', '.join(vllm_layouts.LAYOUTS)})"
        )

    @classmethod
    def import_options(cls, imported: Any) -> dict[str, Any]:
        """API 6: the option values that give this drafter the shape of a foreign folder ``imported`` (what
        ``import_weights`` is then handed: ``num_layers``, ``aux_layer_ids``, ``draft_vocab_size``,
        ``speculative_tokens``, its ``config``). Default, the option names the built-ins used up to API 5 where
        ``Options`` has them: ``layers``, ``aux_layer_ids``, ``draft_vocab_size``, ``k_infer`` (the folder's
        speculative tokens) and ``init_from_target`` false (the folder's weights replace the target's)."""
        return legacy_import_options(cls.Options, imported)

    def import_weights(self, imported: Any) -> None:
        """Load a foreign drafter folder read by ``specframe.layouts.imports.read`` into this drafter, after checking
        it against the target and this drafter's shape (one ``SpecframeError`` naming the field otherwise). The
        folder is in one of the formats it reads (``imports.FORMATS``): ``speculators``, ``eagle3-flat``,
        ``peagle-flat``, ``deepspec``, ``specforge-dspark``, ``parallelspec``, ``pard``; ``imported.plugin`` names
        the drafter it belongs to. ``specframe train --init-from``, ``generate`` / ``bench --checkpoint FOLDER`` and
        ``export`` call it. Default: refuse."""
        raise SpecframeError(
            f"drafter '{self.name}' cannot import {getattr(imported, 'layout', '?')} folders: it does not implement "
            "Drafter.import_weights"
        )
