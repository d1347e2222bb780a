"""The command that serves a target with an exported drafter in vLLM's OpenAI-compatible server (``specframe serve``
runs it): a speculators export without a target is vLLM's ``model`` itself, as ``vllm serve EXPORT`` serves it (the
folder names its verifier and draft tokens, ``k`` overrides the number); with a target, or for an export vLLM serves
only beside one (PARD, ParallelSpec), the target is the model and the export goes in an explicit
``--speculative-config`` built from its manifest.

The caller reads the export's config.json and manifest once and hands them here (``specframe serve`` checks the
folder with them first).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from specframe.errors import SpecframeError
from typing import Any

from specframe.layouts.export import DEFAULT_SPECULATIVE_TOKENS, Manifest, manifest_of, read_config


def serve_command(
    target: str | None,
    drafter: str | os.PathLike | None = None,
    k: int | None = None,
    *,
    manifest: Manifest | None = None,
    config: dict[str, Any] | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    dtype: str = "auto",
    max_model_len: int | None = None,
    kv_cache_gib: float = 1.0,
    enforce_eager: bool = True,
    extra: tuple[str, ...] = (),
) -> tuple[list[str], dict[str, str]]:
    """The argv and environment additions that start vLLM's OpenAI server for ``target`` with the export at
    ``drafter`` (``specframe export`` output; ``manifest`` and ``config``, its manifest and ``config.json``, when the
    caller read them, else they are read here) drafting ``k`` tokens per step (None: the export's own number). A
    speculators export with ``target`` None is vLLM's ``model`` itself."""
    from specframe.vllm import support
    from specframe.vllm.engine import DEFAULT_ENV

    if drafter is not None and config is None:
        config = read_config(Path(drafter))
    if drafter is not None and manifest is None:
        manifest = manifest_of(config, drafter)
    # vLLM would fail after minutes of start-up (a DSpark runner it lacks, a target without SupportsEagle3, a RoPE its
    # drafter models cannot take): the check every command runs before vLLM starts says so first
    support.prestart(target, drafter, config=config)
    folder_alone = manifest is not None and manifest.speculators and target is None
    if folder_alone:
        model = str(Path(drafter).resolve())
    elif target is None:
        raise SpecframeError(f"{drafter} is a {manifest.layout} export: give --target (vLLM serves it beside the target)")
    else:
        model = target
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", host, "--port", str(port), "--dtype", dtype]
    if folder_alone:
        if k is not None:
            manifest.check_tokens(k)  # e.g. a DFlash export below block_size - 1, with the reason
            argv += ["--speculative-config", json.dumps({"num_speculative_tokens": int(k)})]
    elif drafter is not None:
        tokens = k or manifest.speculative_tokens or DEFAULT_SPECULATIVE_TOKENS
        argv += ["--speculative-config", json.dumps(manifest.speculative_config(drafter, tokens))]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    if enforce_eager:
        argv.append("--enforce-eager")
    argv += list(extra)
    env = {k_: v for k_, v in DEFAULT_ENV.items() if k_ != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["VLLM_CPU_KVCACHE_SPACE"] = f"{kv_cache_gib:g}"
    return argv, env
