"""The hooks a specframe plugin can implement.

Every catalogue hook receives a ``register`` callback and calls it once per component it provides; the core checks
what is registered (type, name, duplicates) and says which plugin did it. Implement them with
``@specframe.api.hookimpl``. Hook names and signatures are part of the plugin API (``specframe.api.API_VERSION``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

# The interfaces' own modules, not ``specframe.api``: the API re-exports ``hookimpl`` from here, so naming the API
# would close a (type-only) circle.
if TYPE_CHECKING:
    from specframe.interfaces.drafter import Drafter
    from specframe.interfaces.mask_builder import MaskBuilder
    from specframe.interfaces.partitioner import Partitioner
    from specframe.interfaces.verifier import Verifier

hookspec = pluggy.HookspecMarker("specframe")
hookimpl = pluggy.HookimplMarker("specframe")


@hookspec
def register_drafters(register: Callable[[type[Drafter]], None]) -> None:
    """Register drafter classes: call ``register(cls)`` for each ``specframe.api.Drafter`` subclass.

    A drafter builds its model from the target's config, declares the target features it needs, fills the
    (anchor, depth) elements of a training sequence and computes their loss, and proposes draft tokens at inference.
    Its ``name`` is what ``specframe train --drafter NAME`` selects.
    """


@hookspec
def register_mask_builders(register: Callable[[type[MaskBuilder]], None]) -> None:
    """Register mask-builder classes: call ``register(cls)`` for each ``specframe.api.MaskBuilder`` subclass.

    A mask builder turns the query and key element sets of one training segment into an attention function that
    applies their visibility rule (``specframe.drafting.elements.visible``: the drafter's declared ``chain`` or ``block``; a
    builder lists the rules it applies in ``visibilities``). Selected with ``--mask-builder NAME``.
    """


@hookspec
def register_partitioners(register: Callable[[type[Partitioner]], None]) -> None:
    """Register partitioner classes: call ``register(cls)`` for each ``specframe.api.Partitioner`` subclass.

    A partitioner splits one sequence's element set into segments that are forwarded and back-propagated one after
    another (gradient accumulation within a sequence). Selected with ``--partitioner NAME``.
    """


@hookspec
def register_verifiers(register: Callable[[type[Verifier]], None]) -> None:
    """Register verifier classes: call ``register(cls)`` for each ``specframe.api.Verifier`` subclass.

    A verifier takes the target's logits over a draft (chain or tree) and decides, losslessly, which draft tokens
    are accepted and which token the target adds. Selected with ``--verifier NAME``.
    """
