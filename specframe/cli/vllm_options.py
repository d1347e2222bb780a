"""The vLLM engine options, written once: ``specframe prepare`` and ``specframe regenerate`` size the offline engine
they start with ``engine_options`` (received as one ``VllmFlags``, which gives the engine's ``AnswerOptions``), and
``specframe train --feature-engine vllm`` takes the same sizes as its ``--vllm-*`` run settings
(``feature_engine_options``), as ``target_options`` does for loading a target."""

from __future__ import annotations

import functools
from typing import Any

import attrs
import click

BACKENDS = ["mp", "ray", "uni", "external_launcher"]


@attrs.frozen
class VllmFlags:
    """What the engine options of ``prepare`` / ``regenerate`` say; None: the command's (or vLLM's) default."""

    max_num_seqs: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    gpu_memory_utilization: float | None = None
    distributed_executor_backend: str | None = None
    kv_cache_gib: int = 2

    def answer_options(self, *, dtype: str, max_model_len: int, max_num_seqs: int, threads: int | None) -> Any:
        """The engine's ``AnswerOptions``; ``max_num_seqs``: the command's default when ``--max-num-seqs`` is not
        given (its shard or batch size)."""
        from specframe.vllm.answer import AnswerOptions

        return AnswerOptions(dtype=dtype, max_model_len=max_model_len, max_num_seqs=self.max_num_seqs or max_num_seqs,
                             tensor_parallel_size=self.tensor_parallel_size,
                             pipeline_parallel_size=self.pipeline_parallel_size,
                             gpu_memory_utilization=self.gpu_memory_utilization,
                             distributed_executor_backend=self.distributed_executor_backend,
                             kv_cache_gib=self.kv_cache_gib, threads=threads)


def engine_options(max_num_seqs: str):
    """Add the vLLM engine options to a command (``max_num_seqs``: the help of ``--max-num-seqs``, naming the
    command's default); it receives them as ``vllm: VllmFlags``."""
    options = [
        click.option("--max-num-seqs", type=int, default=None, help=max_num_seqs),
        click.option("--tensor-parallel-size", type=int, default=1, show_default=True, help="vLLM: GPUs per layer."),
        click.option("--pipeline-parallel-size", type=int, default=1, show_default=True, help="vLLM: pipeline stages."),
        click.option("--gpu-memory-utilization", type=float, default=None,
                     help="vLLM: share of each GPU's memory the engine may take (default: vLLM's, 0.9)."),
        click.option("--distributed-executor-backend", type=click.Choice(BACKENDS), default=None,
                     help="vLLM: how its workers run (default: vLLM's choice); ray spreads the target over several "
                          "nodes of a Ray cluster."),
        click.option("--kv-cache-gib", type=int, default=2, show_default=True, help="vLLM on the CPU: KV-cache size."),
    ]

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, max_num_seqs, tensor_parallel_size, pipeline_parallel_size, gpu_memory_utilization,
                    distributed_executor_backend, kv_cache_gib, **kwargs):
            return fn(*args, vllm=VllmFlags(max_num_seqs, tensor_parallel_size, pipeline_parallel_size,
                                            gpu_memory_utilization, distributed_executor_backend, kv_cache_gib),
                      **kwargs)

        for option in reversed(options):
            wrapper = option(wrapper)
        return wrapper

    return decorate


def feature_engine_options(fn):
    """``train``'s ``--vllm-*`` options: the engine sizes of ``--feature-engine vllm``, run settings (``TrainConfig``
    fields, None: the engine's default) passed on by name."""
    options = [
        click.option("--vllm-kv-cache-gib", type=int, default=None,
                     help="--feature-engine vllm on the CPU: KV cache (GiB, default 2)."),
        click.option("--vllm-tensor-parallel-size", type=int, default=None,
                     help="--feature-engine vllm: GPUs per layer (default 1)."),
        click.option("--vllm-gpu-memory-utilization", type=float, default=None,
                     help="--feature-engine vllm: share of each GPU's memory the engine may take (default: vLLM's, "
                          "0.9)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn
