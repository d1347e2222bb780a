"""The decoding methods a comparison measures: plain decoding, a trained drafter from a checkpoint or folder, an
untrained drafter plugin (the ``ngram`` baseline), and the verifiers they are checked by."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from specframe import api
from specframe.errors import UsageError, read_json
from specframe.inference.engine import TreeShape


PLAIN = "plain"


def verifier_spec(text: str) -> tuple[str, api.Verifier]:
    """``NAME`` or ``NAME:KEY=VALUE,KEY=VALUE`` (the inline options every component takes: ``compose.named``; a value
    is typed by the verifier's ``Options``: ``true``, ``8``, ``[1.0, 2.0]``) -> (the label suffix, the verifier with
    those options)."""
    from specframe import compose

    name, given = compose.named("verifier", text)
    return text.strip(), compose.component("verifier", name, given)


def make_verifier(name: str, *, temperature: float | None = None, top_k: int | None = None,
                  top_p: float | None = None) -> api.Verifier:
    """A verifier by name (options inline: ``sampling:temperature=0.5``) with its sampling options; options the
    verifier does not have are refused, and so is an option given both inline and as a flag."""
    from specframe import compose, plugins

    text = name
    name, inline = compose.named("verifier", text)
    cls = plugins.get("verifier", name)
    given = {k: v for k, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)) if v is not None}
    known = {a.name for a in attrs.fields(cls.Options)} if attrs.has(cls.Options) else set()
    unknown = sorted(set(given) - known)
    if unknown:
        has = f"its options: {', '.join(sorted(known))}" if known else "it is greedy"
        raise UsageError(
            f"verifier '{name}' has no {', '.join(unknown)} option ({has}); use --verifier sampling or tree to sample"
        )
    twice = sorted(set(given) & set(inline))
    if twice:
        raise UsageError(f"--verifier {text} and --{twice[0].replace('_', '-')} both set {twice[0]}: give it once")
    return compose.component("verifier", name, {**inline, **given})


def is_greedy(verifier: api.Verifier) -> bool:
    """Whether the verifier's output is plain greedy decoding's (so speculative output must match it exactly)."""
    return bool(verifier.greedy)  # declared by the verifier (API 6)


@attrs.define(eq=False)
class Method:
    """A decoding method: ``drafter`` None is plain decoding. ``checkpoint_hash`` / ``token_budget`` are the
    trained drafter's provenance (None for plain and n-gram)."""

    label: str
    drafter: api.Drafter | None = None
    k: int = 5
    tree: TreeShape | None = None
    checkpoint: str | None = None
    checkpoint_hash: str | None = None
    token_budget: int | None = None
    #: this method's own verifier (None: the run's): one drafter under two verifiers side by side, e.g. DSpark's
    #: block verified whole and through its confidence schedule
    verifier: api.Verifier | None = None

    @property
    def slots(self) -> int:
        """Draft slots reported in per-position acceptance."""
        if self.drafter is None:
            return 0
        return self.tree.depth if self.tree is not None else self.k


def builds_trees(drafter: api.Drafter | None) -> bool:
    """Whether the drafter's ``propose_tree`` builds a real tree (``Drafter.builds_trees``)."""
    return bool(getattr(drafter, "builds_trees", False))


def _shape(drafter: api.Drafter, k: int, tree: TreeShape | None) -> tuple[int, TreeShape | None]:
    """(k, tree) a method really decodes with: a drafter that does not build trees drafts its chain of the tree's
    depth (what its ``propose_tree`` falls back to), so it is measured and labelled as that chain, never as a tree."""
    if tree is not None and not builds_trees(drafter):
        return tree.depth, None
    return k, tree


def default_k(drafter: api.Drafter, fallback: int = 5) -> int:
    """The drafter's own inference depth where it declares one (``Drafter.training``, API 6), else ``fallback``."""
    return int(type(drafter).training(drafter.options).k or fallback)


def token_budget(checkpoint_dir: Path) -> int | None:
    """Training tokens a checkpoint saw: the recorded count if the run logged one, else steps x batch x seq_len (an
    upper bound: conversations shorter than seq_len are not padded)."""
    state_path, config_path = checkpoint_dir / "state.json", checkpoint_dir / "config.json"
    if not state_path.exists() or not config_path.exists():
        return None
    state = read_json(state_path, "the checkpoint's training state")
    config = read_json(config_path, "the checkpoint's run config")
    if "tokens_seen" in state:
        return int(state["tokens_seen"])
    try:
        return int(state["step"]) * int(config["batch_size"]) * int(config["seq_len"])
    except (KeyError, TypeError, ValueError):
        return None


def checkpoint_method(path: str | Path, target_config: Any, *, k: int | None = None,
                      tree: TreeShape | None = None, label: str | None = None) -> Method:
    """A trained drafter from a checkpoint, a run's output folder or a foreign drafter folder (speculators,
    SafeAILab / SpecForge, PARD), in eval mode, with its provenance."""
    from specframe.drafter_folders import load_drafter, locate
    from specframe.engine.checkpoint import drafter_hash

    directory = locate(path)[1]
    drafter = load_drafter(directory, target_config)
    drafter.module().eval()
    k = default_k(drafter) if k is None else k
    if k < 1:
        raise UsageError(f"--k must be positive, got {k}")
    k, tree = _shape(drafter, k, tree)
    return Method(
        label=label or drafter.name, drafter=drafter, k=k, tree=tree, checkpoint=str(directory),
        checkpoint_hash=drafter_hash(directory), token_budget=token_budget(directory),
    )


def plugin_method(name: str, target_config: Any, *, k: int = 5, tree: TreeShape | None = None,
                  label: str | None = None) -> Method:
    """An untrained drafter plugin by name, options inline (``ngram:n_max=4``; the ``ngram`` baseline)."""
    from specframe import compose

    if k < 1:
        raise UsageError(f"--k must be positive, got {k}")
    plugin, options = compose.named("drafter", name)
    drafter = compose.component("drafter", plugin, options, target_config)
    k, tree = _shape(drafter, k, tree)
    return Method(label=label or name.strip(), drafter=drafter, k=k, tree=tree)
