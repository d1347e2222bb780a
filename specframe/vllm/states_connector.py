"""The KV connector through which vLLM hands specframe the target's hidden states, synchronously (loaded by vLLM from
``kv_connector_module_path``; importing this module imports vLLM).

vLLM's ``extract_hidden_states`` method stores each scheduled token's states at the requested layer ids in a
cache-only "attention" layer, and a KV connector copies a finished request's slots out of that cache. The stock
connector (``ExampleHiddenStatesConnector``) does the copy on a CUDA side stream into pinned memory and writes from a
thread pool, guarded by ``flock`` files: on a CPU build the CUDA events it waits on do not exist, the write thread
fails, and only the ``.lock`` files appear. This subclass keeps the stock scheduler side (which request, which
blocks, which file) and replaces the worker side's copy with a plain one, written at once under a temporary name
and renamed, so a file that exists is whole and no lock is needed. On a GPU it is also correct, only not
overlapped with the next forward.

One thing follows from vLLM's design either way: a request's save is handed to the worker in the *next* engine
step's metadata, so after ``LLM.generate`` returns the engine must be stepped until no request is left holding
blocks (``specframe.vllm.states.VllmStates`` does).
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
    extract_from_kv_cache,
)


class SyncHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` with a synchronous, atomic worker-side write (module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._written: set[str] = set()

    def wait_for_save(self) -> None:
        # the stock version takes an flock per new request; a renamed file needs none
        return

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size).reshape(1, -1) + blocks.reshape(-1, 1) * self._block_size).flatten()
        n = pending.token_ids.shape[0]
        states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), n).to("cpu").contiguous()
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        tmp = f"{pending.filename}.tmp-{os.getpid()}"
        save_file({"hidden_states": states, "token_ids": pending.token_ids.clone().contiguous()}, tmp)
        os.replace(tmp, pending.filename)
        self._written.add(pending.req_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, ExampleHiddenStatesConnectorMetadata):
                for pending in meta.pending_saves:
                    self._submit_async_write(pending)
        # a request's blocks are released once it has finished *and* its states are on disk (either may come first)
        self._accumulated_finished_req_ids |= set(finished_req_ids)
        done = self._written & self._accumulated_finished_req_ids
        self._written -= done
        self._accumulated_finished_req_ids -= done
        if not self._is_tp_rank_zero:  # only rank 0 writes, and the connector says one notification per request
            self._accumulated_finished_req_ids.clear()
        return done or None, None
