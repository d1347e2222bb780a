"""What another engine's hidden states must satisfy to stand in for the target's own transformers forward
(``specframe prepare --engine``, ``train --feature-engine``): the layer ids it is asked for, each conversation's
features formed from its states (the target's own final norm applied), and the parity gate against transformers.

An engine is any object with ``name``, ``layer_ids``, ``extract(prompts) -> [[T, len(layer_ids), H], ...]`` and
``describe()``; ``specframe.vllm.states.VllmStates`` is the one shipped.
"""

from __future__ import annotations

from typing import Any

import attrs

from specframe.errors import SpecframeError
from specframe.features import FeatureSpec, capture_features
from specframe.values import is_int


def engine_layer_ids(spec: FeatureSpec, num_layers: int) -> tuple[int, ...]:
    """The layer ids an engine must hand out for ``spec``: the aux ids in order, then ``num_layers`` (the last layer's
    output before the final norm) when the final state is declared."""
    return tuple(spec.aux_layers or ()) + ((num_layers,) if spec.final_hidden else ())


def engine_features(engine: Any, target: Any, prompts: list[list[int]], batch: list[int],
                     spec: FeatureSpec, names: list[str] | None = None,
                     after: str = "the shards finished before it are kept (the same command resumes after them)",
                     ) -> dict[int, tuple[Any, Any]]:
    """Each conversation's (aux, final) from ``engine``. ``names`` given: each one's states are checked first (the
    parity gate, which checks its own conversations against the reference, passes none)."""
    import torch

    from specframe.features import apply_final_norm

    n_aux = len(spec.aux_layers or ())
    ids = list(engine.layer_ids)
    out = {}
    for k, (i, states) in enumerate(zip(batch, engine.extract(prompts))):
        if names is not None:
            # the gate compared the first conversations; every later one is still checked for the silent failures
            # (NaN, zeroed rows) before it is used. id 0 is the embeddings, where a zero row can be real.
            bad = [ids[j] for j in range(states.shape[1]) if not bool(torch.isfinite(states[:, j]).all())]
            zero = [ids[j] for j in range(states.shape[1]) if ids[j] != 0 and bool((states[:, j] == 0).all(-1).any())]
            if bad or zero:
                what = (f"non-finite values at layer id(s) {bad}" if bad else
                        f"all-zero positions at layer id(s) {zero}")
                raise SpecframeError(f"the {engine.name} states of {names[k]} hold {what}; {after}")
        aux = states[:, :n_aux].flatten(-2) if n_aux else None
        fin = apply_final_norm(target, states[:, n_aux]) if spec.final_hidden else None
        out[i] = (aux, fin)
    return out


def parity_gate(target: Any, prompts: list[list[int]], candidate: dict[int, tuple[Any, Any]],
                 spec: FeatureSpec) -> Any:
    """``specframe.feature_gate.compare_features`` of ``candidate`` (features per conversation index, in order)
    against the target's own forward over each prompt alone."""
    import torch

    from specframe.devices import DTYPES
    from specframe.feature_gate import compare_features
    from specframe.features import apply_final_norm

    spelled = {getattr(torch, full): short for short, full in DTYPES.items()}  # torch.bfloat16 -> "bf16"
    dtype = spelled.get(target.model.get_input_embeddings().weight.dtype, "fp32")
    n_layers = target.num_layers
    aux = tuple(spec.aux_layers or ())
    # each declared state's neighbouring layers, which a wrong id would hand out instead: the streams entering the
    # layers before and after it; for the final state, the stream entering the last layer through the final norm
    near = {f"aux {k}": [j for j in (k - 1, k + 1) if 0 <= j < n_layers] for k in aux}
    if spec.final_hidden and n_layers > 1:
        near["final"] = [n_layers - 1]
    wanted = sorted(set(aux) | {j for js in near.values() for j in js})
    ref_spec = attrs.evolve(spec, aux_layers=tuple(wanted) or None)
    ref, got, neighbours = [], [], []
    for prompt, (aux_got, fin) in zip(prompts, (candidate[i] for i in sorted(candidate))):
        f = capture_features(target, torch.tensor([prompt]), ref_spec)
        streams = {} if f.aux is None else dict(zip(wanted, f.aux[0].unflatten(-1, (len(wanted), -1)).unbind(1)))
        ref.append({"aux": torch.cat([streams[k] for k in aux], -1) if aux else None,
                    "final": None if f.final is None else f.final[0]})
        got.append({"aux": aux_got, "final": fin})
        neighbours.append({name: {(f"layer {j}" if name != "final" else f"layer {j} through the final norm"):
                                  (streams[j] if name != "final" else apply_final_norm(target, streams[j]))
                                  for j in js} for name, js in near.items()})
    return compare_features(ref, got, aux, dtype, neighbours)


def check_engine(engine: Any, spec: FeatureSpec, num_layers: int, gate_sequences: Any, use: str) -> None:
    """Refuse an engine that extracts other layer ids than ``spec`` needs, or a gate of no sequence (``use``: what the
    states are for, in the message)."""
    want = engine_layer_ids(spec, num_layers)
    if tuple(engine.layer_ids) != want:
        raise SpecframeError(f"the feature engine extracts layers {list(engine.layer_ids)}, {use} needs {list(want)}")
    if not is_int(gate_sequences, 1):
        raise SpecframeError(f"the parity gate needs at least one sequence, got {gate_sequences!r}: states from "
                             "another engine are never accepted unchecked")


def gate_engine(engine: Any, target: Any, prompts: list[list[int]], spec: FeatureSpec, consequence: str) -> Any:
    """The parity gate of ``engine`` on ``prompts`` (its states checked against the target's transformers forward);
    a ``SpecframeError`` naming every failing layer, then ``consequence``, unless it passes."""
    candidate = engine_features(engine, target, prompts, list(range(len(prompts))), spec)
    gate = parity_gate(target, prompts, candidate, spec)
    if not gate.passed:
        raise SpecframeError(f"the {engine.name} features do not match the target's own ({gate.summary()}): "
                             + "; ".join(gate.failures) + f". {consequence}")
    return gate
