"""One chunk of DSpark's loss over the target's vocabulary (``DSparkDrafter.loss`` runs the chunks, each recomputed in
backward): DeepSpec's ``compute_dspark_loss`` terms."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def chunk_terms(hidden, latent, conf_feats, target_hidden, labels, weight, lm_w, w2, conf_w, conf_b,
                target_head, ce_w: float, l1_w: float, c_w: float):
    """One chunk of rows: the weighted loss sum, each row's top-1 hit (against the data token), its greedy verdict
    (against the target's argmax), its analytical acceptance 1 - TV and the confidence head's raw logit (NaN without
    the head)."""
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    logits = (F.linear(hidden, lm_w) + F.linear(latent, w2)).to(dtype)
    logq = torch.log_softmax(logits, -1)
    ce = -logq.gather(1, labels[:, None]).squeeze(1)
    with torch.no_grad():
        p = torch.softmax(target_head.logits(target_hidden).to(dtype), -1)
    l1 = (logq.exp() - p).abs().sum(-1)
    accept = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)
    per = ce_w * ce + l1_w * l1
    confidence = torch.full_like(accept, float("nan"))
    if conf_feats is not None:
        conf = F.linear(conf_feats, conf_w, conf_b).squeeze(-1).to(dtype)
        per = per + c_w * F.binary_cross_entropy_with_logits(conf, accept, reduction="none")
        confidence = conf.detach()
    top1 = logits.argmax(-1)
    return (per * weight).sum(), top1 == labels, top1 == p.argmax(-1), accept, confidence

