"""Shared pieces of the block drafters' tests (DFlash's and DSpark's, which live in their packages:
packages/specframe-dflash/tests and packages/specframe-dspark/tests): the tiny target as a module fixture, a prepared
drafter with one float64 example, the full element grid under the drafter's visibility rule, and the engine's
per-sequence accumulation with its checks; the set-ups both packages' tests run alike (two-turn masks, a drafter overfit
on the target's greedy decode, a run of the engine, vLLM's reading of an export, the packages' import rule). A test
module imports ``target`` (the fixture) and the helpers from here."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from specframe import api, plugins
from specframe.drafting.elements import check_partition, full_grid, position_docs
from specframe.interfaces.drafter import charged_weight
from tests.drafter_helpers import features, sharp_tiny_target

SDPA = lambda q, k, v: F.scaled_dot_product_attention(q, k, v)  # noqa: E731


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    torch.set_num_threads(1)
    return sharp_tiny_target(tmp_path_factory.mktemp("block-target"))


def make_block(name: str, small: dict[str, Any], target, length: int = 18, docs: int = 1, seed: int = 0, mask=None,
               init: Callable[[api.Drafter, torch.Generator], None] | None = None, **options):
    """Drafter ``name`` at options ``small`` (``options`` on top), prepared and in float64, with one seeded example of
    ``length`` tokens (``docs`` packed documents; the first two unsupervised unless ``mask`` is given) carrying its
    target features. ``init(drafter, generator)`` runs after the drafter is prepared, on the example's generator."""
    torch.manual_seed(seed)
    cls = plugins.get("drafter", name)
    drafter = cls(target.config, cls.Options(**{**small, **options}))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(7, target.config.vocab_size, (length,), generator=g)
    if mask is None:
        mask = torch.ones(length, dtype=torch.bool)
        mask[:2] = False
    doc = torch.arange(length) * docs // length
    plain = api.TrainingExample(ids, mask, doc)
    drafter.prepare(target, [plain])
    drafter.module().double()
    if init is not None:
        init(drafter, g)
    ex = api.TrainingExample(ids, mask, doc, {k: v.double() for k, v in features(target, ids, drafter).items()})
    return drafter, ex


def grid(drafter, ex, depth=None):
    """The full element grid of ``ex`` at the drafter's depth (or ``depth``) under its visibility rule, and its
    supervision."""
    sup = drafter.supervision(ex)
    n = sup.shape[0]
    return full_grid(n, depth or drafter.depth, position_docs(ex.doc, n)).with_visibility(drafter.visibility), sup


def run(drafter, ex, elems, sup, builder="dense", partitioner="none", parts=1, **builder_options):
    """The engine's per-sequence accumulation (segments, the normaliser ``charged_weight``: the charged elements'
    summed weights, API 14): (normalised loss, grads, hits)."""
    cls = plugins.get("mask builder", builder)
    b = cls(cls.Options(**builder_options)) if builder_options else cls()
    segments = plugins.get("partitioner", partitioner)().partition(elems, parts)
    check_partition(elems, segments, partitioner)
    count = charged_weight(drafter, ex, elems, sup)
    drafter.module().zero_grad(set_to_none=True)
    total, hits = 0.0, 0
    for seg in segments:
        terms = drafter.loss(ex, elems, seg, api.SegmentAttention.build(b, elems.subset(seg.elements)))
        (terms.loss_sum / count).backward()
        total += float(terms.loss_sum.detach())
        hits += int(terms.correct.sum())
        assert terms.count == int((seg.loss_mask & sup[elems.subset(seg.elements).position]).sum())
    grads = {n: p.grad.clone() for n, p in drafter.module().named_parameters() if p.grad is not None}
    return total / count, grads, hits


def reference_weight(ex, elems, sup, gamma=None) -> float:
    """The references' normaliser, written from them (SpecForge ``dflash_family_model.py`` L350-362, L455-458;
    DeepSpec ``loss.py`` L112-114): sum(w) over the trained slots, w = exp(-d / gamma) (1 without decay), a slot
    (a, d) trained when its anchor token x_{a+1} and the targets x_{a+2} .. x_{a+2+d} are supervised."""
    total = 0.0
    for a, d in zip(elems.anchor.tolist(), elems.depth.tolist()):
        if sup[a + d] and ex.loss_mask[a + 1] and bool(sup[a : a + d + 1].all()):
            total += math.exp(-d / gamma) if gamma else 1.0
    return total


def two_turns(length=20):
    """A loss mask of two assistant turns after their prompts: x_4..x_9 and x_12..x_19 supervised (the second
    prompt shorter than a block, so a block anchored in the first answer reaches into the second)."""
    mask = torch.zeros(length, dtype=torch.bool)
    mask[4:10] = mask[12:] = True
    return mask


def overfit_on_greedy(target, name: str, options: dict[str, Any], steps: int):
    """Drafter ``name`` at ``options`` in float32, overfit ``steps`` steps through ``loss`` on the target's own greedy
    continuation of a prompt: (drafter, example, prompt, the plain greedy decode, the greedy verifier)."""
    from specframe.features import capture_features
    from specframe.inference.engine import generate

    torch.manual_seed(0)
    prompt = torch.tensor([1, 50, 60, 70, 80])
    verifier = plugins.get("verifier", "greedy")()
    plain = generate(target.model, prompt, verifier, max_new_tokens=40, eos_token_id=())
    seq = torch.cat([prompt, torch.tensor(plain.tokens)])
    mask = torch.arange(len(seq)) >= len(prompt)
    cls = plugins.get("drafter", name)
    drafter = cls(target.config, cls.Options(**options))
    ex = api.TrainingExample(seq, mask, torch.zeros_like(seq))
    drafter.prepare(target, [ex])
    spec = drafter.feature_spec()
    f = capture_features(target, seq[None], spec, dtype=torch.float32)
    feats = {"aux_hidden": f.aux[0], **({"final_hidden": f.final[0]} if spec.final_hidden else {})}
    ex = api.TrainingExample(seq, mask, ex.doc, feats)
    elems, sup = grid(drafter, ex)
    opt = torch.optim.AdamW([p for p in drafter.module().parameters() if p.requires_grad], lr=3e-3)
    for _ in range(steps):
        opt.zero_grad()
        run(drafter, ex, elems, sup)
        opt.step()
    drafter.module().eval()
    return drafter, ex, prompt, plain, verifier


def train_on_engine(tmp_path, name: str, options: dict[str, Any], steps: int, builder: str, partitioner: str,
                    parts: int):
    """``specframe train``'s engine on the tiny target and chat data, drafter ``name`` at ``options``, ``steps`` steps:
    (each step's train loss, the run's checkpoint reloaded)."""
    from specframe.drafter_folders import load_drafter
    from specframe.engine import TrainConfig, train
    from specframe.targets import load_target
    from tests.train_fixtures import build

    target_dir, chat = build(tmp_path / "assets")
    out = tmp_path / "run"
    train(TrainConfig(drafter=name, target=str(target_dir), data=str(chat), output=str(out), seq_len=32,
                      max_steps=steps, batch_size=1, val_examples=1, lr=3e-3, mask_builder=builder,
                      partitioner=partitioner, partitions=parts, drafter_options=dict(options)), progress=False)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [m["train_loss"] for m in metrics if m.get("train_loss") is not None]
    return losses, load_drafter(out, load_target(target_dir).config)


def vllm_pretrained_config(config: dict[str, Any]) -> dict[str, Any]:
    """The transformers config vLLM's own speculators reader makes of an export's ``config``; skips without vLLM."""
    try:
        from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
    except ImportError:  # pragma: no cover - vLLM absent
        pytest.skip("vLLM is not installed: the config is checked by vLLM's own speculators reader")
    return SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(config)))


def imports_only_the_public_api(package) -> None:
    """Every module of ``package`` (a plugin package) imports from specframe only ``from specframe import api``."""
    root = Path(package.__file__).parent
    for path in sorted(root.glob("*.py")):
        imports = [line for line in path.read_text().splitlines() if line.startswith(("import specframe",
                                                                                      "from specframe"))]
        assert all(line == "from specframe import api" for line in imports), (path.name, imports)
