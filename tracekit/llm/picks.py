"""A decode step's token picks for a whole batch, where the logits are (issue 30).

On an accelerator the host's per-row float64 picks (:func:`tracekit.llm.hf.pick_token`: a vocabulary's worth of
numpy work per row, after copying every row's logits over) cost more than the model's step at a GPU's batch size:
300-1300 us per row-step on the H200's host against a few milliseconds for the whole model step
(``benchmarks/results/rollout_throughput_h200.json``). :func:`batch_pick` does the same operations on the device in
float64, for every row at once, and returns three numbers per row.

It is :func:`~tracekit.llm.hf.pick_token` row for row:
- the same float64 formulas (``log_softmax(x / T)``, nucleus truncation by stable descending order, the
  inverse-CDF draw ``searchsorted(cumsum(p), u * sum(p), right)`` clamped to the last token);
- the same draw: each sampled row's one ``u`` comes from that row's own generator (:class:`numpy.random.Generator`),
  so a row's tokens do not depend on the batch it decodes in.

Greedy tokens are the host's exactly (argmax of the same values, first on ties). The sums run in another order
than numpy's, so log-probs agree to ~1e-15, and a sampled token can differ only where ``u * sum(p)`` falls within
that rounding of a CDF step.
"""

from __future__ import annotations

import torch


def batch_pick(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
               uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pick one token per row of ``logits`` [n, V] (any float dtype, any grammar mask applied as -inf).

    ``temperature``, ``top_p``, ``uniform``: [n] (``uniform``: each sampled row's ``u ~ U[0, 1)``, ignored for a
    greedy row, ``temperature <= 0``). Returns ``(tokens int64, logprobs float64, ok bool)`` on the logits' device;
    ``ok`` is False where every logit is -inf (a grammar that allows no token: the host pick's None)."""
    n, V = logits.shape
    dev = logits.device
    t = temperature.to(dev, torch.float64)
    greedy = t <= 0
    x = logits.to(torch.float64)
    y = x / torch.where(greedy, 1.0, t)[:, None]  # a greedy row is divided by 1: unchanged, exactly
    top = y.amax(dim=-1)
    ok = top > float("-inf")
    logp = y - torch.logsumexp(y, dim=-1, keepdim=True)
    p_top = top_p.to(dev, torch.float64)
    nucleus = ~greedy & (p_top < 1.0)
    if bool(nucleus.any()):
        rows = nucleus.nonzero().squeeze(1)
        sorted_lp, order = torch.sort(logp[rows], dim=-1, descending=True, stable=True)
        p_sorted = sorted_lp.exp()
        mass_before = p_sorted.cumsum(dim=-1) - p_sorted
        sorted_lp = sorted_lp.masked_fill(mass_before >= p_top[rows, None], float("-inf"))  # the top token stays
        kept = torch.empty_like(sorted_lp).scatter_(1, order, sorted_lp)
        logp[rows] = kept - torch.logsumexp(kept, dim=-1, keepdim=True)
    tokens = x.argmax(dim=-1)
    if not bool(greedy.all()):
        rows = (~greedy).nonzero().squeeze(1)
        cdf = logp[rows].exp().cumsum(dim=-1)
        at = uniform.to(dev, torch.float64)[rows, None] * cdf[:, -1:]
        tokens[rows] = torch.searchsorted(cdf, at, right=True).squeeze(1).clamp_(max=V - 1)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1), ok
