"""Speculative decoding's acceptance rule (Leviathan et al. 2023, Chen et al. 2023), top to bottom.

Legend: K = drafted tokens, V = vocabulary.

A verification pass runs the last accepted token and K drafts x_1..x_K through the target model at once, which
gives the target's distributions p [K+1,V] at the K+1 positions; the draft sampled x_i from q_i [V]. Then:

  1. draft i is accepted with probability min(1, p_i(x_i) / q_i(x_i)), in order, stopping at the first rejection;
  2. at a rejection the token is drawn from the residual norm(max(0, p_i - q_i)) instead;
  3. when all K are accepted, a bonus token is drawn from p_K.

Every token the pass emits is then distributed exactly as p (the check: `token_distribution`). Greedy decoding is
the limit where p and q put all their mass on their argmax: a draft is accepted iff it is the target's argmax, and
the token at the first mismatch is the target's argmax, so the output is plain greedy decoding's, token for token.
`sampling_probs` is the one definition of "the distribution sampling draws from" (temperature, then top-p), used by
plain sampling (`engine.sample`), the draft and the verification alike.
"""

from __future__ import annotations

import torch


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution [..., V] sampling draws from: softmax(logits / temperature), cut to the top-p nucleus."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        keep = torch.cumsum(sorted_p, -1) - sorted_p < top_p          # always keeps the top token
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p * keep)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draw(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """One token from a distribution [V]."""
    return int(torch.multinomial(probs, 1, generator=gen))


def accept_probability(p: torch.Tensor, q: torch.Tensor, x: int) -> float:
    """min(1, p(x) / q(x)) for a draft x sampled from q (so q(x) > 0)."""
    return min(1.0, float(p[x]) / float(q[x])) if float(q[x]) > 0 else 0.0


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) [V]: what a rejection draws from. (p == q never rejects; p is returned for safety.)"""
    r = torch.clamp(p - q, min=0.0)
    total = float(r.sum())
    return r / total if total > 0 else p


def token_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The exact distribution [V] of the token emitted at one position: draw x ~ q, keep it with min(1, p/q),
    else draw from the residual. Equal to p for every q (the tests check it on constructed cases)."""
    keep = q * torch.clamp(p / torch.where(q > 0, q, torch.ones_like(q)), max=1.0) * (q > 0)   # q(x) min(1,p/q)
    return keep + (1.0 - keep.sum()) * residual(p, q)


def accept_greedy(drafts: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """(accepted drafts, the token that follows them) for greedy decoding; `target_logits` [K+1,V]."""
    best = target_logits.argmax(-1).tolist()                            # [K+1]
    n = 0
    while n < len(drafts) and drafts[n] == best[n]:
        n += 1
    return n, best[n]


def accept_sampled(drafts: list[int], p: torch.Tensor, q: torch.Tensor,
                   gen: torch.Generator | None) -> tuple[int, int]:
    """(accepted drafts, the token that follows them) by speculative sampling; p [K+1,V] target, q [K,V] draft."""
    for i, x in enumerate(drafts):
        u = float(torch.rand((), generator=gen))
        if u >= accept_probability(p[i], q[i], x):
            return i, draw(residual(p[i], q[i]), gen)
    return len(drafts), draw(p[len(drafts)], gen)                      # every draft accepted: a bonus token


class Sampling:
    """How a generation picks tokens: greedy, or temperature + top-p with a seeded generator. `pick(logits [V])`
    -> (token, the distribution [V] it was drawn from, or None when greedy)."""

    def __init__(self, greedy: bool, temperature: float = 1.0, top_p: float = 1.0, gen=None):
        self.greedy = greedy or temperature <= 0
        self.temperature, self.top_p, self.gen = temperature, top_p, gen

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return sampling_probs(logits, self.temperature, self.top_p)

    def pick(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        logits = logits.float().cpu()
        if self.greedy:
            return int(torch.argmax(logits)), None
        probs = self.probs(logits)
        return draw(probs, self.gen), probs

    def accept(self, drafts: list[int], target_logits: torch.Tensor, q: torch.Tensor | None) -> tuple[int, int]:
        """(accepted drafts, the next token) of a verification pass; `target_logits` [K+1,V]."""
        target_logits = target_logits.float().cpu()
        if self.greedy:
            return accept_greedy(drafts, target_logits)
        return accept_sampled(drafts, self.probs(target_logits), q, self.gen)
