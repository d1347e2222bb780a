"""specframe's vLLM general plugin: a drafter model that gives each parallel draft slot its own mask embedding.

vLLM's parallel drafting (P-EAGLE's path: method ``eagle3`` with ``parallel_drafting``) forwards, per request,
[accepted tokens | bonus token | mask token x (k-1) | rejected padding] in one pass, every mask slot carrying the
same token id (``pard_token``) and the same hidden state (``mask_hidden`` through ``fc``). ParallelSpec's slot d
reads its own learned [MASK]_d embedding and, as hidden state, its anchor's (the bonus token's) fused target
feature. ``ParallelSpecLlamaForCausalLMEagle3`` is vLLM's EAGLE-3 Llama drafter with that one difference: before
the layers run it finds each mask slot's index d (its distance from the last non-mask token of the flattened batch:
vLLM lays every request out as above, so that token is the request's bonus token) and replaces the slot's embedding
with ``mask_embeddings[d - 1]`` and its hidden state with the bonus token's row. Everything else (proposer, KV
handling of mask slots, draft-vocabulary mapping, acceptance) is vLLM's own.

vLLM loads it through the ``vllm.general_plugins`` entry point ``specframe`` (``register``, which
``ModelRegistry.register_model`` s the class; safe to call more than once); ``specframe.vllm.engine`` also calls
``register`` before starting vLLM in process. The architecture name ends in ``Eagle3`` so that vLLM's eagle3 method
keeps it as is.

vLLM calls every general plugin in every process it starts (``vllm serve``'s API server included) and does not guard
the call, so ``register`` imports no vLLM model code: it registers the class by its ``"module:Class"`` name, which
vLLM imports only where a ParallelSpec drafter is actually loaded (the module's ``__getattr__`` builds the class
then), and a failure only logs a warning, so that a vLLM this plugin does not fit still serves everything else.
"""

from __future__ import annotations

import logging

ARCHITECTURE = "ParallelSpecLlamaForCausalLMEagle3"
#: what vLLM's registry imports when it first needs the model (``__getattr__`` below builds the class)
MODEL_CLASS = f"{__name__}:{ARCHITECTURE}"
_registered = False
_log = logging.getLogger(__name__)


def register() -> None:
    """Register the ParallelSpec drafter model with vLLM's model registry (the general plugin's entry point).
    Never raises: a failure is logged as a warning (vLLM would otherwise fail in every process, not only for
    ParallelSpec)."""
    global _registered
    if _registered:
        return
    try:
        from vllm import ModelRegistry

        if ARCHITECTURE not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    except Exception as exc:  # noqa: BLE001 - any failure here must leave vLLM usable
        _log.warning("specframe could not register its vLLM model %s (ParallelSpec drafters will not load): %s: %s",
                     ARCHITECTURE, type(exc).__name__, exc)
        return
    _registered = True


def __getattr__(name: str):
    # the lazy registration's target: built (importing vLLM's EAGLE-3 model) on first access only
    if name == ARCHITECTURE:
        cls = _build_model_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def slot_inputs(input_ids, hidden_states, embeds, mask_token_id: int, mask_embeddings):
    """(embeds, hidden_states) with every mask-token row replaced by its slot's own mask embedding (slot d = the
    d-th consecutive mask token) and its anchor's (the last non-mask row's) hidden state. Pure torch, so the
    reference tests can check it without vLLM."""
    import torch

    is_mask = input_ids == mask_token_id
    idx = torch.arange(input_ids.shape[0], device=input_ids.device)
    last_real = torch.cummax(torch.where(is_mask, torch.full_like(idx, -1), idx), dim=0).values
    slot = idx - last_real  # 0 on a real token, d on the d-th mask after it
    rows = (slot - 1).clamp(min=0, max=mask_embeddings.shape[0] - 1)
    embeds = torch.where(is_mask[:, None], mask_embeddings[rows].to(embeds.dtype), embeds)
    anchor = last_real.clamp(min=0)
    hidden_states = torch.where(is_mask[:, None], hidden_states[anchor], hidden_states)
    return embeds, hidden_states


def _build_model_class():
    import torch
    from torch import nn
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    class ParallelSpecLlamaForCausalLMEagle3(Eagle3LlamaForCausalLM):
        """vLLM's EAGLE-3 Llama drafter whose parallel-drafting mask slots each read their own mask embedding."""

        def __init__(self, *, vllm_config, prefix: str = "") -> None:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            config = self.config
            masks = int(getattr(config, "parallelspec_num_masks"))
            self.mask_token_id = int(getattr(config, "pard_token"))
            # on the inner model, so that the loader's "model." prefix finds it
            self.model.mask_embeddings = nn.Parameter(torch.zeros(masks, config.hidden_size), requires_grad=False)

        # vLLM's proposer hands a drafter that supports multimodal embeddings inputs_embeds in place of input_ids;
        # the mask slots are found by their token id, so this model does not take that path (vLLM then drafts from
        # the token ids, text only)
        supports_multimodal_embeddings = False

        def forward(self, input_ids, positions, hidden_states, inputs_embeds=None):
            if input_ids is None:
                # without the ids every mask slot would run with the one shared pard_token embedding and the fc(0)
                # hidden state: still lossless, so only the acceptance would be (silently) wrong
                raise ValueError(f"{ARCHITECTURE} needs input_ids to find its parallel-drafting mask slots; "
                                 "vLLM passed inputs_embeds only")
            if inputs_embeds is None:
                inputs_embeds = self.model.embed_input_ids(input_ids)
            inputs_embeds, hidden_states = slot_inputs(
                input_ids, hidden_states, inputs_embeds, self.mask_token_id, self.model.mask_embeddings
            )
            return self.model(input_ids, positions, hidden_states, inputs_embeds)

    return ParallelSpecLlamaForCausalLMEagle3
