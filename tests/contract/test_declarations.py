"""Declare, don't name (API 6, issue 31): the core reads what components declare, never their names or option
spellings. The AST test fails when a core module compares a registered component's name or reads a plugin option
by its spelling; the fixture plugins show a third-party drafter and mask builder joining through their declarations."""

from __future__ import annotations

import ast
from pathlib import Path

import attrs
import pytest
from transformers import LlamaConfig

from specframe import api, memory, plugins
from specframe.masks import default_mask_builder, ranked_mask_builders
from tests.plugin_fixtures import DRAFTER_SOURCE

ROOT = Path(__file__).resolve().parents[2]

#: (module, name) pairs the scan accepts, each with its reason. The files layer for drafter folders
#: (specframe/layouts/) and what runs vLLM (specframe/vllm/) compare vLLM's and speculators' own layout and method
#: identifiers ("eagle3", "peagle", "dflash", "ngram", ...: the folder formats vLLM reads, which happen to share the
#: drafters' names), never a component's.
ALLOWED = {
    ("specframe/report/runs.py", "tree"): "the method label suffix bench writes for a tree run (label/tree), not a verifier",
}
ALLOWED_FOLDERS = ("specframe/layouts/", "specframe/vllm/")
#: the API-5 defaults: the option names the built-ins used then, read only for a plugin that declares nothing
ALLOWED_FILES = ("specframe/declarations.py",)


def _registered() -> tuple[set[str], set[str]]:
    registry = plugins.load()
    names, options = set(), set()
    for kind in ("drafter", "mask builder", "partitioner", "verifier"):
        for name in registry.names(kind):
            names.add(name)
            cls = registry.get(kind, name)
            if attrs.has(cls.Options):
                options |= {f.name for f in attrs.fields(cls.Options)}
    return names - {"none"}, options  # "none" is also Python-ish vocabulary (a partitioner that does not split)


def _strings(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [s for element in node.elts for s in _strings(element)]
    return []


def name_uses(source: str, names: set[str], options: set[str]) -> list[tuple[int, str]]:
    """(line, string) of every comparison with a component name (``==``, ``in``, ``.startswith("name/")``) and
    every ``getattr`` / ``hasattr`` of a plugin option by its spelling on an ``options`` object."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        found: list[str] = []
        if isinstance(node, ast.Compare):
            found = [s for side in (node.left, *node.comparators) for s in _strings(side) if s in names]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "startswith":
            found = [s.split("/")[0] for arg in node.args for s in _strings(arg) if s.split("/")[0] in names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and "options" in ast.unparse(node.args[0])):
            found = [s for s in _strings(node.args[1]) if s in options]
        hits += [(node.lineno, s) for s in found]
    return hits


def test_the_scan_catches_each_way_of_naming():
    names, options = {"peagle", "dense"}, {"k_train"}
    planted = {
        'if drafter == "peagle": pass': "peagle",
        'x = builder in ("dense", "chunked")': "dense",
        'x = label.startswith("peagle/")': "peagle",
        'x = getattr(self.drafter.options, "k_train", None)': "k_train",
    }
    for source, name in planted.items():
        assert [s for _, s in name_uses(source, names, options)] == [name], source
    assert name_uses('x = getattr(model, "k_train", None)\ny = kind == "cuda"', names, options) == []


def test_no_core_module_compares_a_component_name_or_reads_an_option_by_name():
    names, options = _registered()
    bad = []
    for path in sorted((ROOT / "specframe").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(ALLOWED_FOLDERS) or rel in ALLOWED_FILES:
            continue
        bad += [f"{rel}:{line}: {s!r}" for line, s in name_uses(path.read_text(), names, options)
                if (rel, s) not in ALLOWED]
    assert not bad, "the core names components; read a declaration instead (specframe.api, API 6):\n" + "\n".join(bad)


def test_no_core_module_names_a_built_in_plugins_module():
    """The core never recognises a built-in by where it lives: the memory estimate once counted the two built-in
    partitioners in closed form by class path ("specframe_plugins.partition_peagle.PeaglePartitioner"), which no third
    party's partitioner could match; it now reads ``Partitioner.counted_as``. Strings and imports alike."""
    bad = [f"{path.relative_to(ROOT).as_posix()}:{n}: {line.strip()}"
           for path in sorted((ROOT / "specframe").rglob("*.py"))
           for n, line in enumerate(path.read_text().splitlines(), 1)
           if "specframe_plugins" in line and not line.lstrip().startswith("#")]
    assert not bad, "core modules naming a built-in plugin's module:\n" + "\n".join(bad)


# ------------------------------------------------------------------------------------------ fixture plugins
HORIZON = '''
    import attrs
    import torch
    from specframe import api

    @attrs.define
    class HorizonOptions:
        horizon: int = attrs.field(default=3, metadata={"help": "depth, spelt this drafter's way"})
        keep: float = attrs.field(default=0.5, metadata={"help": "COD keep ratio, spelt this drafter's way"})
        lookahead: int = attrs.field(default=2, metadata={"help": "K, spelt this drafter's way"})

    class Horizon(api.Drafter):
        name = "horizon"
        Options = HorizonOptions

        @classmethod
        def training(cls, options):
            return api.Training(depth=options.horizon, k=options.lookahead, cod_ratio=options.keep)

        @classmethod
        def comparison_options(cls, depth, draft_vocab_size, k):
            return {"horizon": depth, "lookahead": k}

        def feature_spec(self): return api.FeatureSpec(aux_layers=None, final_hidden=False)
        def module(self): return torch.nn.Linear(2, 2)
        def supervision(self, example): return example.loss_mask[1:].clone()
        def loss(self, example, elements, segment, attention): raise NotImplementedError
        def start(self, prompt_ids, features): raise NotImplementedError
        def propose(self, k, generator=None): raise NotImplementedError
        def accept(self, emitted, features): raise NotImplementedError

    @api.hookimpl
    def register_drafters(register):
        register(Horizon)
'''

LEGACY = DRAFTER_SOURCE.replace('''    class {cls}(api.Drafter):''', '''    import attrs

    @attrs.define
    class LegacyOptions:
        k_train: int = 6
        k_infer: int = 4
        draft_vocab_size: int = 100
        cod_ratio: float = 0.5

    class {cls}(api.Drafter):
        Options = LegacyOptions''').format(name="legacy", cls="Legacy")


def test_a_drafter_spelling_its_depth_its_own_way_joins_the_comparison_at_equal_depth(site):
    import sys

    site.add("specframe-horizon", "horizon", HORIZON)
    sys.path.insert(0, str(ROOT))
    from benchmarks.presets import PRESETS

    preset = attrs.evolve(PRESETS["ci"], drafters={"peagle": {"layers": 1}, "horizon": {}})
    opts = preset.train_options("horizon")
    assert opts == {"horizon": preset.depth, "lookahead": min(preset.speed_k, preset.depth)}
    assert preset.train_options("peagle")["k_train"] == preset.depth  # the same depth, spelt P-EAGLE's way
    cls = plugins.get("drafter", "horizon")
    declared = cls.training(cls.Options(**opts))
    assert declared.depth == preset.depth and declared.k == min(preset.speed_k, preset.depth)
    # the run config resolves the declared depth when no --depth is given
    from specframe.engine.config import TrainConfig
    from specframe.engine.run_config import resolve

    cfg = resolve(TrainConfig(drafter="horizon", output="out", drafter_options=opts, device="cpu"))
    assert cfg.depth == preset.depth


def test_the_memory_estimate_applies_a_drafters_declared_cod_schedule(site):
    site.add("specframe-horizon", "horizon", HORIZON)
    tc = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    full = memory.estimate(memory.MemoryConfig(drafter="horizon", target_config=tc, seq_len=128, mask_builder="dense",
                                               drafter_options={"keep": 1.0}, features="synthetic"))
    cod = memory.estimate(memory.MemoryConfig(drafter="horizon", target_config=tc, seq_len=128, mask_builder="dense",
                                              drafter_options={"keep": 0.5}, features="synthetic"))
    assert full.elements == 127 * 3 - 3  # the full grid of depth 3 (horizon's default) over 127 positions
    assert cod.elements < full.elements  # keep 0.5 is the COD ratio the drafter declared


def test_a_plugin_written_for_api_5_keeps_its_defaults_under_the_old_names(site):
    site.add("specframe-legacy", "legacy", LEGACY)
    cls = plugins.get("drafter", "legacy")
    declared = cls.training(cls.Options())
    assert (declared.depth, declared.k, declared.cod_ratio) == (6, 4, 0.5)
    assert cls.comparison_options(5, 64, 3) == {"draft_vocab_size": 64, "k_train": 5, "k_infer": 3}


BUILDER = '''
    from specframe import api

    class Costly(api.MaskBuilder):
        name = "costly"
        visibilities = frozenset(api.VISIBILITY_RULES)
        preference = {preference}
        {declare}

        def build(self, query, key):
            dense = api.visible(query, key)
            import torch.nn.functional as F
            return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense.to(q.device))

    @api.hookimpl
    def register_mask_builders(register):
        register(Costly)
'''


def _estimate(builder: str):
    tc = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    cfg = memory.MemoryConfig(drafter="peagle", target_config=tc, seq_len=256, depth=4, mask_builder=builder,
                              drafter_options={"layers": 1, "draft_vocab_size": 64}, features="synthetic")
    return memory.estimate(cfg)


def test_a_third_party_mask_builder_gets_its_own_memory_cost(site):
    declare = "def attention_bytes(self, shape): return 1000 * shape.rows + 7"
    site.add("specframe-costly", "costly", BUILDER.format(preference=0, declare=declare))
    est = _estimate("costly")
    rows = est.largest_segment["forwarded"]
    assert est.breakdown["attention"] == 1000 * rows + 7


def test_a_mask_builder_that_declares_no_cost_is_charged_a_full_mask(site):
    site.add("specframe-costly", "costly", BUILDER.format(preference=0, declare="pass"))
    assert _estimate("costly").breakdown["attention"] == _estimate("dense").breakdown["attention"]



def test_a_mask_builder_that_declares_query_blocks_is_charged_as_blocks(site):
    site.add("specframe-costly", "costly", BUILDER.format(preference=0, declare="query_blocks = True"))
    # flex declares query blocks and no cost of its own: both get the 256-query block model
    assert _estimate("costly").breakdown["attention"] == _estimate("flex").breakdown["attention"]
    assert _estimate("costly").breakdown["attention"] != _estimate("dense").breakdown["attention"]


@pytest.mark.parametrize("preference, default", [(0, "chunked"), (100, "costly")])
def test_the_default_mask_builder_is_the_most_preferred_one_for_the_device(site, preference, default):
    site.add("specframe-costly", "costly", BUILDER.format(preference=preference, declare="pass"))
    assert default_mask_builder("cpu") == default
    assert ranked_mask_builders("cuda")[0] == ("flex" if preference < 40 else "costly")


def test_the_built_in_declarations():
    registry = plugins.load()
    builders = {n: registry.get("mask builder", n) for n in registry.names("mask builder")}
    assert [n for n, c in builders.items() if c.small_calls] == ["dense"]
    assert {n for n, c in builders.items() if c.query_blocks} == {"chunked", "flex"}
    assert [n for n in registry.names("partitioner") if registry.get("partitioner", n).splits_sequences] == ["peagle"]
    assert [n for n in ("greedy", "sampling", "tree") if registry.get("verifier", n).drafts_trees] == ["tree"]
    greedy = {n: registry.get("verifier", n)().greedy for n in ("greedy", "sampling", "tree")}
    assert greedy == {"greedy": True, "sampling": False, "tree": True}
    sampling = registry.get("verifier", "sampling")
    assert sampling(sampling.Options(temperature=0.0)).greedy
    ngram = registry.get("drafter", "ngram")(LlamaConfig(vocab_size=8, hidden_size=4, num_attention_heads=1))
    assert ngram.vllm_speculative_config(3) == {"method": "ngram", "num_speculative_tokens": 3,
                                                "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    assert api.Drafter.vllm_speculative_config(ngram, 3) is None  # the default: vLLM serves exported weights only


#: the built-in drafters whose options are the EAGLE family's (``api.eagle.family_training`` reads them)
EAGLE_FAMILY = ("peagle", "eagle3", "pard", "parallelspec")


@pytest.mark.parametrize("name", EAGLE_FAMILY)
def test_the_eagle_familys_shared_options_are_defined_once(name):
    """Each family drafter takes its shared fields from ``api.eagle.FamilyFields``: the shared help, default and
    validator, and an error that names the drafter. Fails when a drafter spells one of them out again (a copied field
    without its validator, or with another default or help) or ``family_training`` reads one the drafter lacks."""
    from specframe.structuring import structure_options

    cls = plugins.get("drafter", name)
    own = attrs.fields_dict(cls.Options)
    shared = api.eagle.FamilyFields(name)
    probes = {"k_infer": 0, "draft_vocab_size": 0, "loss_chunk": 0, "cod_ratio": 1.5, "cod_min_ratio": -0.1}
    checked = 0
    for field_name in ("k_infer", "draft_vocab_size", "aux_layer_ids", "train_embedding", "cod_ratio",
                       "cod_min_ratio", "activation_checkpointing", "loss_chunk", "vocab_position_mask"):
        if field_name not in own:
            continue
        make = getattr(shared, field_name)
        # the two fields whose default a drafter chooses: the COD ratio (the papers differ) and the draft vocabulary
        # (None, the whole vocabulary, for every built-in since API 16; 16,384 for a plugin that says nothing)
        chosen = {"cod_ratio": lambda: make(own[field_name].default),
                  "draft_vocab_size": lambda: make(default=None)}
        reference = chosen.get(field_name, make)()
        probe = attrs.make_class("Probe", {field_name: reference})
        expected = attrs.fields(probe)[0]
        got = own[field_name]
        assert got.metadata["help"].startswith(expected.metadata["help"]), f"{name}.{field_name}: its own help"
        if field_name != "cod_ratio":
            assert got.default == expected.default, f"{name}.{field_name}: another default"
        if field_name in probes:
            with pytest.raises(api.UsageError, match=rf"^{name} option '{field_name}'"):
                structure_options({field_name: probes[field_name]}, cls.Options, f"drafter '{name}'")
        checked += 1
    assert checked >= 5, f"{name} has only {checked} of the family's fields"
    declared = cls.training(cls.Options())  # family_training reads the shared fields by attribute
    assert declared.loss_chunk == own["loss_chunk"].default and declared.cod_ratio == own["cod_ratio"].default


#: a third-party drafter whose layers are its own type (no ``self_attn`` carrying a LayerShape): the estimator cannot
#: find them by structure. ``SHAPES`` (filled per test) is what it declares through ``layer_shapes`` (API 9).
OWN_LAYERS = '''
    import attrs, torch
    from torch import nn
    from specframe import api

    SHAPES = {shapes}

    class Mixer(nn.Module):
        def __init__(self, h):
            super().__init__()
            self.attend, self.ffn = nn.Linear(h, h), nn.Linear(h, h)

    @attrs.define
    class Options:
        k_train: int = 3

    class OwnLayers(api.Drafter):
        name = "own-layers"
        Options = Options
        def __init__(self, target_config, options=None):
            super().__init__(target_config, options)
            self.net = nn.ModuleList([Mixer(int(target_config.hidden_size)) for _ in range(2)])
        def layer_shapes(self):
            if SHAPES is None:
                return None
            return tuple(api.modeling.LayerShape(hidden=h, heads=2, kv_heads=2, head_dim=h // 2, intermediate=i)
                         for h, i in SHAPES)
        def feature_spec(self): return api.FeatureSpec()
        def module(self): return self.net
        def supervision(self, example): return torch.ones_like(example.input_ids, dtype=torch.bool)
        def loss(self, example, elements, segment, attention): raise NotImplementedError
        def start(self, prompt_ids, features): raise NotImplementedError
        def propose(self, k, generator=None): raise NotImplementedError
        def accept(self, emitted, features): raise NotImplementedError

    @api.hookimpl
    def register_drafters(register):
        register(OwnLayers)
'''


def _own_layers_estimate(site, shapes):
    import sys

    if "specframe_own_layers" not in sys.modules:
        site.add("specframe-own-layers", "own-layers", OWN_LAYERS.format(shapes=None))
        plugins.get("drafter", "own-layers")  # imports the module
    sys.modules["specframe_own_layers"].SHAPES = shapes
    tc = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    return memory.estimate(memory.MemoryConfig(drafter="own-layers", target_config=tc, seq_len=64,
                                               mask_builder="dense", features="synthetic"))


def test_a_drafter_with_its_own_layer_type_is_costed_by_what_it_declares(site):
    """API 9: a drafter's declared layers are charged (one per declared shape, each by its own size); undeclared and
    unseen, the estimate says it counted none instead of passing silently. Fails when the estimator ignores the
    declaration, charges every layer as the first one, or drops the note."""
    unseen = _own_layers_estimate(site, None)
    assert any("declares no decoder layers" in note for note in unseen.notes)
    none = _own_layers_estimate(site, [])
    assert none.notes == [] and none.breakdown["saved_activations"] == unseen.breakdown["saved_activations"]
    small, large = (16, 32), (64, 256)
    one = _own_layers_estimate(site, [small])
    two = _own_layers_estimate(site, [small, large])
    other = _own_layers_estimate(site, [large])
    rows = one.largest_segment["forwarded"]

    def per_row(hidden: int, intermediate: int) -> float:  # fp32 activation bytes one layer saves per row
        return (memory.A_H * hidden + memory.A_I * intermediate) * memory.ACT_TRANSIENT * 4

    assert one.notes == [] and one.breakdown["saved_activations"] > none.breakdown["saved_activations"]
    saved = {n: e.breakdown["saved_activations"] for n, e in (("none", none), ("one", one), ("two", two))}
    assert saved["one"] - saved["none"] == pytest.approx(rows * per_row(*small), abs=2)  # (bytes are whole)
    # every layer by its own size: the large layer adds its own activations, not another copy of the first's
    assert saved["two"] - saved["one"] == pytest.approx(rows * per_row(*large), abs=2)
    assert two.breakdown["backward_layer"] == other.breakdown["backward_layer"]  # one layer's backward: the largest


def test_every_built_in_drafters_layers_are_found():
    """The built-ins are costed with their layers (found by structure): none gets the estimate's note."""
    registry = plugins.load()
    tc = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2)
    for name in registry.names("drafter"):
        if name == "ngram":  # prompt lookup: no weights, nothing to train or cost
            continue
        cls = registry.get("drafter", name)
        est = memory.estimate(memory.MemoryConfig(drafter=name, target_config=tc, seq_len=64, features="synthetic",
                                                  drafter_options=cls.comparison_options(3, 64, 3)))
        assert est.notes == [], f"{name}: {est.notes}"
