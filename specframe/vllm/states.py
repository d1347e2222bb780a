"""The target's hidden states from vLLM's offline engine (``specframe prepare --engine vllm``).

vLLM's ``extract_hidden_states`` speculative method runs the target as it serves it (tensor / pipeline parallel,
continuous batching, its own kernels) and keeps, for every token it computes, the residual stream at the requested
layer ids; ``specframe.vllm.states_connector`` writes each finished request's states to a file. vLLM's ids are
specframe's: id k is the stream entering decoder layer k (0: the embeddings), and id L (the number of layers) is the
last layer's output *before* the final norm. specframe's cache stores the post-norm final state (what the head
reads), so the caller applies the target's own final norm to id L (``specframe.cache``).

Each prompt is one request of a single new token: the states of every prompt position come from the prefill, and
the one generated token is never used. A batch of prompts is one ``LLM.generate`` call, every prompt in flight.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import attrs

from specframe.errors import SpecframeError
from specframe.vllm.answer import AnswerOptions
from specframe.vllm.engine import (
    EngineOptions,
    configure_environment,
    cpu_binding,
    import_llm,
)

CONNECTOR = "SyncHiddenStatesConnector"
CONNECTOR_MODULE = "specframe.vllm.states_connector"
#: how long to wait for a state file after the engine has nothing left to run (a multi-process engine writes it in a
#: worker process, whose step the caller cannot drive)
WAIT_SECONDS = 600.0


def model_len(config: Any, max_length: int, flag: str) -> int:
    """vLLM's ``max_model_len`` for prompts of at most ``max_length`` tokens: one more, for the single token each
    request must generate; a ``SpecframeError`` naming ``flag`` when the target's positions do not reach it."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and max_length + 1 > limit:
        raise SpecframeError(f"--engine vllm: {flag} {max_length} leaves no room for the one token vLLM must generate "
                             f"per conversation within the target's {limit} positions; use {flag} {limit - 1} or "
                             "less")
    return max_length + 1


class VllmStates:
    """vLLM's offline engine on ``model`` (a model folder or hub id), returning the states at ``layer_ids`` of every
    position of each prompt. ``extract`` may be called many times; ``close`` removes the state files' folder."""

    name = "vllm"

    def __init__(self, model: str | os.PathLike, layer_ids: Sequence[int], options: AnswerOptions | None = None,
                 *, scratch: str | os.PathLike | None = None) -> None:
        options = options or AnswerOptions()
        if not layer_ids:
            raise SpecframeError("vLLM's hidden-state extraction needs at least one layer id")
        self.layer_ids = tuple(int(i) for i in layer_ids)
        if len(set(self.layer_ids)) != len(self.layer_ids):  # vLLM keeps one copy and then fails on the shape
            raise SpecframeError(f"vLLM's hidden-state extraction needs distinct layer ids, got {list(self.layer_ids)}")
        self.options = options
        self.model = str(model)
        #: positions extracted, and how many of them vLLM took from its prefix cache (computed by an earlier request)
        self.tokens = self.cached_tokens = 0
        from specframe.vllm import support

        support.prestart(self.model, extract_states=True)  # before the engine: what it is known not to run
        configure_environment(EngineOptions(kv_cache_gib=options.kv_cache_gib,
                                            threads_bind=cpu_binding(options.threads) if options.threads else None))
        LLM = import_llm()
        self.scratch = tempfile.mkdtemp(prefix="specframe-vllm-states-", dir=scratch)
        kwargs = options.llm_kwargs()
        self.llm = LLM(
            model=self.model,
            **kwargs,
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(self.layer_ids)}},
            },
            kv_transfer_config={
                "kv_connector": CONNECTOR,
                "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": self.scratch},
            },
        )

    def describe(self) -> dict:
        import vllm

        return {"engine": self.name, "vllm": vllm.__version__, **attrs.asdict(self.options)}

    def extract(self, prompts: Sequence[Sequence[int]]) -> list[Any]:
        """Each prompt's states, float tensors [T, len(layer_ids), H] in the engine's dtype, in the prompts' order."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not prompts:
            return []
        params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts], params,
                                 use_tqdm=False)
        if len(outs) != len(prompts):
            raise SpecframeError(f"vLLM answered {len(outs)} of {len(prompts)} prompts")
        paths = []
        for out in outs:
            path = (out.kv_transfer_params or {}).get("hidden_states_path")
            if not path:
                raise SpecframeError(f"vLLM returned no hidden-states file for request {out.request_id}; is the "
                                     "extract_hidden_states method active?")
            paths.append(path)
            self.tokens += len(out.prompt_token_ids or ())
            self.cached_tokens += int(out.num_cached_tokens or 0)
        self._drain()
        states = []
        for prompt, path in zip(prompts, paths):
            data = self._take(path)
            ids = [int(t) for t in data["token_ids"].tolist()]
            if ids != [int(t) for t in prompt]:
                raise SpecframeError(f"vLLM's states file {os.path.basename(path)} holds {len(ids)} tokens that are "
                                     f"not its prompt's {len(prompt)}")
            h = data["hidden_states"]
            if tuple(h.shape[:2]) != (len(ids), len(self.layer_ids)):
                raise SpecframeError(f"vLLM's states file has shape {tuple(h.shape)}, expected "
                                     f"[{len(ids)}, {len(self.layer_ids)}, hidden]")
            states.append(h)
        return states

    def _take(self, path: str) -> dict[str, Any]:
        """The states file ``path`` once written (read, then removed)."""
        from safetensors.torch import load_file

        self._wait(path)
        data = load_file(path)
        os.unlink(path)
        return data

    def _drain(self) -> None:
        """Step an in-process engine until no finished request still holds blocks: a request's states are written in
        the step after it finished (``specframe.vllm.states_connector``), and ``LLM.generate`` stops before it."""
        core = getattr(getattr(self.llm.llm_engine, "engine_core", None), "engine_core", None)
        if core is None:  # a background engine process steps itself while it holds requests
            return
        for _ in range(1000):
            if not core.scheduler.has_requests():
                return
            core.step_fn()
        raise SpecframeError("vLLM still holds finished requests after 1000 engine steps; their states were not written")

    def _wait(self, path: str) -> None:
        deadline = time.monotonic() + WAIT_SECONDS
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise SpecframeError(f"vLLM did not write the hidden states {path} within {WAIT_SECONDS:.0f} s")
            time.sleep(0.01)

    def close(self) -> None:
        """Remove the state files' folder and release the engine (as ``VllmEngine.close``: vLLM keeps process-wide
        parallel state, so a second engine in this process needs it torn down)."""
        import gc

        shutil.rmtree(self.scratch, ignore_errors=True)
        if getattr(self, "llm", None) is None:
            return
        from vllm.distributed.parallel_state import (
            destroy_distributed_environment,
            destroy_model_parallel,
        )

        self.llm = None
        gc.collect()
        destroy_model_parallel()
        destroy_distributed_environment()
