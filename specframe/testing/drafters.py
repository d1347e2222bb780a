"""The drafter contract, ``DrafterContract``: the checks every drafter must pass on the shared engine, run with the
fixture ``specframe_tiny_target`` of the pytest plugin (``specframe.pytest_plugin``, the ``pytest11`` entry point
``specframe``, which imports this package only when a test asks for the fixture). A plugin author subclasses it in a
test module of their package, as tests/contract/test_contract.py does for the built-ins:

    from specframe.testing import DrafterContract

    class TestSkipgram(DrafterContract):
        drafter = "skipgram"            # a registered name, or the class itself (no install needed)
        options = {"dim": 16}           # small options for a fast run (the comparison's depth is set for you)

Beside it, the helpers it is built from (the tiny target, an example with its target features, the engine's element
set and per-segment accumulation), which a drafter's own tests use too.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, ClassVar

import torch

from specframe import api


def tiny_test_target(folder: Path) -> Any:
    """The target behind the ``specframe_tiny_target`` fixture (``specframe.pytest_plugin``), built in ``folder``: a
    tiny random Llama (320 tokens, 4 layers, width 32, grouped-query attention), its lm_head sharpened so its
    next-token distribution is peaked (a random target is near uniform: a distillation loss would start near zero
    and a draft would be accepted by chance)."""
    from specframe.targets import load_target, tiny_target

    tiny_target(folder, vocab=320, layers=4, hidden=32, heads=4, kv_heads=2, seed=0)
    target = load_target(folder)
    with torch.no_grad():
        target.model.get_output_embeddings().weight.mul_(30.0)
    return target


def target_features(target: Any, ids: torch.Tensor, drafter: api.Drafter) -> dict[str, torch.Tensor]:
    """The features ``drafter.feature_spec()`` asks for, from ``target`` over ``ids`` (as the engine computes them)."""
    spec = drafter.feature_spec()
    aux = tuple(getattr(spec, "aux_layers", None) or ())
    with torch.no_grad():
        out = target.model(ids[None], output_hidden_states=True)
    feats = {"final_hidden": out.hidden_states[-1][0]}
    if aux:
        feats["aux_hidden"] = torch.cat([out.hidden_states[i][0] for i in aux], -1)
    return feats


def training_example(target: Any, drafter: api.Drafter, length: int = 18, docs: int = 2,
                     seed: int = 0) -> api.TrainingExample:
    """One seeded example of ``length`` tokens (``docs`` packed documents, the first 3 tokens unsupervised) with the
    drafter's target features; ``drafter.prepare`` is called on it first, as the trainer does."""
    bare = prepared(target, drafter, length, docs, seed)
    return api.TrainingExample(bare.input_ids, bare.loss_mask, bare.doc, target_features(target, bare.input_ids,
                                                                                        drafter))


def prepared(target: Any, drafter: api.Drafter, length: int = 18, docs: int = 2, seed: int = 0) -> api.TrainingExample:
    """``training_example``'s example without features, after ``drafter.prepare`` has been called on it (the target
    is not run: a run from a feature cache never runs it)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(7, int(target.config.vocab_size), (length,), generator=g)  # past special / reserved ids
    mask = torch.ones(length, dtype=torch.bool)
    mask[:3] = False
    doc = torch.arange(length) * docs // length if docs > 1 else torch.zeros(length, dtype=torch.long)
    example = api.TrainingExample(ids, mask, doc)
    drafter.prepare(target, [example])
    return example


def element_set(drafter: api.Drafter, example: api.TrainingExample, depth: int, seed: int = 0):
    """(elements, supervision) as the engine builds them: the drafter's declared COD schedule, or the full grid,
    stamped with its visibility rule."""
    from specframe.drafting.elements import cod_sample, full_grid, position_docs

    sup = drafter.supervision(example).to(torch.bool)
    doc = position_docs(example.doc, sup.shape[0])
    declared = type(drafter).training(drafter.options)
    if declared.cod_ratio < 1.0:
        g = torch.Generator().manual_seed(seed)
        elems = cod_sample(sup, depth, declared.cod_ratio, declared.cod_min_ratio, generator=g, doc=doc)
    else:
        elems = full_grid(sup.shape[0], depth, doc)
    return elems.with_visibility(drafter.visibility), sup


def accumulate_loss(drafter: api.Drafter, example: api.TrainingExample, elems: Any, sup: torch.Tensor,
                    builder: str = "dense", partitioner: str = "none", parts: int = 1) -> float:
    """Back-propagate one sequence as the engine does (segments in turn, normalised by the sequence's charged count,
    or the charged elements' summed weights for a drafter that weighs them, attention through
    ``api.SegmentAttention``); returns the normalised loss."""
    from specframe.interfaces.drafter import charged_weight
    from specframe.testing.components import build_component

    b = build_component("mask builder", builder, {})
    p = build_component("partitioner", partitioner, {})
    count = charged_weight(drafter, example, elems, sup)
    total = 0.0
    for seg in p.partition(elems, parts):
        if len(seg.elements) == 0:
            continue
        sub = elems.subset(seg.elements)
        terms = drafter.loss(example, elems, seg, api.SegmentAttention.build(b, sub))
        (terms.loss_sum / count).backward()
        total += float(terms.loss_sum.detach())
    return total / count


def gradients(drafter: api.Drafter) -> dict[str, torch.Tensor]:
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in drafter.module().named_parameters() if p.requires_grad}


class DrafterContract:
    """What every drafter must do on the shared engine, as pytest tests (collected from a subclass named Test*).
    ``drafter``: the registered name or the class; ``options``: small option values; ``depth`` / ``k``: the depth
    it trains at and the tokens it drafts, set through its own ``comparison_options`` (API 6); ``draft_vocab``: the
    draft vocabulary the comparison hands it; ``overfit_steps`` / ``overfit_ratio``: one example's loss must fall
    below ``overfit_ratio`` of its first value within the steps."""

    drafter: ClassVar[Any] = None
    options: ClassVar[dict[str, Any]] = {}
    depth: ClassVar[int] = 3
    k: ClassVar[int] = 3
    draft_vocab: ClassVar[int] = 128
    overfit_steps: ClassVar[int] = 40
    overfit_ratio: ClassVar[float] = 0.7

    # -- helpers
    @classmethod
    def drafter_class(cls) -> type:
        from specframe.testing.components import component_class

        return component_class("drafter", cls.drafter)

    def option_values(self) -> dict[str, Any]:
        drafter_cls = self.drafter_class()
        equal = drafter_cls.comparison_options(self.depth, self.draft_vocab, self.k)
        return {**equal, **self.options}

    def build(self, target: Any, seed: int = 0) -> api.Drafter:
        from specframe.testing.components import build_component

        torch.manual_seed(seed)
        return build_component("drafter", self.drafter_class(), self.option_values(), target.config)

    # -- the contract
    def test_declares_the_comparisons_depth_and_k(self):
        """``comparison_options`` must make ``training`` declare the depth and K it was handed: else the equal-budget
        comparison trains this drafter at another depth than the rest."""
        from specframe import compose

        drafter_cls = self.drafter_class()
        _, options = compose.options("drafter", drafter_cls,
                                     drafter_cls.comparison_options(self.depth, self.draft_vocab, self.k),
                                     "comparison options")
        declared = drafter_cls.training(options)
        assert isinstance(declared, api.Training)
        assert declared.depth == self.depth, f"comparison_options(depth={self.depth}) trains at {declared.depth}"
        assert declared.k in (None, self.k), f"comparison_options(k={self.k}) drafts {declared.k}"

    def test_its_layers_are_costed(self, specframe_tiny_target):
        """The memory estimate sees this drafter's decoder layers: found by structure (``api.modeling.DecoderLayer``)
        or declared by ``layer_shapes`` (API 9). Else ``specframe memory`` and ``--memory-budget`` cost it without
        its layers' activations and propose a context length the in-run guard then stops. A drafter with no decoder
        layers declares ``()``."""
        from specframe import memory

        drafter = self.build(specframe_tiny_target)
        shapes, declared = memory._layers(drafter, drafter.module())
        assert shapes or declared, (f"{type(drafter).__name__}: the memory estimate finds no decoder layers; declare "
                                    "them with Drafter.layer_shapes() (or return () when it has none)")

    def test_prepare_reads_only_the_target_layers_it_declares(self, specframe_tiny_target):
        """``target_layers`` (API 15) names every decoder layer ``prepare`` reads: a run from a feature cache keeps only
        those, so with the others dropped ``prepare`` must start the drafter exactly as from the whole target (a
        dropped layer raises when read; one that is only missing from the state dict would leave weights fresh)."""
        import copy

        from specframe.targets import keep_layers

        probe = self.build(specframe_tiny_target)
        n = int(specframe_tiny_target.config.num_hidden_layers)
        declared = probe.target_layers(n)
        if declared is None:
            return  # the whole target: nothing is dropped
        assert all(isinstance(i, int) and 0 <= i < n for i in declared), f"target_layers({n}) gave {declared}"
        light = copy.deepcopy(specframe_tiny_target)
        keep_layers(light.model, declared)
        states = []
        for target in (specframe_tiny_target, light):
            drafter = self.build(target)
            prepared(target, drafter)
            states.append(drafter.module().state_dict())
        whole, kept = states
        assert whole.keys() == kept.keys()
        for key in whole:
            assert torch.equal(whole[key], kept[key]), f"{key} differs when only layers {declared} are loaded"

    def test_every_builder_and_partitioner_gives_the_dense_gradients(self, specframe_tiny_target):
        """Every registered CPU mask builder and partitioner gives the dense single pass's loss and gradients, and
        the loss reaches some parameter."""
        from specframe import plugins
        from specframe.masks import ranked_mask_builders

        registry = plugins.load()
        drafter = self.build(specframe_tiny_target)
        example = training_example(specframe_tiny_target, drafter)
        elems, sup = element_set(drafter, example, self.depth)
        ref_loss = accumulate_loss(drafter, example, elems, sup)
        ref = gradients(drafter)
        assert any(float(v.abs().sum()) > 0 for v in ref.values()), "the loss reaches no trainable parameter"
        splits = [n for n in registry.names("partitioner") if registry.get("partitioner", n).splits_sequences]
        for builder in ranked_mask_builders("cpu"):
            if drafter.visibility not in registry.get("mask builder", builder).visibilities:
                continue
            for partitioner, parts in [("none", 1)] + [(n, 3) for n in splits]:
                drafter.module().zero_grad(set_to_none=True)
                loss = accumulate_loss(drafter, example, elems, sup, builder, partitioner, parts)
                where = f"{builder} / {partitioner} x{parts}"
                assert math.isclose(loss, ref_loss, rel_tol=1e-4, abs_tol=1e-6), f"{where}: {loss} != {ref_loss}"
                for key, value in gradients(drafter).items():
                    torch.testing.assert_close(value, ref[key], rtol=1e-4, atol=1e-6, msg=f"{where}: {key}")

    def test_overfits_one_example(self, specframe_tiny_target):
        drafter = self.build(specframe_tiny_target)
        example = training_example(specframe_tiny_target, drafter)
        elems, sup = element_set(drafter, example, self.depth)
        params = [p for p in drafter.module().parameters() if p.requires_grad]
        opt = torch.optim.Adam(params, lr=1e-2)
        drafter.module().train()
        losses = []
        for _ in range(self.overfit_steps):
            opt.zero_grad()
            losses.append(accumulate_loss(drafter, example, elems, sup))
            opt.step()
        assert all(math.isfinite(v) for v in losses)
        assert losses[-1] < self.overfit_ratio * losses[0], f"loss {losses[0]:.4f} -> {losses[-1]:.4f}"

    def test_greedy_speculative_decoding_equals_plain_decoding(self, specframe_tiny_target):
        """Lossless: chains of K drafts (and trees, for a drafter that builds them) emit exactly plain greedy
        decoding's tokens through the reference engine."""
        from specframe.inference.engine import TreeShape, generate
        from specframe.testing.components import build_component

        drafter = self.build(specframe_tiny_target)
        training_example(specframe_tiny_target, drafter)  # prepare it (draft vocabulary, mask token) as training does
        drafter.module().eval()
        model = specframe_tiny_target.model
        prompt = torch.randint(7, int(model.config.vocab_size), (12,), generator=torch.Generator().manual_seed(1))
        greedy, tree_verifier = build_component("verifier", "greedy", {}), build_component("verifier", "tree", {})
        plain = generate(model, prompt, greedy, max_new_tokens=16, eos_token_id=())
        chain = generate(model, prompt, greedy, drafter, k=self.k, max_new_tokens=16, eos_token_id=())
        assert chain.tokens == plain.tokens
        assert max(r.nodes for r in chain.rounds) <= self.k
        if drafter.builds_trees:
            tree = generate(model, prompt, tree_verifier, drafter, tree=TreeShape(self.k, 2, 6), max_new_tokens=16,
                            eos_token_id=())
            assert tree.tokens == plain.tokens

    def test_accepts_without_a_propose_between_draft_as_after_one(self, specframe_tiny_target):
        """API 11: a verifier may skip drafting (``draft_budget`` 0), so ``accept`` can come several times without a
        ``propose`` between. The draft after tokens committed one ``accept`` at a time, with no drafting between,
        must equal the draft after the usual flow (a draft proposed and discarded, then the tokens committed in one
        ``accept``): a drafter that keeps only the last ``accept``'s tokens, or forwards its queue twice, drafts
        from a wrong context here (greedy verification stays lossless, so only the drafts show it)."""
        drafter = self.build(specframe_tiny_target)
        example = training_example(specframe_tiny_target, drafter)
        drafter.module().eval()
        n = 10
        seq = example.input_ids[: n + 3]
        feats = target_features(specframe_tiny_target, seq, drafter)

        def rows(lo: int, hi: int) -> dict[str, torch.Tensor]:
            return {name: value[lo:hi] for name, value in feats.items()}

        drafts = []
        with torch.no_grad():
            drafter.start(seq[:n], rows(0, n))
            drafter.accept(seq[n : n + 1], rows(n - 1, n))
            drafter.propose(self.k, torch.Generator().manual_seed(0))
            drafter.accept(seq[n + 1 : n + 3], rows(n, n + 2))
            drafts.append(drafter.propose(self.k, torch.Generator().manual_seed(1)).tokens.tolist())
            drafter.start(seq[:n], rows(0, n))
            for j in range(n, n + 3):  # the prefill's token, then two rounds whose drafting was skipped
                drafter.accept(seq[j : j + 1], rows(j - 1, j))
            drafts.append(drafter.propose(self.k, torch.Generator().manual_seed(1)).tokens.tolist())
        assert drafts[1] == drafts[0], "after accepts with no propose between, the drafter drafts from another context"

    def test_a_saved_drafter_loads_back_and_drafts_the_same(self, specframe_tiny_target, tmp_path: Path):
        drafter = self.build(specframe_tiny_target)
        example = training_example(specframe_tiny_target, drafter)
        with torch.no_grad():  # move off the initialisation, so a load that keeps fresh weights is caught
            for p in drafter.module().parameters():
                p.add_(0.05 * torch.randn_like(p))
        drafter.save(tmp_path / "drafter")
        loaded = type(drafter).from_checkpoint(tmp_path / "drafter", specframe_tiny_target.config)
        for key, value in drafter.module().state_dict().items():
            torch.testing.assert_close(loaded.module().state_dict()[key], value, rtol=0, atol=0, msg=key)
        prompt = example.input_ids[:10]
        feats = target_features(specframe_tiny_target, prompt, drafter)
        drafts = []
        for d in (drafter, loaded):
            d.module().eval()
            d.start(prompt, feats)
            drafts.append(d.propose(self.k).tokens.tolist())
        assert drafts[0] == drafts[1]
