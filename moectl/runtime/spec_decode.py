"""Speculative decoding's loop: draft K tokens, verify them in one pass through the offloaded layers, keep the
accepted prefix and the target's own next token, roll the KV cache back over the rest.

Legend: K = tokens drafted this pass, V = vocabulary, n = tokens in the target's KV cache before the pass.

One pass (`Speculator.step`), after the prompt's prefill and first token:

    k = rule.next_k()                        # 0..K: `auto` turns drafting off where it does not pay
    k == 0: a plain decode step (Engine.forward of the last token)
    drafts, q = drafter.draft(ctx, pkv, k)   # [K], [K,V] (draft.py: the draft leaves pkv at n entries)
    logits = eng.forward([last] + drafts, pkv, verify=True)    # [1,K+1,V]: ONE pass through the offloaded layers
    accepted, nxt = sampling.accept(drafts, logits, q)         # speculative.py: greedy, or speculative sampling
    rollback(pkv, n + 1 + accepted)          # the rejected drafts' KV entries dropped: as if they never ran
    emit drafts[:accepted] + [nxt]

The verification pass is a decode step for the cache (`Engine.forward(verify=True)`): phase "decode", so its hits,
misses and bytes count as decode's, prefetch predicts after it (from its first token's routing: the one token sure
to be kept) and gating applies to every row; per MoE layer the union of the K+1 tokens' experts is resolved once by
the decode miss rule (hit, fetch, CPU compute with the tokens' count, low-bit or skip), each expert then applied
to the tokens routed to it (`OffloadedExperts.forward`'s multi-token path). The experts of rejected drafts are
loaded too: that is the price `auto` weighs (`policies/draft_length.py: OnlineDraftRule`, the cost model's rule on
measured pass times and acceptance).
"""

from __future__ import annotations

import time

import torch

from ..policies.draft_length import AcceptanceCounter, FixedDraftRule, OnlineDraftRule


def rollback(pkv, keep: int) -> None:
    """The KV cache cut back to its first `keep` tokens, exactly as if the later ones never ran (transformers' crop
    takes the count to remove; a sliding-window layer needs `activate_past_recording` from its start, and crop(0)
    trims it back to its window)."""
    pkv.crop(-(pkv.get_seq_length() - keep))


class Speculator:
    """What an Engine with `--draft` holds: the draft, the rule, and the acceptance measured over its life."""

    def __init__(self, drafter, k_max: int, rule: str = "auto", fingerprint: str | None = None):
        self.drafter, self.k_max, self.rule_name = drafter, k_max, rule
        self.rule = FixedDraftRule(k_max) if rule == "always" else OnlineDraftRule(k_max)
        self.counter = AcceptanceCounter(source=f"measured: --draft {drafter.name}")
        self.fingerprint = fingerprint
        self.enabled = True

    def acceptance(self):
        return self.counter.acceptance(self.fingerprint)

    def decode(self, eng, pkv, ctx: list[int], out, sampling):
        """Decode until `out` says stop (`ctx`: prompt + tokens so far, the last not yet in `pkv`): the KV cache and
        the request's figures (passes, drafted and accepted tokens, time and expert bytes)."""
        run = {"passes": 0, "drafted": 0, "accepted": 0, "tokens": 0, "draft_s": 0.0, "seconds": 0.0, "bytes": 0,
               "per_pass": []}
        while not out.done:
            k = min(self.rule.next_k(), out.room - 1)
            pkv = self.step(eng, pkv, ctx, out, sampling, k, run)
        return pkv, run

    def step(self, eng, pkv, ctx: list[int], out, sampling, k: int, run: dict):
        t0, mark = time.perf_counter(), eng.cache.stats.as_dict()
        if k <= 0:
            logits, pkv = eng.forward(torch.tensor([[ctx[-1]]]), pkv)
            rollback(pkv, pkv.get_seq_length())                    # (trims sliding-window layers)
            accepted, emit, t_draft = 0, [sampling.pick(logits[0, -1])[0]], t0
        else:
            n = pkv.get_seq_length()
            drafts, q = self.drafter.draft(ctx, pkv, k, sampling)
            t_draft = time.perf_counter()
            logits, pkv = eng.forward(torch.tensor([[ctx[-1]] + drafts]), pkv, verify=True)     # [1,K+1,V]
            accepted, nxt = sampling.accept(drafts, logits[0], q)
            rollback(pkv, n + 1 + accepted)
            emit = drafts[:accepted] + [nxt]
            self.counter.record(k, accepted)
        ms = (time.perf_counter() - t0) * 1000
        self.rule.record(max(k, 0), accepted, ms)
        produced = 0
        for tok in emit:
            ctx.append(tok)
            produced += 1
            if out.emit(tok):
                break
        now = eng.cache.stats.as_dict()
        delta = {c: now[c] - mark[c] for c in ("hits", "misses", "bytes_loaded", "prefetches")}
        loaded = delta["bytes_loaded"]
        run["passes"] += 1
        run["drafted"] += max(k, 0)
        run["accepted"] += accepted
        run["tokens"] += produced
        run["draft_s"] += t_draft - t0
        run["seconds"] += ms / 1000
        run["bytes"] += loaded
        run["per_pass"].append(delta | {"k": max(k, 0), "accepted": accepted, "tokens": produced, "ms": ms})
        return pkv

    def stats(self, run: dict) -> dict:
        """The request's figures for `--json`: acceptance per position (over the engine's life), accepted tokens
        per pass, expert bytes per token and ms per token (decode after the first token, drafting included)."""
        passes, tokens = max(run["passes"], 1), max(run["tokens"], 1)
        return {"source": self.drafter.name, "draft_tokens": self.k_max, "rule": self.rule_name,
                "note": self.drafter.note, "passes": run["passes"], "drafted": run["drafted"],
                "accepted": run["accepted"], "accepted_per_pass": run["accepted"] / passes,
                "tokens_per_pass": run["tokens"] / passes,
                "drafting_passes": sum(p["k"] > 0 for p in run["per_pass"]),
                "expert_bytes_per_token": run["bytes"] / tokens, "ms_per_token": run["seconds"] * 1000 / tokens,
                "draft_ms_per_token": run["draft_s"] * 1000 / tokens, "acceptance": self.acceptance().to_json()}
