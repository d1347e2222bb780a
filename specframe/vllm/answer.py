"""The target's greedy answers from vLLM's offline engine, many requests in flight (``specframe regenerate --engine
vllm``).

``specframe.data.regenerate`` decides which prompts form a batch and when a batch is written; this module only
answers one batch: every prompt of it is handed to ``LLM.generate`` at once, and vLLM's scheduler keeps up to
``max_num_seqs`` of them decoding together (continuous batching: a finished answer's slot goes to the next prompt at
once, where ``model.generate`` pads every row to the longest). Decoding is greedy, and stopping follows the same ids
as the transformers engine: ``ignore_eos`` turns off vLLM's own eos rule and ``stop_token_ids`` names the target's
stop ids, so neither engine stops where the other would not.

Parallelism is vLLM's own: ``tensor_parallel_size`` / ``pipeline_parallel_size`` spread the target over GPUs and
``gpu_memory_utilization`` bounds its share of each; on the CPU ``kv_cache_gib`` sizes the KV cache and
``threads`` pins the OpenMP threads.
"""

from __future__ import annotations

from typing import Any

import attrs

from specframe.errors import SpecframeError
from specframe.vllm.engine import EngineOptions, configure_environment, cpu_binding, import_llm

VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
#: vLLM's distributed executors: ``mp`` (processes on one node), ``ray`` (a Ray cluster: several nodes), ``uni`` (one
#: process), ``external_launcher`` (one engine per torchrun rank)
EXECUTORS = ("mp", "ray", "uni", "external_launcher")


@attrs.frozen
class AnswerOptions:
    """How the engine is started for answering (all passed to ``vllm.LLM``; None: vLLM's default)."""

    dtype: str = "fp32"
    max_model_len: int = 1024
    max_num_seqs: int = 128
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    gpu_memory_utilization: float | None = None
    #: vLLM's ``distributed_executor_backend`` (None: vLLM's choice); ``ray`` spreads a target over several nodes
    distributed_executor_backend: str | None = None
    kv_cache_gib: int = 2
    threads: int | None = None
    seed: int = 0
    enforce_eager: bool = True
    #: reuse the KV (and, with extract_hidden_states, the hidden-state) blocks of an earlier request that shares a
    #: prefix: ``regenerate --capture`` asks for a whole conversation's states right after answering its prompt
    prefix_caching: bool = False
    #: tokens per KV block (None: vLLM's; 128 on the CPU): a prefix is reused in whole blocks only
    block_size: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.dtype not in VLLM_DTYPES:
            raise SpecframeError(f"vLLM dtype must be one of {', '.join(VLLM_DTYPES)}, not '{self.dtype}'")
        for name in ("max_model_len", "max_num_seqs", "tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise SpecframeError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise SpecframeError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.distributed_executor_backend not in (None, *EXECUTORS):
            raise SpecframeError(f"--distributed-executor-backend must be one of {', '.join(EXECUTORS)}, not "
                                 f"'{self.distributed_executor_backend}'")
        if self.block_size is not None and self.block_size < 1:
            raise SpecframeError(f"vLLM's block size must be positive, got {self.block_size}")
        if self.kv_cache_gib < 1:
            raise SpecframeError(f"--kv-cache-gib must be a whole number of GiB, at least 1, got {self.kv_cache_gib}")

    def llm_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {
            "dtype": VLLM_DTYPES[self.dtype],
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "seed": self.seed,
            "enforce_eager": self.enforce_eager,
            # answers are independent: a shared-prefix cache would only change which kernels ran, not the answers
            "enable_prefix_caching": self.prefix_caching,
        }
        if self.block_size is not None:
            kw["block_size"] = self.block_size
        if self.gpu_memory_utilization is not None:
            kw["gpu_memory_utilization"] = self.gpu_memory_utilization
        if self.distributed_executor_backend is not None:
            kw["distributed_executor_backend"] = self.distributed_executor_backend
        return kw


class VllmAnswerer:
    """vLLM's offline engine on ``model`` (a model folder or hub id), answering whole batches at once."""

    name = "vllm"

    def __init__(self, model: str, options: AnswerOptions = AnswerOptions()) -> None:
        from specframe.vllm import support

        support.prestart(model)
        configure_environment(EngineOptions(kv_cache_gib=options.kv_cache_gib,
                                            threads_bind=cpu_binding(options.threads) if options.threads else None))
        LLM = import_llm()
        self.options = options
        self.model = str(model)
        self.llm = LLM(model=self.model, **options.llm_kwargs())

    def describe(self) -> dict:
        import vllm

        return {"engine": self.name, "vllm": vllm.__version__, **attrs.asdict(self.options)}

    def answer(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int]) -> list[tuple[list[int], bool]]:
        """Each prompt's new tokens (the stop id included when vLLM keeps it) and whether it ended on a stop id."""
        return [(tokens, stopped) for tokens, stopped, _ in generate_answers(self.llm, prompts, max_new_tokens,
                                                                              stop_ids)]


def generate_answers(llm: Any, prompts: list[list[int]], max_new_tokens: int,
                     stop_ids: list[int]) -> list[tuple[list[int], bool, Any]]:
    """Greedy answers of ``llm`` (a ``vllm.LLM``) to every prompt at once: each one's new tokens, whether it ended on
    a stop id, and vLLM's output (its ``kv_transfer_params`` name a hidden-states file when the engine extracts)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True,
                            stop_token_ids=list(stop_ids), detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts], params, use_tqdm=False)
    if len(outs) != len(prompts):
        raise SpecframeError(f"vLLM answered {len(outs)} of {len(prompts)} prompts")
    result = []
    for out in outs:  # LLM.generate returns outputs in the order of its inputs
        c = out.outputs[0]
        result.append(([int(t) for t in c.token_ids], c.finish_reason == "stop", out))
    return result
