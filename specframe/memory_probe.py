"""Measure the real peak memory of training steps, in a child process (docs/design.md section 7: measure, never assume).

``measure(ProbeSpec(...))`` starts a fresh Python process that builds a random-weight Llama target of the given
shape in memory, writes one long synthetic conversation, sets up the real ``specframe.engine`` ``Trainer`` (real
drafter plugin, mask builder, partitioner, COD, AdamW) and runs ``steps`` real ``train_step`` calls. The resident-set
high-water mark (VmHWM) is reset just before the first step, so ``peak_bytes`` is the process's peak while training
(resident baseline, target and drafter weights, optimizer state and every step temporary), not a start-up transient.
AdamW's moments are allocated before that (from zero gradients, so no weight moves): the measured step is a
steady-state one, as every step after the first is.

Features: ``online`` runs the target forward as the engine does; ``synthetic`` replaces it with random aux / final
hidden states of the right shape, memoised per sequence, which is what a feature cache hands the engine (the target
then only matters through its lm_head, which the loss needs). The estimator in ``specframe.memory`` is checked
against these figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs


@attrs.define
class ProbeSpec:
    seq_len: int
    depth: int = 8
    drafter: str = "peagle"
    mask_builder: str = "chunked"
    partitioner: str = "none"
    partitions: int = 1
    features: str = "synthetic"
    steps: int = 1
    threads: int = 1
    #: target shape (a Llama config)
    vocab: int = 49152
    hidden: int = 576
    heads: int = 9
    kv_heads: int = 3
    intermediate: int = 1536
    target_layers: int = 4
    drafter_options: dict[str, Any] = attrs.field(factory=dict)
    mask_builder_options: dict[str, Any] = attrs.field(factory=dict)
    #: the partitioner's options, as ``train --config``'s ``partitioner_options`` (the estimate costs the same)
    partitioner_options: dict[str, Any] = attrs.field(factory=dict)
    #: budget handed to the engine (None: no budget, no guard); the pre-check is skipped with ``skip_check``
    memory_budget: str | None = None
    skip_check: bool = False
    #: ``cuda``: the step runs on the GPU and ``peak_bytes`` is ``torch.cuda.max_memory_allocated`` during it
    device: str = "cpu"
    #: the run's --dtype (autocast of the step; the target's weights are loaded in it)
    dtype: str = "fp32"


def _reset_hwm() -> None:
    # writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class SyntheticSource:
    """The engine's sequence source with random aux / final hidden states of the target's shape in place of the
    target forward, memoised per sequence (a feature cache's sequence, already in memory)."""

    def __init__(self, source: Any, hidden: int, aux_layers: int, final: bool) -> None:
        self.source = source
        self.hidden, self.aux, self.final = hidden, aux_layers, final
        self._memo: dict[int, dict[str, Any]] = {}

    def __len__(self) -> int:
        return len(self.source)

    def tokens(self, index: int) -> Any:
        return self.source.tokens(index)

    def example(self, index: int) -> Any:
        import torch

        from specframe import api

        example = self.source.tokens(index)
        if index not in self._memo:
            n = example.input_ids.shape[0]
            g = torch.Generator().manual_seed(index + 1)
            feats = {}
            if self.aux:
                feats["aux_hidden"] = torch.randn(n, self.aux * self.hidden, generator=g)
            if self.final:
                feats["final_hidden"] = torch.randn(n, self.hidden, generator=g)
            self._memo[index] = feats
        return api.TrainingExample(example.input_ids, example.loss_mask, example.doc, self._memo[index])


def _target(spec: ProbeSpec, root: Path) -> Any:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from specframe.targets import Target, tiny_target

    tiny_target(root / "tok", vocab=320, layers=1, hidden=8, heads=2, kv_heads=1, intermediate=8)
    tokenizer = AutoTokenizer.from_pretrained(str(root / "tok"))
    cfg = LlamaConfig(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.target_layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        max_position_embeddings=max(2048, spec.seq_len + 16), tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    return Target(model=model, tokenizer=tokenizer, id="probe-random", weights_hash="none", config=cfg)


def _chat(path: Path, seq_len: int) -> Path:
    words = "the quick brown fox jumps over lazy dog add clips sold april may half many".split()
    answer = " ".join(words[(i * 7) % len(words)] for i in range(seq_len + 16))
    record = {"id": "0", "messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": answer}]}
    path.write_text(json.dumps(record) + "\n")
    return path


def child(spec: ProbeSpec) -> dict[str, Any]:
    import torch

    from specframe.engine import TrainConfig
    from specframe.engine import loop
    from specframe.memory import status_bytes

    torch.set_num_threads(spec.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        target = _target(spec, root)
        cfg = TrainConfig(
            drafter=spec.drafter, output=str(root / "out"), target="probe", data=str(_chat(root / "chat.jsonl",
            spec.seq_len)), seq_len=spec.seq_len, depth=spec.depth, mask_builder=spec.mask_builder,
            partitioner=spec.partitioner, partitions=spec.partitions, memory_budget=spec.memory_budget,
            max_steps=spec.steps, batch_size=1, max_examples=1, val_examples=0, drafter_options=spec.drafter_options,
            mask_builder_options=spec.mask_builder_options, partitioner_options=spec.partitioner_options,
            device=spec.device, dtype=spec.dtype,
        )
        if spec.skip_check:
            os.environ["SPECFRAME_SKIP_MEMORY_CHECK"] = "1"
        trainer = loop.Trainer(cfg, target=target, log=lambda *a: None)
        try:
            if spec.features == "synthetic":
                fs = trainer.drafter.feature_spec()
                aux = tuple(getattr(fs, "aux_layers", None) or ()) if fs is not None else ()
                final = bool(getattr(fs, "final_hidden", False)) if fs is not None else False
                trainer.source = SyntheticSource(trainer.source, spec.hidden, len(aux), final)
                # a feature cache never holds the target's trunk: keep only what the loss reads (lm_head)
                trainer.target.model.model = None
            # AdamW allocates its moments at the first step; create them now from zero gradients (no weight moves:
            # m = 0, and weight decay is 0) so the measured step is a steady-state one, moments included
            for p in trainer.params:
                p.grad = torch.zeros_like(p)
            trainer.optimizer.step()
            trainer.optimizer.zero_grad(set_to_none=True)
            import gc

            gc.collect()
            tokens = int(trainer.source.tokens(0).input_ids.shape[0])
            cuda = torch.device(spec.device).type == "cuda"
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            else:
                _reset_hwm()
                before = status_bytes("VmRSS")
            times = []
            for _ in range(spec.steps):
                t0 = time.perf_counter()
                entry = trainer.guarded_step()  # the engine's budget, as in training: ceiling during, check after
                if cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            peak = torch.cuda.max_memory_allocated() if cuda else status_bytes("VmHWM")
        finally:
            trainer.close()
    return {
        "seq_len": spec.seq_len, "tokens": tokens, "elements": entry["elements"], "rss_before_step_bytes": before,
        "peak_bytes": peak, "step_seconds": times, "torch_threads": spec.threads,
    }


def measure(spec: ProbeSpec, *, timeout: float | None = None, nice: int = 0) -> dict[str, Any]:
    """Run ``spec`` in a fresh child process and return its measurements (see ``child``)."""
    cmd = [sys.executable, "-m", "specframe.memory_probe", json.dumps(attrs.asdict(spec))]
    if nice:
        cmd = ["nice", "-n", str(nice), *cmd]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"memory probe failed ({done.returncode}): {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    print(json.dumps(child(ProbeSpec(**json.loads(sys.argv[1])))))
