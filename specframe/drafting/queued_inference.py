"""The inference protocol of the drafters that draft from the committed tokens they have not forwarded yet: a
queue of those tokens with the target's feature rows they pair with (``PendingInputs``), and the ``start`` /
``accept`` / ``check_k`` a drafter mixes in to fill it (``QueuedInference``).

P-EAGLE, ParallelSpec and DFlash (a separate package) draft this way. Plugins reach both classes as
``api.eagle.QueuedInference`` / ``api.eagle.PendingInputs`` (``specframe.drafting.eagle`` re-exports them).
"""

from __future__ import annotations

import torch

from specframe.errors import SpecframeError, UsageError


class QueuedInference:
    """The inference protocol of a drafter that drafts from the committed tokens it has not forwarded yet
    (``PendingInputs``): ``start`` checks the drafter is ready, resets its state and queues the prompt, ``accept``
    queues the verified tokens with their feature rows, and ``propose`` (the drafter's own) calls ``check_k`` and then
    ``self._pending.take()``.

    Mix it in before ``api.Drafter``. The drafter provides ``_reset_inference`` (its own caches; call
    ``super()._reset_inference()`` to get a fresh ``self._pending``) and, if it reads no target features, sets
    ``reads_features`` False. ``_check_ready`` refuses to draft without a mask token (``mask_token_id``); drafters
    with other prerequisites override it."""

    reads_features: bool = True

    def _reset_inference(self) -> None:
        self._pending = PendingInputs(self.name, reads_features=self.reads_features)

    def _check_ready(self) -> None:
        if getattr(self, "mask_token_id", None) is None:
            raise SpecframeError(f"{self.name}: no mask token chosen (train the drafter or load a checkpoint first)")

    def start(self, prompt_ids: torch.Tensor, features: dict[str, torch.Tensor]) -> None:
        self._check_ready()
        self._reset_inference()
        self._pending.start(prompt_ids, features)

    def accept(self, emitted: torch.Tensor, features: dict[str, torch.Tensor]) -> None:
        self._pending.accept(emitted, features)

    def check_k(self, k: int) -> None:
        if k < 1:
            raise UsageError(f"{self.name}.propose: k must be positive, got {k}")


class PendingInputs:
    """Committed tokens a drafter has not forwarded yet, each with the target's aux feature row it pairs with.

    Section 8 indexing: drafter position i reads token x_{i+1} with feature g_i, so a prompt of n tokens queues
    tokens 1..n-1 with feature rows 0..n-2, and every ``accept`` queues the emitted tokens with the rows the verifier
    forward produced for them. ``take`` hands the queue to the next drafter forward and empties it.
    """

    def __init__(self, owner: str, reads_features: bool = True) -> None:
        self.owner = owner
        self.reads_features = reads_features
        self.tokens: list[torch.Tensor] = []
        self.aux: list[torch.Tensor] = []

    def _rows(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        aux = features["aux_hidden"]
        return aux.reshape(-1, aux.shape[-1])

    def start(self, prompt_ids: torch.Tensor, features: dict[str, torch.Tensor]) -> None:
        self.tokens, self.aux = [], []
        ids = prompt_ids.reshape(-1)
        n = ids.shape[0]
        aux = self._rows(features) if self.reads_features else None
        if aux is not None and aux.shape[0] not in (n, n - 1):
            raise SpecframeError(f"{self.owner}.start: {n} prompt tokens but {aux.shape[0]} feature rows")
        if n > 1:
            self.tokens.append(ids[1:])
            if aux is not None:
                self.aux.append(aux[: n - 1])

    def accept(self, emitted: torch.Tensor, features: dict[str, torch.Tensor]) -> None:
        emitted = emitted.reshape(-1)
        aux = self._rows(features) if self.reads_features else None
        if aux is not None and aux.shape[0] != emitted.shape[0]:
            raise SpecframeError(
                f"{self.owner}.accept: {emitted.shape[0]} emitted tokens need as many feature rows, got {aux.shape[0]}"
            )
        self.tokens.append(emitted)
        if aux is not None:
            self.aux.append(aux)

    def take(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(tokens [P], aux rows [P, n_aux*H] or None), emptying the queue."""
        if not self.tokens:
            raise SpecframeError(f"{self.owner}: no new token to draft from (call accept with the verifier's tokens)")
        tokens = torch.cat(self.tokens)
        aux = torch.cat(self.aux) if self.aux else None
        self.tokens, self.aux = [], []
        return tokens, aux
