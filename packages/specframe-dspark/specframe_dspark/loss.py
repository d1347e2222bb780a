"""DSpark's loss over the target's vocabulary in row chunks: DeepSpec's ``compute_dspark_loss`` terms.

``chunked_terms`` forms each chunk's gradients in its forward (the logits' gradient is closed-form: CE's q - onehot,
the l1 term's q (s - <s, q>) with s = sign(q - p), the confidence BCE's sigmoid(c) - acceptance), so a chunk's three
vocabulary-sized products (draft head, Markov ``w2``, the teacher's head) run once. Under activation checkpointing
(what this module did before) backward recomputed all three: measured 1.73x the time of one 1,024-row chunk's
forward and backward at H 576, V 49,152 (stop 64's note). Memory stays one chunk's [rows, V] blocks at a time.
``chunk_terms`` is one chunk's terms under autograd: the definition the fused path is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specframe import api


def chunk_terms(hidden, latent, conf_feats, target_hidden, labels, weight, lm_w, w2, conf_w, conf_b,
                target_head, ce_w: float, l1_w: float, c_w: float):
    """One chunk of rows under autograd: the weighted loss sum, each row's top-1 hit (against the data token), its
    greedy verdict (against the target's argmax), its analytical acceptance 1 - TV and the confidence head's raw
    logit (NaN without the head)."""
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


def chunked_terms(hidden, latent, conf_feats, target_hidden, labels, weight, lm_w, w2, conf_w, conf_b,
                  target_head, ce_w: float, l1_w: float, c_w: float, chunk: int):
    """``chunk_terms`` over every row in chunks of ``chunk``, the loss sum differentiable with respect to ``hidden``,
    ``latent``, ``conf_feats``, ``lm_w``, ``w2``, ``conf_w`` and ``conf_b`` (those that require a gradient while
    grad mode is on); the per-row outputs concatenated."""
    inputs = (hidden, latent, conf_feats, lm_w, w2, conf_w, conf_b)
    need = [torch.is_grad_enabled() and x is not None and x.requires_grad for x in inputs]
    need_h, need_latent, need_conf_feats, need_lm, need_w2, need_conf_w, need_conf_b = need
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    # the rows' gradients (each chunk writes its own rows) in the rows' dtype, as autograd's would be; the weights'
    # (summed over every chunk) in at least fp32
    grads = [None if not n else torch.zeros_like(x) if i < 3 else
             torch.zeros(x.shape, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
             for i, (x, n) in enumerate(zip(inputs, need))]
    g_h, g_latent, g_conf_feats, g_lm, g_w2, g_conf_w, g_conf_b = grads
    total = torch.zeros((), dtype=dtype, device=hidden.device)
    hits, verdicts, accepts, confidences = [], [], [], []
    # each weight in the gradient's dtype once per call, not per chunk (under bf16 autocast the fp32 [V, H] head
    # would otherwise be copied for every chunk)
    lm_in, w2_in, conf_in = api.modeling.CastOnce(lm_w), api.modeling.CastOnce(w2), api.modeling.CastOnce(conf_w)

    with torch.no_grad():
        for lo in range(0, int(hidden.shape[0]), chunk):
            sl = slice(lo, lo + chunk)
            h, lat, y, w = hidden[sl], latent[sl], labels[sl], weight[sl].to(dtype)
            z = F.linear(h, lm_w) + F.linear(lat, w2)
            # the logits' gradient in the logits' dtype (their matmuls under autograd's), fp16's in fp32
            gd = api.modeling.grad_dtype(z.dtype)
            logq = torch.log_softmax(z.to(dtype), -1)
            del z  # one [chunk, V] block fewer alive while the chunk's gradient is formed
            top1 = logq.argmax(-1)
            p = torch.softmax(target_head.logits(target_hidden[sl]).to(dtype), -1)
            q = logq.exp()
            diff = q - p
            l1 = diff.abs().sum(-1)
            accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0)
            per = ce_w * -logq.gather(1, y[:, None]).squeeze(1) + l1_w * l1
            confidence = torch.full_like(accept, float("nan"))
            if conf_feats is not None:
                cf = conf_feats[sl]
                conf = F.linear(cf, conf_w, conf_b).squeeze(-1).to(dtype)
                per = per + c_w * F.binary_cross_entropy_with_logits(conf, accept, reduction="none")
                confidence = conf
                if need_conf_feats or need_conf_w or need_conf_b:
                    # d BCE(c, a) / d c = sigmoid(c) - a; the acceptance a is a constant (detached in the reference)
                    gc = (c_w * (torch.sigmoid(conf) - accept) * w)[:, None]
                    gcd = api.modeling.grad_dtype(cf.dtype)
                    with torch.autocast(cf.device.type, enabled=False):
                        if need_conf_feats:
                            g_conf_feats[sl] = gc.to(gcd) @ conf_in(gcd)
                        if need_conf_w:
                            g_conf_w += gc.T.to(gcd) @ cf.to(gcd)
                    if need_conf_b:
                        g_conf_b += gc.sum(0)
            total += (per * w).sum()
            hits.append(top1 == y)
            verdicts.append(top1 == p.argmax(-1))
            accepts.append(accept)
            confidences.append(confidence)
            if need_h or need_latent or need_lm or need_w2:
                # d/dz of ce_w CE + l1_w sum|q - p| (abs' derivative sign(x), 0 at 0, as autograd's), times w
                s = diff.sign_()
                g = q.mul_(s.sub_(torch.linalg.vecdot(s, q)[:, None])).mul_(l1_w)
                g.add_(logq.exp_(), alpha=ce_w)
                g[torch.arange(len(y), device=g.device), y] -= ce_w
                g.mul_(w[:, None])
                g = g.to(gd)
                with torch.autocast(g.device.type, enabled=False):
                    if need_h:
                        g_h[sl] = g @ lm_in(gd)
                    if need_latent:
                        g_latent[sl] = g @ w2_in(gd)
                    if need_lm:
                        g_lm += g.T @ h.to(gd)
                    if need_w2:
                        g_w2 += g.T @ lat.to(gd)
    if any(need):
        grads = [None if g is None else g.to(x.dtype) for g, x in zip(grads, inputs)]
        total = api.modeling.precomputed_grad(total, list(zip(inputs, grads)))
    return total, torch.cat(hits), torch.cat(verdicts), torch.cat(accepts), torch.cat(confidences)
