"""Self-distillation and feature capture in one pass (``specframe regenerate --engine vllm --capture CACHE``).

vLLM answers each batch of prompts as ``regenerate --engine vllm`` does, with its ``extract_hidden_states`` method
and prefix caching on (in small blocks, ``CAPTURE_BLOCK``). Every position it computed, prompt and answer, then holds
its states in vLLM's cache, so asking at once for the whole conversation's states (the prompt, the answer and the
chat template's closing tokens, encoded exactly as ``specframe prepare`` encodes the conversation) runs the target
only over the tail that no full block of the answering request covers. Each conversation's states are staged in the
cache folder (``.captured/``, one file per conversation, keyed by its token ids) *before* its batch of answers is
appended, so every answer a resumed run finds has its states. When every batch is done, the cache is written from
the staged states by ``specframe.cache.prepare_cache`` itself: the same format, draft vocabulary and teacher as
``prepare``, and the same parity gate (its first ``--gate-sequences`` conversations recomputed with transformers).
The staging folder is removed once the cache is complete.

Why not the states vLLM saves while answering (``kv_transfer_params.include_output_tokens``): they stop one token
short (the last sampled token is never a forward's input, so the closing tokens have none) and follow vLLM's token
ids, where the cache follows the chat template's encoding of the decoded answer; either would make the cache differ
from the one ``prepare`` writes for the same conversations.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from specframe.errors import SpecframeError
from specframe.vllm.answer import AnswerOptions, generate_answers
from specframe.vllm.states import VllmStates

#: the staging folder inside the cache folder (a dot name: ``prepare_cache`` writes beside it)
STAGING = ".captured"
#: tokens per KV block while capturing: vLLM reuses a prefix in whole blocks only, so the tail it computes again is
#: under one block (the CPU's default, 128, would recompute a third of a 350-token conversation)
CAPTURE_BLOCK = 32
#: room beyond prompt + answer for the chat template's closing tokens (and a decoded answer that re-encodes a few
#: tokens longer than vLLM's ids)
CLOSING_TOKENS = 16


def staging_folder(cache: str | os.PathLike) -> Path:
    return Path(cache) / STAGING


class StagedStates:
    """Conversations' states staged in ``folder``, found by their token ids: an engine for ``prepare_cache`` (``name``,
    ``layer_ids``, ``extract``, ``describe``). A conversation with no staged states is handed to ``fallback`` (the
    live capture engine), else refused by name."""

    def __init__(self, folder: str | os.PathLike, layer_ids: Sequence[int], *, fallback: Any = None) -> None:
        self.folder = Path(folder)
        self.layer_ids = tuple(int(i) for i in layer_ids)
        self.fallback = fallback
        self.name = "vllm"

    def _path(self, ids: Sequence[int]) -> Path:
        digest = hashlib.sha256(json.dumps([int(t) for t in ids]).encode()).hexdigest()[:32]
        return self.folder / f"{digest}.safetensors"

    def has(self, ids: Sequence[int]) -> bool:
        return self._path(ids).exists()

    def start(self, record: dict) -> None:
        """Record which engine stages the states (the cache's manifest names it); a folder staged by another engine
        configuration is refused."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / "engine.json"
        if path.exists():
            old = json.loads(path.read_text())
            if old != record:
                differ = sorted(k for k in {*old, *record} if old.get(k) != record.get(k))
                raise SpecframeError(f"{self.folder} holds states captured with another engine setting ({', '.join(differ)}); "
                                     "rerun with the same options, or delete the folder to capture them again")
            return
        tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(record, sort_keys=True))
        os.replace(tmp, path)

    def put(self, ids: Sequence[int], states: Any) -> None:
        import torch
        from safetensors.torch import save_file

        path = self._path(ids)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        save_file({"token_ids": torch.tensor([int(t) for t in ids], dtype=torch.int64),
                   "hidden_states": states.contiguous()}, str(tmp))
        os.replace(tmp, path)

    def log(self, conversations: int, tokens: int, cached_tokens: int) -> None:
        with open(self.folder / "batches.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps({"conversations": conversations, "tokens": tokens, "cached_tokens": cached_tokens}) + "\n")

    def extract(self, prompts: Sequence[Sequence[int]]) -> list[Any]:
        from safetensors.torch import load_file

        found: dict[int, Any] = {}
        missing = []
        for k, ids in enumerate(prompts):
            path = self._path(ids)
            if not path.exists():
                missing.append(k)
                continue
            data = load_file(str(path))
            if data["token_ids"].tolist() != [int(t) for t in ids]:
                raise SpecframeError(f"{path} holds the states of another conversation (a hash collision or a damaged "
                                     "file); delete it and rerun")
            found[k] = data["hidden_states"]
        if missing:
            if self.fallback is None:
                raise SpecframeError(f"{len(missing)} of {len(prompts)} conversations have no captured states in "
                                     f"{self.folder} (answered without --capture); rerun without --finalize-only so "
                                     "the engine computes them")
            for k, states in zip(missing, self.fallback.extract([prompts[k] for k in missing]), strict=True):
                found[k] = states
        return [found[k] for k in range(len(prompts))]

    def describe(self) -> dict:
        path = self.folder / "engine.json"
        record = json.loads(path.read_text()) if path.exists() else {"engine": self.name}
        batches = [json.loads(x) for x in (self.folder / "batches.jsonl").read_text().splitlines() if x.strip()] \
            if (self.folder / "batches.jsonl").exists() else []
        tokens = sum(b["tokens"] for b in batches)
        cached = sum(b["cached_tokens"] for b in batches)
        # how much of the states came from the answering pass: the one-pass claim, measured
        return record | {"capture": {"conversations": sum(b["conversations"] for b in batches), "extracted_tokens": tokens,
                                     "prefix_cached_tokens": cached,
                                     "prefix_cached_share": cached / tokens if tokens else None}}

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


class VllmCapture(VllmStates):
    """vLLM answering prompts and staging each answered conversation's states (module docstring). ``answer`` is
    ``regenerate``'s answerer; ``capture`` its per-batch hook, called before the batch is appended."""

    def __init__(self, model: str | os.PathLike, layer_ids: Sequence[int], options: AnswerOptions, *,
                 tokenizer: Any, max_length: int, staging: StagedStates) -> None:
        options = attrs.evolve(options, prefix_caching=True, block_size=options.block_size or CAPTURE_BLOCK)
        super().__init__(model, layer_ids, options)
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.staging = staging
        staging.start(self.describe())

    def describe(self) -> dict:
        return super().describe() | {"capture": "regenerate"}

    def answer(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int]) -> list[tuple[list[int], bool]]:
        answered = generate_answers(self.llm, prompts, max_new_tokens, stop_ids)
        self._drain()
        for *_, out in answered:  # the connector saved each prompt's states too: the conversation's are asked next
            path = (out.kv_transfer_params or {}).get("hidden_states_path")
            if path:
                self._wait(path)
                os.unlink(path)
        return [(tokens, stopped) for tokens, stopped, _ in answered]

    def capture(self, records: list[dict]) -> None:
        """``regenerate``'s per-batch hook: stage each answered conversation's states (``stage_conversations``)."""
        stage_conversations(records, self.tokenizer, self.max_length, self.staging, self)


def stage_conversations(records: list[dict], tokenizer: Any, max_length: int, staging: StagedStates, engine: Any) -> int:
    """Stage the states of each conversation (``source``, ``id``, ``messages`` ending with the answer), encoded as
    ``prepare`` encodes it, from ``engine.extract``; a conversation ``prepare`` would skip (over ``max_length``, no
    assistant token) is skipped here too, and one already staged is not asked again. Returns how many were staged.
    ``engine.tokens`` / ``cached_tokens``, when it counts them, give the share taken from the prefix cache."""
    from specframe.data.chat import encode_dataset

    todo = [e for e in encode_dataset(tokenizer, records, max_length=max_length) if not staging.has(e.input_ids)]
    tokens, cached = getattr(engine, "tokens", 0), getattr(engine, "cached_tokens", 0)
    for e, states in zip(todo, engine.extract([e.input_ids for e in todo]), strict=True):
        staging.put(e.input_ids, states)
    staging.log(len(todo), getattr(engine, "tokens", 0) - tokens, getattr(engine, "cached_tokens", 0) - cached)
    return len(todo)


def write_captured_cache(target: Any, prompts: list[dict], answers: list[dict], cache: str | os.PathLike,
                         staged: StagedStates, spec: Any, *, data_name: str, max_length: int, **prepare: Any) -> dict:
    """The feature cache of every answer (``answers``: regenerate's records; ``prompts``: the records they answer),
    written by ``prepare_cache`` from the states staged while answering, in the order ``specframe prepare`` reads a
    set of answers (``specframe.data.default.load_default``); the staged states are removed once it is complete.
    ``prepare``: ``prepare_cache``'s other options (dtype, draft_vocab, teacher_top_k, gate_sequences)."""
    from specframe.cache import MANIFEST, prepare_cache
    from specframe.data.default import interleave_sources
    from specframe.data.regenerate import conversation, prompt_messages
    from specframe.errors import read_json

    manifest = Path(cache) / MANIFEST
    if not staged.folder.exists() and manifest.exists() and read_json(manifest, "the feature cache's manifest").get("complete"):
        return {"cache": str(cache), "reused": True, "line": f"cache {cache}: already complete (nothing new captured)"}
    asked = {(str(r["source"]), str(r["id"])): prompt_messages(list(r["messages"])) for r in prompts}
    missing = [f"{r['source']}/{r['id']}" for r in answers if (r["source"], r["id"]) not in asked]
    if missing:
        raise SpecframeError(f"{len(missing)} answers are to prompts that are not in --data (first: {missing[0]}); the "
                             "cache needs each answer's prompt: pass the --data they were answered from")
    conversations = [conversation(asked[(r["source"], r["id"])], r) for r in interleave_sources(answers)]
    rep = prepare_cache(target, conversations, cache, spec=spec, max_length=max_length, data_name=data_name,
                        engine=staged, **prepare)
    described = staged.describe()["capture"]
    staged.remove()
    share = described["prefix_cached_share"]
    line = (f"cache {cache}: {rep.examples} conversations, {rep.tokens} tokens, {rep.shards} shards, "
            f"{rep.bytes / 2**20:.1f} MiB; features captured while answering"
            + (f" ({share:.1%} of their positions from the answering pass)" if share is not None else "")
            + f"; {rep.gate.summary()}")
    return {"cache": str(cache), "reused": False, **rep.as_dict(), **described, "line": line}
