"""One feature cache: token ids, loss masks and the declared target hidden states, as sharded safetensors.

Layout of a cache folder::

    manifest.json              config (target id + weights hash, aux layers, dtype, data fingerprint, max length,
                               draft vocabulary) + the list of *finished* shards
    vocab.safetensors          the draft vocabulary (specframe.drafting.vocab.DraftVocab) built from the data's assistant tokens
    shard-00000.safetensors    examples [0, S): input_ids int32 [T], loss_mask uint8 [T], offsets int64 [n+1],
                               aux [T, len(aux_layers)*H], final [T, H] (float16 / bfloat16); with
                               --teacher-top-k K also teacher_ids int32 [T, K] and teacher_logp float32 [T, K] (the
                               target's K most likely next tokens over its whole vocabulary, best first, and their
                               log-probabilities: a compact teacher, so cached training never runs the target's
                               head); metadata: record ids

Writing is resumable: each shard is written under a temporary name and ``os.replace``d into place, then the manifest
(also replaced atomically) gains it; a rerun after a kill skips finished shards and recomputes the rest with the same
batches, so the result is byte-identical to an uninterrupted run. A folder made for another target, data or config is
refused with ``SpecframeError`` naming what differs. Nothing in the manifest depends on time or machine.

``FeatureCache`` reads a cache and ``OnlineFeatures`` computes the same ``Example`` stream from a live target, so
cached and online training share one code path (both are ``Iterable[Example]``).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs

from specframe.data.chat import Encoded, EncodeStats, encode_dataset
from specframe.errors import SpecframeError, read_json
from specframe.feature_engines import check_engine, engine_features, gate_engine
from specframe.features import FeatureSpec, capture_features
from specframe.drafting.vocab import DraftVocab, build_draft_vocab, count_tokens, vocab_metadata
from specframe.values import is_int

CACHE_FORMAT = 1
MANIFEST = "manifest.json"
VOCAB_FILE = "vocab.safetensors"
DTYPES = ("float16", "bfloat16", "float32")


@attrs.define(eq=False)
class Example:
    """One training sequence: ``tokens`` int64 [T], ``loss_mask`` bool [T], ``aux_hidden`` [T, A*H] or None,
    ``final_hidden`` [T, H] or None, plus its ``source`` and record ``id``."""

    tokens: Any
    loss_mask: Any
    aux_hidden: Any = None
    final_hidden: Any = None
    teacher_ids: Any = None
    teacher_logp: Any = None
    source: str = ""
    id: str = ""


@attrs.define
class PrepareReport:
    examples: int = 0
    tokens: int = 0
    shards: int = 0
    shards_reused: int = 0
    bytes: int = 0
    seconds: float = 0.0
    tokens_per_second: float = 0.0
    encode: EncodeStats = attrs.Factory(EncodeStats)
    draft_vocab_size: int = 0
    draft_vocab_coverage: float = 0.0
    teacher_top_k: int = 0
    #: mean over tokens of the target's probability mass its top-k holds (what the compact teacher keeps)
    teacher_mass: float = 0.0
    #: the parity gate's outcome (specframe.feature_gate.GateReport) when the states came from another engine
    gate: Any = None

    def as_dict(self) -> dict:
        d = attrs.asdict(self, filter=lambda a, v: a.name != "gate")
        if self.gate is not None:
            d["gate"] = self.gate.as_dict()
        d["encode"] = attrs.asdict(self.encode) | {"skipped": self.encode.skipped}
        d["encode"].pop("skipped_ids")
        d["skipped_ids"] = self.encode.skipped_ids[:20]
        return d


def _fingerprint(examples: Sequence[Encoded]) -> str:
    h = hashlib.sha256()
    for e in examples:
        h.update(f"{e.source}\x00{e.id}\x00".encode())
        h.update(",".join(map(str, e.input_ids)).encode())
        h.update(b"|")
        h.update(bytes(e.loss_mask))
    return h.hexdigest()


def _atomic_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _torch_dtype(name: str) -> Any:
    import torch

    if name not in DTYPES:
        raise SpecframeError(f"cache dtype must be one of {', '.join(DTYPES)}, not '{name}'")
    return getattr(torch, name)


def _top_k(final: Any, head: Any, k: int, rows: int = 256) -> tuple[Any, Any]:
    """(ids int32 [T, k], log-probabilities float32 [T, k]) of the target's k most likely next tokens at each of
    ``final``'s T positions (softmax over the target's logits ``head.logits(final)``, a ``TargetHead``, the whole
    vocabulary), in blocks of ``rows`` positions so the [T, V] logits are never held at once."""
    import torch

    ids, logp = [], []
    for start in range(0, final.shape[0], rows):
        z = head.logits(final[start : start + rows].to(device=head.device, dtype=head.dtype)).float()
        top = torch.log_softmax(z, dim=-1).topk(k, dim=-1)
        ids.append(top.indices.to(torch.int32).cpu())
        logp.append(top.values.cpu())
    if not ids:
        return torch.zeros(0, k, dtype=torch.int32), torch.zeros(0, k)
    return torch.cat(ids), torch.cat(logp)


def capture_spec(spec: FeatureSpec, teacher_top_k: int = 0) -> FeatureSpec:
    """What the target must hand out for a cache of ``spec``: the teacher needs the final state even when the cache
    does not store it."""
    return attrs.evolve(spec, final_hidden=True) if teacher_top_k else spec


def _batches(idx: list[int], lengths: list[int], max_batch_tokens: int) -> list[list[int]]:
    """Greedy length-sorted batches of at most ``max_batch_tokens`` padded tokens (deterministic)."""
    order = sorted(idx, key=lambda i: (lengths[i], i))
    out: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and (len(cur) + 1) * max(lengths[j] for j in cur + [i]) > max_batch_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def prepare_cache(
    target: Any,
    records: Iterable[dict],
    output: str | os.PathLike,
    *,
    spec: FeatureSpec | None = None,
    dtype: str = "float16",
    max_length: int = 2048,
    shard_size: int = 64,
    max_batch_tokens: int = 4096,
    draft_vocab: int | None = 16384,
    data_name: str = "",
    progress: Callable[[int, int], None] | None = None,
    workers: int | None = None,
    teacher_top_k: int = 0,
    engine: Any = None,
    gate_sequences: int = 4,
    _after_shard: Callable[[int], None] | None = None,
) -> PrepareReport:
    """Build (or resume) a feature cache for ``records`` (``source``, ``id``, ``messages``) in ``output``.

    ``spec`` defaults to EAGLE needs (default aux layers + final hidden). Conversations that are empty, over
    ``max_length`` tokens, or have no assistant token are skipped and counted in the report. ``workers``: processes
    that tokenise (``specframe.data.chat.encode_dataset``; None: one for a small set, more for a large one).
    ``teacher_top_k`` K > 0 also stores the target's top-K next tokens and their log-probabilities per token
    (``Example.teacher_ids`` / ``teacher_logp``), computed from the final hidden state in the target's own precision
    with its head as its forward applies it (``specframe.target_head``: bias, logit scale, soft-capping), as the
    drafters' dense teacher is.

    ``engine``: where the hidden states come from instead of the loaded target's transformers forward, an object
    with ``layer_ids`` (``engine_layer_ids``), ``extract(prompts) -> [[T, len(layer_ids), H], ...]`` and
    ``describe()`` (``specframe.vllm.states.VllmStates``); the final state is then the target's final norm of the
    last layer's output (``specframe.features.apply_final_norm``), the teacher's top-K the target's head of it. Such a
    cache must pass the parity gate (``specframe.feature_gate``) on its first ``gate_sequences`` conversations,
    recomputed with transformers, before anything is written; its manifest records the engine and the gate's figures.
    """
    import torch
    from safetensors.torch import save_file

    from specframe.target_head import target_head

    t0 = time.perf_counter()
    out = Path(output)
    tok = target.tokenizer
    n_layers = target.num_layers
    spec = spec or FeatureSpec.eagle(n_layers)
    spec.validate(n_layers)
    tdtype = _torch_dtype(dtype)
    if not is_int(teacher_top_k, 0):
        raise SpecframeError(f"--teacher-top-k must be 0 (none) or a positive number of tokens, got {teacher_top_k!r}")
    if teacher_top_k > target.vocab_size:
        raise SpecframeError(f"--teacher-top-k {teacher_top_k} exceeds the target's vocabulary of {target.vocab_size}")
    # the sizes a shard loop divides by, refused before the conversations are encoded or the folder made
    for flag, value, unit in (("--shard-size", shard_size, "conversations"), ("--max-batch-tokens", max_batch_tokens,
                                                                             "tokens")):
        if not is_int(value, 1):
            raise SpecframeError(f"{flag} must be a positive number of {unit}, got {value!r}")
    head = target_head(target) if teacher_top_k else None
    capture = capture_spec(spec, teacher_top_k)
    rep = PrepareReport(teacher_top_k=teacher_top_k)
    if engine is not None:
        check_engine(engine, capture, n_layers, gate_sequences, "the cache")
    examples = list(encode_dataset(tok, records, max_length=max_length, stats=rep.encode, workers=workers))
    if not examples:
        raise SpecframeError(f"no usable conversation in the data ({rep.encode.summary()})")
    vocab_rows = target.vocab_size
    config = {
        "format": CACHE_FORMAT,
        "target_id": target.id,
        "target_weights_hash": target.weights_hash,
        "hidden_size": target.hidden_size,
        "num_layers": n_layers,
        "aux_layers": list(spec.aux_layers or []),
        "final_hidden": bool(spec.final_hidden),
        "dtype": dtype,
        "max_length": max_length,
        "shard_size": shard_size,
        "max_batch_tokens": max_batch_tokens,
        "data": data_name,
        "data_fingerprint": _fingerprint(examples),
        "num_examples": len(examples),
        "num_tokens": sum(len(e.input_ids) for e in examples),
        "num_supervised_tokens": sum(sum(e.loss_mask) for e in examples),
        "draft_vocab_size": draft_vocab or 0,
    }
    if engine is not None:  # absent for transformers, so caches made before engines existed still match
        config["engine"] = engine.name
    if teacher_top_k:  # absent rather than 0, so caches made before the option still match their manifests
        config["teacher_top_k"] = teacher_top_k
        if not head.plain:  # likewise absent for a plain head; a cache whose teacher skipped these is not resumed
            config["teacher_head"] = head.describe()
    n_shards = (len(examples) + shard_size - 1) // shard_size

    def capture_batch(batch: list[int]) -> dict[int, tuple[Any, Any]]:
        """(aux [T, A*H] or None, final [T, H] or None) per conversation, in the target's compute precision."""
        if engine is not None:
            names = [f"conversation {examples[i].source}/{examples[i].id}" for i in batch]
            return engine_features(engine, target, [examples[i].input_ids for i in batch], batch, capture, names)
        width = max(lengths[i] for i in batch)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for r, i in enumerate(batch):  # right padding: causal attention keeps real positions unaffected
            ids[r, : lengths[i]] = torch.tensor(examples[i].input_ids)
            attn[r, : lengths[i]] = 1
        feats = capture_features(target, ids, capture, attention_mask=attn)
        return {i: (None if feats.aux is None else feats.aux[r, : lengths[i]],
                    None if feats.final is None else feats.final[r, : lengths[i]]) for r, i in enumerate(batch)}

    lengths = [len(e.input_ids) for e in examples]
    engine_record = None
    if engine is not None:
        gate = gate_engine(engine, target, [e.input_ids for e in examples[:gate_sequences]], capture,
                           "Nothing was written.")
        engine_record = engine.describe() | {"gate": gate.as_dict()}
        rep.gate = gate
    finished: list[dict] = []
    man_path = out / MANIFEST
    if man_path.exists():
        old = read_json(man_path, "the feature cache's manifest")
        had = old.get("config", {})
        # both ways: a key only the old cache has (an engine, a teacher) differs as much as a changed value
        diff = [k for k in [*config, *(k for k in had if k not in config)] if had.get(k) != config.get(k)]
        if diff:
            details = "; ".join(f"{k}: cache has {had.get(k)!r}, asked {config.get(k)!r}" for k in diff[:4])
            raise SpecframeError(
                f"{out} holds a feature cache made for another target/data/config ({details}); "
                "use another --output or delete it"
            )
        finished = [s for s in old.get("shards", []) if (out / s["file"]).exists() and (out / s["file"]).stat().st_size == s["bytes"]]
    elif out.exists() and any(p for p in out.iterdir() if not p.name.startswith(".")):
        raise SpecframeError(f"{out} exists and is not a specframe feature cache (no {MANIFEST}); refusing to write into it")
    # counted, and the draft vocabulary built (its size refused), before the cache folder is made
    masked = count_tokens(examples, vocab_rows, masked_only=True)
    all_counts = count_tokens(examples, vocab_rows, masked_only=False)
    dv = build_draft_vocab(masked, draft_vocab) if draft_vocab else None
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(".*.tmp-*"):
        stale.unlink(missing_ok=True)

    if dv is not None:
        vtmp = out / f".{VOCAB_FILE}.tmp-{os.getpid()}"
        save_file(
            {"ids": dv.ids, "d2t": dv.d2t, "t2d": dv.t2d, "counts": dv.counts, "all_counts": all_counts},
            str(vtmp),
            metadata=vocab_metadata(dv.size, vocab_rows, dv.coverage),
        )
        os.replace(vtmp, out / VOCAB_FILE)
        rep.draft_vocab_size, rep.draft_vocab_coverage = dv.size, dv.coverage

    def write_manifest(complete: bool) -> None:
        man = {"config": config, "shards": finished, "complete": complete, "num_shards": n_shards}
        if engine_record is not None:
            man["engine"] = engine_record
        _atomic_json(man_path, man)

    write_manifest(False)
    done_files = {s["file"] for s in finished}
    rep.shards_reused = len(done_files)
    computed_tokens = 0
    t_compute = 0.0
    for k in range(n_shards):
        name = f"shard-{k:05d}.safetensors"
        if progress:
            progress(k, n_shards)
        if name in done_files:
            continue
        lo, hi = k * shard_size, min((k + 1) * shard_size, len(examples))
        idx = list(range(lo, hi))
        aux_parts: dict[int, Any] = {}
        fin_parts: dict[int, Any] = {}
        top_parts: dict[int, tuple[Any, Any]] = {}
        tc = time.perf_counter()
        # an engine schedules a whole shard itself (continuous batching); transformers gets padded batches
        for batch in [idx] if engine is not None else _batches(idx, lengths, max_batch_tokens):
            for i, (aux, fin) in capture_batch(batch).items():
                if aux is not None:
                    aux_parts[i] = aux.to(tdtype)
                if spec.final_hidden:
                    fin_parts[i] = fin.to(tdtype)
                if teacher_top_k:
                    top_parts[i] = _top_k(fin, head, teacher_top_k)
        t_compute += time.perf_counter() - tc
        tensors = {
            "input_ids": torch.tensor([t for i in idx for t in examples[i].input_ids], dtype=torch.int32),
            "loss_mask": torch.tensor([m for i in idx for m in examples[i].loss_mask], dtype=torch.uint8),
            "offsets": torch.tensor([0] + [sum(lengths[lo : i + 1]) for i in idx], dtype=torch.int64),
        }
        if aux_parts:
            tensors["aux"] = torch.cat([aux_parts[i] for i in idx]).contiguous()
        if fin_parts:
            tensors["final"] = torch.cat([fin_parts[i] for i in idx]).contiguous()
        if top_parts:
            tensors["teacher_ids"] = torch.cat([top_parts[i][0] for i in idx]).contiguous()
            tensors["teacher_logp"] = torch.cat([top_parts[i][1] for i in idx]).contiguous()
        for key in ("aux", "final"):
            if key in tensors and not bool(torch.isfinite(tensors[key]).all()):
                raise SpecframeError(f"non-finite {key} hidden states in {dtype} (shard {k}); try --storage-dtype bfloat16")
        computed_tokens += int(tensors["input_ids"].numel())
        meta = {"records": json.dumps([[examples[i].source, examples[i].id] for i in idx])}
        tmp = out / f".{name}.tmp-{os.getpid()}"
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, out / name)
        entry = {"file": name, "examples": hi - lo, "tokens": int(tensors["input_ids"].numel()),
                 "bytes": (out / name).stat().st_size}
        if top_parts:
            entry["teacher_mass"] = float(tensors["teacher_logp"].double().exp().sum())
        finished.append(entry)
        finished.sort(key=lambda s: s["file"])
        write_manifest(False)
        if _after_shard:
            _after_shard(k)
    if progress:
        progress(n_shards, n_shards)
    write_manifest(True)
    rep.examples = len(examples)
    rep.tokens = config["num_tokens"]
    if teacher_top_k:
        rep.teacher_mass = sum(s.get("teacher_mass", 0.0) for s in finished) / max(1, rep.tokens)
    rep.shards = n_shards
    rep.bytes = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    rep.seconds = time.perf_counter() - t0
    rep.tokens_per_second = computed_tokens / t_compute if t_compute else 0.0
    return rep


class FeatureCache:
    """Read a finished feature cache: ``len(cache)``, ``cache[i]`` and iteration give ``Example``s in data order."""

    def __init__(self, path: str | os.PathLike, *, target: Any = None):
        self.path = Path(path)
        man = self.path / MANIFEST
        if not man.exists():
            raise SpecframeError(f"{self.path} is not a feature cache (no {MANIFEST}); build one with `specframe prepare`")
        m = read_json(man, "the feature cache's manifest")
        if not m.get("complete"):
            raise SpecframeError(
                f"feature cache {self.path} is incomplete ({len(m.get('shards', []))}/{m.get('num_shards')} shards); "
                "rerun the same `specframe prepare` command to finish it"
            )
        self.config: dict = m["config"]
        self.shards: list[dict] = m["shards"]
        #: where the hidden states came from and the parity gate they passed (None: the target's transformers forward)
        self.engine: dict | None = m.get("engine")
        self._starts = []
        n = 0
        for s in self.shards:
            self._starts.append(n)
            n += s["examples"]
        self._len = n
        self._loaded: tuple[int, dict, list[str]] | None = None
        if target is not None:
            self.check_target(target)

    def check_target(self, target: Any) -> None:
        """``SpecframeError`` unless the cache was made with this target's weights."""
        if self.config["target_weights_hash"] != target.weights_hash:
            raise SpecframeError(
                f"feature cache {self.path} was made for target {self.config['target_id']} "
                f"(weights {self.config['target_weights_hash'][:12]}), not {target.id} ({target.weights_hash[:12]})"
            )

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return tuple(self.config["aux_layers"])

    @property
    def vocab(self) -> DraftVocab | None:
        p = self.path / VOCAB_FILE
        return DraftVocab.load(p) if p.exists() else None

    def __len__(self) -> int:
        return self._len

    def _shard(self, k: int) -> tuple[dict, list[str]]:
        if self._loaded is None or self._loaded[0] != k:
            from safetensors import safe_open

            with safe_open(str(self.path / self.shards[k]["file"]), framework="pt") as f:
                tensors = {name: f.get_tensor(name) for name in f.keys()}
                records = json.loads((f.metadata() or {}).get("records", "[]"))
            self._loaded = (k, tensors, records)
        return self._loaded[1], self._loaded[2]

    def __getitem__(self, i: int) -> Example:
        import bisect

        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(i)
        k = bisect.bisect_right(self._starts, i) - 1
        t, recs = self._shard(k)
        j = i - self._starts[k]
        a, b = int(t["offsets"][j]), int(t["offsets"][j + 1])
        source, rid = recs[j] if j < len(recs) else ("", "")
        return Example(
            tokens=t["input_ids"][a:b].long(),
            loss_mask=t["loss_mask"][a:b].bool(),
            aux_hidden=t["aux"][a:b] if "aux" in t else None,
            final_hidden=t["final"][a:b] if "final" in t else None,
            teacher_ids=t["teacher_ids"][a:b] if "teacher_ids" in t else None,
            teacher_logp=t["teacher_logp"][a:b] if "teacher_logp" in t else None,
            source=source,
            id=rid,
        )

    def __iter__(self) -> Iterator[Example]:
        for i in range(self._len):
            yield self[i]


class OnlineFeatures:
    """The ``Example`` stream of ``FeatureCache``, computed on the fly from a live target (one forward per example).

    Features come out in ``dtype`` (default float32; pass the cache dtype to mimic a cache exactly)."""

    def __init__(
        self,
        target: Any,
        records: Iterable[dict],
        *,
        spec: FeatureSpec | None = None,
        max_length: int = 2048,
        dtype: str = "float32",
    ):
        self.target = target
        self.spec = spec or FeatureSpec.eagle(target.num_layers)
        self.stats = EncodeStats()
        self.examples = list(encode_dataset(target.tokenizer, records, max_length=max_length, stats=self.stats))
        self.dtype = _torch_dtype(dtype)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> Example:
        import torch

        e = self.examples[i]
        ids = torch.tensor([e.input_ids], dtype=torch.long)
        f = capture_features(self.target, ids, self.spec, dtype=self.dtype)
        return Example(
            tokens=ids[0],
            loss_mask=torch.tensor(e.loss_mask, dtype=torch.bool),
            aux_hidden=f.aux[0] if f.aux is not None else None,
            final_hidden=f.final[0] if f.final is not None else None,
            source=e.source,
            id=e.id,
        )

    def __iter__(self) -> Iterator[Example]:
        for i in range(len(self)):
            yield self[i]
