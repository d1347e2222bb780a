"""The peak-memory estimate of one training step (``estimate``).

Estimator (an analytic model of what the code holds, checked against measured child-process peaks by
``tests/unit/test_memory.py`` and ``benchmarks/memory_context.py``):

    peak = process baseline                           (Python + torch + transformers + specframe, CPU only)
         + target weights                             (online: the whole target; cache: its embedding, head, final
                                                       norm and the layers the drafter reads, API 15;
                                                       ``synthetic``: lm_head only)
         + drafter weights, gradients, AdamW moments  (4 x trainable parameters)
         + features held in memory                    (online: every training sequence's, memoised)
         + the largest segment's step memory:
             step overhead                            (allocator arenas, autograd graph, index tensors; CPU only)
           + elements forwarded x saved bytes         (every layer's activations; with activation checkpointing only
                                                       each layer's input, plus the embedding, fused input, final norm)
           + the larger of two phases that do not overlap:
               the layers' backward                   (one layer's activations and gradients, elements forwarded x
                                                       backward bytes: with checkpointing, once a segment is longer
                                                       than ``modeling.ROW_CHUNK``, its position-wise parts are
                                                       recomputed in row chunks and only q, k, v, the attention output
                                                       and their gradients are held for every row; plus attention
                                                       scratch: dense / precomputed the [N, N] mask and SDPA's copies,
                                                       chunked a few [heads, chunk, band] score blocks)
               the loss                               (the chunked KL keeps each charged element's hidden state and its
                                                       gradient, formed in the forward, and a few [chunk, draft vocab]
                                                       blocks at a time)

Element counts come from ``specframe.memory.counts`` (sampled, or in closed form for long sequences). "Elements
forwarded" is the drafter's ``Drafter.forwarded_rows`` of a segment's elements and anchors: one row per element unless
the drafter runs others (DFlash runs each anchor's whole block).
Per-element byte counts were read off the saved-tensor sizes of ``specframe.drafting.modeling.DecoderLayer`` (about
10.8 H + 4 I floats per element and layer), the row-chunked regime's from the tensors live at the peak of a
long-context step (a ``TorchDispatchMode`` census), and the constants below (the process baseline and a per-step
overhead) were read off a few measured runs; the tests and the benchmark check configurations that were not used to
fit them (``benchmarks/results/memory_context.json`` has every measured point next to its estimate).

The estimator assumes the process's pinned mmap threshold (``specframe.memory.guard.pin_mmap_threshold``, called by the
engine).

Assumptions: one sequence per rank in flight (the engine's loop), online features memoised for every training
sequence, the target forward computed without logits (``specframe.features``), activations and target weights in
``dtype`` (fp32 by default; the drafter's weights, gradients and AdamW state are fp32 in every precision). Start-up
transients (loading the target) are not estimated; the guard's measured peak includes them (from a cache the target
is loaded whole and its other layers dropped: memory-mapped safetensors weights in the run's dtype are never read, so
on the CPU they cost nothing, but a dtype conversion copies them once).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import attrs
import torch

from specframe.attention_memory import AttentionShape
from specframe.errors import SpecframeError, UsageError
from specframe.memory.config import Estimate, MemoryConfig, resolved_plan
from specframe.memory.counts import segment_counts

# segments longer than ROW_CHUNK recompute a layer's position-wise parts in chunks
from specframe.drafting.modeling import ROW_CHUNK, LayerShape

#: resident bytes of a training process before any model tensor: Python, torch, transformers, specframe and its
#: plugins (measured: RSS before the first step minus the model tensors, 550-563 MiB here; CPU only:
#: ``max_memory_allocated`` on CUDA counts tensors alone)
CPU_BASELINE_BYTES = 560 * 2**20
#: saved activation floats per element and decoder layer: A_H * hidden + A_I * intermediate, counted from
#: DecoderLayer's saved tensors (``torch.autograd.graph.saved_tensors_hooks``, distinct storages) at several shapes;
#: ACT_TRANSIENT scales them for what else is alive at the peak (1.0 matched the SmolLM2-shaped dense runs to 5%)
A_H, A_I, ACT_TRANSIENT = 10.8, 4.0, 1.0
#: per-element floats outside the layers, in units of H: embedding, fused input, final norm and the gradients
#: flowing into them (P-EAGLE runs fc once per position, so no per-element [N, 3H] aux gather is kept)
INPUT_FLOATS_PER_H = 5
#: [N, H] rows alive besides the attention tensors in a layer recomputed in row chunks (``row_chunked`` below)
ROW_CHUNKED_H = 1
#: fp32 [chunk, Vd] blocks alive at once in one chunk of the KL loss (logits, log-probs, target probs, gradient)
LOSS_CHUNK_BLOCKS = 6
#: resident growth of any CPU step beyond its tensors (allocator arenas, autograd graph, index tensors), measured
#: as the gap between small-shape steps and their tensor counts
CPU_STEP_OVERHEAD_BYTES = 48 * 2**20
#: AdamW's foreach step briefly holds about one more parameter-sized buffer per trainable parameter
OPTIMIZER_TRANSIENT = 1.0
# the attention's own bytes are the mask builder's to declare (MaskBuilder.attention_bytes, API 6), from the two
# calibrated models in specframe.attention_memory (full mask, query blocks)


#: drafters built for an estimate, by (class, options, target config): the advice's searches estimate one configuration
#: at many lengths, and building even a shapes-only drafter (its initialisers on the meta device) costs more than
#: the arithmetic
_BUILT: dict[tuple[type, str, int], tuple[Any, Any, Any]] = {}


def _drafter(cfg: MemoryConfig) -> tuple[Any, Any]:
    """The drafter of ``cfg``'s plan, built for its target with no weight allocated. The estimate's one instance
    besides the run's: it reads the drafter's shapes, supervision and declarations off a meta-device copy."""
    plan = resolved_plan(cfg)
    cls, options = plan.drafter_cls, plan.drafter_options
    key = (cls, repr(options), id(cfg.target_config))
    built = _BUILT.get(key)
    if built is not None and built[2] is cfg.target_config:
        return built[0], built[1]
    try:
        with torch.device("meta"):  # shapes only: no weight is allocated or initialised
            drafter = cls(cfg.target_config, options)
    except (NotImplementedError, RuntimeError):
        drafter = cls(cfg.target_config, options)
    if len(_BUILT) >= 8:
        _BUILT.clear()
    _BUILT[key] = (drafter, options, cfg.target_config)  # the config kept alive, so its id names no other
    return drafter, options


def _numel(tensors: Any) -> int:
    return sum(int(t.numel()) for t in tensors)


def _layers(drafter: Any, module: torch.nn.Module) -> tuple[tuple[Any, ...], bool]:
    """The shapes of the drafter's decoder layers, and whether the drafter declared them. ``Drafter.layer_shapes``
    (API 9) when it gives them; else found by structure: ``modeling.DecoderLayer`` s, and any plugin layer built the
    same way (an ``mlp`` beside a ``self_attn`` that carries a ``LayerShape``, as DFlash's), whose activations per
    row the per-element constants describe as well."""
    declared = drafter.layer_shapes()
    if declared is not None:
        shapes = tuple(declared)
        bad = [s for s in shapes if not isinstance(s, LayerShape)]
        if bad:
            raise SpecframeError(f"drafter '{drafter.name}' layer_shapes() must give api.modeling.LayerShape s, got "
                                 f"{type(bad[0]).__name__}")
        return shapes, True
    layers = [m for m in module.modules() if isinstance(getattr(getattr(m, "self_attn", None), "shape", None),
                                                        LayerShape) and hasattr(m, "mlp")]
    return tuple(m.self_attn.shape for m in layers), False


def _builder(cfg: MemoryConfig) -> Any:
    """The run's mask builder with its options (defaults included): it states its own attention bytes."""
    plan = resolved_plan(cfg)
    return plan.builder_cls(plan.builder_options)


def estimate(cfg: MemoryConfig) -> Estimate:
    """Predicted peak memory (bytes) of one training step of ``cfg``, with a breakdown."""
    if cfg.features not in ("online", "cache", "synthetic"):
        raise UsageError(f"features must be online, cache or synthetic, got {cfg.features!r}")
    if cfg.plan is None:  # the names resolved once for the whole estimate
        cfg = attrs.evolve(cfg, plan=resolved_plan(cfg))
    drafter, _ = _drafter(cfg)
    training = cfg.plan.training  # what the drafter declares (API 6), whatever its options are called
    depth = cfg.plan.depth
    if not depth:
        raise UsageError(f"drafter '{cfg.drafter}' has no default training depth: pass --depth")
    module = drafter.module()
    from specframe.devices import DTYPE_BYTES

    if cfg.dtype not in DTYPE_BYTES:
        raise UsageError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {cfg.dtype!r}")
    e = DTYPE_BYTES[cfg.dtype]  # activations and the target's weights
    w = 4  # fp32 master weights, their gradients and AdamW's two moments
    trainable = _numel(p for p in module.parameters() if p.requires_grad)
    frozen = _numel(p for p in module.parameters() if not p.requires_grad) + _numel(module.buffers())
    shapes, declared = _layers(drafter, module)
    notes = [] if shapes or declared else [
        f"drafter '{cfg.drafter}' declares no decoder layers (Drafter.layer_shapes, API 9) and none were found by "
        "structure: its layers' activations are not counted, so this estimate is low if it has any"]
    # layers of one shape are charged as count x one layer's floats: exactly what a uniform stack always was
    groups = Counter(shapes)
    n_layers = len(shapes)
    tc = cfg.target_config
    h_t, v_t = int(tc.hidden_size), int(tc.vocab_size)
    if shapes:
        shape = shapes[0]
    else:  # no layer found: one layer the target's size sizes the per-layer terms (and no layer is summed)
        t_heads = int(getattr(tc, "num_attention_heads", 1))
        shape = LayerShape(hidden=h_t, heads=t_heads, kv_heads=t_heads, head_dim=h_t // t_heads,
                           intermediate=int(getattr(tc, "intermediate_size", 4 * h_t)))
    sizing = list(groups) or [shape]  # the shapes the largest-layer terms are taken over
    h, heads = shape.hidden, shape.heads
    vd = int(drafter.draft_vocab_size or v_t)  # api.Drafter.draft_vocab_size: None is the full vocabulary
    spec = drafter.feature_spec()
    n_aux = len(tuple(getattr(spec, "aux_layers", None) or ())) if spec is not None else 0
    final = bool(getattr(spec, "final_hidden", False)) if spec is not None else False
    feature_floats = (n_aux + int(final)) * h_t * cfg.seq_len

    # from a cache the engine keeps the target's embedding, head, final norm and the layers the drafter reads (API 15)
    kept = drafter.target_layers(int(tc.num_hidden_layers)) if cfg.features == "cache" else None
    target_params = _target_params(tc, None if kept is None else len(set(kept)))
    cpu = torch.device(cfg.device).type == "cpu"
    fixed = {
        "process_baseline": CPU_BASELINE_BYTES if cpu else 0,
        "target_weights": (v_t * h_t if cfg.features == "synthetic" else target_params) * e,
        "drafter_weights": (trainable + frozen) * w + ((trainable + frozen) * w // cfg.shards if cfg.shards > 1 else 0),
        "drafter_gradients": trainable * w,
        "optimizer_state": 2 * trainable * w // cfg.shards,
        "features": feature_floats * 4 * (cfg.sequences if cfg.features != "cache" else 2),
    }
    builder = _builder(cfg)
    segs, n_elements = segment_counts(cfg, drafter, depth, training)
    checkpointing = bool(training.activation_checkpointing)
    loss_chunk = int(training.loss_chunk)
    head_dim = shape.head_dim

    def one_layer(s: Any) -> float:  # activation floats one layer saves per row
        return (A_H * s.hidden + A_I * s.intermediate) * ACT_TRANSIENT

    # the largest layer is what one layer's backward holds; the sum over layers is what all of them save
    layer_floats = max(one_layer(s) for s in sizing)
    all_layer_floats = sum(n * one_layer(s) for s, n in groups.items())
    all_layer_inputs = sum(n * s.hidden for s, n in groups.items())
    # what one layer holds while its backward runs when its position-wise parts are recomputed in row chunks:
    # q, k, v, output and log-sum-exp saved by the attention, and about as much again in their gradients, plus
    # a few [N, H] rows (the o_proj input, the layer output, gradients flowing through the residual stream)
    def chunked(q_heads: int, dim: int, kv: int, hidden: int) -> float:
        return (2 * (2 * q_heads * dim + 2 * kv * dim) + q_heads + ROW_CHUNKED_H * hidden) * ACT_TRANSIENT

    # a builder declaring grouped_kv takes grouped k / v as they are; the others get them repeated to every query head
    row_chunked = max(chunked(s.heads, s.head_dim, s.kv_heads if builder.grouped_kv else s.heads, s.hidden)
                      for s in sizing)
    inputs = INPUT_FLOATS_PER_H * h + 2 * head_dim  # + the rotary tables

    def per_element(forwarded: int) -> tuple[float, float]:
        """Bytes per forwarded element (saved through the step, held while one layer's backward runs). With
        checkpointing what is saved is each layer's input, and the layer being recomputed holds its activations
        (its position-wise parts in row chunks once the segment is longer than ``ROW_CHUNK``); without, every
        layer's activations are saved and backward holds about one more layer's worth of gradients."""
        if checkpointing:
            recompute = row_chunked if forwarded > ROW_CHUNK else 2 * layer_floats
            return (inputs + all_layer_inputs) * e, recompute * e
        return (inputs + all_layer_floats) * e, layer_floats * e

    best: tuple[int, dict[str, int], tuple[int, int, int]] | None = None
    for forwarded, charged, roots in segs:
        attention = builder.attention_bytes(AttentionShape(
            rows=forwarded, depth=depth, seq_len=cfg.seq_len, heads=heads,
            saved_copies=1 if checkpointing else n_layers))
        saved, backward = per_element(forwarded)
        step = {
            "step_overhead": CPU_STEP_OVERHEAD_BYTES if cpu else 0,
            "saved_activations": int(forwarded * saved),
            "backward_layer": int(forwarded * backward),
            "attention": int(attention),
            # the chunked KL (modeling.chunked_forward_kl) forms each row chunk's logit gradient in its forward: it
            # holds every charged row's hidden state and its gradient (about H + H_t per row), the teacher of a block
            # of positions and a few [chunk, Vd] fp32 blocks at a time (LOSS_CHUNK_BLOCKS counts both), and the
            # target head's draft rows; a cache's compact top-k teacher needs no head rows, which this still counts
            "loss": int(charged * (h + h_t) * e + LOSS_CHUNK_BLOCKS * min(loss_chunk, max(charged, 1)) * vd * 4
                        + vd * h_t * e),
        }
        # the loss runs (and is differentiated) before the layers' backward starts: the two phases do not overlap
        total = (step["step_overhead"] + step["saved_activations"]
                 + max(step["backward_layer"] + step["attention"], step["loss"]))
        if best is None or total > best[0]:
            best = (total, step, (forwarded, charged, roots))
    assert best is not None
    step_total, step_parts, (forwarded, charged, _) = best
    if cfg.features == "online":
        # the target forward that captures features (no grad; SDPA's causal path keeps no score matrix)
        online = (4 * h_t + 3 * int(getattr(tc, "intermediate_size", 4 * h_t))) * cfg.seq_len * e
        step_total = max(step_total, online)
        step_parts = {**step_parts, "target_forward": online}
    optimizer_peak = int(OPTIMIZER_TRANSIENT * trainable * w)
    fixed_total = sum(fixed.values())
    peak = fixed_total + max(step_total, optimizer_peak)
    return Estimate(
        peak_bytes=int(peak), fixed_bytes=int(fixed_total), step_bytes=int(max(step_total, optimizer_peak)),
        breakdown={**fixed, **step_parts, "optimizer_step_transient": optimizer_peak},
        elements=n_elements, segments=len(segs),
        largest_segment={"forwarded": forwarded, "charged": charged}, notes=notes,
    )


def _target_params(tc: Any, layers: int | None = None) -> int:
    """The target's parameters with ``layers`` of its decoder layers (None: all of them)."""
    h, v = int(tc.hidden_size), int(tc.vocab_size)
    inter = int(getattr(tc, "intermediate_size", 4 * h))
    heads = int(getattr(tc, "num_attention_heads", 1))
    kv = int(getattr(tc, "num_key_value_heads", None) or heads)
    hd = int(getattr(tc, "head_dim", None) or h // heads)
    layer = h * heads * hd * 2 + 2 * h * kv * hd + 3 * h * inter + 2 * h
    tied = bool(getattr(tc, "tie_word_embeddings", False))
    n = int(tc.num_hidden_layers) if layers is None else layers
    return n * layer + v * h * (1 if tied else 2) + h
