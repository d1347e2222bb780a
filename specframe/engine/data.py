"""Training sequences with target features, online (target in the loop) or from the shared feature cache.

Both sources give the same thing: ``len(source)`` sequences, ``source.tokens(i)`` (a ``TrainingExample`` without
features, for vocabulary and mask-token choices) and ``source.example(i)`` (with the features the drafter declared:
``aux_hidden`` [L, n_aux * H], ``final_hidden`` [L, H], float32). A conversation longer than ``--seq-len`` is
truncated to it.

Packing (the default; ``--no-pack`` gives one conversation per sequence): conversations are packed greedily in data
order, each joining the current sequence while it fits in ``--seq-len`` and starting the next one otherwise, so the
result is deterministic and keeps every token of every (truncated) conversation exactly once. ``doc`` numbers the
conversations of a sequence 0, 1, ...: the visibility rule never lets one attend to another, and the target computes
each conversation's features on that conversation alone (they are concatenated afterwards), so a packed sequence
trains exactly as its conversations would alone.

Online: conversations come from ``specframe.data`` (``--data``: a built-in name, a file or a hub id), are rendered
through the target's chat template with assistant-only loss masks, and the target computes features on first use
(``specframe.features.capture_features``). They are kept in memory for the sequences ``keep_features`` names (all
by default: the engine names every sequence when the run visits them more than once, else only the validation
ones), so each kept sequence costs one target forward per run.
Cache: ``specframe.cache.FeatureCache`` written by ``specframe prepare`` for the same target and aux layers; a packed
sequence concatenates its conversations' cached features. A cache prepared with ``--teacher-top-k`` also gives the
drafters that declare ``final_hidden`` its compact teacher (``teacher_ids`` / ``teacher_logp``).

Prefetch (``prefetch``): the engine names the next step's sequences while the current step trains, and one background
thread computes their features (the target's forward online, the cache read offline). On CUDA the thread works on its
own stream, so the target's kernels overlap the drafter's; features of at most the current and the next step are
held beyond the kept ones. ``example`` returns exactly what it would have computed itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from specframe import api
from specframe.errors import SpecframeError


def _usable(ids: torch.Tensor, mask: torch.Tensor) -> bool:
    # a shifted (EAGLE-style) drafter is charged with x_{i+2}: something from the third token on must be supervised
    return ids.numel() >= 3 and bool(mask[2:].any())


def pack(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Greedy packing in data order: the indices of ``lengths`` (each at most ``seq_len``) grouped into sequences,
    each item joining the current group while the group's total stays within ``seq_len``."""
    groups: list[list[int]] = []
    used = seq_len + 1
    for i, n in enumerate(lengths):
        if n > seq_len:
            raise ValueError(f"item {i} has {n} tokens, more than seq_len {seq_len}")
        if used + n > seq_len:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return groups


class _Sequences:
    """Conversations (already truncated and usable) grouped into training sequences, features concatenated."""

    def __init__(self, conversations: list[api.TrainingExample], seq_len: int, packed: bool,
                 features: Callable[[int], dict[str, torch.Tensor]]) -> None:
        self.conversations = conversations
        lengths = [int(c.input_ids.shape[0]) for c in conversations]
        self.groups = pack(lengths, seq_len) if packed else [[i] for i in range(len(conversations))]
        self._features = features
        self._tokens: list[api.TrainingExample] = []
        for group in self.groups:
            parts = [conversations[j] for j in group]
            doc = torch.repeat_interleave(torch.arange(len(parts)), torch.tensor([lengths[j] for j in group]))
            self._tokens.append(api.TrainingExample(
                torch.cat([p.input_ids for p in parts]), torch.cat([p.loss_mask for p in parts]), doc,
            ))
        self._keep: set[int] | None = None
        self._memo: dict[int, dict[str, torch.Tensor]] = {}
        self._pending: dict[int, Future] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._stream: Any = None  # the prefetch thread's CUDA stream, made on first use
        self._lock = threading.Lock()  # _memo and _pending are read by the caller and written by the prefetch thread
        # one feature computation at a time: the target's capture hooks and the cache's file reads are not re-entrant
        self._compute_lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._tokens)

    def tokens(self, i: int) -> api.TrainingExample:
        return self._tokens[i]

    def keep_features(self, ids: Iterable[int] | None) -> None:
        """Keep the features of these sequences in memory once computed (None: all of them)."""
        self._keep = None if ids is None else set(ids)
        self._memo = {i: f for i, f in self._memo.items() if self._keep is None or i in self._keep}

    def example(self, i: int) -> api.TrainingExample:
        ex = self._tokens[i]
        with self._lock:
            feats = self._memo.get(i)
            pending = self._pending.pop(i, None)
        if feats is None:
            feats = pending.result() if pending is not None else self._compute(i)
        if pending is not None:
            # made on the prefetch stream, also when kept (taken from _memo): the caller's stream uses them now
            _record_on_current_stream(feats)
        return api.TrainingExample(ex.input_ids, ex.loss_mask, ex.doc, feats)

    def prefetch(self, ids: Iterable[int]) -> None:
        """Start computing the features of ``ids`` in the background (those not kept or already under way); a later
        ``example(i)`` waits for and takes them. Errors surface there, in the caller's thread."""
        with self._lock:
            todo = [i for i in dict.fromkeys(ids) if i not in self._memo and i not in self._pending]
            if not todo:
                return
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="specframe-prefetch")
            for i in todo:
                self._pending[i] = self._pool.submit(self._compute_on_side_stream, i)

    def close(self) -> None:
        """Stop the prefetch thread (work under way finishes; unclaimed results are dropped)."""
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
            pool, self._pool = self._pool, None
        for f in pending:
            f.cancel()
        if pool is not None:
            pool.shutdown(wait=True)

    def _compute(self, i: int) -> dict[str, torch.Tensor]:
        feats = self._gather(i)
        self._remember(i, feats)
        return feats

    def _gather(self, i: int) -> dict[str, torch.Tensor]:
        with self._compute_lock:
            per = self._group_features(self.groups[i])
        return {key: torch.cat([f[key] for f in per]) for key in per[0]} if len(per) > 1 else per[0]

    def _group_features(self, group: list[int]) -> list[dict[str, torch.Tensor]]:
        """The features of one sequence's conversations, in order (a source that computes them together overrides
        this)."""
        return [self._features(j) for j in group]

    def _remember(self, i: int, feats: dict[str, torch.Tensor]) -> None:
        if self._keep is None or i in self._keep:
            with self._lock:
                self._memo[i] = feats

    def _compute_on_side_stream(self, i: int) -> dict[str, torch.Tensor]:
        device = self._device()
        if device is None or device.type != "cuda":
            return self._compute(i)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        with torch.cuda.stream(self._stream):
            feats = self._gather(i)
        self._stream.synchronize()  # in this thread: the features are complete before the caller can take them
        # kept only now: example() takes a kept entry without waiting for the thread, so publishing it while the
        # stream may still be writing it would hand the drafter half-written features
        self._remember(i, feats)
        return feats

    def _device(self) -> torch.device | None:
        return None


def _record_on_current_stream(feats: dict[str, torch.Tensor]) -> None:
    # tensors made on the prefetch stream and used on the caller's: the caching allocator must not hand their memory
    # back to the prefetch stream while the caller's kernels may still read it
    for t in feats.values():
        if t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))


class OnlineSource(_Sequences):
    """Conversations of ``spec`` with the target's features computed as they are needed: by its transformers
    forward, one conversation at a time, or, given ``engine`` (``specframe.feature_engines``: vLLM's hidden-state
    extraction), by that engine, a sequence's conversations in one call, after its states passed the parity gate on
    the first ``gate_sequences`` conversations."""

    def __init__(self, spec: str, target: Any, feature_spec: Any, seq_len: int, limit: int | None,
                 pack: bool = True, workers: int | None = None, *, engine: Any = None,
                 gate_sequences: int = 4) -> None:
        from specframe.data.chat import EncodeStats, encode_dataset
        from specframe.data.specs import load_data

        self.target = target
        self.feature_spec = feature_spec
        self.stats = EncodeStats()
        conversations: list[api.TrainingExample] = []
        for enc in encode_dataset(target.tokenizer, load_data(spec, limit=limit), stats=self.stats,
                                  workers=workers):
            ids = torch.tensor(enc.input_ids[:seq_len], dtype=torch.long)
            mask = torch.tensor(enc.loss_mask[:seq_len], dtype=torch.bool)
            if _usable(ids, mask):
                conversations.append(api.TrainingExample(ids, mask, torch.zeros_like(ids)))
        if not conversations:
            raise SpecframeError(f"data '{spec}' has no conversation with assistant tokens within --seq-len {seq_len}")
        super().__init__(conversations, seq_len, pack, self._conversation_features)
        self.engine = engine
        # one call into the engine at a time: with --prefetch the prefetch thread and the caller (a sequence not
        # prefetched) can both ask, and vLLM's offline engine is not safe to drive from two threads (a full-suite
        # run hung there)
        self._engine_lock = threading.Lock()
        self.gate = None
        if engine is not None:
            from specframe.feature_engines import check_engine, gate_engine

            check_engine(engine, feature_spec, target.num_layers, gate_sequences, "the drafter")
            self.gate = gate_engine(engine, target, [c.input_ids.tolist() for c in conversations[:gate_sequences]],
                                    feature_spec, "Nothing was trained.")

    def _group_features(self, group: list[int]) -> list[dict[str, torch.Tensor]]:
        if self.engine is None:
            return super()._group_features(group)
        from specframe.feature_engines import engine_features

        # one request per conversation of the sequence, all in flight at once
        with self._engine_lock:
            got = engine_features(self.engine, self.target, [self.conversations[j].input_ids.tolist() for j in group],
                                  group, self.feature_spec, names=[f"training conversation {j}" for j in group],
                                  after="training stops here (--resume continues from the last checkpoint)")
        device = self._device()
        return [{key: t.to(device=device, dtype=torch.float32)
                 for key, t in (("aux_hidden", got[j][0]), ("final_hidden", got[j][1])) if t is not None}
                for j in group]

    def close(self) -> None:
        super().close()
        if self.engine is not None and hasattr(self.engine, "close"):
            self.engine.close()
            self.engine = None

    def _device(self) -> torch.device | None:
        model = getattr(self.target, "model", self.target)
        param = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
        return None if param is None else param.device

    def _conversation_features(self, j: int) -> dict[str, torch.Tensor]:
        from specframe.features import capture_features

        # one conversation per forward: the target never attends across the documents of a packed sequence
        # on the target's (first) device: the features stay there for a drafter training on it
        ids = self.conversations[j].input_ids[None]
        f = capture_features(self.target, ids.to(self._device() or ids.device), self.feature_spec,
                             dtype=torch.float32)
        feats = {}
        if f.aux is not None:
            feats["aux_hidden"] = f.aux[0]
        if f.final is not None:
            feats["final_hidden"] = f.final[0]
        return feats


class CacheSource(_Sequences):
    def __init__(self, path: str, target: Any, feature_spec: Any, seq_len: int, limit: int | None,
                 pack: bool = True) -> None:
        from specframe.cache import FeatureCache

        self.cache = FeatureCache(path, target=target)
        want = tuple(getattr(feature_spec, "aux_layers", None) or ())
        have = self.cache.aux_layers
        missing = sorted({layer for layer in want if layer not in have})
        if missing:
            raise SpecframeError(
                f"feature cache {path} holds aux layers {list(have)} but the drafter needs {list(want)} (missing "
                f"{missing}); prepare a cache with those layers (--aux-layers) or set the drafter's aux_layer_ids"
            )
        # One cache can serve drafters that read different layers (a comparison prepares the union once): each
        # drafter gets its own layers, in its own order, picked out of the stored [T, len(have) * H] block.
        self._aux_pick = None if not want or want == have else [have.index(layer) for layer in want]
        self._aux_stored = len(have)
        self._teacher = bool(getattr(feature_spec, "final_hidden", False))
        self.seq_len = seq_len
        n = len(self.cache) if limit is None else min(limit, len(self.cache))
        self._index = []
        conversations: list[api.TrainingExample] = []
        for i in range(n):
            e = self.cache[i]
            ids, mask = e.tokens[:seq_len].long(), e.loss_mask[:seq_len].bool()
            if _usable(ids, mask):
                self._index.append(i)
                conversations.append(api.TrainingExample(ids, mask, torch.zeros_like(ids)))
        if not conversations:
            raise SpecframeError(f"feature cache {path} has no sequence with assistant tokens within --seq-len")
        super().__init__(conversations, seq_len, pack, self._conversation_features)
        self.keep_features(())  # the cache is the store: nothing is kept in memory

    def _conversation_features(self, j: int) -> dict[str, torch.Tensor]:
        e = self.cache[self._index[j]]
        feats = {}
        if e.aux_hidden is not None:
            aux = e.aux_hidden[: self.seq_len]
            if self._aux_pick is not None:
                aux = aux.unflatten(-1, (self._aux_stored, -1))[:, self._aux_pick].flatten(-2)
            feats["aux_hidden"] = aux.float()
        if e.final_hidden is not None:
            feats["final_hidden"] = e.final_hidden[: self.seq_len].float()
        if e.teacher_ids is not None and self._teacher:
            # the compact teacher (``prepare --teacher-top-k``): drafters that learn the target's distribution use
            # it in place of running the target's head over final_hidden (``api.eagle.kl_teacher``)
            feats[api.eagle.TEACHER_IDS] = e.teacher_ids[: self.seq_len]
            feats[api.eagle.TEACHER_LOGP] = e.teacher_logp[: self.seq_len].float()
        return feats
