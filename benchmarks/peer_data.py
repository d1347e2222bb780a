"""The peer benchmark's data for speculators' trainer (issue 54, item 1): the same conversations, in the same order and
with the same held-out split as specframe's run, in the layout speculators' file backend reads.

- Rows: the token ids and assistant-only loss mask of specframe's own feature cache (``specframe prepare``:
  ``specframe.data.chat``'s template and mask), the first ``n`` examples, each cut to ``seq_len`` as specframe's
  ``--no-pack`` run cuts it. ``speculators prepare-data`` is not run: it would only pass these pre-tokenised rows
  through and shuffle them; the dataset is written in the columns it writes (``input_ids``, ``loss_mask``,
  ``seq_len``, torch format) in the cache's order, and ``token_freq.pt`` by speculators' own counter over the
  training rows only.
- The split: specframe validates on the last ``n_val`` examples (``engine.loop``: ``range(n - n_val, n)``);
  speculators on the rows from ``int(n * train_data_ratio)`` on. ``train_data_ratio`` picks the same boundary.
- Hidden states: ``hidden_states/hs_{i}.safetensors`` holding ``hidden_states`` [T, n_aux + 1, H] fp32 and
  ``token_ids`` [T], from the target's transformers forward: the residual stream entering each aux layer (vLLM's
  convention, which specframe's ``aux_layer_ids`` and speculators' ``target_layer_ids`` share) and the last decoder
  layer's output before the final norm (speculators applies a frozen copy of the target's norm and lm_head to it).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import claims

#: what the written data depends on beyond its inputs: bump when the layout or the extraction changes
DATA_SCHEMA = 3


def rows_from_cache(cache: Path, n: int, seq_len: int) -> list[tuple[list[int], list[int]]]:
    """The conversations specframe trains on out of the first ``n`` examples of its feature cache, as (token ids,
    loss mask): each cut to ``seq_len``, and only those specframe keeps after the cut (``engine.data._usable``: a
    supervised token from the third on), in cache order. A conversation dropped by one trainer and read by the other
    would move every later row across the held-out boundary."""
    import torch

    from specframe.cache import FeatureCache
    from specframe.engine.data import _usable

    fc = FeatureCache(cache)
    if len(fc) < n:
        raise RuntimeError(f"the feature cache {cache} holds {len(fc)} examples, fewer than the {n} the peer run needs")
    rows = []
    for i in range(n):
        ex = fc[i]
        ids, mask = torch.as_tensor(ex.tokens[:seq_len]), torch.as_tensor(ex.loss_mask[:seq_len])
        if _usable(ids, mask.bool()):
            rows.append(([int(t) for t in ids], [int(m) for m in mask]))
    return rows


def specframe_split(n: int, n_val: int) -> tuple[range, range]:
    """specframe's training and validation example indices (``engine.loop``: the last ``n_val`` validate)."""
    n_val = min(n_val, n - 1)
    return range(0, n - n_val), range(n - n_val, n)


def train_data_ratio(n: int, n_val: int) -> float:
    """The ``--train-data-ratio`` whose boundary ``int(n * ratio)`` is specframe's: half a row past it, so float
    rounding never moves it."""
    return (n - n_val + 0.5) / n


def speculators_split(n: int, ratio: float) -> tuple[range, range]:
    """speculators' split (``train/data.py::ArrowDataset``: ``split_idx = int(len(data) * train_ratio)``, the rows
    after it validate)."""
    split_idx = int(n * ratio)
    return range(0, split_idx), range(split_idx, n)


def target_layer_ids(num_layers: int, stated: list[int] | None = None) -> list[int]:
    """The aux layers speculators reads: ``stated``, else its default ``[2, L//2, L-3]``
    (``models/utils.py::resolve_target_layer_ids``)."""
    return list(stated) if stated else [2, num_layers // 2, num_layers - 3]


def write_dataset(rows: list[tuple[list[int], list[int]]], n_train: int, out: Path) -> None:
    """The rows as speculators' prepared dataset (``save_to_disk``) and ``token_freq.pt`` over the training rows."""
    from datasets import Dataset
    from speculators.train.vocab_mapping import save_token_frequency_distribution

    columns = {"input_ids": [r[0] for r in rows], "loss_mask": [r[1] for r in rows],
               "seq_len": [len(r[0]) for r in rows]}
    ds = Dataset.from_dict(columns)
    ds.set_format(type="torch")
    ds.save_to_disk(str(out))
    save_token_frequency_distribution(ds.select(range(n_train)), out / "token_freq.pt")


class StateCapture:
    """Forward hooks on a transformers causal LM: the residual stream entering each of ``layer_ids`` (id L, the
    layer count, is the last layer's output) and the last layer's output before the final norm."""

    def __init__(self, model: Any, layer_ids: list[int]):
        self.layers = _decoder_layers(model)
        self.layer_ids = list(layer_ids)
        self.captured: dict[int, Any] = {}
        self.handles = []
        n = len(self.layers)
        for i in self.layer_ids:
            if not 0 <= i <= n:
                raise ValueError(f"aux layer {i} outside a {n}-layer target")
            if i < n:
                self.handles.append(self.layers[i].register_forward_pre_hook(self._entering(i), with_kwargs=True))
        self.handles.append(self.layers[-1].register_forward_hook(self._last))

    def _entering(self, i: int):
        def hook(_module, args, kwargs):
            self.captured[i] = (args[0] if args else kwargs["hidden_states"]).detach()

        return hook

    def _last(self, _module, _args, output):
        self.captured[len(self.layers)] = (output[0] if isinstance(output, tuple) else output).detach()

    def states(self) -> Any:
        """[T, n_aux + 1, H] of the last forward (batch 1): the aux layers in order, then the pre-norm last state."""
        import torch

        n = len(self.layers)
        return torch.stack([self.captured[i][0] for i in self.layer_ids] + [self.captured[n][0]], dim=1)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _decoder_layers(model: Any) -> Any:
    inner = getattr(model, "model", model)
    return inner.layers


def _final_norm(model: Any) -> Any:
    return getattr(model, "model", model).norm


def extract(target: str, rows: list[tuple[list[int], list[int]]], layer_ids: list[int], out: Path,
            threads: int) -> dict[str, Any]:
    """``out/hs_{i}.safetensors`` for every row (resumable: a finished file is kept; each is written beside and moved
    into place), and the first row's check: the stored last state through the target's norm equals the model's own
    final hidden state, and through its lm_head predicts the row's next tokens (the share where it does, on supervised
    positions: near 1 on self-distilled data)."""
    import time

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    capture = StateCapture(model, layer_ids)
    out.mkdir(parents=True, exist_ok=True)
    check: dict[str, Any] = {}
    tokens_done, seconds = 0, 0.0
    try:
        for i, (ids, mask) in enumerate(rows):
            path = out / f"hs_{i}.safetensors"
            if path.exists() and i > 0:
                continue
            start = time.perf_counter()
            with torch.no_grad():
                result = model(torch.tensor([ids]), output_hidden_states=True)
            states = capture.states()
            if i == 0:
                check = first_row_check(model, states, result, ids, mask)
            if not path.exists():
                tmp = path.with_name(path.name + ".tmp")
                save_file({"hidden_states": states.contiguous(), "token_ids": torch.tensor(ids, dtype=torch.long)},
                          str(tmp))
                os.replace(tmp, path)
                tokens_done += len(ids)
                seconds += time.perf_counter() - start
    finally:
        capture.close()
    return {"first_row": check, "tokens_extracted": tokens_done, "extract_seconds": seconds}


def first_row_check(model: Any, states: Any, result: Any, ids: list[int], mask: list[int]) -> dict[str, Any]:
    """The stored last state, through the target's final norm, is the model's last hidden state (exact: refused
    otherwise); through its lm_head, the share of supervised positions whose argmax is the next data token."""
    import torch

    with torch.no_grad():
        normed = _final_norm(model)(states[:, -1].unsqueeze(0))
        final = result.hidden_states[-1]
        if not torch.allclose(normed, final, atol=1e-5, rtol=1e-5):
            raise RuntimeError("the captured last state through the target's norm is not its final hidden state: the "
                               "hooks read the wrong place")
        predicted = model.lm_head(normed)[0].argmax(-1)
    supervised = [t for t in range(len(ids) - 1) if mask[t + 1]]
    agree = sum(int(predicted[t]) == ids[t + 1] for t in supervised)
    return {"supervised_positions": len(supervised), "argmax_is_next_token": agree / max(1, len(supervised)),
            "norm_of_last_state_is_final": True}


def claim_states(out: Path, key: str) -> None:
    """Keep ``out/hidden_states`` only if it was written for ``key`` (the same target, rows and layers), else remove
    it, and record ``key`` as the folder's. Finished ``hs_{i}`` files are reused across runs, and speculators' loader
    drops a file whose token ids do not match its row with a warning, not an error: it would train on fewer rows."""
    claims.claim(out / "hidden_states", out / "hidden_states.key", key)


def prepare(target: str, cache: Path, n: int, n_val: int, seq_len: int, layer_ids: list[int], out: Path,
            threads: int) -> dict[str, Any]:
    """speculators' data folder for the peer run (``--data-path``), built once and reused: the rows, the split, the
    token frequencies and the hidden states. Returns its record (``data.json``)."""
    record_path = out / "data.json"
    examples = n
    key = json.dumps([DATA_SCHEMA, str(target), str(cache), n, n_val, seq_len, layer_ids])
    if record_path.exists():
        record = json.loads(record_path.read_text())
        if record.get("key") == key:
            return record
    rows = rows_from_cache(cache, n, seq_len)
    n = len(rows)
    train, val = specframe_split(n, n_val)
    ratio = train_data_ratio(n, len(val))
    if speculators_split(n, ratio) != (train, val):
        raise RuntimeError(f"--train-data-ratio {ratio} does not give specframe's split of {n} rows")
    if out.exists() and not (out / "hidden_states").exists():
        shutil.rmtree(out)
    tmp = out.with_name(out.name + ".dataset-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write_dataset(rows, len(train), tmp)
    out.mkdir(parents=True, exist_ok=True)
    for name in os.listdir(tmp):  # the dataset's files beside the (kept) hidden states
        target_path = out / name
        if target_path.is_dir():
            shutil.rmtree(target_path)
        os.replace(tmp / name, target_path)
    shutil.rmtree(tmp)
    claim_states(out, json.dumps([DATA_SCHEMA, str(target), str(cache), examples, seq_len, layer_ids]))
    states = extract(target, rows, layer_ids, out / "hidden_states", threads)
    record = {"key": key, "cache_examples": examples, "rows": n, "train_rows": len(train), "val_rows": len(val),
              "train_data_ratio": ratio,
              "train_tokens": sum(len(rows[i][0]) for i in train),
              "train_row_lengths": [len(rows[i][0]) for i in train],
              "train_supervised": sum(sum(rows[i][1]) for i in train),
              "val_tokens": sum(len(rows[i][0]) for i in val), "target_layer_ids": layer_ids, "seq_len": seq_len,
              **states}
    record_path.write_text(json.dumps(record, indent=1))
    return record
