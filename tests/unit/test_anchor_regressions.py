"""Regression tests for five bugs users reported in the anchor projects (issue 30, "what to build" item 2), each
asserting the correct behaviour on every drafter it concerns.

1. The EAGLE-3 loss mask one position before the first answer token (SpecForge #885): the first supervised element
   is exactly the one taught the first answer token; no prompt token is a target, no answer token is dropped.
2. Anchors sampled per document under packing (speculators PR #1071): elements, parallel slots and DFlash blocks
   never cross a document boundary, every packed document gets its share of sampled elements, and no document sees
   another's context (through the public mask builders and partitioners).
3. The last aux layer id (TorchSpec #87): the target hidden states a drafter trains on are the ones vLLM collects
   for the exported aux layer ids, the last layer included; an id equal to the layer count is refused.
4. Exported config fields that differ from what the trainer used ("trains successfully, then mysteriously low
   acceptance"): every field vLLM reads equals what the trained drafter computes, and export -> import drafts the
   same tokens.
5. A rank whose batch has no supervised element (SpecForge PR #737, Model-Optimizer PR #2410): 2 gloo ranks finish
   and give the one-process result (docs/design.md section 8: the step's loss is the global sum over the global count).

Where an existing test covers part of a bug it is named at the test here, which adds only what it misses.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import inspect
import json
from types import SimpleNamespace

import attrs
import pytest
import torch

from specframe import api, plugins

from specframe.drafting import modeling
from specframe.data.chat import encode_conversation
from specframe.drafter_folders import load_drafter
from specframe.drafting.elements import check_partition, full_grid, position_docs
from specframe.engine.data import _Sequences
from specframe.engine.loop import Trainer
from tests.drafter_helpers import DRAFTERS, SMALL, features, sharp_tiny_target
from tests.target_fixtures import chat_records

try:
    importlib.metadata.distribution("specframe-dflash")
    ALL = (*DRAFTERS, "dflash")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - depends on the environment
    ALL = DRAFTERS
OPTIONS = {**SMALL, "dflash": {"layers": 2, "block_size": 4, "aux_layer_ids": [1, 3]}}
DEPTH = 3  # every drafter's grid below (DFlash: block_size - 1)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    torch.set_num_threads(1)
    return sharp_tiny_target(tmp_path_factory.mktemp("anchors"))


# ------------------------------------------------------------------------------------------------------- helpers


def conversations(target, n: int = 3, *, headless: tuple[int, ...] = (), seed: int = 0) -> list[api.TrainingExample]:
    """``n`` documents with the loss masks the target's chat template gives two-turn conversations (each answer
    follows a prompt), every token id distinct across all of them, so a label names its position. A document in
    ``headless`` is supervised from its first token on (no prompt), so a packed sequence has an answer token right
    after a boundary."""
    masks = []
    for i, record in enumerate(chat_records(n, turns=4)):
        _, mask = encode_conversation(target.tokenizer, record["messages"])
        mask = torch.tensor(mask, dtype=torch.bool)
        masks.append(torch.ones_like(mask) if i in headless else mask)
    g = torch.Generator().manual_seed(seed)
    # ids 7.. avoid the special and reserved tokens the mask-token rule picks
    ids = 7 + torch.randperm(target.config.vocab_size - 7, generator=g)[: sum(len(m) for m in masks)]
    out, start = [], 0
    for mask in masks:
        out.append(api.TrainingExample(ids[start : start + len(mask)], mask, torch.zeros(len(mask), dtype=torch.long)))
        start += len(mask)
    return out


def build(target, name: str, docs: list[api.TrainingExample], *, packed: bool, **options):
    """A prepared drafter and the training examples of ``docs`` as the engine makes them: one packed sequence
    (per-document features concatenated) or one example per document."""
    torch.manual_seed(0)
    cls = plugins.get("drafter", name)
    drafter = cls(target.config, cls.Options(**{**OPTIONS[name], **options}))
    seqs = _Sequences(docs, sum(len(d.input_ids) for d in docs), packed,
                      lambda j: features(target, docs[j].input_ids, drafter))
    drafter.prepare(target, [seqs.tokens(i) for i in range(len(seqs))])
    drafter.module().eval()
    return drafter, [seqs.example(i) for i in range(len(seqs))]


def grid(drafter, example, depth: int = DEPTH) -> api.ElementSet:
    """The full element grid of ``example`` under the drafter's visibility rule (the engine's rule without COD)."""
    n = drafter.supervision(example).shape[0]
    return full_grid(n, depth, position_docs(example.doc, n), visibility=drafter.visibility)


def reach(drafter, example) -> int:
    """How far beyond its position a depth-0 element's target lies: a drafter with L - n = s positions fewer than data
    tokens reads x_{i+s} at position i and predicts the token after it (EAGLE family: 2, PARD: 1)."""
    return int(example.input_ids.shape[0] - drafter.supervision(example).shape[0]) + 1


@contextlib.contextmanager
def watched_targets(example: api.TrainingExample):
    """Records the data position of every target the drafters' loss kernels are handed: a KL row ``target_index``
    t is the target's distribution at t, which predicts x_{t+1}; a cross-entropy label is a token id, looked up
    (``example``'s ids are distinct)."""
    seen: list[int] = []
    kl, ce = modeling.chunked_forward_kl, modeling.chunked_cross_entropy
    position = {int(t): i for i, t in enumerate(example.input_ids.tolist())}
    assert len(position) == example.input_ids.numel(), "the ids must be distinct"

    def watch_kl(*args, **kwargs):
        index = inspect.signature(kl).bind(*args, **kwargs).arguments.get("target_index")
        assert index is not None, "a KL drafter must say which target row teaches each element"
        seen.extend((index + 1).tolist())
        return kl(*args, **kwargs)

    def watch_ce(hidden, head, labels, *args, **kwargs):
        seen.extend(position[int(t)] for t in labels.tolist())
        return ce(hidden, head, labels, *args, **kwargs)

    modeling.chunked_forward_kl, modeling.chunked_cross_entropy = watch_kl, watch_ce
    try:
        yield seen
    finally:
        modeling.chunked_forward_kl, modeling.chunked_cross_entropy = kl, ce


@torch.no_grad()
def targets(drafter, example, elems, charge: torch.Tensor, builder: str = "dense") -> list[int]:
    """The data positions the loss of ``elems``' elements in ``charge`` is taught to predict (one per element the
    drafter charges: its supervised ones)."""
    attention = api.SegmentAttention.build(plugins.get("mask builder", builder)(), elems)
    with watched_targets(example) as seen:
        terms = drafter.loss(example, elems, api.Segment(torch.arange(len(elems)), charge), attention)
    assert len(seen) == terms.count
    return seen


def engine_elements(drafter, depth: int = DEPTH):
    """The engine's element rule for ``drafter`` (``Trainer.elements``: COD where its options sample, else the full
    grid, under its visibility rule): ``(example, generator) -> (elements, supervision)``."""
    trainer = SimpleNamespace(drafter=drafter, depth=depth, training=type(drafter).training(drafter.options))
    return lambda example, generator: Trainer.elements(trainer, example, generator)


def doc_starts(example) -> torch.Tensor:
    """The first data position of each token's document."""
    doc = example.doc
    first = torch.zeros(int(doc.max()) + 1, dtype=torch.long)
    first.scatter_reduce_(0, doc, torch.arange(doc.numel()), reduce="amin", include_self=False)
    return first[doc]


def answer_starts(example) -> list[int]:
    """The first token of every answer span (an answer token after a prompt token or a document boundary)."""
    mask, doc = example.loss_mask, example.doc
    return [t for t in range(mask.numel()) if mask[t] and (t == 0 or not mask[t - 1] or doc[t] != doc[t - 1])]


# ---------------------------------------------------------------------------------- 1. the first answer token
# tests/unit/test_data.py::test_loss_mask_covers_assistant_turns_only pins the data side (the loss mask starts at the
# assistant's first content token); tests/unit/test_peagle.py and tests/unit/test_pard.py pin `supervision` against the mask
# for one drafter each. Missing: what each drafter's loss is actually taught, end to end, with and without packing.


def has_mask_bit(name: str) -> bool:
    """Whether the drafter lets a run choose whose loss-mask bit gates an element (the EAGLE family's
    ``loss_mask_bit``)."""
    return any(f.name == "loss_mask_bit" for f in attrs.fields(plugins.get("drafter", name).Options))


@pytest.mark.parametrize("packed", [False, True], ids=["alone", "packed"])
@pytest.mark.parametrize("name", ALL)
def test_the_first_supervised_element_is_taught_the_first_answer_token(target, name, packed):
    """Depth 0 is taught exactly the answer tokens it can reach (every one of a prompt-led answer, the first
    included; a document supervised from its first token loses the ones whose inputs lie before it), never a
    prompt token; no element of any depth is taught a prompt token. For the EAGLE family this is the
    ``loss_mask_bit = "predicted"`` rule (the input token's bit, its default, is the next test's)."""
    docs = conversations(target, 3, headless=(1,) if packed else ())
    drafter, examples = build(target, name, docs, packed=packed,
                              **({"loss_mask_bit": "predicted"} if has_mask_bit(name) else {}))
    for ex in examples:
        elems = grid(drafter, ex)
        r = reach(drafter, ex)
        answers = set(ex.loss_mask.nonzero().squeeze(1).tolist())
        starts = doc_starts(ex)
        # a target r past its position needs every input of that position inside its own document
        reachable = sorted(t for t in answers if t - r >= int(starts[t]))
        depth0 = targets(drafter, ex, elems, elems.depth == 0)
        assert sorted(depth0) == reachable, name
        # the sequence's first supervised position is the one taught its first answer token (a prompt-led answer)
        assert int(drafter.supervision(ex).nonzero()[0]) == answer_starts(ex)[0] - r == min(depth0) - r, name
        for first in answer_starts(ex):
            if first - r >= int(starts[first]):
                assert first in depth0, f"{name}: the first answer token at {first} is dropped"
            assert first - 1 not in depth0 or ex.loss_mask[first - 1], f"{name}: prompt token {first - 1} supervised"
        every = targets(drafter, ex, elems, torch.ones(len(elems), dtype=torch.bool))
        assert set(every) <= answers, f"{name}: prompt tokens {sorted(set(every) - answers)} are targets"
        assert len(every) > len(depth0)  # the deeper elements are trained too


@pytest.mark.parametrize("packed", [False, True], ids=["alone", "packed"])
@pytest.mark.parametrize("name", [n for n in ALL if has_mask_bit(n)])
def test_under_the_input_bit_the_element_reading_each_first_answer_token_is_taught(target, name, packed):
    """``loss_mask_bit = "input"`` (the EAGLE family's default: speculators' ``shift_batch``, and SpecForge once #885
    shifted its mask with the inputs): depth 0 is taught exactly the reachable tokens whose previous token is an
    answer token. So the element that reads a turn's first answer token, the one a served drafter runs first in
    every turn (SpecForge #885's bug left it out), is charged; the one taught the first answer token from the
    prompt's last token, which no served round runs (the target emits that token), is not."""
    docs = conversations(target, 3, headless=(1,) if packed else ())
    drafter, examples = build(target, name, docs, packed=packed, loss_mask_bit="input")
    for ex in examples:
        elems = grid(drafter, ex)
        r = reach(drafter, ex)
        mask, starts = ex.loss_mask, doc_starts(ex)
        n = mask.numel()
        taught = [t for t in range(r, n) if mask[t - 1] and t - r >= int(starts[t])]
        depth0 = targets(drafter, ex, elems, elems.depth == 0)
        assert sorted(depth0) == taught, name
        for first in answer_starts(ex):
            if first + 1 < n and mask[first] and first + 1 - r >= int(starts[first + 1]):
                assert first + 1 in depth0, f"{name}: the element reading the answer token at {first} is dropped"
            if first > int(starts[first]):  # a prompt-led answer: its first token follows a prompt token
                assert first not in depth0, f"{name}: the answer's first token is taught from prompt token {first - 1}"


# ------------------------------------------------------------------------------------ 2. packing, per document
# tests/unit/test_packing.py::test_packed_sequence_has_the_losses_of_its_conversations_alone checks the four built-in
# drafters' per-element losses on the full grid with the dense builder and no partitioner; tests/contract/test_masks.py and
# tests/contract/test_visibility_oracle.py check every builder's documents against an oracle on element sets alone. Missing:
# DFlash, COD's per-document share, the engine's element rule under packing, and the other builders and partitioned
# segments on real drafters.


def data_doc(example, elems_anchor: torch.Tensor, shift: int) -> torch.Tensor:
    """The data document of each anchor's position (its reads: x_a .. x_{a+shift}), -1 where they straddle two."""
    a, b = example.doc[elems_anchor], example.doc[elems_anchor + shift]
    return torch.where(a == b, a, torch.full_like(a, -1))


@pytest.mark.parametrize("name", ALL)
def test_packed_elements_and_their_targets_stay_in_their_document(target, name):
    """Under the engine's element rule (COD where the drafter samples it, else the full grid): every parallel slot
    (depth >= 1) lies in its anchor's document, and what each document's elements are taught lies in that document;
    on the full grid a later document has exactly the elements it has alone."""
    docs = conversations(target, 3, headless=(1,))
    drafter, (ex,) = build(target, name, docs, packed=True, **({"cod_ratio": 0.7} if name != "dflash" else {}))
    shift = ex.input_ids.shape[0] - drafter.supervision(ex).shape[0]
    r = shift + 1
    engine = engine_elements(drafter)
    for seed in range(3):
        elems, sup = engine(ex, torch.Generator().manual_seed(seed))
        assert elems.visibility == drafter.visibility
        a, d = elems.anchor, elems.depth
        deep = d > 0
        assert bool((ex.doc[a[deep]] == ex.doc[a[deep] + d[deep] + shift]).all()), f"{name}: a slot crosses a boundary"
        charged = sup[elems.position]
        assert bool((ex.doc[a[charged]] == ex.doc[a[charged] + d[charged] + r]).all())
        owner = data_doc(ex, a, shift)
        for j in range(len(docs)):
            taught = targets(drafter, ex, elems, charged & (owner == j))
            assert taught and all(int(ex.doc[t]) == j for t in taught), f"{name}: document {j} taught another's token"
    # DFlash runs every supervised anchor's block; on the full grid every drafter's later document keeps all of its
    # elements (what it has alone), not a share of the sequence's
    elems = grid(drafter, ex)
    owner = data_doc(ex, elems.anchor, shift)
    sup = drafter.supervision(ex)
    start = 0
    for j, doc in enumerate(docs):
        alone = api.TrainingExample(doc.input_ids, doc.loss_mask, doc.doc)
        mine = grid(drafter, alone)
        packed = (owner == j) & sup[elems.position]
        assert sorted(zip((elems.anchor[packed] - start).tolist(), elems.depth[packed].tolist(), strict=True)) == \
            sorted(zip(mine.anchor[drafter.supervision(alone)[mine.position]].tolist(),
                       mine.depth[drafter.supervision(alone)[mine.position]].tolist(), strict=True)), (name, j)
        start += len(doc.input_ids)


@pytest.mark.parametrize("name", DRAFTERS)  # DFlash trains the full grid: every anchor of every document
def test_cod_gives_every_packed_document_its_share(target, name):
    """COD samples once per sequence (docs/design.md section 8), uniformly among the depth's candidates: over many
    draws every packed document keeps the same share of its candidates as the others, the last one too."""
    docs = conversations(target, 3, headless=(1,))
    drafter, (ex,) = build(target, name, docs, packed=True, cod_ratio=0.7, cod_min_ratio=0.2)
    sup = drafter.supervision(ex)
    n = sup.shape[0]
    shift = ex.input_ids.shape[0] - n
    pdoc = position_docs(ex.doc, n)
    engine = engine_elements(drafter)
    kept = torch.zeros(len(docs), DEPTH)
    offered = torch.zeros(len(docs), DEPTH)
    for seed in range(48):
        elems, _ = engine(ex, torch.Generator().manual_seed(seed))
        owner = data_doc(ex, elems.anchor, shift)
        for d in range(1, DEPTH):
            parents = elems.anchor[elems.depth == d - 1]
            parents = parents[parents + d < n]
            cand = parents[(pdoc[parents + d] == pdoc[parents]) & sup[parents + d]]
            mine = owner[elems.depth == d]
            cand_owner = data_doc(ex, cand, shift)
            for j in range(len(docs)):
                kept[j, d] += int((mine == j).sum())
                offered[j, d] += int((cand_owner == j).sum())
    for d in range(1, DEPTH):
        overall = float(kept[:, d].sum() / offered[:, d].sum())
        assert overall < 0.95  # the depth really samples
        for j in range(len(docs)):
            assert offered[j, d] > 0
            assert float(kept[j, d] / offered[j, d]) == pytest.approx(overall, rel=0.15), (name, j, d)


SETUPS = {"dense": ("dense", {}, "none", 1), "chunked-peagle3": ("chunked", {"chunk_size": 16}, "peagle", 3),
          "precomputed-peagle2": ("precomputed", {}, "peagle", 2)}


@torch.no_grad()
def document_loss(drafter, example, elems, setup, doc: int) -> tuple[float, int, list[int]]:
    """(loss sum, count, per-depth hits) of ``doc``'s elements, accumulated over the partition's segments as the
    engine does, each segment attending through the chosen builder."""
    builder_name, builder_options, partitioner, parts = setup
    cls = plugins.get("mask builder", builder_name)
    builder = cls(cls.Options(**builder_options))
    segments = plugins.get("partitioner", partitioner)().partition(elems, parts)
    check_partition(elems, segments, partitioner)
    shift = example.input_ids.shape[0] - drafter.supervision(example).shape[0]
    total, count, hits = 0.0, 0, torch.zeros(elems.max_depth, dtype=torch.long)
    for seg in segments:
        if not seg.elements.numel():
            continue
        sub = elems.subset(seg.elements)
        mine = seg.loss_mask & (data_doc(example, sub.anchor, shift) == doc)
        terms = drafter.loss(example, elems, api.Segment(seg.elements, mine), api.SegmentAttention.build(builder, sub))
        total += float(terms.loss_sum)
        count += terms.count
        hits += terms.correct.long()
    return total, count, hits.tolist()


@pytest.mark.parametrize("setup", sorted(SETUPS))
@pytest.mark.parametrize("name", ALL)
def test_a_packed_document_never_sees_another_documents_context(target, name, setup):
    """The last of three packed documents trains exactly as it does alone, whatever the documents before it hold
    (other tokens, other features), under each builder and partition: no key of another document reaches it."""
    docs = conversations(target, 3)
    drafter, (ex,) = build(target, name, docs, packed=True)
    others = conversations(target, 3, seed=1)
    # the same last document after two other documents (other ids and lengths, so other positions too)
    swapped = [*others[:2], docs[2]]
    seqs = _Sequences(swapped, sum(len(d.input_ids) for d in swapped), True,
                      lambda j: features(target, swapped[j].input_ids, drafter))
    other = seqs.example(0)
    alone = _Sequences([docs[2]], len(docs[2].input_ids), True,
                       lambda j: features(target, docs[2].input_ids, drafter)).example(0)
    want = document_loss(drafter, alone, grid(drafter, alone), SETUPS[setup], 0)
    assert want[1] > 0
    for packed in (ex, other):
        got = document_loss(drafter, packed, grid(drafter, packed), SETUPS[setup], 2)
        assert got[1] == want[1] and got[2] == want[2], (name, setup)
        assert got[0] == pytest.approx(want[0], rel=1e-4, abs=1e-6), (name, setup)


# ------------------------------------------------------------------------------------- 3. the last aux layer id
# tests/unit/test_features_cache.py::test_capture_matches_hidden_state_convention pins the capture against transformers'
# hidden_states, tests/vllm_integration/test_vllm_export.py::test_ids_are_checked write_peagle's refusal of id L, and packages/specframe-dflash/tests/test_dflash.py
# the DFlash id mapping vLLM reads. Missing, per drafter: that the ids its export names make vLLM's target collect the
# very states it trained on, the last layer included, and that id L is refused all the way (options, capture, export).

AUX_DRAFTERS = tuple(n for n in ALL if n != "pard")  # PARD reads no target features
LAST = 3  # the tiny target's last layer (4 layers: ids 0..3)
AUX_IDS = {
    "increasing": {"dflash": [1, LAST]} | {n: [0, 2, LAST] for n in DRAFTERS},
    "unsorted": {"dflash": [LAST, 1]} | {n: [LAST, 0, 2] for n in DRAFTERS},
}


def vllm_collected(target, ids: torch.Tensor, layer_ids) -> torch.Tensor:
    """What vLLM 0.32's target hands the drafter for ``layer_ids`` (``EagleModelMixin``): each id once, in layer order
    (``sorted(set(ids))``), id 0 the embedding output and id i >= 1 the residual stream after decoder layer i - 1
    (``_maybe_add_hidden_state(aux, idx + 1, hidden_states, residual)``), concatenated in that order. Emulated on the
    transformers model with forward hooks on the layers' outputs, independently of specframe's pre-hooks."""
    base = target.model.model
    states: dict[int, torch.Tensor] = {}
    hooks = [base.embed_tokens.register_forward_hook(lambda m, i, o: states.__setitem__(0, o))]
    for idx, layer in enumerate(base.layers):
        hooks.append(layer.register_forward_hook(
            lambda m, i, o, idx=idx: states.__setitem__(idx + 1, o[0] if isinstance(o, tuple) else o)))
    try:
        with torch.no_grad():
            target.model(ids[None])
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([states[i][0] for i in sorted(set(layer_ids))], -1)


@pytest.mark.parametrize("order", sorted(AUX_IDS))
@pytest.mark.parametrize("name", AUX_DRAFTERS)
def test_vllm_collects_the_aux_states_the_drafter_trained_on(target, tmp_path, name, order):
    """The states the engine captures for the drafter's aux ids, through its fc, are what the exported folder's fc
    makes of what vLLM collects for the ids it names (last layer included); ids vLLM would collect in another order
    than the drafter trained on are refused at export, with the reason."""
    from safetensors.torch import load_file

    from specframe.features import capture_features

    ids_option = AUX_IDS[order][name]
    drafter, (ex,) = build(target, name, conversations(target, 1), packed=False, aux_layer_ids=ids_option)
    assert list(drafter.feature_spec().aux_layers) == ids_option
    trained = capture_features(target, ex.input_ids[None], drafter.feature_spec()).aux[0]  # what the engine feeds
    torch.testing.assert_close(trained, ex.features["aux_hidden"])
    try:
        drafter.export_vllm(tmp_path / "export", None)
    except api.SpecframeError as e:
        assert order == "unsorted" and "layer order" in str(e), str(e)
        assert not (tmp_path / "export").exists()
        return
    cfg = json.loads((tmp_path / "export" / "config.json").read_text())
    named = cfg.get("eagle_aux_hidden_state_layer_ids", cfg.get("aux_hidden_state_layer_ids"))
    assert named is not None and LAST in named
    served = vllm_collected(target, ex.input_ids, named)
    fc = load_file(str(tmp_path / "export" / "model.safetensors"))["fc.weight"]
    with torch.no_grad():
        torch.testing.assert_close(served @ fc.T, trained @ drafter.module().fc.weight.T)
    if order == "increasing":
        torch.testing.assert_close(served, trained)  # the very states, in the order trained


@pytest.mark.parametrize("name", AUX_DRAFTERS)
def test_an_aux_id_equal_to_the_layer_count_is_refused(target, tmp_path, name):
    """Id L would be the last layer's output, which specframe's capture (the input of a layer) cannot give: the
    drafter refuses it, the capture refuses it, and an export naming it (edited, or written elsewhere) cannot pass
    check_export."""
    from specframe.features import FeatureSpec
    from specframe.layouts import export

    layers = target.config.num_hidden_layers
    assert layers == LAST + 1
    bad = [1, layers] if name == "dflash" else [0, 2, layers]
    cls = plugins.get("drafter", name)
    with pytest.raises(api.UsageError, match=rf"\b{layers}\b"):
        cls(target.config, cls.Options(**{**OPTIONS[name], "aux_layer_ids": bad}))
    with pytest.raises(api.SpecframeError, match=rf"aux layer id {layers} out of range"):
        FeatureSpec(aux_layers=tuple(bad)).validate(layers)
    drafter, _ = build(target, name, conversations(target, 1), packed=False)
    drafter.export_vllm(tmp_path / "export", None)
    export.check_export(tmp_path / "export", target.config)
    path = tmp_path / "export" / "config.json"
    cfg = json.loads(path.read_text())
    key = "aux_hidden_state_layer_ids" if name == "dflash" else "eagle_aux_hidden_state_layer_ids"
    cfg[key] = [*cfg[key][:-1], layers]
    path.write_text(json.dumps(cfg))
    with pytest.raises(api.SpecframeError, match=rf"cannot be served by vLLM: .*\b{layers}\b"):
        export.check_export(tmp_path / "export", target.config)


# ------------------------------------------------------------------------- 4. exported fields the trainer never used
# tests/vllm_integration/test_vllm_export.py checks each writer's layout against hand-made weights, tests/vllm_integration/test_vllm_import.py the
# byte-identical round trip (EAGLE-3, P-EAGLE, PARD, ParallelSpec) and one P-EAGLE drafting check, packages/specframe-dflash/tests/test_dflash.py
# the DFlash layout. Missing: after a real training run, on a target whose RoPE, norm epsilon and attention heads are
# not the defaults, that every field vLLM reads equals what the trained drafter computes with, for every drafter, and
# that the folder imported back drafts the same tokens round after round.

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
EPS = 2e-6  # neither specframe's default (1e-5) nor transformers' Llama / Qwen3 default (1e-6)
K_INFER = {"dflash": 3, "parallelspec": 3}  # DFlash: vLLM serves block_size - 1 only; ParallelSpec: masks + 1 at most


@pytest.fixture(scope="module")
def unusual(tmp_path_factory):
    """A tiny target with Llama-3 RoPE at theta 50,000, RMSNorm epsilon 1e-6 and grouped-query attention (4 heads,
    2 KV heads), its chat data, and a cache of drafters trained on it (one short run each)."""
    from specframe.targets import load_target
    from specframe.targets import tiny_target as build_tiny
    from tests.train_fixtures import write_chat

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("unusual")
    path = build_tiny(root / "target", rope_parameters=LLAMA3_ROPE, seed=2)
    cfg = json.loads((path / "config.json").read_text())
    cfg["rms_norm_eps"] = EPS
    (path / "config.json").write_text(json.dumps(cfg))
    target = load_target(path)
    with torch.no_grad():
        target.model.get_output_embeddings().weight.mul_(30.0)  # a peaked target: training moves the drafter
    assert target.config.rms_norm_eps == EPS and target.config.rope_parameters["rope_type"] == "llama3"
    return SimpleNamespace(path=path, target=target, chat=write_chat(root / "chat.jsonl", n=8), root=root, runs={})


def trained_run(unusual, name: str):
    """(the drafter loaded from its checkpoint, the run's resolved drafter options) of a 3-step run of ``name``."""
    from specframe.engine import TrainConfig, train

    if name not in unusual.runs:
        options = {**OPTIONS[name], "k_infer": K_INFER.get(name, 4)}
        out = unusual.root / f"run-{name}"
        result = train(TrainConfig(drafter=name, output=str(out), target=str(unusual.path), data=str(unusual.chat),
                                   seq_len=48, max_steps=3, batch_size=2, val_examples=1, lr=1e-2,
                                   drafter_options=options), target=unusual.target, progress=False)
        resolved = json.loads((out / "config.json").read_text())["drafter_options"]
        drafter = load_drafter(result.checkpoint, unusual.target.config)
        drafter.module().eval()
        unusual.runs[name] = (drafter, resolved)
    return unusual.runs[name]


def vllm_reads(folder) -> tuple[dict, int | None]:
    """(the config vLLM builds the drafter from, the number of draft tokens it serves by default). A speculators folder
    goes through vLLM's own reader (``transformers_utils/configs/speculators/algos.py``, loaded from its file so vLLM
    itself is not imported; without vLLM a copy of its rules for these layouts); a PARD or ParallelSpec folder is read
    as its config.json."""
    import copy
    import importlib.util
    from pathlib import Path

    cfg = json.loads((Path(folder) / "config.json").read_text())
    kind = cfg.get("speculators_model_type")
    if kind is None:
        return cfg, None
    pre = copy.deepcopy(cfg["transformer_layer_config"])
    spec = importlib.util.find_spec("vllm")
    algos = Path(spec.origin).parent / "transformers_utils/configs/speculators/algos.py" if spec and spec.origin else None
    if algos is not None and algos.is_file():
        loader = importlib.util.spec_from_file_location("vllm_speculators_algos", algos)
        module = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(module)
        module.SUPPORTED_SPECULATORS_TYPES[kind](config_dict=cfg, pre_trained_config=pre)
    else:  # pragma: no cover - vLLM 0.32's rules for the three layouts specframe writes
        pre.update(draft_vocab_size=cfg.get("draft_vocab_size"), target_hidden_size=cfg.get("target_hidden_size"))
        if kind == "dflash":
            ids = cfg["aux_hidden_state_layer_ids"]
            pre.update(eagle_aux_hidden_state_layer_ids=ids, dflash_config={
                "mask_token_id": cfg["mask_token_id"], "target_layer_ids": [i - 1 for i in ids]})
        else:
            pre.update(norm_before_residual=cfg.get("norm_before_residual", kind == "eagle3"),
                       norm_before_fc=cfg.get("norm_before_fc", False),
                       eagle_aux_hidden_state_layer_ids=cfg.get("eagle_aux_hidden_state_layer_ids"))
            pre.update(fc_norm=cfg.get("fc_norm", False), norm_output=cfg.get("norm_output", False))
            if kind == "peagle":
                pre["pard_token"] = cfg["mask_token_id"]
    return pre, cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"]


def layer_fields(drafter) -> dict:
    """What the trained drafter's layers compute with, read off the module: sizes from its weights, every norm's
    epsilon, and its rotary cos / sin (positions past the original context, where Llama-3 RoPE rescales)."""
    state = drafter.module().state_dict()
    prefix = "model.layers." if "model.layers.0.self_attn.q_proj.weight" in state else "layers."
    layers = {int(k[len(prefix):].split(".")[0]) for k in state if k.startswith(prefix)}
    norms = {float(m.eps) for m in drafter.module().modules() if hasattr(m, "eps") and hasattr(m, "weight")}
    cos, sin = modeling.rotary(torch.arange(0, 3000, 37), drafter.shape, torch.float32)
    return {"layers": len(layers), "hidden": state[prefix + "0.post_attention_layernorm.weight"].shape[0],
            "q": state[prefix + "0.self_attn.q_proj.weight"].shape[0],
            "kv": state[prefix + "0.self_attn.k_proj.weight"].shape[0],
            "intermediate": state[prefix + "0.mlp.gate_proj.weight"].shape[0], "eps": norms, "cos": cos, "sin": sin}


def served_rotary(pre: dict, model_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin of the rotary embedding a transformers config built from vLLM's fields gives."""
    from transformers import LlamaConfig, Qwen3Config
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta", "rope_parameters",
            "rope_scaling", "max_position_embeddings")
    config_cls, rope_cls = (Qwen3Config, Qwen3RotaryEmbedding) if model_type == "qwen3" else (LlamaConfig,
                                                                                             LlamaRotaryEmbedding)
    config = config_cls(**{k: pre[k] for k in keys if pre.get(k) is not None})
    cos, sin = rope_cls(config)(torch.zeros(1), torch.arange(0, 3000, 37)[None])
    return cos[0], sin[0]


@pytest.mark.parametrize("name", ALL)
def test_every_field_vllm_reads_is_what_the_trained_drafter_used(unusual, tmp_path, name):
    """After a short real run: the layer sizes, depth, heads, head width, every norm's epsilon, activation, context
    length and RoPE (its cos / sin past the original context) vLLM builds from the export are the trained module's;
    so are the vocabulary sizes, draft-vocabulary maps, aux ids, target width, norm-before-residual flags, mask
    tokens, number of masks, DFlash's block and each layout's draft tokens per step."""
    from safetensors.torch import load_file

    from specframe.layouts import export

    drafter, options = trained_run(unusual, name)
    target = unusual.target
    manifest = drafter.export_vllm(tmp_path / "export", target.tokenizer)
    pre, tokens = vllm_reads(tmp_path / "export")
    weights = load_file(str(tmp_path / "export" / "model.safetensors"))
    used = layer_fields(drafter)
    state = drafter.module().state_dict()
    # the layers: sizes, depth, heads, epsilon, activation, context, RoPE
    heads, kv = int(pre["num_attention_heads"]), int(pre.get("num_key_value_heads") or pre["num_attention_heads"])
    head_dim = int(pre.get("head_dim") or int(pre["hidden_size"]) // heads)
    assert int(pre["hidden_size"]) == used["hidden"] and int(pre["num_hidden_layers"]) == used["layers"]
    assert heads * head_dim == used["q"] and kv * head_dim == used["kv"] and head_dim == drafter.shape.head_dim
    assert int(pre["intermediate_size"]) == used["intermediate"]
    assert {float(pre["rms_norm_eps"])} == used["eps"] == {EPS}
    assert pre["hidden_act"] == drafter.shape.act
    assert int(pre["max_position_embeddings"]) == drafter.shape.max_positions
    cos, sin = served_rotary(pre, pre.get("model_type", "llama"))
    torch.testing.assert_close(cos, used["cos"])
    torch.testing.assert_close(sin, used["sin"])
    assert int(pre["vocab_size"]) == target.config.vocab_size
    if name == "pard":
        assert pre["pard_token"] == drafter.mask_token_id
        assert bool(pre.get("tie_word_embeddings")) == drafter.tie
        return
    # the drafter-level fields: vocabularies, aux ids, target width, mask tokens, draft tokens per step
    aux = drafter.aux_layer_ids
    assert pre["eagle_aux_hidden_state_layer_ids"] == aux
    assert options["aux_layer_ids"] in (None, aux)
    assert int(pre["target_hidden_size"]) == target.config.hidden_size == state["fc.weight"].shape[1] // len(aux)
    draft_vocab = state["lm_head.weight"].shape[0]
    assert int(pre["draft_vocab_size"]) == draft_vocab == (drafter.draft_vocab_size or target.config.vocab_size)
    if draft_vocab < target.config.vocab_size:
        assert torch.equal(weights["d2t"], state["d2t"]) and torch.equal(weights["t2d"], state["t2d"])
    if name == "dflash":
        assert pre["dflash_config"]["mask_token_id"] == drafter.mask_token_id
        assert pre["dflash_config"]["target_layer_ids"] == [i - 1 for i in aux]
        # vLLM's DFlash proposer runs a block of K + 1 slots: the block trained on
        assert tokens + 1 == options["block_size"] == json.loads((tmp_path / "export" / "config.json").read_text())[
            "block_size"]
        return
    # specframe's EAGLE layer starts the residual stream from the raw fused state (vLLM's eagle3 default is true)
    assert pre["norm_before_residual"] is False and not pre.get("norm_before_fc") and not pre.get("fc_norm")
    if name == "parallelspec":
        masks = options["num_masks"] or options["k_train"] - 1
        assert pre["parallelspec_mask_token_ids"] == drafter.mask_token_ids and pre["parallelspec_num_masks"] == masks
        assert pre["pard_token"] == drafter.mask_token_ids[0]
        assert torch.equal(weights["mask_embeddings"], state["mask_embeddings"])
        assert export.read_manifest(tmp_path / "export").max_speculative_tokens == masks + 1 >= options["k_infer"]
        return
    assert tokens == options["k_infer"] == manifest["speculative_tokens"]
    if name == "peagle":
        assert pre["pard_token"] == drafter.mask_token_id
        assert torch.equal(weights["mask_hidden"].reshape(-1), state["mask_hidden"].reshape(-1))


@pytest.mark.parametrize("name", ALL)
def test_an_exported_drafter_imported_back_drafts_the_same_tokens(unusual, tmp_path, name):
    """The trained drafter and the one `specframe generate --checkpoint EXPORT` builds from its export propose the
    same drafts in every round of a greedy decode, and so emit the same tokens."""
    from specframe.inference.engine import generate

    drafter, options = trained_run(unusual, name)
    target = unusual.target
    drafter.export_vllm(tmp_path / "export", target.tokenizer)
    try:
        copy = load_drafter(tmp_path / "export", target.config, target.tokenizer)
    except api.SpecframeError as e:  # pragma: no cover - until DFlash folders import (issue 30, item 3)
        if name == "dflash" and ("dflash" in str(e) or "import" in str(e)):
            pytest.xfail(f"DFlash folders do not import yet: {e}")
        raise
    assert copy.name == name
    copy.module().eval()
    greedy = plugins.get("verifier", "greedy")()
    runs = []
    for d in (drafter, copy):
        drafts: list[list[int]] = []
        plain = d.propose

        def propose(k, generator=None, plain=plain, drafts=drafts):
            draft = plain(k, generator)
            drafts.append(draft.tokens.tolist())
            return draft

        d.propose = propose
        try:
            prompt = torch.tensor(target.tokenizer.encode("the quick brown fox jumps over"))
            out = generate(target.model.eval(), prompt, greedy, d, k=options["k_infer"], max_new_tokens=24,
                           eos_token_id=())
        finally:
            del d.propose
        runs.append((drafts, out.tokens))
    assert len(runs[0][0]) > 3
    assert runs[0] == runs[1], name


# -------------------------------------------------------------------------------- 5. a rank with nothing supervised
# tests/e2e/test_distributed.py covers a rank that holds no sequence (test_a_rank_without_a_sequence_still_joins_the_
# reduction) and a step that supervises nothing on any rank (test_a_step_that_supervises_nothing_does_not_deadlock_ddp),
# both on P-EAGLE. Missing: a rank that holds a sequence with no supervised element while the other rank's is
# supervised, the case of the reports (one rank's batch has no valid anchor), on every drafter.


@pytest.mark.parametrize("name", ALL)
def test_a_sequence_with_nothing_supervised_gives_a_zero_loss_in_the_graph(target, name):
    """Every segment of a sequence without an answer token charges nothing, and its zero loss still back-propagates
    (DDP's reduction is armed by that backward; a loss outside the graph would raise, a skipped one would leave the
    other ranks waiting) into zero gradients."""
    docs = conversations(target, 1)
    blank = [api.TrainingExample(d.input_ids, torch.zeros_like(d.loss_mask), d.doc) for d in docs]
    drafter, (ex,) = build(target, name, blank, packed=False)
    drafter.module().train()
    elems = grid(drafter, ex)
    assert not bool(drafter.supervision(ex).any())
    builder = plugins.get("mask builder", "dense")()
    segments = plugins.get("partitioner", "peagle")().partition(elems, 2)
    check_partition(elems, segments, "peagle")
    drafter.module().zero_grad(set_to_none=True)
    for seg in segments:
        sub = elems.subset(seg.elements)
        terms = drafter.loss(ex, elems, seg, api.SegmentAttention.build(builder, sub))
        assert terms.count == 0 and float(terms.loss_sum.detach()) == 0.0 and int(terms.total.sum()) == 0
        assert terms.loss_sum.requires_grad, f"{name}: a segment without supervision returns a loss outside the graph"
        (terms.loss_sum * 0.5).backward()
    grads = [p.grad for p in drafter.module().parameters() if p.requires_grad and p.grad is not None]
    assert grads and all(not bool(g.any()) for g in grads)


def blank_slot_zero(trainer_cls) -> None:
    """Patch ``trainer_cls.train_step`` so that the sequence in slot 0 of every step (rank 0's under 2 ranks and
    batch size 2) has no answer token: that rank's batch has no supervised element, the other rank's has."""
    plain_step = trainer_cls.train_step

    def train_step(self):
        blank = self.batch_indices(self.step)[0]
        if self.dist.world > 1 and self.dist.rank == 0:  # its batch is that sequence alone
            assert [idx for _, idx in self.local_slots(self.step)] == [blank]
        plain = self.source.example

        def example(i):
            ex = plain(i)
            return ex if i != blank else api.TrainingExample(ex.input_ids, torch.zeros_like(ex.loss_mask), ex.doc,
                                                             ex.features)

        self.source.example = example
        try:
            return plain_step(self)
        finally:
            del self.source.example

    trainer_cls.train_step = train_step


RANKS = """
import os
import sys
with open({pids!r}, "a") as f:  # a deadlocked run is killed by these ids
    f.write(f"{{os.getpid()}}\\n")
sys.path.insert(0, {root!r})
import torch
torch.set_num_threads(1)
from torch.nn.parallel import DistributedDataParallel
from specframe.engine import TrainConfig, train
from specframe.engine.loop import Trainer
from tests.unit.test_anchor_regressions import blank_slot_zero
blank_slot_zero(Trainer)
blanked = Trainer.train_step
def step(self):
    assert isinstance(self.ddp, DistributedDataParallel)  # gradients go through torch's DDP
    return blanked(self)
Trainer.train_step = step
for cfg in {configs!r}:  # one process group, every drafter in turn
    train(TrainConfig(**cfg), progress=False)
"""


@pytest.mark.slow
def test_a_rank_whose_batch_has_nothing_supervised_matches_one_process(tmp_path, monkeypatch):
    """2 gloo ranks, batch size 2: every step rank 0's sequence has no supervised element and rank 1's has. Every
    drafter finishes (no deadlock, no NaN) with the one-process weights and losses: the step's loss is the global sum
    over the global count, to which the empty rank adds nothing but its share of the reduction."""
    import os
    import sys
    import textwrap
    from pathlib import Path

    import attrs
    from transformers import AutoConfig

    from specframe.engine import TrainConfig, train
    from tests.train_fixtures import build as build_assets

    root = Path(__file__).resolve().parents[2]
    target_dir, chat = build_assets(tmp_path / "assets")
    monkeypatch.setattr(Trainer, "train_step", Trainer.train_step)  # restored after the test
    blank_slot_zero(Trainer)

    def config(name, out):
        options = {**OPTIONS[name], **({"draft_vocab_size": 64} if "draft_vocab_size" in OPTIONS[name] else {})}
        return TrainConfig(drafter=name, output=str(out), target=str(target_dir), data=str(chat), seq_len=48,
                           max_steps=2, batch_size=2, lr=3e-3, val_examples=1, partitioner="peagle", partitions=2,
                           drafter_options=options)

    single = {name: train(config(name, tmp_path / f"one-{name}"), progress=False) for name in ALL}
    for run in single.values():
        assert all(m["elements"] > 0 for m in run.metrics)  # rank 1's sequence is supervised every step
    script, pids = tmp_path / "ranks.py", tmp_path / "ranks.pids"
    configs = [attrs.asdict(config(name, tmp_path / f"two-{name}")) for name in ALL]
    script.write_text(textwrap.dedent(RANKS.format(root=str(root), pids=str(pids), configs=configs)))
    from tests.e2e.test_distributed import run_ranks

    run_ranks([str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", "2", "--master-port", "29561",
               str(script)], pids, 900, {**os.environ, "OMP_NUM_THREADS": "1"})
    target_config = AutoConfig.from_pretrained(target_dir)
    for name in ALL:
        # each drafter's own checkpoint format (PARD's is a transformers folder)
        one = load_drafter(single[name].checkpoint, target_config).module().state_dict()
        two = load_drafter(tmp_path / f"two-{name}", target_config).module().state_dict()
        assert one.keys() == two.keys()
        for key in one:
            torch.testing.assert_close(two[key], one[key], atol=1e-5, rtol=1e-4, msg=f"{name}: {key}")
        logged = [json.loads(line) for line in (tmp_path / f"two-{name}" / "metrics.jsonl").read_text().splitlines()
                  if line.strip()]
        losses = [m["train_loss"] for m in logged if "train_loss" in m]
        assert losses == pytest.approx([m["train_loss"] for m in single[name].metrics], rel=1e-4), name
