"""``specframe serve``: vLLM's OpenAI-compatible server on a target, with an exported drafter.

A speculators export (EAGLE-3, P-EAGLE, DFlash, DSpark) without ``--target`` is served as vLLM serves it, ``vllm serve EXPORT``: vLLM
starts the verifier the folder names with the folder's method (``--k`` overrides its number of draft tokens). With
``--target``, or for a PARD export, the target is served with an explicit ``--speculative-config``. The command is
built by ``specframe.vllm.serving.serve_command``; this module reads the export's manifest once and hands it to the
export check and to the command.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click


@click.command("serve", context_settings={"ignore_unknown_options": True})
@click.option("--target", default=None,
              help="Target model: folder, hub id or 'default'. Default: the verifier a speculators export names "
                   "(vLLM serves the export folder itself), else 'default'.")
@click.option("--drafter", default=None, type=click.Path(exists=True, file_okay=False),
              help="A `specframe export --format vllm` folder (or any speculators-format drafter). Without it the "
                   "target is served plainly.")
@click.option("--k", "k", type=int, default=None,
              help="Draft tokens per step. Default: the export's own (speculators), else 5.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--dtype", default="auto", show_default=True, help="vLLM dtype (float32 for exact CPU comparisons).")
@click.option("--max-model-len", type=click.IntRange(min=1), default=None, help="Longest prompt + output vLLM reserves for.")
@click.option("--kv-cache-gib", type=float, default=1.0, show_default=True,
              help="KV cache on CPU (VLLM_CPU_KVCACHE_SPACE; an explicit environment value wins).")
@click.option("--eager/--no-eager", default=True, show_default=True, help="vLLM --enforce-eager (no graph capture).")
@click.option("--print-command", is_flag=True, help="Print the vLLM command (JSON with --json) instead of running it.")
@click.option("--json", "as_json", is_flag=True, help="With --print-command: print argv and environment as JSON.")
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
def serve(
    target: str | None, drafter: str | None, k: int | None, host: str, port: int, dtype: str, max_model_len: int | None,
    kv_cache_gib: float, eager: bool, print_command: bool, as_json: bool, vllm_args: tuple[str, ...],
) -> None:
    """Serve a target (--target) with vLLM's OpenAI-compatible API, speculating with an exported drafter (--drafter).

    Arguments after the options go to vLLM unchanged, as options (e.g. `-- --max-num-seqs 4`).
    """
    from specframe.targets import target_source
    from specframe.errors import SpecframeError, UsageError
    from specframe.vllm import vllm_available
    from specframe.vllm.serving import serve_command

    if k is not None and k < 1:
        raise SpecframeError(f"--k must be positive, got {k}")
    if vllm_args and not vllm_args[0].startswith("-"):
        # vLLM's server takes a stray word beside --model and serves the target plainly: `specframe serve EXPORT`
        # would start a server without the drafter the user meant
        raise UsageError(f"serve takes no argument '{vllm_args[0]}': a drafter export goes after --drafter, a target "
                         "after --target, and what follows the options goes to vLLM as its options (e.g. -- "
                         "--max-num-seqs 4)")
    source = None
    if drafter is None or target is not None:
        source = target_source(target or "default")
    manifest = config = None
    if drafter is not None:
        from specframe.layouts.export import check_export, manifest_of, read_config

        config = read_config(Path(drafter))  # read once: the manifest, both checks and the command come from it
        manifest = manifest_of(config, drafter)
        if source is None and not manifest.speculators:
            source = target_source("default")
        if source is None:
            check_export(drafter, _local_config(_verifier(drafter, manifest.verifier)), manifest, config=config)
        else:
            check_export(drafter, _local_config(source), manifest, config=config)
    argv, env = serve_command(
        source, drafter, k, manifest=manifest, config=config, host=host, port=port, dtype=dtype,
        max_model_len=max_model_len, kv_cache_gib=kv_cache_gib, enforce_eager=eager, extra=vllm_args,
    )
    if print_command:
        if as_json:
            click.echo(json.dumps({"argv": argv, "env": env}, indent=1))
        else:
            click.echo(" ".join(f"{k_}={v}" for k_, v in env.items()) + " " + " ".join(_quote(a) for a in argv))
        return
    if not vllm_available():
        raise SpecframeError("vLLM is not installed; run `make setup VLLM=cpu` (CPU) or `VLLM=gpu`")
    merged: dict[str, Any] = {**env, **os.environ}  # the caller's environment wins
    os.execve(argv[0], argv, merged)


def _verifier(drafter: str, verifier: str | None) -> str:
    """The verifier a speculators export names, refused when missing or a local folder that is gone."""
    from specframe.errors import SpecframeError

    if not verifier:
        raise SpecframeError(f"{drafter} names no verifier (speculators_config.verifier.name_or_path); pass --target")
    if (os.path.isabs(verifier) or verifier.startswith((".", "~"))) and not Path(verifier).expanduser().is_dir():
        raise SpecframeError(
            f"{drafter} names the verifier {verifier}, which is not a folder here; pass --target or re-export with "
            "--verifier"
        )
    return verifier


def _local_config(source: str) -> Any:
    """The target's config when ``source`` is a local folder (a hub id is left for vLLM to resolve)."""
    if not (Path(source) / "config.json").is_file():
        return None
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(source)


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)
