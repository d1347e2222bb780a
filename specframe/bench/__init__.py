"""Measured comparisons of decoding methods, shared by ``specframe bench`` and ``benchmarks/``.

One module per idea:

- ``prompts``: the evaluation prompts (``BenchPrompt``, ``load_prompts``, ``chat_ids``);
- ``methods``: what is compared (``Method``: plain decoding, a trained checkpoint, an untrained plugin) and the
  verifiers (``make_verifier``, ``verifier_spec``);
- ``reference``: the interleaved comparison on the reference engine (``compare``, ``Comparison``, ``decode``);
- ``vllm``: the same comparison served by vLLM (``compare_vllm``, ``vllm_jobs``, ``vllm_refusals``);
- ``provenance``: what a results file records beside the figures (``json_safe``, ``first_recorded_target``,
  ``results_provenance``).

The statistics (``t975``, ``Interval``, ``speed_flags`` and their bounds) live in the leaf ``specframe.stats``, which
the reports read too; they are re-exported here under the names bench's callers have always used.
"""

from __future__ import annotations

from specframe.bench.methods import (
    PLAIN,
    Method,
    builds_trees,
    checkpoint_method,
    default_k,
    is_greedy,
    make_verifier,
    plugin_method,
    token_budget,
    verifier_spec,
)
from specframe.bench.prompts import BenchPrompt, chat_ids, load_prompts, spread_over_categories
from specframe.bench.provenance import first_recorded_target, json_safe, results_provenance
from specframe.bench.reference import (
    MAX_REMEASURE,
    Comparison,
    Record,
    Trial,
    compare,
    decode,
    remeasure,
    round_cost,
)
from specframe.bench.vllm import compare_vllm, vllm_jobs, vllm_refusals
from specframe.stats import OUTLIER_FACTOR, PHYSICAL_SLACK, Interval, speed_flags, t975

__all__ = [
    "MAX_REMEASURE", "OUTLIER_FACTOR", "PHYSICAL_SLACK", "PLAIN", "BenchPrompt", "Comparison", "Interval", "Method",
    "Record", "Trial", "builds_trees", "chat_ids", "checkpoint_method", "compare", "compare_vllm", "decode",
    "default_k", "first_recorded_target", "is_greedy", "json_safe", "load_prompts", "make_verifier", "plugin_method",
    "remeasure", "results_provenance", "round_cost", "speed_flags", "spread_over_categories", "t975", "token_budget",
    "verifier_spec", "vllm_jobs", "vllm_refusals",
]
