"""The scales the comparison suites run at: ``ci`` (tiny target, minutes), ``cpu`` (SmolLM2 on a laptop-class CPU,
about two hours) and ``gpu`` (a scale worth publishing, for a machine with one).

A preset fixes everything that must be equal across drafters for the comparison to be fair: the target, the
training conversations (one shared feature cache), the sequence length, depth, steps, batch size, learning rate and
seed (hence the same supervised data tokens), and one memory budget for every training run and for the memory suite.
Each drafter keeps its own published architecture (layer count); that is what is being compared.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Preset:
    name: str
    description: str
    #: ``tiny`` (a random-weight Llama built in the work folder) or any ``--target`` value (``default``: SmolLM2)
    target: str
    #: training conversations (``--data`` of ``specframe prepare``)
    data: str
    train_examples: int
    val_examples: int
    seq_len: int
    depth: int
    steps: int
    batch_size: int
    lr: float
    draft_vocab: int
    #: one budget for every training run (the engine's guard) and for the memory suite's search
    memory_budget: str
    drafters: dict[str, dict]
    mask_builder: str = "chunked"
    partitioner: str = "none"
    partitions: int = 1
    threads: int = 2
    device: str = "cpu"
    # memory suite: every drafter x builder x partitioner, searched up to ``memory_cap`` tokens
    memory_builders: tuple[str, ...] = ("dense", "precomputed", "chunked")
    memory_partitioners: tuple[str, ...] = ("none", "peagle")
    memory_segment_len: int = 512
    memory_cap: int = 4096
    memory_depth: int = 4
    # acceptance and speed suites
    datasets: tuple[str, ...] = ("mt-bench", "humaneval", "gsm8k")
    prompts: int = 2
    max_new_tokens: int = 64
    ks: tuple[int, ...] = (3, 5, 7)
    tree: tuple[int, int, int] = (5, 4, 16)  # depth, top-k per level, total nodes (EAGLE-2 dynamic tree)
    speed_k: int = 5
    repeats: int = 5
    vllm: bool = True
    #: the vLLM suite serves every drafter at each of these K (speed_k among them: the reference engine's K)
    vllm_ks: tuple[int, ...] = (2, 3, 5)
    #: every engine starts once and the repeats are interleaved, but each costs a full pass over the prompts
    vllm_repeats: int = 3

    def train_options(self, drafter: str) -> dict:
        """The drafter's options: its architecture from ``drafters``, plus the preset's shared vocabulary and depth."""
        opts = dict(self.drafters[drafter])
        if drafter != "pard":  # pard drafts over the full target vocabulary
            opts.setdefault("draft_vocab_size", self.draft_vocab)
        if drafter == "eagle3":
            opts.setdefault("ttt_steps", self.depth)
        else:
            opts.setdefault("k_train", self.depth)
        opts.setdefault("k_infer", min(self.speed_k, self.depth))
        return opts


# The published architectures: P-EAGLE 4 layers, EAGLE-3 1 layer, PARD a 2-layer causal LM, ParallelSpec 1 layer.
PUBLISHED = {"peagle": {"layers": 4}, "eagle3": {"layers": 1}, "pard": {"layers": 2}, "parallelspec": {"layers": 1}}

PRESETS = {
    "ci": Preset(
        name="ci", description="tiny random target, a few steps: keeps the suites from rotting (.ci/run)",
        target="tiny", data="gsm8k", train_examples=12, val_examples=2, seq_len=256, depth=4, steps=6, batch_size=2,
        lr=3e-3, draft_vocab=128, memory_budget="2GiB",
        drafters={"peagle": {"layers": 2}, "eagle3": {"layers": 1}, "pard": {"layers": 1}, "parallelspec": {"layers": 1}},
        memory_builders=("dense", "chunked"), memory_cap=512, memory_depth=4, memory_segment_len=128,
        datasets=("mt-bench", "humaneval", "gsm8k"), prompts=1, max_new_tokens=12, ks=(2, 4), tree=(3, 2, 6),
        speed_k=3, repeats=2, vllm=True, vllm_ks=(2, 3), vllm_repeats=2,
    ),
    "cpu": Preset(
        name="cpu", description="SmolLM2-135M-Instruct, the committed self-distilled set; one to two hours on 2 cores",
        target="default", data="default", train_examples=300, val_examples=16, seq_len=512, depth=7, steps=150,
        batch_size=2, lr=1e-3, draft_vocab=8192, memory_budget="3GiB", drafters=PUBLISHED,
        memory_cap=3072, memory_depth=4, prompts=2, max_new_tokens=64, repeats=5,
    ),
    "gpu": Preset(
        name="gpu", description="SmolLM2 target, about 30x the cpu preset's training tokens, 8 GiB budget, 64K memory search",
        target="default", data="default", train_examples=1000, val_examples=64, seq_len=2048, depth=8, steps=1000,
        batch_size=4, lr=5e-4, draft_vocab=32000, memory_budget="8GiB", drafters=PUBLISHED,
        memory_builders=("dense", "precomputed", "chunked", "flex"), memory_cap=65536, memory_depth=8,
        memory_segment_len=2048, prompts=20, max_new_tokens=256, repeats=5, device="cuda",
    ),
}
