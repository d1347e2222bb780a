"""The composition root: where the names in a run config become components.

A run config names its target, data, drafter, mask builder and partitioner; a comparison its verifiers. Their
classes come from the plugin registry and their options are structured (``specframe.structuring``: one converter, one
error format) here and nowhere else (``options``), and ``component`` is the one constructor of a component from a
name and options. So a name means the same component with the same defaults, and a bad option the same message,
whether a config is checked without a target (``run_config.resolve``, ``--print-config``), a run is built (the
engine, from the ``Plan``), costed (``specframe.memory``), a checkpoint reopened (``specframe.drafter_folders``), a
comparison set up (``specframe.bench``) or an option typed inline (``--drafter peagle:layers=4``: ``named``).

One ``train`` resolves its names once: ``ResolvedRun.of`` gives the resolved config beside its ``Plan``, which the CLI
hands to the engine (``specframe.engine.assembly`` builds the parts from it) and the engine to the memory estimate. This module stays
below the engine: it reads a run config through ``RunNames`` (what ``TrainConfig`` and ``memory.MemoryConfig`` both
hold), never imports it.
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs
import torch

from specframe import api, plugins
from specframe.errors import UsageError
from specframe.structuring import inline, structure_options, unstructure


def _prefix(where: str | None) -> str:
    return f"{where}: " if where else ""


#: per plugin kind, an inline spelling that shows the syntax (``structuring.inline``'s one error)
EXAMPLES = {
    "drafter": "peagle:layers=4,k_infer=3", "mask builder": "chunked:chunk_size=256",
    "partitioner": "peagle:KEY=VALUE", "verifier": "scheduled:skip_drafting=true",
}


def options(kind: str, name: str | type, table: dict[str, Any], where: str | None = None) -> tuple[type, Any]:
    """The ``kind`` class registered as ``name`` and its typed options (every default filled in) from ``table`` (a
    file's table, a checkpoint's record, inline options: ``structuring.Text`` values are typed by the field).
    ``name`` may be the class itself (the test kit checks a class before it is installed): the same structuring and
    messages, under the class's own name."""
    cls = plugins.get(kind, name) if isinstance(name, str) else name
    name = name if isinstance(name, str) else cls.name
    if not attrs.has(cls.Options):  # a component without options (greedy) takes none
        if table:
            raise UsageError(f"{_prefix(where)}{kind} '{name}' has no options, got {', '.join(table)}")
        return cls, cls.Options()
    return cls, structure_options(table, cls.Options, f"{_prefix(where)}{kind} '{name}'")


def component(kind: str, name: str | type, table: dict[str, Any], *args: Any, where: str | None = None) -> Any:
    """The one constructor of a component from a name and options: the ``kind`` registered as ``name``, built with
    ``args`` (a drafter's target config) and its options structured from ``table``."""
    cls, typed = options(kind, name, table, where)
    return cls(*args, typed)


def named(kind: str, text: str) -> tuple[str, dict[str, Any]]:
    """A component named with its options inline (``peagle:layers=4``; ``structuring.inline``) -> the name and the
    options as typed (text, typed when the component is built)."""
    return inline(text, kind, EXAMPLES[kind])


def drafter(name: str, table: dict[str, Any], where: str | None = None) -> tuple[type, Any]:
    """The drafter class registered as ``name`` and its typed options (every default filled in)."""
    return options("drafter", name, table, where)


def mask_builder(name: str, table: dict[str, Any], where: str | None = None) -> tuple[type, Any]:
    return options("mask builder", name, table, where)


def partitioner(name: str, table: dict[str, Any], where: str | None = None) -> tuple[type, Any]:
    return options("partitioner", name, table, where)


def verifier(name: str, table: dict[str, Any], where: str | None = None) -> tuple[type, Any]:
    """The verifier class registered as ``name`` and its typed options."""
    return options("verifier", name, table, where)


def mask_builder_name(name: str | None, device: torch.device | str | None) -> str | None:
    """The run's mask builder: the one named, else the most preferred one that trains on ``device``; None while the
    device is still ``auto`` (the machine decides when the run starts)."""
    if name is not None:
        return name
    if device is None or str(device) == "auto":
        return None
    from specframe.masks import default_mask_builder

    return default_mask_builder(device)


class RunNames(Protocol):
    """The fields of a run config (``engine.TrainConfig``, ``memory.MemoryConfig``) that name its components."""

    drafter: str
    drafter_options: dict[str, Any]
    depth: int | None
    mask_builder: str | None
    mask_builder_options: dict[str, Any]
    partitioner: str
    partitioner_options: dict[str, Any]
    device: str


@attrs.frozen
class Plan:
    """What a run config's names resolve to before any target is loaded: classes, typed options with their defaults,
    the drafter's training declaration (API 6) and the run's depth."""

    drafter_cls: type
    drafter_options: Any
    training: api.Training
    #: the depth given, else the drafter's declared default; None when it declares none
    depth: int | None
    #: None only while the device is ``auto``
    builder_name: str | None
    builder_cls: type | None
    #: typed, or the table as given while the builder is undecided
    builder_options: Any
    partitioner_cls: type
    partitioner_options: Any
    #: small attention calls go to the small-call builder (``TrainConfig.sized_attention``; None there: whether the
    #: run named no builder)
    sized_attention: bool = False

    def for_device(self, device: torch.device | str, where: str | None = None) -> Plan:
        """This plan with the mask builder decided for ``device`` where it was left to the machine (device
        ``auto``); the plan itself when it was decided."""
        if self.builder_cls is not None:
            return self
        name = mask_builder_name(None, device)
        cls, options = mask_builder(name, self.builder_options, where)
        return attrs.evolve(self, builder_name=name, builder_cls=cls, builder_options=options)

    def resolved(self, cfg: Any) -> Any:
        """``cfg`` (a ``TrainConfig``) with every decided value written in, as OUTPUT/config.json records it (and
        reads back as is)."""
        return attrs.evolve(
            cfg, depth=self.depth, mask_builder=self.builder_name, sized_attention=self.sized_attention,
            drafter_options=unstructure(self.drafter_options),
            mask_builder_options=(self.builder_options if self.builder_cls is None
                                  else unstructure(self.builder_options)),
            partitioner_options=unstructure(self.partitioner_options),
        )


@attrs.frozen
class ResolvedRun:
    """A run config with every decided value written in (``Plan.resolved``) beside the ``Plan`` it was resolved from,
    as one record: what one ``train`` hands from the CLI to the resume check and the engine, and the engine to its
    parts and the memory estimate, so a config and a plan that disagree never travel together."""

    config: Any
    plan: Plan

    @classmethod
    def of(cls, cfg: RunNames, device: torch.device | str | None = None, where: str | None = None) -> ResolvedRun:
        """``cfg``'s names resolved (``plan``) and written into it."""
        resolved = plan(cfg, device, where)
        return cls(resolved.resolved(cfg), resolved)

    def for_device(self, device: torch.device | str) -> ResolvedRun:
        """This run with its mask builder decided for ``device`` where it was left to the machine (``auto``)."""
        decided = self.plan.for_device(device)
        return self if decided is self.plan else ResolvedRun(decided.resolved(self.config), decided)

    def on(self, device: torch.device | str) -> ResolvedRun:
        """This run with ``device`` written into its config (the device ``auto`` became), its plan as it is."""
        return attrs.evolve(self, config=attrs.evolve(self.config, device=str(device)))


def plan(cfg: RunNames, device: torch.device | str | None = None, where: str | None = None) -> Plan:
    """Resolve ``cfg``'s names for ``device`` (default: ``cfg.device``; ``auto`` leaves the mask builder undecided);
    an unknown name or option is a ``UsageError`` prefixed with ``where``."""
    drafter_cls, drafter_options = drafter(cfg.drafter, cfg.drafter_options, where)
    training = drafter_cls.training(drafter_options)
    builder_name = mask_builder_name(cfg.mask_builder, cfg.device if device is None else device)
    builder_cls, builder_options = None, cfg.mask_builder_options
    if builder_name is not None:
        builder_cls, builder_options = mask_builder(builder_name, cfg.mask_builder_options, where)
    partitioner_cls, partitioner_options = partitioner(cfg.partitioner, cfg.partitioner_options, where)
    # a config that predates the field (or the memory command's, which has none) sizes as a run naming no builder did
    sized = getattr(cfg, "sized_attention", None)
    return Plan(drafter_cls, drafter_options, training, cfg.depth or training.depth, builder_name, builder_cls,
                builder_options, partitioner_cls, partitioner_options,
                cfg.mask_builder is None if sized is None else bool(sized))
