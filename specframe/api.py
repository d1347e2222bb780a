"""The public API of specframe: the one module a plugin imports.

It defines the four component interfaces (drafter, mask builder, partitioner, verifier), the data they exchange,
and the ``hookimpl`` marker. Everything here is versioned by ``API_VERSION``: a change to a signature bumps it and is
made for every built-in plugin at once.

Components are classes with a class attribute ``name`` (what users type) and an ``Options`` attrs class (their
plugin-specific settings, filled from CLI flags or ``--config``); the core instantiates them as ``cls(options)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar, Protocol

import attrs
import torch

# Drafter building blocks (decoder layers over element sets, chunked KL) are part of the public surface, as
# ``api.modeling``, so drafter plugins share them without importing core internals; so is the draft-vocabulary and
# mask-token rule (``api.vocab``), which every drafter must apply the same way.
from specframe import modeling, vocab

# The feature-reading drafters' shared backbone (vLLM EAGLE-3 names), draft vocabulary and depth bookkeeping.
from specframe import eagle
from specframe.attention_memory import AttentionShape, full_mask_bytes, query_block_bytes

# The block-drafting backbone (context from the target's aux states, a block of anchor + mask slots) that DFlash and
# DSpark share (API 7).
from specframe import block

# Calibration of per-token confidence (prefix ECE, sequential temperature scaling), for drafters that estimate it
# (API 8).
from specframe import calibration
from specframe.declarations import (Training, legacy_comparison_options, legacy_greedy, legacy_import_options,
                                    legacy_training, positive_int, unit_interval)
from specframe.drafts import Draft
from specframe.elements import (VISIBILITY_RULES, ElementSet, full_grid, rule_matrix, shared_visibility,
                                shared_window, visible)
from specframe.modeling import expand_kv  # noqa: F401  (api.expand_kv, for drafters' attention)
from specframe.errors import InvalidDraftError, PluginError, SpecframeError, UsageError, read_json
from specframe.features import FeatureSpec
from specframe.hookspecs import hookimpl
from specframe.inference.tree import DraftTree, dynamic_tree

# The checkpoint layouts vLLM loads (speculators EAGLE-3 / P-EAGLE / DFlash, PARD, ParallelSpec): a drafter's
# ``export_vllm`` calls one of ``vllm_layouts.write_eagle3`` / ``write_peagle`` / ``write_dflash`` / ``write_pard`` /
# ``write_parallelspec``.
from specframe.layouts import export as vllm_layouts


#: Version history and the compatibility rule (a plugin states the version it was written for in its docs):
#:
#: - "1": the four component interfaces.
#: - "2" (additive): drafter-declared visibility. ``Drafter.visibility`` ("chain", the default, or "block"),
#:   carried to mask builders and partitioners as ``ElementSet.visibility``; ``MaskBuilder.visibilities`` says
#:   which rules a builder applies. A version-1 plugin runs unchanged: its drafters are chain drafters, and its
#:   mask builders are taken as chain-only, so a block drafter is refused with them (``UsageError`` at the first
#:   segment) rather than trained under the wrong rule; a partitioner that ignores the rule is caught by the
#:   engine's causal-completeness check (``specframe.elements.check_partition``), which applies the set's rule.
#: - "3" (additive): ``Drafter.forwarded_rows``, the row count the memory estimator charges a segment with; its
#:   default (one row per element) is what every version-2 drafter was estimated with, so those run unchanged.
#: - "4" (additive): ``api.eagle.target_head(target)`` / ``api.eagle.TargetHead``, the target's head as its forward
#:   applies it (lm_head bias, logit scale, soft-capping), which ``api.eagle.kl_teacher`` and
#:   ``api.modeling.chunked_forward_kl`` take as ``target_head``; a bare lm_head weight is still accepted and taken as
#:   a head that is only the matmul, so a version-3 plugin runs unchanged (with the teacher it had).
#: - "5" (additive): what built-in plugins reached past this module for, here: ``api.rule_matrix`` and
#:   ``api.shared_visibility`` (a visibility rule as a boolean matrix, the rule two element sets share: for mask
#:   builders), ``api.one_dtype`` (the one dtype ``SegmentAttention`` hands a builder q, k, v in), and the folder a
#:   drafter's ``import_weights`` is handed has ``check_target``, ``check_shape`` and ``eagle_state`` methods. Nothing
#:   a version-4 plugin uses changed.
#: - "6" (additive): components declare what the core used to read by name. ``Drafter.training(options)`` (a
#:   ``Training``: default depth and K, COD schedule, activation checkpointing, loss chunk),
#:   ``Drafter.comparison_options(depth, draft_vocab_size, k)`` (how an equal-budget comparison sets them),
#:   ``Drafter.import_options(folder)``, ``Drafter.draft_vocab_size`` and ``Drafter.vllm_speculative_config(k)``;
#:   ``MaskBuilder.preference``, ``small_calls``, ``query_blocks``, ``grouped_kv`` and
#:   ``attention_bytes(AttentionShape)`` (with the calibrated ``full_mask_bytes`` / ``query_block_bytes``);
#:   ``Partitioner.splits_sequences``; ``Verifier.greedy`` and ``drafts_trees``. A version-5 drafter's declarations
#:   default to the option names the built-ins used (``k_train``, ``k_infer``, ...), so it keeps its defaults; a
#:   version-5 mask builder is costed as a full mask (the safe side) and ranks below the built-ins for the default
#:   choice.
#: - "7" (additive): ``api.block``, the block-drafting backbone DFlash had in its package (``BlockModel`` with vLLM's
#:   ``DFlashQwen3Model`` names, ``block_hidden`` for training under the block rule through the segment's mask
#:   builder, ``BlockContext`` for inference, ``position_docs``), so DFlash and DSpark share it. Nothing a
#:   version-6 plugin uses changed. Also ``Draft.confidence`` (per-node acceptance estimates, optional),
#:   ``Draft.prefix`` and ``Verifier.schedule`` (how much of a chain to verify, asked by the engine before the target
#:   forward; default: all), so a confidence-scheduled verifier works with any drafter that gives confidence.
#: - "8" (additive): confidence calibration. ``LossTerms.confidence`` (a drafter's raw confidence logit per charged
#:   element, beside ``hit``), ``Drafter.calibrated_confidence(logits)`` (its estimates as probabilities; default the
#:   sigmoid) and ``Drafter.calibrate(logits, accepted)`` (fit on the held-out sequences once at the end of training,
#:   kept with the checkpoint; default: nothing to fit), and ``api.calibration`` (``prefix_ece``,
#:   ``fit_temperatures``); ``api.speculative_chain`` / ``chain_verification``, the chain speculative sampling the
#:   ``sampling`` and ``scheduled`` verifiers share; the folder ``import_weights`` is handed has ``block_state`` (the
#:   DFlash / DSpark state dict, shared weights filled, checked). The engine reports ``val_confidence_ece`` for a
#:   drafter that returns confidence. A version-7 drafter returns none and is calibrated by nothing: it runs unchanged.
#: - "9" (additive): ``Drafter.layer_shapes()``, the drafter's decoder layers as the memory estimate charges them;
#:   its default (None: found by structure) is how every version-8 drafter was costed, and the estimate's ``notes``
#:   now say when it found none, so a version-8 drafter with a layer type of its own is no longer costed without
#:   its layers silently.
#: - "10" (additive): ``Verifier.bind(model)``, the target model handed to a verifier by the reference engine at
#:   the start of every decode, before its clock starts, so a verifier whose choices depend on the
#:   cost of the target's forward measures it on the engine it runs on (``scheduled``'s cost curve); its default
#:   does nothing, which is what every version-9 verifier did.
#: - "11" (additive): a verifier may also decide, before a chain round's drafting, how many tokens to draft
#:   (``Verifier.draft_budget(k)``; 0 skips drafting and the round is a plain target step, lossless by construction)
#:   and is told each round's outcome and costs (``Verifier.observe(RoundCost)``). Defaults: ``k`` and nothing,
#:   which is what every version-10 verifier did. A drafter may now see ``accept`` twice without a ``propose``
#:   between (every built-in queues what it has not forwarded; ``specframe.testing.DrafterContract`` checks it).
#: - "12" (additive): ``LossTerms.acceptance``, each charged element's chance of acceptance under the rule its
#:   confidence is calibrated for (a 0 / 1 verdict, or 1 - TV for speculative sampling), which the engine then
#:   measures and fits the calibration against instead of ``hit`` (``api.calibration`` takes values in [0, 1]). A
#:   version-11 drafter returns none and is calibrated against ``hit`` as before.
#: - "13" (additive): sliding windows. ``ElementSet.window`` (None: none) narrows the context clause of the rule
#:   (``rule_matrix(..., window)``, ``api.shared_window``); ``MaskBuilder.windows`` says a builder applies it (dense,
#:   chunked, precomputed and flex do), and ``SegmentAttention`` refuses a windowed set to a builder that does not.
#:   Sets without a window, which is every set a version-12 drafter sees, attend exactly as before.
API_VERSION = "13"

__all__ = [
    "API_VERSION",
    "Attention",
    "AttentionShape",
    "Component",
    "Draft",
    "FeatureSpec",
    "DraftTree",
    "InvalidDraftError",
    "Drafter",
    "ElementSet",
    "LossTerms",
    "MaskBuilder",
    "NoOptions",
    "Partitioner",
    "PluginError",
    "RoundCost",
    "Segment",
    "SegmentAttention",
    "SpecframeError",
    "Training",
    "TrainingExample",
    "UsageError",
    "VISIBILITY_RULES",
    "Verification",
    "Verifier",
    "dynamic_tree",
    "full_mask_bytes",
    "full_grid",
    "hookimpl",
    "positive_int",
    "query_block_bytes",
    "one_dtype",
    "residual_distribution",
    "rule_matrix",
    "sampling_distribution",
    "speculative_chain",
    "chain_verification",
    "shared_visibility",
    "shared_window",
    "modeling",
    "eagle",
    "block",
    "calibration",
    "vocab",
    "unit_interval",
    "verify",
    "visible",
    "vllm_layouts",
]


@attrs.define
class NoOptions:
    """Options of a component that has none."""


class Component:
    """What every registered component has: a ``name`` and an ``Options`` attrs class."""

    name: ClassVar[str]
    Options: ClassVar[type] = NoOptions

    def __init__(self, options: Any = None) -> None:
        self.options = self.Options() if options is None else options


# ----------------------------------------------------------------------------------------------------- mask builders


class Attention(Protocol):
    """Masked attention for one segment: ``q`` [B, heads, Nq, D], ``k`` / ``v`` [B, heads, Nk, D] -> [B, heads, Nq, D].

    Query i may attend key j iff ``visible(query, key)[i, j]`` (under the rule the element sets carry, chain or
    block); scores are scaled by 1/sqrt(D). Heads are already
    expanded (grouped-query attention repeats k / v before the call), unless the callable has a true ``grouped_kv``
    attribute: then k / v come with their own head count (``heads`` a multiple of it, query head h reading k / v head
    ``h // (heads // kv_heads)``), which saves the repeated copies at long context.
    """

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class MaskBuilder(Component, ABC):
    """Turns the element sets of a segment into an attention function that applies their visibility rule
    (``ElementSet.visibility``: the drafter's declared ``chain`` or ``block``, see ``specframe.elements``)."""

    #: devices (``torch.device.type``) the builder supports for training (forward and backward)
    devices: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})
    #: the visibility rules the builder applies (``VISIBILITY_RULES``); a builder that predates API 2 applies only
    #: the chain rule, so that is the default, and ``SegmentAttention.build`` refuses it a block drafter's elements
    visibilities: ClassVar[frozenset[str]] = frozenset({"chain"})
    #: API 13: True when the builder applies an element set's sliding ``window`` (``rule_matrix``'s window clause);
    #: False (a builder written before it) has windowed sets refused by ``SegmentAttention``, never attended unwindowed
    windows: ClassVar[bool] = False
    #: API 6: the order a run that names no builder tries the registered ones in (``specframe.masks``): the highest
    #: that trains on the run's device is chosen (ties: registration order). 0, the default, ranks below every
    #: built-in, so installing a builder never changes another run's default unless it says it should.
    preference: ClassVar[int] = 0
    #: API 6: True when one fused call over the full (queries x keys) mask is the fastest way to run a small
    #: attention call; a run that names no builder sends calls below ``engine.attention.DENSE_ATTENTION_BYTES`` to
    #: the most preferred such builder (dense), the rest to its default builder.
    small_calls: ClassVar[bool] = False
    #: API 6: True when the builder evaluates the mask in blocks of queries and never holds the whole (queries x
    #: keys) mask: the memory advice proposes such a builder (the most preferred one) to a run whose builder does.
    query_blocks: ClassVar[bool] = False
    #: API 6: True when the builder's attention takes k / v with their own grouped-query head count
    #: (``Attention.grouped_kv``), so the memory estimate charges k / v at that count rather than repeated.
    grouped_kv: ClassVar[bool] = False

    @abstractmethod
    def build(self, query: ElementSet, key: ElementSet) -> Attention:
        """Return the attention function for queries ``query`` over keys ``key`` (reused by every layer). Queries
        and keys may be any subsets of one sequence's elements, in any order."""

    def attention_bytes(self, shape: AttentionShape) -> int:
        """API 6: the bytes this builder's attention holds for one training segment of ``shape`` while its backward
        runs, what ``specframe.memory``'s estimate charges (and its in-run guard checks against the measured peak).
        Two calibrated models are at hand: ``full_mask_bytes(shape)`` and ``query_block_bytes(shape, block)``.
        Default: a builder declaring ``query_blocks`` is charged as blocks of 256 queries, any other as a full mask
        (the safe side: an estimate that is too low proposes a context length that runs out of memory)."""
        return query_block_bytes(shape, 256) if self.query_blocks else full_mask_bytes(shape)


@attrs.frozen
class SegmentAttention:
    """What ``Drafter.loss`` receives: the mask builder's attention over the segment's elements (call it like an
    ``Attention``), plus ``subset(query, key)``, the same builder's attention for other subsets of the segment's
    elements. A drafter that runs several passes over parts of a segment (EAGLE-3's training-time test forwards only
    the depth each pass changes, reading the shallower depths' keys from earlier passes) builds those with it, so it
    keeps the configured builder's memory behaviour and the shared visibility rule."""

    builder: MaskBuilder
    attention: Attention

    @classmethod
    def build(cls, builder: MaskBuilder, elements: ElementSet) -> SegmentAttention:
        check_builder_visibility(builder, elements.visibility, elements.window)
        return cls(builder, builder.build(elements, elements))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.attention(*one_dtype(q, k, v))

    @property
    def grouped_kv(self) -> bool:
        return bool(getattr(self.attention, "grouped_kv", False))

    def subset(self, query: ElementSet, key: ElementSet) -> Attention:
        check_builder_visibility(self.builder, query.visibility, query.window)
        return SegmentAttention(self.builder, self.builder.build(query, key))


def one_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v in one floating dtype, as a mask builder receives them through ``SegmentAttention``: autocast's where
    autocast is on (as torch's own SDPA does), else the promoted one. Under bf16 / fp16 autocast a drafter's q and k
    leave RMSNorms with fp32 weights in fp32 while v leaves a projection in the autocast dtype, and the builders'
    fused kernels take one dtype (the chunked builder's CPU flash kernel raised "expected scalar type Float but
    found BFloat16" on DFlash's bf16 step)."""
    if q.dtype == k.dtype == v.dtype:
        return q, k, v
    device = q.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def check_builder_visibility(builder: MaskBuilder, rule: str, window: int | None = None) -> None:
    """Refuse (``UsageError``) a mask builder that does not declare ``rule`` in its ``visibilities``, or a
    ``window`` without ``windows``: it would otherwise attend by another rule than the drafter's, which trains
    silently on the wrong masks."""
    if window is not None and not getattr(builder, "windows", False):
        raise UsageError(
            f"mask builder '{getattr(builder, 'name', type(builder).__name__)}' does not apply a sliding window, and "
            f"the drafter attends within {window} positions; choose a builder that does (dense, precomputed, chunked "
            "or flex)")
    rules = getattr(builder, "visibilities", frozenset({"chain"}))
    if rule not in rules:
        raise UsageError(
            f"mask builder '{getattr(builder, 'name', type(builder).__name__)}' applies the "
            f"{', '.join(sorted(rules))} visibility rule(s), not the drafter's '{rule}' rule; choose a builder "
            f"that declares it (dense, precomputed, chunked and flex apply every rule)"
        )


# ------------------------------------------------------------------------------------------------------ partitioners


@attrs.frozen
class Segment:
    """One forward/backward unit of a sequence.

    ``elements`` indexes the sequence's element set (sorted); the segment forwards exactly these elements, which must
    be causally complete (every key an element may see is in the segment). ``loss_mask`` [len(elements)] marks the
    elements whose loss this segment is charged with; every element is charged in exactly one segment.
    """

    elements: torch.Tensor
    loss_mask: torch.Tensor


class Partitioner(Component, ABC):
    """Splits one sequence's element set into segments for gradient accumulation within the sequence."""

    #: API 6: True when the partitioner cuts one sequence's elements into several segments (``--partitions``), so
    #: a long sequence's step holds one segment's activations at a time: the memory advice proposes it (the first
    #: registered such partitioner) when a sequence does not fit whole.
    splits_sequences: ClassVar[bool] = False

    @abstractmethod
    def partition(self, elements: ElementSet, num_segments: int) -> list[Segment]:
        """Cut ``elements`` into at most ``num_segments`` segments (the loss is normalised by the core, not here).

        A segment may be empty (say, more segments asked for than the sequence has positions); the engine skips it.
        """


# --------------------------------------------------------------------------------------------------------- verifiers


def sampling_distribution(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The distribution a target's ``logits`` [..., V] sample from: temperature, then top-k, then top-p (nucleus).

    ``temperature`` 0 means greedy (one-hot at the argmax); ``top_k`` 0 and ``top_p`` 1 switch those filters off.
    Sampling verifiers accept against this distribution, so plain sampling and speculative sampling with the same
    options draw from the same law.
    """
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise UsageError(f"invalid sampling options: temperature {temperature}, top_k {top_k}, top_p {top_p}")
    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses it included).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Where the target's token comes from after a draft drawn from q was rejected: normalise(max(0, p - q)).

    If p <= q everywhere a rejection has probability zero; floating-point error can still get here, and p is then
    the right law. Sampling verifiers, chain and tree, share this rule.
    """
    r = (p - q).clamp_min(0)
    total = r.sum()
    return r / total if total > 0 else p


def speculative_chain(
    logits: torch.Tensor, draft: Any, target: Any, generator: torch.Generator | None = None,
    residual: Any = residual_distribution,
) -> Verification:
    """Speculative sampling over a chain (API 8; what the ``sampling`` verifier and DSpark's ``scheduled`` verifier
    share). ``target(logits_row)`` is the target's law p at a slot; draft token d_i is accepted with probability
    min(1, p(d_i) / q(d_i)), q being ``draft.probs`` when the drafter sampled and one-hot at d_i when it took the
    argmax; at the first rejection the target's token is drawn from ``residual(p, q)`` and the round stops; after a
    fully accepted chain a bonus token is drawn from p at the last slot. Every random draw comes from ``generator``,
    one uniform per draft token tried and one categorical at the end, in that order."""
    tokens = draft.tokens.tolist()
    accepted: list[int] = []
    for i, token in enumerate(tokens):
        p = target(logits[i])
        if draft.probs is not None:
            q = draft.probs[i].float().cpu()
        else:
            q = torch.zeros_like(p)
            q[token] = 1.0
        ratio = p[token] / q[token] if q[token] > 0 else torch.tensor(0.0)
        if torch.rand((), generator=generator) < ratio:
            accepted.append(i)
            continue
        fix = int(torch.multinomial(residual(p, q), 1, generator=generator).item())
        return chain_verification(accepted, tokens, fix)
    bonus = int(torch.multinomial(target(logits[len(tokens)]), 1, generator=generator).item())
    return chain_verification(accepted, tokens, bonus)


def chain_verification(accepted: list[int], tokens: list[int], last: int) -> Verification:
    """The ``Verification`` of a chain whose draft slots ``accepted`` (a prefix) were kept, then ``last`` emitted."""
    emitted = [tokens[i] for i in accepted] + [last]
    return Verification(torch.tensor(accepted, dtype=torch.long), torch.tensor(emitted, dtype=torch.long))


@attrs.frozen
class Verification:
    """The outcome of one verification.

    ``accepted`` (int64): draft node indices accepted, root to leaf. ``emitted`` (int64): the tokens to append, i.e.
    the accepted draft tokens followed by exactly one token from the target (the correction at the first rejection,
    or the bonus token after a fully accepted path).
    """

    accepted: torch.Tensor
    emitted: torch.Tensor


@attrs.frozen
class RoundCost:
    """API 11: one decode round as the reference engine saw it, for ``Verifier.observe``. ``drafted``: draft tokens
    the drafter proposed (0: drafting was skipped); ``verified``: those the target read (after ``schedule``);
    ``accepted``: those it accepted; ``draft_seconds``: the drafter's ``propose`` and the verifier's ``schedule``
    (0 when drafting was skipped); ``target_seconds``: the target's forward and the verification."""

    drafted: int
    verified: int
    accepted: int
    draft_seconds: float
    target_seconds: float


class Verifier(Component, ABC):
    """Decides which draft tokens the target accepts, without changing the target's output distribution."""

    #: whether the verifier accepts drafts with branching (``Draft.parents`` not a chain)
    supports_tree: ClassVar[bool] = False
    #: API 6: True when a run with this verifier drafts a tree unless told otherwise (the ``tree`` verifier: the
    #: EAGLE-2 dynamic tree at ``TreeShape``'s defaults); False: a chain unless a ``--tree-*`` option is given
    drafts_trees: ClassVar[bool] = False

    @property
    def greedy(self) -> bool:
        """API 6: True when this verifier's output is plain greedy decoding's, so speculative output must equal the
        target's own greedy output token for token (the benchmarks check it). Default, for a verifier written for
        API 5 or earlier: its ``temperature`` option is 0, or it has none."""
        return legacy_greedy(self.options)

    @abstractmethod
    def verify(self, logits: torch.Tensor, draft: Draft, generator: torch.Generator | None = None) -> Verification:
        """``logits`` [N + 1, V]: row 0 is the target at the root (predicts the first draft level), row i + 1 the
        target at draft node i. ``generator`` drives every random choice, so a seeded run is reproducible."""

    def bind(self, model: Any) -> None:
        """API 10: ``model`` (a transformers causal LM) is the target this verifier is about to verify for. The
        reference engine calls it at the start of every decode, before the decode's clock starts, so a verifier that
        measures something of the target (the cost of its forward) does it here, once per model, and no timed
        decode pays for it. Default: nothing."""
        return None

    def schedule(self, draft: Draft) -> int | None:
        """How many leading tokens of a chain ``draft`` the target should verify, decided before its forward (API 7;
        None, the default: all of them). The engine verifies ``draft.prefix(n)``. To keep sampling lossless the
        choice to keep token i may depend on the draft only through tokens before i (e.g. ``confidence[: i + 1]``,
        whose entry i a drafter computes before drawing token i), never on token i or later."""
        return None

    def draft_budget(self, k: int) -> int:
        """API 11: how many tokens (0..``k``) the drafter is asked for in the next chain round, decided before it
        drafts, from what ``observe`` has told of earlier rounds. 0 skips drafting: the round is a plain target step
        (the target's forward over the pending token alone), which is lossless whatever the choice, since the choice
        depends only on earlier rounds. Default: ``k``."""
        return k

    def observe(self, cost: RoundCost) -> None:
        """API 11: what the round just finished drafted, verified and accepted, and what its drafting and its target
        forward took on the reference engine (a chain round or a tree round; called after every decode round, so a
        verifier can weigh drafting against its return). Default: nothing."""
        return None


def verify(verifier: Verifier, logits: torch.Tensor, draft: Draft, generator: torch.Generator | None = None) -> Verification:
    """``verifier.verify`` with both sides checked: the inputs against each other (``InvalidDraftError``), and the
    result against the draft (a ``PluginError`` naming the verifier), so a buggy verifier plugin cannot emit a
    silently wrong sequence. The engines call verifiers only through this."""
    draft.check_against(logits)
    if draft.branched and not verifier.supports_tree:
        raise UsageError(f"verifier '{verifier.name}' only verifies chains, and the draft is a tree")
    result = verifier.verify(logits, draft, generator)
    who = f"verifier '{getattr(verifier, 'name', type(verifier).__name__)}'"
    if not isinstance(result, Verification):
        raise PluginError(f"{who} returned {type(result).__name__}, not a specframe.api.Verification")
    accepted, emitted = result.accepted.tolist(), result.emitted.tolist()
    if len(emitted) != len(accepted) + 1:
        raise PluginError(f"{who} emitted {len(emitted)} tokens for {len(accepted)} accepted draft tokens (expected one more)")
    parents, tokens = draft.parent_index().tolist(), draft.tokens.tolist()
    node = -1
    for a, tok in zip(accepted, emitted):
        if not 0 <= a < len(draft) or parents[a] != node:
            raise PluginError(f"{who} accepted nodes {accepted}, which are not a path from the root of the draft")
        if tok != tokens[a]:
            raise PluginError(f"{who} emitted token {tok} for accepted node {a}, whose draft token is {tokens[a]}")
        node = a
    if not 0 <= emitted[-1] < logits.shape[1]:
        raise PluginError(f"{who} emitted token {emitted[-1]}, outside the {logits.shape[1]}-token vocabulary")
    return result


# ---------------------------------------------------------------------------------------------------------- drafters


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

    ``loss_sum``: sum of (depth-weighted) losses over the elements the segment is charged with (the engine divides by
    the global supervised count). ``count``: number of those elements. ``correct`` / ``total`` [K]: per-depth top-1
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
    #: partitioner applies it (``specframe.elements`` states both rules).
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

    @abstractmethod
    def supervision(self, example: TrainingExample) -> torch.Tensor:
        """Bool [L'] over the drafter's own positions: True where the element at that reference position has a loss."""

    @abstractmethod
    def loss(self, example: TrainingExample, elements: ElementSet, segment: Segment, attention: Attention) -> LossTerms:
        """The loss of the segment's charged elements (``elements.subset(segment.elements)`` are forwarded).
        ``attention`` is a ``SegmentAttention`` when the engine calls (tests may pass a plain ``Attention``)."""

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
        import json

        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.module().state_dict().items()}
        save_file(state, str(directory / self.CHECKPOINT_WEIGHTS), metadata={"drafter": self.name})
        (directory / self.CHECKPOINT_INFO).write_text(json.dumps(self.describe(), indent=1))

    def load(self, directory: Path) -> None:
        """Load what ``save`` wrote (safetensors only: nothing is unpickled): ``check_checkpoint`` vets the recorded
        description before any weight is read, ``restore_checkpoint`` takes back the non-tensor state after."""
        from safetensors.torch import load_file

        directory = Path(directory)
        info = self.read_checkpoint_info(directory)
        self.check_checkpoint(directory, info)
        try:
            self.module().load_state_dict(load_file(str(directory / self.CHECKPOINT_WEIGHTS)))
        except RuntimeError as exc:
            raise SpecframeError(f"{directory}: weights do not fit this {self.name} drafter: {exc}") from exc
        self.restore_checkpoint(info)

    def check_checkpoint(self, directory: Path, info: dict[str, Any]) -> None:
        """Refuse (``SpecframeError``) a checkpoint whose recorded shape does not match this drafter. Default: none."""

    def restore_checkpoint(self, info: dict[str, Any]) -> None:
        """Take back state kept in ``describe()`` rather than in tensors (mask token ids, ...). Default: nothing."""

    @classmethod
    def read_checkpoint_info(cls, directory: Path) -> dict[str, Any]:
        """The checkpoint's ``describe()`` record, refused unless this drafter wrote it."""
        import json

        path = Path(directory) / cls.CHECKPOINT_INFO
        if not path.exists():
            raise SpecframeError(f"{directory} is not a {cls.name} checkpoint (no {cls.CHECKPOINT_INFO})")
        info = read_json(path, f"the {cls.name} drafter's description")
        if info.get("drafter") != cls.name:
            raise SpecframeError(f"{directory} holds a '{info.get('drafter')}' drafter, not '{cls.name}'")
        return info

    @classmethod
    def from_checkpoint(cls, directory: Path, target_config: Any) -> Drafter:
        """A drafter rebuilt from ``save``'s files (options included) for the given target config."""
        from specframe.structuring import structure_options

        info = cls.read_checkpoint_info(directory)
        # the one converter and error format (specframe.structuring): a damaged record names the option
        drafter = cls(target_config, structure_options(info["options"], cls.Options, f"{directory}: drafter '{cls.name}'"))
        drafter.load(directory)
        return drafter

    # -- serving
    def vllm_speculative_config(self, k: int) -> dict[str, Any] | None:
        """API 6: the ``speculative_config`` vLLM serves this drafter with as it is, drafting ``k`` tokens, without
        exported weights: a weightless method vLLM implements itself (prompt lookup is vLLM's ``ngram``). None, the
        default: vLLM serves only this drafter's trained checkpoints, written by ``export_vllm``."""
        return None

    def export_vllm(self, directory: Path, tokenizer: Any) -> dict[str, Any]:
        """Write this (trained) drafter into ``directory`` in a checkpoint layout vLLM loads, with ``tokenizer`` (the
        target's) saved beside it, and return the manifest dict the ``vllm_layouts`` writer returned (``layout``,
        ``method``, ``parallel_drafting``). ``specframe export --format vllm`` calls it; ``specframe serve`` and the
        vLLM engine read the manifest to build vLLM's ``speculative_config``.

        Implementations gather their tensors under the layout's names and call ``vllm_layouts.write_eagle3``,
        ``write_peagle``, ``write_dflash``, ``write_pard`` or ``write_parallelspec`` (they validate shapes and ids and write
        atomically). Default: refuse, for drafters vLLM has no model for (those belong in a vLLM general plugin, as
        ``specframe.vllm.vllm_plugin`` does for ParallelSpec).
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
        """Load a foreign drafter folder read by ``specframe.layouts.imports.read`` (speculators EAGLE-3 / P-EAGLE,
        SafeAILab / SpecForge EAGLE-3, a PARD causal LM) into this drafter, after checking it against the target and
        this drafter's shape (one ``SpecframeError`` naming the field otherwise). ``specframe train --init-from``,
        ``generate`` / ``bench --checkpoint FOLDER`` and ``export`` call it. Default: refuse."""
        raise SpecframeError(
            f"drafter '{self.name}' cannot import {getattr(imported, 'layout', '?')} folders: it does not implement "
            "Drafter.import_weights"
        )
