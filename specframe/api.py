"""The public API of specframe: the one module a plugin imports.

It names the four component interfaces (drafter, mask builder, partitioner, verifier), the data they exchange,
the sampling math verifiers share, the drafters' building blocks and the ``hookimpl`` marker. Everything here is
versioned by ``API_VERSION``: a change to a signature bumps it and is made for every built-in plugin at once.

Components are classes with a class attribute ``name`` (what users type) and an ``Options`` attrs class (their
plugin-specific settings, filled from CLI flags or ``--config``); the core instantiates them as ``cls(options)``.

This module holds the version and its history and re-exports the names; the bodies live below it, one idea a module
(``specframe.interfaces.*``, ``specframe.sampling``, ``specframe.drafting.draft_tree``, ...), as pluggy's ``__init__`` re-exports
its ``_hooks`` and ``_manager``. The rule "a plugin imports only ``specframe.api``" is about this name, not about
where a body lives: a name importable from here keeps its identity wherever its body moves.
"""

from __future__ import annotations

# Drafter building blocks (decoder layers over element sets, chunked KL) are part of the public surface, as
# ``api.modeling``, so drafter plugins share them without importing core internals; so is the draft-vocabulary and
# mask-token rule (``api.vocab``), which every drafter must apply the same way.
from specframe.drafting import modeling, vocab

# The feature-reading drafters' shared backbone (vLLM EAGLE-3 names), draft vocabulary and depth bookkeeping.
from specframe.drafting import eagle
from specframe.attention_memory import AttentionShape, full_mask_bytes, query_block_bytes

# The block-drafting backbone (context from the target's aux states, a block of anchor + mask slots) that DFlash and
# DSpark share (API 7).
from specframe.drafting import block

# Calibration of per-token confidence (prefix ECE, sequential temperature scaling), for drafters that estimate it
# (API 8).
from specframe.drafting import calibration
from specframe.declarations import Training, non_negative, positive_int, unit_interval
from specframe.drafting.draft_tree import DraftTree, dynamic_tree
from specframe.drafting.drafts import Draft
from specframe.drafting.elements import (VISIBILITY_RULES, ElementSet, full_grid, rule_matrix, shared_visibility,
                                shared_window, visible)
from specframe.errors import InvalidDraftError, PluginError, SpecframeError, UsageError
from specframe.features import FeatureSpec
from specframe.hookspecs import hookimpl

# The four component interfaces and the data they exchange (one module per component kind).
from specframe.interfaces.component import Component, NoOptions
from specframe.interfaces.drafter import Drafter, LossTerms, TrainingExample
from specframe.interfaces.mask_builder import Attention, MaskBuilder, SegmentAttention, one_dtype
from specframe.interfaces.partitioner import Partitioner, Segment
from specframe.interfaces.verifier import RoundCost, Verification, Verifier, verify
from specframe.interfaces.target_law import SamplesTarget, SamplingFields

# The checkpoint layouts vLLM loads, one per row of the layout table (speculators EAGLE-3 / P-EAGLE / DFlash / DSpark,
# PARD, ParallelSpec): a drafter's ``export_vllm`` calls one of ``vllm_layouts.write_eagle3`` / ``write_peagle`` /
# ``write_dflash`` / ``write_dspark`` / ``write_pard`` / ``write_parallelspec`` with the ``Serving`` it was handed
# (API 14), and returns the ``Manifest`` the writer returns.
from specframe.layouts import export as vllm_layouts
from specframe.layouts.manifest import Manifest, Serving
from specframe.drafting.modeling import expand_kv  # grouped-query k / v heads repeated, for drafters' attention

# The sampling math the sampling verifiers share (API 8: the chain speculative sampling; API 14: one token's acceptance
# ratio, which the chain and the tree share).
from specframe.sampling import (acceptance_ratio, chain_verification, residual_distribution, sampling_distribution,
                                speculative_chain)


#: Version history and the compatibility rule (a plugin states the version it was written for in its docs):
#:
#: - "1": the four component interfaces.
#: - "2" (additive): drafter-declared visibility. ``Drafter.visibility`` ("chain", the default, or "block"),
#:   carried to mask builders and partitioners as ``ElementSet.visibility``; ``MaskBuilder.visibilities`` says
#:   which rules a builder applies. A version-1 plugin runs unchanged: its drafters are chain drafters, and its
#:   mask builders are taken as chain-only, so a block drafter is refused with them (``UsageError`` at the first
#:   segment) rather than trained under the wrong rule; a partitioner that ignores the rule is caught by the
#:   engine's causal-completeness check (``specframe.drafting.elements.check_partition``), which applies the set's rule.
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
#: - "14" (additive): an export is written once. ``Drafter.export_vllm(directory, tokenizer, serving=None)`` is
#:   handed the ``Serving`` the user chose (``verifier``, ``speculative_tokens``; None: the drafter's own) and passes
#:   it to its ``vllm_layouts`` writer (every writer takes ``serving=``), which writes ``config.json`` once with it;
#:   the writers return the ``Manifest`` object instead of a dict (``Manifest.as_dict()`` is that dict, and a manifest
#:   still answers ``manifest["layout"]`` and ``.get``). Compatibility: a version-13 drafter, whose ``export_vllm``
#:   has no ``serving`` parameter, keeps working: the core reads its signature (``inspect``), calls it as before and
#:   re-targets the folder it wrote (``vllm_layouts.set_serving``), and a dict it returns is taken as its manifest.
#:   Also, pieces built-in drafters had written twice, now held once: ``api.acceptance_ratio`` (one draft token's
#:   speculative acceptance, which ``speculative_chain`` and the ``tree`` verifier share), ``LossTerms.zero`` /
#:   ``LossTerms.empty`` (the loss of a segment charged with nothing), ``api.block.share_target``, ``charged_blocks``
#:   and ``trained_elements`` (what DFlash and DSpark do alike around the block backbone) and
#:   ``api.eagle.FamilyTraining`` / ``FamilyDrafter`` (the EAGLE family's declarations and checkpoint record, beside
#:   ``family_training``). Nothing a version-13 plugin uses changed.
#:   Also (issue 54, D5): ``Drafter.element_weights(example, elements)`` (default None) weighs each element in the
#:   loss's normaliser: the engine divides a step's summed loss by the summed weights of its charged elements
#:   (``specframe.interfaces.drafter.charged_weight``, known before the first backward) instead of their count, and
#:   the drafter's ``loss`` weighs each element's loss by the same value; ``api.block.element_weights`` is DFlash's and
#:   DSpark's (the trained elements by the depth decay). A drafter without the hook trains exactly as before.
#:   Also ``Partitioner.counted_as`` (default None): the rule the memory estimate may count a partitioner's segments
#:   by on a long sequence without running it (``"whole"``, ``"balanced_ranges"``), read from the class that defines
#:   ``partition``; the estimate used to recognise the two built-in partitioners by class path. A partitioner
#:   without it is run up to ``RUN_MAX_LEN`` tokens, as before.
#:   Also, more of what the EAGLE-family built-ins wrote alike, in ``api.eagle``: ``low_mid_high_layers`` (EAGLE-3's
#:   choice of target layers, named ``default_aux_layers`` up to now: the old name stays an alias, since it meant
#:   something else in ``api.block``), ``aux_layer_ids`` (resolve and check a drafter's three aux layers),
#:   ``start_from_target`` (a drafter's embedding, draft vocabulary and head rows from the target),
#:   ``cat_kv`` / ``keep_committed`` (the committed tokens' KV after a parallel draft forward) and
#:   ``charged_forward_kl`` (the forward KL, per-document weights and top-1 hits over the charged elements).
#:   And in ``api.block``, what DFlash and DSpark declared and recorded alike: ``BlockDrafter`` (a mixin: declarations,
#:   supervision, trained elements and weights, checkpoint record and checks, import checks, export preamble),
#:   ``resolve_k_infer`` / ``check_decay_gamma`` (their option checks), ``reference_init`` / ``INIT_STD``;
#:   ``element_docs`` and ``spaced_aux_layers`` are ``api.block``'s ``position_docs`` and ``default_aux_layers``
#:   renamed (other functions had those names); the old names stay aliases.
#:   Also ``Training.max_anchors`` (default None: every anchor): a drafter may cap the anchors a training step charges
#:   per sequence; the engine draws the sample with the step's generator (``engine.segments.anchor_sample``), leaves
#:   out the other anchors' deeper elements and charges their depth-0 elements nothing, and draws nothing where the cap
#:   does not bind. ``api.block.max_anchors_field`` / ``MAX_ANCHORS`` (512, the references') are DFlash's and DSpark's.
#:   ``expand_kv`` (grouped-query k / v heads repeated, which the built-ins' attention uses) is listed in ``__all__``;
#:   names the facade bound by accident and never listed (the ``legacy_*`` declaration readers, ``read_json``,
#:   ``check_builder_visibility``: the core's own, which the interfaces call) are no longer bound.
#: - "15" (additive): ``Drafter.target_layers(num_layers)``, the target decoder layers ``prepare`` reads besides the
#:   embedding, final norm and head. A run from a feature cache keeps only those (``specframe.targets.keep_layers``
#:   drops the others once the target has loaded, and reading a dropped layer raises), so a large target's body never
#:   reaches the training device and the memory estimate charges only what is kept. The built-ins declare theirs: the
#:   EAGLE family none, or its last ``layers`` with ``init_from_target_layers``; ParallelSpec's standalone backbone and
#:   PARD with ``init_from_target`` their first ``layers``; DFlash and DSpark (``api.block.BlockDrafter``) none. A
#:   version-14 drafter declares nothing (None) and is handed the whole target, as before.
#:   Also ``api.SamplingFields`` (a verifier's ``temperature``, ``top_k`` and ``top_p`` option fields, each refusing
#:   what ``sampling_distribution`` refuses when the options are built, before a target loads, instead of at the
#:   first verification) and ``api.SamplesTarget`` (``target(logits)``, the law they give): what the ``sampling`` and
#:   ``tree`` verifiers wrote alike. And ``api.non_negative(owner)``, the option validator beside ``positive_int`` and
#:   ``unit_interval`` that P-EAGLE and DSpark's drafter and scheduled verifier each wrote by hand (P-EAGLE's let NaN
#:   through).
#: - "16" (additive): ``api.eagle.FamilyFields.draft_vocab_size(note, default=...)`` takes the default its drafter
#:   wants; None, which every built-in family drafter now passes (issue 54, deviations row 6), is the target's whole
#:   vocabulary (the option then reads null), so such a drafter sizes its head ``min(value or vocab_size,
#:   vocab_size)``. A plugin that passes no default keeps 16,384 and never sees None: a version-15 plugin runs
#:   unchanged. Also, in ``api.modeling``, what the chunked losses wrote alike (DSpark's package had copies):
#:   ``precomputed_grad(loss, [(input, gradient or None), ...])`` (a loss computed under no_grad whose gradients
#:   were formed in the forward; backward only scales them), ``grad_dtype(logits_dtype)`` (the dtype such a
#:   gradient is formed in: fp16's in fp32) and ``CastOnce`` (a weight cast once per dtype for a whole loss call).
#: - "17" (additive): ``api.eagle.draft_vocab_size(option, vocab_size)``, the head's rows for that option (None: the
#:   whole vocabulary; a larger size clamped to the target's), the rule the three family built-ins each wrote out.
API_VERSION = "17"

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
    "Manifest",
    "MaskBuilder",
    "NoOptions",
    "Partitioner",
    "PluginError",
    "RoundCost",
    "SamplesTarget",
    "SamplingFields",
    "Segment",
    "SegmentAttention",
    "Serving",
    "SpecframeError",
    "Training",
    "TrainingExample",
    "UsageError",
    "VISIBILITY_RULES",
    "Verification",
    "Verifier",
    "dynamic_tree",
    "expand_kv",
    "full_mask_bytes",
    "full_grid",
    "hookimpl",
    "non_negative",
    "positive_int",
    "query_block_bytes",
    "one_dtype",
    "acceptance_ratio",
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
