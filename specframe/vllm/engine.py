"""Run vLLM on a target, with or without an exported drafter, and read its speculative-decoding figures.

``VllmEngine`` starts vLLM in this process (``from vllm import LLM``): greedy generation from token ids, one prompt
at a time (as the reference engine decodes, so per-prompt timings and rounds mean the same thing). Scripts that use
it need an ``if __name__ == "__main__":`` guard, because vLLM may spawn workers that re-import the main module.
``specframe.vllm.jobs`` runs engines in child processes instead (the child takes vLLM's memory and threads with it,
and vLLM is imported once for all of them), and ``specframe.vllm.interleaved`` measures several engines side by side
on the same prompts with them. The figures an engine reads are records of ``specframe.vllm.counters``.

What vLLM 0.32 exposes and how it maps onto ``specframe.metrics`` (docs/design.md section 8):

- Aggregate counters (``LLM.get_metrics()``): ``vllm:spec_decode_num_drafts`` (verification steps that carried a
  draft, summed over requests), ``..._num_draft_tokens``, ``..._num_accepted_tokens`` and the vector
  ``..._num_accepted_tokens_per_pos`` (slot i accepted, per draft). vLLM counts a step's accepted tokens *before*
  the output is cut at ``max_tokens``, and ignores decode steps that carried no draft.
- Per request, with ``per_request_spec_decode_metrics="detailed"`` (set here whenever a drafter runs):
  ``CompletionOutput.spec_decode_metrics.per_step_accepted`` / ``per_step_drafted``, one entry per verification
  step in order. These give specframe's ``Round`` s exactly: each step emits accepted + 1 tokens, the last ones cut
  at ``max_tokens`` like the reference engine's; every output token not accounted for by a drafting step came from
  a decode forward without a draft (1 token each); the prefill's token is excluded.
- Per request timings (``RequestOutput.metrics``): engine-core timestamps of the first and last token; the decode
  phase is the time between them, so OTPS = decode tokens / that time.
"""


from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from specframe.errors import SpecframeError
from specframe.vllm.counters import SpecCounters, VllmGeneration, rounds_from_steps

# Without a KV-cache size vLLM's CPU backend claims about 90% of RAM; 1 GiB serves short prompts of small models.
DEFAULT_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


@attrs.frozen
class EngineOptions:
    """How vLLM is started. ``dtype`` float32 keeps plain and speculative greedy outputs bit-identical on CPU;
    ``kv_cache_gib`` sets ``VLLM_CPU_KVCACHE_SPACE`` unless the environment already does."""

    max_model_len: int = 2048
    dtype: str = "float32"
    seed: int = 0
    kv_cache_gib: float = 1.0
    enforce_eager: bool = True
    #: CPU ids vLLM's OpenMP threads are pinned to (``VLLM_CPU_OMP_THREADS_BIND``); None: ``cpu_binding()``
    threads_bind: str | None = None
    #: requests vLLM decodes together. 1 for timings (one prompt at a time, as the reference engine decodes); more
    #: for acceptance over whole sets (``generate(..., together=True)``), which batching does not change
    max_num_seqs: int = 1


def cpu_binding(threads: int | None = None) -> str:
    """The CPU list to pin vLLM's OpenMP threads to: the first ``threads`` CPUs this process may run on (all of them
    when None), as ``VLLM_CPU_OMP_THREADS_BIND`` spells it ("0,1").

    vLLM's own default ("auto") keeps one core per rank back for a scheduler process; specframe runs the engine in
    its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so on a 2-core machine "auto" would leave decoding one
    core and let the threads of anything else running land on the other: timings then swing by 3x."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if threads is not None:
        if threads < 1:
            raise SpecframeError(f"--threads must be positive, got {threads}")
        if threads > len(cpus):
            raise SpecframeError(f"--threads {threads}: this process may only run on {len(cpus)} CPU(s) {cpus}")
        cpus = cpus[:threads]
    return ",".join(str(c) for c in cpus)


def configure_environment(options: EngineOptions = EngineOptions()) -> None:
    """Set vLLM's environment defaults (values already set win, except an explicit ``threads_bind``); must run
    before ``vllm`` is imported."""
    env = dict(DEFAULT_ENV, VLLM_CPU_KVCACHE_SPACE=f"{options.kv_cache_gib:g}", VLLM_CPU_OMP_THREADS_BIND=cpu_binding())
    for key, value in env.items():
        os.environ.setdefault(key, value)
    if options.threads_bind is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = options.threads_bind


def import_llm() -> Any:
    """``vllm.LLM``, or a ``SpecframeError`` saying how to install vLLM."""
    try:
        from vllm import LLM
    except ImportError as exc:
        raise SpecframeError(
            f"vLLM is not usable here ({exc}); install it with `make setup VLLM=cpu` (CPU) or `VLLM=gpu`"
        ) from exc
    return LLM


class VllmEngine:
    """vLLM in this process on ``target`` (a local folder or hub id), with an optional ``speculative_config``
    (``specframe.layouts.export.speculative_config`` builds one for an exported drafter).

    ``target`` may also be a speculators-format export (EAGLE-3, P-EAGLE, DFlash, DSpark): vLLM then starts the verifier the folder
    names, with the folder's method and number of draft tokens; ``speculative_config`` may override fields of it
    (``{"num_speculative_tokens": k}``; ``drafter_job`` builds such jobs)."""

    def __init__(
        self,
        target: str | os.PathLike,
        speculative_config: Mapping[str, Any] | None = None,
        options: EngineOptions = EngineOptions(),
    ) -> None:
        check_engine(target, speculative_config)
        configure_environment(options)
        LLM = import_llm()
        from specframe.vllm.vllm_plugin import register

        register()  # specframe's drafter models (ParallelSpec); the vllm.general_plugins entry point does the same
        self.speculative_config = dict(speculative_config) if speculative_config else None
        kwargs: dict[str, Any] = {}
        if self.speculative_config:
            kwargs["speculative_config"] = self.speculative_config
        if self.speculative_config or _speculators_export(target):
            kwargs["per_request_spec_decode_metrics"] = "detailed"
            self.speculative_config = self.speculative_config or {}
        self.llm = LLM(
            model=str(target),
            dtype=options.dtype,
            max_model_len=options.max_model_len,
            max_num_seqs=options.max_num_seqs,
            enforce_eager=options.enforce_eager,
            seed=options.seed,
            disable_log_stats=False,
            enable_prefix_caching=False,
            **kwargs,
        )

    def counters(self) -> SpecCounters:
        return SpecCounters.from_metrics(self.llm.get_metrics())

    def close(self) -> None:
        """Release the engine so another can start in this process (vLLM keeps process-wide parallel state)."""
        import gc

        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        self.llm = None
        gc.collect()
        destroy_model_parallel()
        destroy_distributed_environment()

    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 256, ignore_eos: bool = False,
        together: bool = False,
    ) -> list[VllmGeneration]:
        """Greedy generation of each prompt (token ids), one after the other; ``together``: all of them handed to
        vLLM at once, up to ``max_num_seqs`` decoding in one batch (each request's rounds are still its own, from
        its per-request counters; its timings then measure the batch, not the request)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=ignore_eos)
        groups = [list(prompts)] if together else [[ids] for ids in prompts]
        results = []
        for group in groups:
            started = time.perf_counter()
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in ids]) for ids in group], params,
                                     use_tqdm=False)
            total = time.perf_counter() - started
            if len(outs) != len(group):
                raise SpecframeError(f"vLLM answered {len(outs)} of {len(group)} requests")
            results.extend(self._generation(out, total) for out in outs)
        return results

    def _generation(self, out: Any, total: float) -> VllmGeneration:
        completion = out.outputs[0]
        tokens = tuple(int(t) for t in completion.token_ids)
        stats = completion.spec_decode_metrics
        accepted = list(stats.per_step_accepted) if stats is not None else []
        drafted = list(stats.per_step_drafted) if stats is not None else []
        if self.speculative_config is not None and stats is None and len(tokens) > 1:
            raise SpecframeError("vLLM returned no per-request spec-decode metrics; is this vLLM older than 0.32?")
        return VllmGeneration(
            tokens=tokens,
            rounds=rounds_from_steps(len(tokens), accepted, drafted),
            decode_seconds=_decode_seconds(out, total),
            total_seconds=total,
        )


def _speculators_export(target: str | os.PathLike) -> bool:
    from specframe.layouts.export import SPECULATORS, layout_of

    path = Path(target) / "config.json"
    if not path.is_file():
        return False
    try:
        return layout_of(json.loads(path.read_text())) in SPECULATORS
    except ValueError:
        return False


def _decode_seconds(out: Any, total: float) -> float:
    stats = getattr(out, "metrics", None)
    first, last = getattr(stats, "first_token_ts", 0.0), getattr(stats, "last_token_ts", 0.0)
    if first and last >= first:
        return float(last - first)
    latency = getattr(stats, "first_token_latency", 0.0) or 0.0
    return max(total - latency, 0.0)


def check_engine(target: str | os.PathLike, speculative_config: Mapping[str, Any] | None = None) -> None:
    """``specframe.vllm.support.prestart`` for an engine: the target alone, the target with the export its
    ``speculative_config`` names, or an export folder served alone (its verifier the target)."""
    from specframe.vllm import support

    model = (speculative_config or {}).get("model")
    if model is not None and (Path(model) / "config.json").is_file():
        support.prestart(target, model)
    elif _speculators_export(target):
        support.prestart(None, target)
    else:
        support.prestart(target)
