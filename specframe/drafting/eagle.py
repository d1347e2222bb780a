"""Pieces shared by the drafters that read the target's features and draft over a reduced vocabulary.

Exposed to plugins as ``api.eagle``. EAGLE-3 (``eagle3``) and ParallelSpec (``parallelspec``) use all of it; P-EAGLE
subclasses ``EagleBackbone`` (adding its ``mask_hidden``); P-EAGLE, ParallelSpec and DFlash (a separate package)
draft from ``QueuedInference``'s queue of committed tokens (``specframe.drafting.queued_inference``, re-exported here). What
their classes declare and record alike (``family_training``, the ``FamilyTraining`` / ``FamilyDrafter`` mixins) is
``specframe.drafting.family``, and the options they share (``FamilyFields``, ``Architecture``) are
``specframe.drafting.family_options``, both re-exported here.

``EagleBackbone`` holds the vLLM ``llama_eagle3`` parameter names (``embed_tokens``, ``fc``, ``layers.N.*``,
``norm``, ``lm_head``, ``d2t`` offsets and ``t2d`` mask), so a checkpoint exports without renaming. Draft vocabulary
and mask tokens follow ``specframe.drafting.vocab``'s documented rules (loss-masked token counts, ties to the lower id; mask
ids are unused special / reserved tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import attrs
import torch
from torch import nn

from specframe.drafting import modeling
from specframe.drafting.elements import position_docs
# What a family drafter class declares and records (training, comparison options, the checkpoint record), held once.
from specframe.drafting.family import FamilyDrafter, FamilyTraining, family_training
from specframe.drafting.family_options import LOSS_MASK_BITS, Architecture, FamilyFields
from specframe.drafting.queued_inference import PendingInputs, QueuedInference
from specframe.drafting.vocab import (
    build_draft_vocab,
    count_tokens,
    mask_token_ids,
)
from specframe.errors import SpecframeError, UsageError
from specframe.features import low_mid_high_layers
from specframe.target_head import TargetHead, as_target_head, target_head

__all__ = [
    "TEACHER_IDS",
    "TEACHER_LOGP",
    "Architecture",
    "EagleBackbone",
    "FamilyDrafter",
    "FamilyFields",
    "FamilyTraining",
    "TargetHead",
    "PendingInputs",
    "QueuedInference",
    "all_token_counts",
    "aux_layer_ids",
    "cat_kv",
    "ce_share",
    "charged_forward_kl",
    "copy_target_layers",
    "default_aux_layers",
    "depth_weights",
    "draft_vocab_size",
    "draft_vocabulary",
    "family_training",
    "freeze_head",
    "full_vocab_top1",
    "in_draft_vocab",
    "loss_kind",
    "keep_committed",
    "kl_teacher",
    "low_mid_high_layers",
    "mask_token_ids",
    "per_depth",
    "sequence_weights",
    "shifted_supervision",
    "start_from_target",
    "supervised_per_document",
    "target_head",
    "windowed",
]


class EagleBackbone(nn.Module):
    """Embedding, optional ``fc`` fusing ``num_aux`` target hidden states (num_aux * H -> H), Llama layers (the
    first one EAGLE-3's cat(embedding, hidden) layer when ``eagle_input``), final norm and a draft-vocabulary head.

    With ``num_aux`` 0 there is no ``fc`` and, with ``eagle_input`` False, the layers are a plain causal LM stack
    whose residual stream starts from the token embedding.
    """

    def __init__(
        self,
        shape: modeling.LayerShape,
        vocab_size: int,
        draft_vocab_size: int,
        num_aux: int,
        layers: int,
        eagle_input: bool = True,
        architecture: Architecture | None = None,
    ) -> None:
        super().__init__()
        if layers < 1:
            raise UsageError(f"a drafter needs at least one layer, got {layers}")
        self.shape = shape
        self.eagle_input = eagle_input
        arch = architecture or Architecture()
        self.architecture = arch
        h = shape.hidden
        self.embed_tokens = nn.Embedding(vocab_size, h)
        # speculators' norm_before_fc (vLLM's input_norm): one RMSNorm over the concatenated aux states before fc
        self.input_norm = modeling.RMSNorm(num_aux * h, shape.eps) if num_aux and arch.norm_before_fc else None
        self.fc = nn.Linear(num_aux * h, h, bias=False) if num_aux else None
        self.layers = nn.ModuleList(
            [modeling.DecoderLayer(shape, eagle_input=(eagle_input and i == 0),
                                   norm_before_residual=arch.norm_before_residual, qk_norm=arch.qk_norm)
             for i in range(layers)]
        )
        self.norm = modeling.RMSNorm(h, shape.eps)
        self.lm_head = nn.Linear(h, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(vocab_size, dtype=torch.bool))
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
        self.set_draft_vocab(torch.arange(draft_vocab_size))

    def set_draft_vocab(self, draft_ids: torch.Tensor) -> None:
        """Install the draft vocabulary (target ids, strictly increasing): target id = draft id + d2t[draft id]."""
        draft_ids = draft_ids.to(device=self.d2t.device, dtype=torch.long)
        self.d2t.copy_(draft_ids - torch.arange(draft_ids.numel(), device=self.d2t.device))
        self.t2d.zero_()
        self.t2d[draft_ids] = True

    def draft_ids(self) -> torch.Tensor:
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    def to_target(self, draft: torch.Tensor) -> torch.Tensor:
        return draft + self.d2t[draft]

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's concatenated aux states [N, num_aux * H] projected to the drafter width [N, H] (through
        ``input_norm`` first with ``norm_before_fc``)."""
        if self.fc is None:
            raise UsageError("this backbone reads no target features (num_aux 0)")
        aux = aux.to(self.fc.weight.dtype)
        return self.fc(aux if self.input_norm is None else self.input_norm(aux))

    def feed(self, out: torch.Tensor) -> torch.Tensor:
        """The hidden state an autoregressive step hands the next one from its layers' output ``out``: the pre-norm
        output, or with ``norm_output`` (EAGLE 3.1) the final norm's output (vLLM's ``aux_output``)."""
        return self.norm(out) if self.architecture.norm_output else out

    def attention_window(self) -> int | None:
        """The sliding window every draft layer attends within (None: the whole context)."""
        return self.architecture.sliding_window

    def run(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor | None,
        position: torch.Tensor,
        attention: modeling.Attention,
        past: list[modeling.KV] | None = None,
        checkpointing: bool = False,
    ) -> tuple[torch.Tensor, list[modeling.KV]]:
        """One block of N elements: ``embeds`` [N, H] token inputs, ``hidden`` [N, H] hidden inputs (ignored, and
        may be None, without ``eagle_input``), ``position`` [N]. Returns the last layer's *pre-norm* output [N, H]
        (what EAGLE-3 feeds forward) and each layer's new (k, v)."""
        stream = hidden if self.eagle_input else embeds
        out, kvs = modeling.run_layers(
            self.layers, stream[None], embeds[None], position, self.shape, attention, past=past,
            checkpointing=checkpointing,
        )
        return out[0], kvs

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of pre-norm outputs."""
        return self.lm_head(self.norm(out))


def windowed(attention: Any, elements: Any, window: int | None) -> Any:
    """A drafter's training attention over ``elements`` (a segment's) with the sliding ``window`` applied: the same
    mask builder's attention rebuilt for the windowed sets (``SegmentAttention.subset``; a builder that does not
    apply windows is refused by name). Unchanged when there is no window or it cannot bind (every position lies
    within ``window`` of every anchor before it), so full-attention drafters and short sequences pay nothing."""
    if window is None or len(elements) == 0:
        return attention
    span = int((elements.anchor + elements.depth).max()) - int(elements.anchor.min())
    if span < window:
        return attention
    subset = getattr(attention, "subset", None)
    if subset is None:
        raise UsageError(f"the drafter attends within a sliding window of {window} positions and this attention "
                         "cannot rebuild its mask with it (no SegmentAttention.subset)")
    sets = attrs.evolve(elements, window=window)
    return subset(sets, sets)


def ce_share(options: Any) -> float:
    """The CE weight ``modeling.chunked_forward_kl`` takes for a drafter's ``loss`` / ``ce_weight`` options."""
    return {"kl": 0.0, "ce": 1.0}.get(options.loss, float(options.ce_weight))


def loss_kind(options: Any) -> dict[str, float]:
    """``chunked_forward_kl``'s keyword for the drafter's ``loss`` option: none for plain KL, so a loss kernel
    written before the option (a test's reference, a plugin's wrapper) is still called exactly as it was."""
    w = ce_share(options)
    return {"ce_weight": w} if w else {}


def freeze_head(model: nn.Module, train: bool) -> None:
    """``train_head`` false: the draft lm_head gets no gradient, so the engine neither optimises it nor counts it
    (both take ``requires_grad`` parameters), and the memory estimate charges it as frozen weights."""
    model.lm_head.weight.requires_grad_(bool(train))


def aux_layer_ids(drafter: str, requested: list[int] | None, num_layers: int) -> list[int]:
    """The three target layers (low, mid, high) whose inputs a drafter on the EAGLE-3 input reads: ``requested`` (its
    ``aux_layer_ids`` option) checked against the target's ``num_layers``, or, when None, ``low_mid_high_layers``."""
    ids = requested if requested is not None else list(low_mid_high_layers(num_layers))
    if len(ids) != 3 or any(not 0 <= int(i) < num_layers for i in ids):
        raise UsageError(
            f"{drafter} needs 3 aux layer ids in 0..{num_layers - 1} (low, mid, high), got {ids}; "
            "set drafter.aux_layer_ids in --config"
        )
    return [int(i) for i in ids]


def start_from_target(model: EagleBackbone, target: Any, draft: torch.Tensor, copy_layers: bool) -> TargetHead:
    """What a family drafter's ``prepare`` takes from the target: its token embedding, the draft vocabulary ``draft``
    (target ids) with the target's ``lm_head`` rows of it as the draft head, and, with ``copy_layers`` (the
    ``init_from_target_layers`` option), its last layers (``copy_target_layers``). Returns the target's head as its
    forward applies it (bias, logit scale, soft-capping): the loss's teacher."""
    head = target_head(target)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight.detach())
        model.set_draft_vocab(draft)
        model.lm_head.weight.copy_(head.weight[draft])
    if copy_layers:
        copy_target_layers(model.layers, target.model)
    return head


def copy_target_layers(layers: nn.ModuleList, target_model: Any) -> list[str]:
    """Copy the target's last ``len(layers)`` decoder layers into ``layers`` (draft layer i from target layer
    L - n + i), every tensor whose name and shape match the target's ``model.layers.J.*``; returns the names (in the
    draft layer's terms, ``i.self_attn.o_proj.weight``) that were not copied. EAGLE-3's first layer reads
    cat(embedding, hidden) (2H), so its q/k/v_proj have no counterpart and its hidden_norm none at all."""
    source = target_model.state_dict()
    total = int(target_model.config.num_hidden_layers)
    n = len(layers)
    if n > total:
        raise UsageError(f"init_from_target_layers: {n} draft layers cannot come from a {total}-layer target")
    # a layer with no tensors here (not loaded, or not named model.layers.J) would leave its draft layer fresh unseen
    lacking = [j for j in range(total - n, total) if not any(k.startswith(f"model.layers.{j}.") for k in source)]
    if lacking:
        raise SpecframeError(f"init_from_target_layers: the target holds no tensors of its layers {lacking} (a target "
                             "without model.layers.J, or layers the run did not load: see Drafter.target_layers)")
    fresh = []
    with torch.no_grad():
        for i, layer in enumerate(layers):
            for key, value in layer.state_dict(keep_vars=True).items():
                src = source.get(f"model.layers.{total - n + i}.{key}")
                if src is None or tuple(src.shape) != tuple(value.shape):
                    fresh.append(f"{i}.{key}")
                    continue
                value.copy_(src.to(dtype=value.dtype, device=value.device))
    return fresh


def supervised_per_document(examples: Iterable[Any], supervision: Callable[[Any], torch.Tensor]) -> float:
    """Mean supervised positions per document (one with any) over ``examples``: the fixed scale of
    ``loss_normalisation = 'sequence'`` (see ``sequence_weights``)."""
    total, docs = 0, 0
    for example in examples:
        sup = supervision(example).to(torch.bool)
        doc = position_docs(example.doc, sup.shape[0])  # the documents the engine gives the drafter's positions
        total += int(sup.sum())
        docs += int(torch.unique(doc[sup]).numel())
    return total / docs if docs else 1.0


def sequence_weights(elements: Any, supervised: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    """Per-row loss weights of ``loss_normalisation = 'sequence'``: ``scale`` / n_doc, n_doc being the charged
    elements of the row's document in the *whole* element set (every segment of the sequence), so a document's
    elements sum to ``scale`` however the engine cuts it into segments. ``supervised`` bool [positions]: the
    drafter's supervision; ``rows``: the charged elements' indices into ``elements``.

    The engine divides a step's loss by its charged count N, so the step's loss is scale / N times the sum of the
    documents' means: the per-document mean up to that one positive factor per step (scale is the training data's
    mean supervised positions per document, so the factor stays near 1 / elements per position)."""
    charged = supervised.to(torch.bool).cpu()[elements.position.cpu()]
    doc = elements.doc.cpu()
    n_doc = torch.bincount(doc[charged], minlength=int(doc.max()) + 1 if doc.numel() else 1).float()
    return (scale / n_doc[doc[rows.cpu()]]).to(rows.device)


def charged_forward_kl(
    options: Any, outputs: torch.Tensor, head: torch.Tensor, teacher: dict[str, Any], *, depth: torch.Tensor,
    pos: torch.Tensor, charged: torch.Tensor, elements: Any, segment: Any, supervised: torch.Tensor,
    sequence_scale: float,
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """The loss of a family drafter that drafts every depth in one forward (P-EAGLE, ParallelSpec): forward KL from
    the target's distribution at ``pos + 1`` (``teacher``, ``kl_teacher``'s) over the draft vocabulary, for the
    charged elements' final states ``outputs`` read by the draft ``head``, each weighted per document under
    ``loss_normalisation = 'sequence'`` (``supervised``: the drafter's supervision). ``depth``, ``pos``, ``charged``:
    the ``segment``'s elements (a subset of ``elements``). Returns the kernel's result and the top-1 hits per depth
    (correct, total)."""
    row_weight = None
    if options.loss_normalisation == "sequence":
        rows = segment.elements[charged.cpu()]
        row_weight = sequence_weights(elements, supervised, rows, sequence_scale).to(outputs.device)
    result = modeling.chunked_forward_kl(
        outputs, head, **teacher, chunk=options.loss_chunk,
        # element (a, d) is taught by the target's distribution at reference position a + d + 1, computed once per
        # position for all the depths that predict it
        target_index=pos[charged] + 1, row_weight=row_weight, **loss_kind(options),
    )
    correct, total = per_depth(depth[charged], result.correct, elements.max_depth)
    return result, correct, total


def all_token_counts(examples: Iterable[Any], vocab_size: int) -> torch.Tensor:
    """Counts of every token (loss-masked or not) over ``examples``: what the mask-token rule must avoid."""
    return count_tokens(examples, vocab_size, masked_only=False)


def draft_vocab_size(option: int | None, vocab_size: int) -> int:
    """The draft head's rows for a ``draft_vocab_size`` option: None (``FamilyFields.draft_vocab_size`` with
    ``default=None``) is the target's whole vocabulary, and a size past it is clamped to it (a preset states one
    size for targets of any vocabulary)."""
    return min(int(option or vocab_size), int(vocab_size))


def draft_vocabulary(
    examples: Iterable[Any], size: int, vocab_size: int, exclude: Iterable[int] = ()
) -> torch.Tensor:
    """Target ids (ascending) of the ``size`` most frequent loss-masked training tokens (``specframe.drafting.vocab`` rule);
    ``exclude`` (mask tokens) never enters, even as filler."""
    counts = count_tokens(examples, vocab_size).clone()
    for tok in exclude:
        counts[int(tok)] = -1
    return build_draft_vocab(counts, min(size, vocab_size)).ids


def full_vocab_top1(t2d: torch.Tensor, target_head: TargetHead | torch.Tensor
                    ) -> Callable[[torch.Tensor], torch.Tensor]:
    """Reference for evaluation hits: the target's argmax over its whole vocabulary (what greedy verification
    accepts), as a draft id, or -1 when it lies outside the draft vocabulary (a hit is then impossible)."""
    to_draft = _draft_index(t2d)
    target_head = as_target_head(target_head)

    def top1(target_hidden: torch.Tensor) -> torch.Tensor:
        return to_draft[_head_top1(target_hidden, target_head).to(to_draft.device)]

    return top1


def _draft_index(t2d: torch.Tensor) -> torch.Tensor:
    """Each target id's draft-vocabulary id, -1 outside the draft vocabulary ``t2d`` (bool [V])."""
    return torch.where(t2d, torch.cumsum(t2d.long(), 0) - 1, -1)


def in_draft_vocab(t2d: torch.Tensor, target_head: TargetHead | torch.Tensor
                   ) -> Callable[[torch.Tensor], torch.Tensor]:
    """The reference trainers' position mask (EAGLE-3 / P-EAGLE: ``t2d[target argmax]``): True for a row whose
    target top-1 over the whole vocabulary (``target_head``: a ``TargetHead``, or a bare [V, H] weight) lies inside
    the draft vocabulary."""
    target_head = as_target_head(target_head)

    def keep(target_hidden: torch.Tensor) -> torch.Tensor:
        return t2d[_head_top1(target_hidden, target_head).to(t2d.device)]

    return keep


def _head_top1(target_hidden: torch.Tensor, target_head: TargetHead) -> torch.Tensor:
    # on the head's device and in its dtype (as the target's own greedy pick): the rows move, never the [V, H] head
    return target_head.logits(target_hidden.to(target_head.weight)).argmax(-1)


#: the compact teacher a feature cache may hold (``specframe prepare --teacher-top-k K``): per token the target's top-K
#: next-token ids over its whole vocabulary (int32 [T, K], best first) and their log-probabilities (float32 [T, K])
TEACHER_IDS, TEACHER_LOGP = "teacher_ids", "teacher_logp"


def kl_teacher(features: dict[str, torch.Tensor], t2d: torch.Tensor, target_head: TargetHead | torch.Tensor, *,
               device: torch.device, dtype: torch.dtype, mask: bool, evaluating: bool) -> dict[str, Any]:
    """The teacher arguments of ``modeling.chunked_forward_kl`` (``target_hidden``, ``target_head``,
    ``position_mask``, ``reference_top1``) for a drafter over the draft vocabulary ``t2d`` (bool [V]).

    From the feature cache's compact top-k teacher when ``features`` hold one (the target's head never runs), else
    from ``final_hidden`` through ``target_head``: the ``TargetHead`` that ``target_head(target)`` returns (the
    lm_head with the bias, logit scale and soft-capping the target's forward applies; a bare [V, H] weight is taken
    as a head that is only the matmul, which is right for a Llama and wrong for a Gemma-2). ``mask``: the reference
    trainers' position mask (keep a
    position only when the target's top-1 over the whole vocabulary is a draft token); ``evaluating``: a hit must
    match that top-1 (what greedy verification accepts), else the teacher's argmax within the draft vocabulary."""
    if TEACHER_IDS in features:
        to_draft = _draft_index(t2d).to(device)
        keep_t2d = t2d.to(device)
        teacher = modeling.TopKTeacher(features[TEACHER_IDS].to(device), features[TEACHER_LOGP].to(device),
                                       to_draft, int(t2d.sum()))
        return {"target_hidden": teacher, "target_head": None,
                "position_mask": (lambda top1: keep_t2d[top1]) if mask else None,
                "reference_top1": (lambda top1: to_draft[top1]) if evaluating else None}
    # the draft rows are sliced where the head is and only they move and are cast: a copy of the whole [V, H] head
    # in the drafter's dtype (2.1 GB in fp32 for 128K x 4096, every segment) is what this avoids
    target_head = as_target_head(target_head)
    draft_rows = target_head.rows(t2d.to(target_head.device).nonzero().squeeze(1))
    return {"target_hidden": features["final_hidden"].to(device=device, dtype=dtype),
            "target_head": draft_rows.to(device=device, dtype=dtype),
            "position_mask": in_draft_vocab(t2d, target_head) if mask else None,
            "reference_top1": full_vocab_top1(t2d, target_head) if evaluating else None}


def per_depth(depth: torch.Tensor, hit: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(correct [k], total [k]) per depth from element depths and top-1 hit flags."""
    depth = depth.cpu()
    total = torch.bincount(depth, minlength=k)[:k]
    correct = torch.bincount(depth[hit.cpu().bool()], minlength=k)[:k]
    return correct, total


def depth_weights(k: int, decay: float, explicit: list[float] | None = None) -> torch.Tensor:
    """Loss weight of each depth: ``explicit`` when given (one per depth, at least k), else decay ** d."""
    if explicit is not None:
        if len(explicit) < k:
            raise UsageError(f"depth_weights has {len(explicit)} entries but training uses depth {k}")
        return torch.tensor([float(w) for w in explicit[:k]])
    return torch.tensor([decay**d for d in range(k)], dtype=torch.float32)



def cat_kv(a: list[modeling.KV], b: list[modeling.KV]) -> list[modeling.KV]:
    """Each layer's (k, v) of ``a`` followed by ``b``'s along the sequence (a KV cache and what a forward added)."""
    return [(torch.cat([ak, bk], dim=2), torch.cat([av, bv], dim=2)) for (ak, av), (bk, bv) in zip(a, b, strict=True)]


def keep_committed(cache: list[modeling.KV] | None, kvs: list[modeling.KV], committed: int) -> list[modeling.KV]:
    """The KV cache after a parallel drafter's forward over [committed tokens | mask slots]: ``cache`` (None: empty)
    extended with the first ``committed`` positions of ``kvs``; the mask slots' are dropped, rewritten next round."""
    kept = [(k[:, :, :committed], v[:, :, :committed]) for k, v in kvs]
    return kept if cache is None else cat_kv(cache, kept)


# Re-exported so plugins reach the project's mask-token rule, vLLM's default aux layers (its low / mid / high picks),
# the target's head (the teacher's logits as the target makes them) and the queued-inference protocol
# (``specframe.drafting.queued_inference``) through ``api.eagle``.
mask_token_ids = mask_token_ids
low_mid_high_layers = low_mid_high_layers
# kept for plugins written against earlier names (API <= 14; the old name, a homonym of api.block's choice of layers)
default_aux_layers = low_mid_high_layers
TargetHead = TargetHead
target_head = target_head
PendingInputs = PendingInputs
QueuedInference = QueuedInference


def shifted_supervision(loss_mask: torch.Tensor, doc: torch.Tensor, bit: str = "predicted") -> torch.Tensor:
    """Which of an EAGLE-family drafter's L - 1 positions carry a loss (docs/design.md section 8 indexing).

    Position i reads x_{i+1} with feature g_i and is charged with x_{i+2}: with ``bit`` 'predicted' (this function's
    default, kept for API 15 callers; the family's option defaults to 'input') its bit is x_{i+2}'s loss-mask bit, and
    x_i, x_{i+1} and x_{i+2} must lie in one document (a packed sequence's first position of a document reads the
    previous document's last feature: it is never charged, see ``specframe.drafting.elements.position_docs``). The last
    position has nothing to predict. ``bit`` 'input' takes x_{i+1}'s bit instead (the token the position reads, as
    speculators' ``shift_batch`` aligns l_{i+1} with it): one position earlier at every assistant-turn boundary.
    """
    if bit not in LOSS_MASK_BITS:
        raise UsageError(f"loss_mask_bit must be one of {', '.join(LOSS_MASK_BITS)}, got {bit!r}")
    lm = loss_mask.to(torch.bool)
    n = lm.shape[0] - 1
    sup = torch.zeros(max(n, 0), dtype=torch.bool)
    if n >= 2:
        gate = lm[2:] if bit == "predicted" else lm[1:-1]
        sup[: n - 1] = gate & (doc[2:] == doc[1:-1]) & (doc[1:-1] == doc[:-2])
    return sup
