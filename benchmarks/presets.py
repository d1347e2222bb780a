"""The scales the comparison suites run at: ``ci`` (tiny target, minutes), ``cpu`` (SmolLM2 on a laptop-class CPU,
about 2.5 hours), ``cpu-large`` (the same target trained on at least 1M tokens of the large self-distilled set per drafter,
each drafter one resumable job: about 2.5 hours per drafter) and ``gpu`` (a scale worth publishing, for a machine with
one).

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
    #: options for drafters of installed plugin packages, used only when the package is installed (others run at
    #: their own defaults)
    plugin_drafters: dict[str, dict] = attrs.field(factory=dict)
    #: validate every N steps (0: only at the end); the learning curves' points, on one token axis for all drafters
    eval_every: int = 0
    #: pack short conversations into seq_len sequences (False: one conversation per sequence, truncated)
    pack: bool = False
    #: None: the engine's own choice by size (dense / SDPA where the mask fits, the device's default builder where
    #: it must), as `specframe train` without --mask-builder
    mask_builder: str | None = "chunked"
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
    #: one self-contained job per drafter (benchmarks/test_jobs.py): train, whole-set acceptance in vLLM, speed in
    #: vLLM, its results in ``<results>/<drafter>/``; the suite-by-suite files (test_training, test_acceptance,
    #: test_vllm) are skipped, the memory suite still runs
    per_drafter_jobs: bool = False
    #: results committed under benchmarks/results/<name> and a work folder outside the checkout
    #: ($SPECFRAME_HOME/bench/<name>, kept across fresh checkouts); False (the ci presets): both under runs/bench/
    committed: bool = True
    #: per-drafter jobs: prompts per set for the whole-set acceptance (None: the whole set) and its answer cap
    acceptance_prompts: int | None = None
    acceptance_max_new_tokens: int = 256
    #: requests in flight in the whole-set acceptance runs, and the KV cache (GiB) that holds them
    acceptance_batch: int = 64
    acceptance_kv_gib: int = 4
    #: per-drafter jobs: bump a drafter's revision when a change alters its training or decoding, so its finished job
    #: (whose results say the commit they were measured at) runs again
    job_revisions: dict[str, int] = attrs.field(factory=dict)
    #: per-drafter jobs: MT-Bench questions (two turns each) timed at batch 1, taken in turn from each of its eight
    #: categories (``bench.spread_over_categories``), and the answer cap there
    speed_prompts: int = 10
    speed_max_new_tokens: int = 128
    #: per-drafter jobs: speed is measured at each of these numbers of requests at once (1: batch 1; 4: the smallest
    #: case a server sees)
    speed_concurrency: tuple[int, ...] = (1, 4)
    #: the EAGLE-2 tree on the reference engine, for drafters that build trees: MT-Bench questions (a subset)
    tree_prompts: int = 5
    #: per-drafter jobs: the fewest training tokens each drafter must have seen. The steps give steps x batch x
    #: seq_len slots, which packing fills only in part (whole conversations, never split), so this is checked on the
    #: tokens the run reports, before anything is measured (harness.too_few_tokens)
    min_train_tokens: int = 0
    #: per-drafter jobs: training steps whose drafter is kept whole (``train --keep-drafter-at``), beside the final
    #: one: the points of the served learning curve (whole-set acceptance in vLLM at each, issue 57)
    keep_drafter_at: tuple[int, ...] = ()
    #: the sets the served learning curve is measured on at each kept step
    curve_datasets: tuple[str, ...] = ("mt-bench", "gsm8k")
    #: per-drafter jobs, for a drafter the installed vLLM serves at no K (DSpark on vLLM's CPU build, which has no V2
    #: model runner): the verifiers its whole block is also verified through on the reference engine, beside greedy
    #: (``--also-verifier`` names, options inline). Only a drafter's own entry is part of its job key
    reference_verifiers: dict[str, tuple[str, ...]] = attrs.field(factory=dict)

    def train_options(self, drafter: str, depth: int | None = None) -> dict:
        """The drafter's options: its architecture from ``drafters``, plus the preset's shared draft vocabulary,
        training depth and inference K, set the way the drafter declares (``Drafter.comparison_options``, API 6: each
        names them its own way, EAGLE-3's depth is ``ttt_steps``, DFlash's ``block_size - 1``, and PARD and DFlash
        have no draft vocabulary); an option ``drafters`` states wins. ``depth``: the training depth when not the
        preset's (the memory suite's ``memory_depth``). The inference K is the reference engine's ``speed_k`` (at
        most the depth); vLLM serves DFlash only at ``block_size - 1`` (the suites skip its other K with the reason,
        test_jobs / test_vllm)."""
        from specframe import plugins

        depth = self.depth if depth is None else depth
        equal = plugins.get("drafter", drafter).comparison_options(depth, self.draft_vocab, min(self.speed_k, depth))
        opts = dict(self.drafters[drafter])
        for key, value in equal.items():  # after the stated ones, in the order they always had (job keys hash it)
            opts.setdefault(key, value)
        return opts

    def with_installed(self) -> Preset:
        """This preset with every drafter of an installed third-party package added at its own defaults (its
        published architecture): `pip install specframe-dflash` puts DFlash in every table of the next run."""
        extra = {name: dict(self.plugin_drafters.get(name, {})) for name in installed_drafters()
                 if name not in self.drafters}
        return attrs.evolve(self, drafters={**self.drafters, **extra}) if extra else self


def installed_drafters() -> list[str]:
    """Drafters registered by plugins outside specframe's own distribution (entry points in the ``specframe``
    group). Built-in drafters that a preset leaves out (``ngram``, a baseline with no weights) stay out."""
    from specframe import plugins

    registry = plugins.load()
    builtin = {info.name for info in registry.plugins if info.builtin}
    return [name for name in registry.names("drafter") if registry.plugin_of("drafter", name) not in builtin]


def resolve(name: str) -> Preset:
    """The preset the suites run: ``PRESETS[name]`` plus the installed third-party drafters."""
    return PRESETS[name].with_installed()


def exportable(drafter: str) -> bool:
    """Whether the drafter implements ``Drafter.export_vllm`` (the vLLM suite serves only those)."""
    from specframe import api, plugins

    return plugins.get("drafter", drafter).export_vllm is not api.Drafter.export_vllm


# The published architectures: P-EAGLE 4 layers, EAGLE-3 1 layer, PARD a 2-layer causal LM, ParallelSpec 1 layer.
PUBLISHED = {"peagle": {"layers": 4}, "eagle3": {"layers": 1}, "pard": {"layers": 2}, "parallelspec": {"layers": 1}}
#: the per-drafter job revisions of the presets that run one job per drafter (``ci-jobs``, ``cpu-large``): a bump
#: reruns that drafter's finished job, since what it trains or measures changed. dflash 1: drafts from its full
#: block on the reference engine, and vLLM serves it at block_size - 1 only (GPU-path review item 3); 2: starts as
#: the references' post_init (N(0, 0.02)) and trains only their elements (anchor token and first target supervised,
#: up to the first unsupervised slot; issue 54); 3 (and dspark 1): the loss is divided by the summed weights of the
#: trained elements, the references' sum(w * CE) / sum(w), not by the charged count (issue 54, D5); peagle, eagle3,
#: parallelspec 1: the family's defaults aligned with the references after P-EAGLE's ablations (mask_hidden N(0, 1),
#: the input token's loss-mask bit; deviations rows 1 and 4)
JOB_REVISIONS = {"dflash": 3, "dspark": 1, "peagle": 1, "eagle3": 1, "parallelspec": 1}

PRESETS = {
    "ci": Preset(
        name="ci", description="tiny random target, a few steps: keeps the suites from rotting (.ci/run)",
        target="tiny", data="gsm8k", train_examples=12, val_examples=2, seq_len=256, depth=4, steps=6, batch_size=2,
        lr=3e-3, draft_vocab=128, memory_budget="2GiB",
        drafters={"peagle": {"layers": 2}, "eagle3": {"layers": 1}, "pard": {"layers": 1}, "parallelspec": {"layers": 1}},
        # a 4-layer target is too shallow for DFlash's default layer spacing (it would read layer 2 five times);
        # DSpark spaces its layers the same way (api.block.default_aux_layers)
        plugin_drafters={"dflash": {"layers": 2, "aux_layer_ids": [1, 3]},
                         "dspark": {"layers": 2, "aux_layer_ids": [1, 3], "markov_rank": 16}},
        memory_builders=("dense", "chunked"), memory_cap=512, memory_depth=4, memory_segment_len=128,
        datasets=("mt-bench", "humaneval", "gsm8k"), prompts=1, max_new_tokens=12, ks=(2, 4), tree=(3, 2, 6),
        speed_k=3, repeats=2, vllm=True, vllm_ks=(2, 3), vllm_repeats=2, committed=False,
    ),
    # the per-drafter job path at ci scale (tests/e2e/test_bench_jobs.py and .ci/run's bench run keep it working)
    "ci-jobs": Preset(
        name="ci-jobs", description="the ci preset run as one job per drafter (train, whole-set acceptance and speed "
        "in vLLM)",
        target="tiny", data="gsm8k", train_examples=12, val_examples=2, seq_len=256, depth=4, steps=6, batch_size=2,
        lr=3e-3, draft_vocab=128, memory_budget="2GiB",
        drafters={"peagle": {"layers": 2}, "eagle3": {"layers": 1}},
        plugin_drafters={"dflash": {"layers": 2, "aux_layer_ids": [1, 3]},
                         "dspark": {"layers": 2, "aux_layer_ids": [1, 3], "markov_rank": 16}},
        memory_builders=("dense",), memory_partitioners=("none",), memory_cap=256, memory_depth=4,
        memory_segment_len=128, datasets=("mt-bench", "gsm8k"), prompts=1, max_new_tokens=12, ks=(2,), tree=(3, 2, 6),
        speed_k=2, repeats=2, vllm=True, vllm_ks=(2, 3), vllm_repeats=2, eval_every=3, per_drafter_jobs=True,
        acceptance_prompts=3, acceptance_max_new_tokens=16, acceptance_batch=4, acceptance_kv_gib=1, speed_prompts=2,
        speed_max_new_tokens=12, tree_prompts=1, committed=False, speed_concurrency=(1, 2), keep_drafter_at=(3,),
        job_revisions=JOB_REVISIONS,
        # DSpark's block through its confidence schedule as well as whole, where vLLM cannot serve it (issue 57)
        reference_verifiers={"dspark": ("scheduled",)},
    ),
    "cpu": Preset(
        name="cpu", description="SmolLM2-135M-Instruct, the committed self-distilled set; about 2.5 hours on 2 cores",
        target="default", data="default", train_examples=300, val_examples=16, seq_len=512, depth=7, steps=150,
        batch_size=2, lr=1e-3, draft_vocab=8192, memory_budget="3GiB", drafters=PUBLISHED,
        memory_cap=3072, memory_depth=4, prompts=2, max_new_tokens=64, repeats=5, eval_every=30, mask_builder=None,
    ),
    # The budget that answers (issue 29): the large self-distilled set (the target's own greedy answers, so the
    # drafters learn what the target says), 4,500 distinct conversations (about 1.3M tokens) packed into 512-token
    # sequences and read once. Packing whole conversations fills a sequence with 354 tokens on average (measured:
    # 500 steps gave P-EAGLE 708,319 tokens, not the 1,024,000 slots), so 720 steps x 4 sequences (2,880 of the
    # 3,457 packed training sequences: still one pass) give about 1.02M tokens, and min_train_tokens holds every job
    # to 1M; validated at 14 points on one token axis. At 240 tokens/s (P-EAGLE on 2 AMD EPYC cores) that is about
    # 70 minutes of training per drafter (DFlash several hours). Each drafter is one job (train, whole-set acceptance in vLLM, batch-1 speed in
    # vLLM) that resumes from its last checkpoint (save_every = eval_every) in the work folder under
    # $SPECFRAME_HOME, which a fresh checkout keeps; a drafter whose results are complete is skipped.
    "cpu-large": Preset(
        name="cpu-large", description="SmolLM2-135M-Instruct on the large self-distilled set, at least 1M training "
        "tokens per drafter (one pass), learning curves at 14 points; one resumable job per drafter, about 2.5 hours "
        "each on 2 cores",
        target="default", data="large", train_examples=4500, val_examples=64, seq_len=512, depth=7, steps=720,
        min_train_tokens=1_000_000,
        batch_size=4, lr=1e-3, draft_vocab=8192, memory_budget="3GiB", drafters=PUBLISHED, pack=True,
        eval_every=50, mask_builder=None, memory_cap=3072, memory_depth=4, prompts=2, max_new_tokens=64, repeats=3,
        per_drafter_jobs=True, vllm_ks=(2, 3, 5), speed_k=3, vllm_repeats=3, speed_prompts=16,  # 2 per category
        # about 128K, 255K and 510K training tokens (packing fills about 1,417 tokens a step), then the final 1.02M
        keep_drafter_at=(90, 180, 360),
        # DFlash trains at block depth + 1 = 8 here, where the references decay its loss with gamma 4 (speculators at
        # block 8, DeepSpec at 7); its default, 7, is SpecForge's at block 16 (deviations D4)
        plugin_drafters={"dflash": {"loss_decay_gamma": 4.0}},
        job_revisions=JOB_REVISIONS,
        # DSpark's block through its confidence schedule as well as whole, where vLLM cannot serve it (issue 57)
        reference_verifiers={"dspark": ("scheduled",)},
    ),
    "gpu": Preset(
        name="gpu", description="SmolLM2 target, about 30x the cpu preset's training tokens, 8 GiB budget, 64K memory search",
        target="default", data="default", train_examples=1000, val_examples=64, seq_len=2048, depth=8, steps=1000,
        batch_size=4, lr=5e-4, draft_vocab=32000, memory_budget="8GiB", drafters=PUBLISHED,
        memory_builders=("dense", "precomputed", "chunked", "flex"), memory_cap=65536, memory_depth=8,
        memory_segment_len=2048, prompts=20, max_new_tokens=256, repeats=5, device="cuda",
    ),
}


# ------------------------------------------------------------------------------------------------ ablations (issue 54)
@attrs.frozen
class Variant:
    """One arm of the ablation suite (``benchmarks/test_ablations.py``): today's defaults with one lever moved."""

    name: str
    #: the reference the lever comes from, and what it changes
    why: str
    #: drafter options set on top of the preset's (``FULL_VOCAB`` as a value: the target's whole vocabulary)
    options: dict = attrs.field(factory=dict)
    #: training flags that are not drafter options (``lr``, ``warmup_ratio``: a share of the steps; ``seed``;
    #: ``memory_budget``: the guard's budget where the lever needs more than the preset's, which changes no number a
    #: run computes)
    schedule: dict = attrs.field(factory=dict)
    #: the drafters the lever applies to (empty: every drafter of the preset)
    only: tuple[str, ...] = ()
    #: a control, not a lever: it measures the noise a lever's difference must exceed and never joins ``winners``
    control: bool = False


#: a ``draft_vocab_size`` that stands for the target's whole vocabulary (read from its config when the job starts)
FULL_VOCAB = "target vocabulary"
#: the variant trained with every lever that beat the baseline (``report.ablations.wins``), set from finished results
WINNERS = "winners"

#: the seed the control retrains the baseline with (every other run uses the harness's seed 0)
CONTROL_SEED = 1
#: the control variant's name: the baseline retrained with ``CONTROL_SEED``
RESEEDED = "reseeded"

VARIANTS = (
    Variant("baseline", "today's defaults"),
    # one training per variant: the paired interval holds which held-out sequences were drawn, not the run's own
    # randomness (init, data order, COD draws), which every lever also moves; this run measures that once
    Variant(RESEEDED, f"control: today's defaults with seed {CONTROL_SEED} (another init, data order and COD draws): "
            "how far two trainings land apart by chance alone", schedule={"seed": CONTROL_SEED}, control=True),
    Variant("mask_hidden_std", "item 1: mask_hidden starts at N(0, 1) as speculators, NeMo and SpecForge",
            {"mask_hidden_std": 1.0}, only=("peagle",)),
    Variant("frozen_head", "item 2: the draft lm_head frozen at the target's rows (speculators)", {"train_head": False}),
    # EAGLE-3 trains the full grid (cod_ratio 1.0), where the floor changes nothing
    Variant("no_cod_floor", "item 3: COD keeps r^d with no 0.2 floor (the newer speculators doc)",
            {"cod_min_ratio": 0.0}, only=("peagle",)),
    Variant("mask_bit_input", "item 4: the loss gated by the input token's mask bit (speculators' shift_batch)",
            {"loss_mask_bit": "input"}),
    # item 5: specframe drops such elements (SpecForge); without the mask the teacher is the target's distribution
    # renormalised over the draft vocabulary (speculators)
    Variant("oov_renormalise", "item 5: out-of-vocabulary top-1 kept, teacher renormalised over the draft vocabulary "
            "(speculators)", {"vocab_position_mask": False}),
    # P-EAGLE's 49,152-row head, its gradient and AdamW state and the loss's logit chunks: a measured peak of 2.9987
    # GiB by its second step at 3 GiB (2.89 estimated), so the guard would stop it at the first step that reached the
    # budget. The budget guards; it is not the lever: this one runs under 4 GiB
    Variant("full_vocab", "item 6: the target's whole vocabulary (speculators RFC #979, DeepSpec, NeMo)",
            {"draft_vocab_size": FULL_VOCAB}, schedule={"memory_budget": "4GiB"}),
    Variant("per_sequence", "item 7: loss normalised per sequence (DeepSpec's EAGLE-3)",
            {"loss_normalisation": "sequence"}),
    Variant("schedule_6e-4", "item 8: lr 6e-4 with 4% warmup (DeepSpec)", schedule={"lr": 6e-4, "warmup_ratio": 0.04}),
    Variant("loss_ce", "CE against the teacher's argmax instead of KL", {"loss": "ce"}),
    # DeepSpec's DSpark weighs its cross-entropy 0.1 beside the distribution term (ce_loss_alpha), the one published
    # mix of the two that specframe already trains (specframe_dspark's ce_weight default)
    Variant("loss_mix", "(1 - 0.1) KL + 0.1 CE (DeepSpec DSpark's ce_loss_alpha)", {"loss": "mix", "ce_weight": 0.1}),
    Variant("init_target_layers", "draft layers initialised from the target's last layers (no trainer has tried it)",
            {"init_from_target_layers": True}),
    Variant(WINNERS, "every lever that beat the baseline (its interval above 0, by more than the reseeded control "
            "moved), together"),
)


@attrs.frozen
class Ablation:
    """An ablation preset beside its ``Preset`` (same name in ``PRESETS``); kept apart so the per-drafter jobs' keys,
    which hash every ``Preset`` field, stay as they are."""

    #: the preset whose work folder holds the feature cache (same ``cache_args``: the same cache, never a second)
    cache_from: str | None = None
    #: the variants run, by name (empty: all of ``VARIANTS``)
    variants: tuple[str, ...] = ()
    #: whole-set acceptance in vLLM on ``served_dataset`` at K = ``served_k`` (when vLLM is installed)
    served: bool = False
    served_dataset: str = "mt-bench"
    served_k: int = 3
    #: the preset whose committed results hold the served set's contexts (``<results>/baselines/contexts-*.json.gz``)
    contexts_from: str | None = None
    #: bump when a change alters what every variant trains or measures, so finished variants run again
    revision: int = 0
    #: per drafter, the option values every variant starts from where a default changed after the suite began (the
    #: baseline stays the one the finished variants were compared with); a variant's own option wins. Kept out of
    #: the key: a pinned value is the default the finished variants ran at, so their results still stand
    pinned: dict[str, dict] = attrs.field(factory=dict)

    def variants_for(self, drafter: str) -> list[Variant]:
        """The variants that apply to ``drafter``, in ``VARIANTS`` order (the baseline first, the winners last)."""
        chosen = [v for v in VARIANTS if not self.variants or v.name in self.variants]
        return [v for v in chosen if not v.only or drafter in v.only]


PRESETS["ablations"] = attrs.evolve(
    PRESETS["cpu-large"], name="ablations", description="issue 54: P-EAGLE and EAGLE-3 at one budget (about 260K "
    "training tokens), today's defaults and each lever alone, on cpu-large's cache; one resumable job per variant",
    # 184 steps x about 1,417 packed tokens a step: about 260K tokens, over the 250K floor with some margin
    steps=184, min_train_tokens=250_000, eval_every=46, keep_drafter_at=(),
    drafters={"peagle": PUBLISHED["peagle"], "eagle3": PUBLISHED["eagle3"]}, per_drafter_jobs=False,
    datasets=("mt-bench",), vllm_ks=(3,),
)
PRESETS["ablations-ci"] = Preset(
    name="ablations-ci", description="the ablation suite at ci scale: tiny target, a few steps, three variants",
    target="tiny", data="gsm8k", train_examples=12, val_examples=4, seq_len=256, depth=4, steps=8, batch_size=2,
    lr=3e-3, draft_vocab=128, memory_budget="2GiB", drafters={"peagle": {"layers": 1}, "eagle3": {"layers": 1}},
    eval_every=2, committed=False, datasets=("mt-bench",), ks=(2,), speed_k=3, vllm_ks=(3,), min_train_tokens=1,
)
#: the family's defaults before P-EAGLE's suite decided rows 1, 4 and 6 of docs/training/deviations.md (the draft
#: vocabulary needs no pin: the presets state theirs)
PRE_ADOPTION = {"peagle": {"mask_hidden_std": 0.02, "loss_mask_bit": "predicted"},
                "eagle3": {"loss_mask_bit": "predicted"}}
ABLATIONS = {
    "ablations": Ablation(cache_from="cpu-large", served=True, contexts_from="cpu-large", pinned=PRE_ADOPTION),
    "ablations-ci": Ablation(variants=("baseline", "mask_hidden_std", "full_vocab", WINNERS), pinned=PRE_ADOPTION),
}


# ------------------------------------------------------------------------------------------------ peer (issue 54, item 1)
# speculators' trainer beside specframe's (benchmarks/test_peer.py). One conversation per sequence (no packing), so the
# held-out split is the same last examples for both trainers; one epoch over the training conversations for both.
# `drafters` is the matched architecture both trainers build (1 llama layer, no extra norms, full attention); each
# trainer's defaults run beside it. `depth` is the matched training depth and every row's evaluation depth.
PRESETS["peer"] = Preset(
    name="peer", description="issue 54: speculators 0.9.0's trainer and specframe's on SmolLM2, the large "
    "self-distilled set (1,050 training conversations, about 280K tokens, one epoch), at each trainer's defaults and "
    "at matched settings, P-EAGLE and EAGLE-3",
    # 4 GiB: at its defaults specframe drafts over the whole vocabulary, as speculators does (deviations row 6), and
    # P-EAGLE's 4-layer drafter with a 49,152-row head peaked at 3.08 GiB in the ablations; the budget is the guard's,
    # and this benchmark compares trainers, not drafters under one budget
    target="default", data="large", train_examples=1050, val_examples=64, seq_len=512, depth=4, steps=0, batch_size=4,
    lr=1e-3, draft_vocab=8192, memory_budget="4GiB", drafters={"peagle": {"layers": 1}, "eagle3": {"layers": 1}},
    mask_builder=None, datasets=("gsm8k", "mt-bench"), ks=(3,), speed_k=3, vllm_ks=(3,), min_train_tokens=250_000,
)
PRESETS["peer-ci"] = Preset(
    name="peer-ci", description="the peer benchmark at ci scale: tiny target, a few conversations, both trainers",
    target="tiny", data="gsm8k", train_examples=12, val_examples=4, seq_len=256, depth=3, steps=0, batch_size=2,
    lr=3e-3, draft_vocab=128, memory_budget="2GiB",
    # a 4-layer target: speculators' default layers [2, L//2, L-3] repeat a layer, which it refuses
    drafters={"peagle": {"layers": 1, "aux_layer_ids": [1, 2, 3]}, "eagle3": {"layers": 1, "aux_layer_ids": [1, 2, 3]}},
    committed=False, datasets=("gsm8k", "mt-bench"), ks=(3,), speed_k=3, vllm_ks=(3,), acceptance_prompts=3,
    acceptance_max_new_tokens=16, acceptance_batch=4, acceptance_kv_gib=1, min_train_tokens=1,
)
