"""Sampling and speculative decoding: how the next tokens are picked, how drafted ones are accepted, the loop that
drafts and verifies, and who drafts (`--draft`).

Legend: K = tokens drafted this pass, V = vocabulary, n = tokens in the target's KV cache before the pass.

Sampling (`Sampling`, numpy, in sampling.py): greedy, or temperature + top-p with a seeded PCG64 generator;
`sampling_probs` is the one definition of the distribution sampling draws from, used by plain sampling
(`Engine.generate`), the draft and the verification. Logits go to numpy once (`as_numpy`), where they are picked.

One pass (`Speculator.step`), after the prompt's prefill and first token:

    k = rule.next_k()                        # 0..K: `auto` turns drafting off where it does not pay
    k == 0: a plain decode step (Engine.forward of the last token)
    drafts, q = drafter.draft(ctx, pkv, k)   # [K], [K,V] (the draft leaves pkv at n entries)
    logits = eng.forward([last] + drafts, pkv, verify=True)    # [1,K+1,V]: ONE pass through the offloaded layers
    accepted, nxt = sampling.accept(drafts, logits, q)         # greedy, or speculative sampling
    rollback(pkv, n + 1 + accepted)          # the rejected drafts' KV entries dropped: as if they never ran
    emit drafts[:accepted] + [nxt]

The acceptance rule (Leviathan et al. 2023, Chen et al. 2023): the verification pass gives the target's
distributions p [K+1,V] at the K+1 positions; the draft sampled x_i from q_i [V]. Then

  1. draft i is accepted with probability min(1, p_i(x_i) / q_i(x_i)), in order, stopping at the first rejection;
  2. at a rejection the token is drawn from the residual norm(max(0, p_i - q_i)) instead;
  3. when all K are accepted, a bonus token is drawn from p_K.

Every token the pass emits is then distributed exactly as p (the check: `token_distribution`). Greedy decoding is
the limit where p and q put all their mass on their argmax: a draft is accepted iff it is the target's argmax, and
the token at the first mismatch is the target's argmax, so the output is plain greedy decoding's, token for token.

The verification pass is a decode step for the cache (`Engine.forward(verify=True)`): phase "decode", so its hits,
misses and bytes count as decode's, prefetch predicts after it (from its first token's routing: the one token sure
to be kept) and gating applies to every row; per MoE layer the union of the K+1 tokens' experts is resolved once by
the decode miss rule (hit, fetch, CPU compute with the tokens' count, low-bit or skip), each expert then applied
to the tokens routed to it (`OffloadedExperts._tokens`, in `pass_order`). The experts of rejected drafts are
loaded too: that is the price `auto` weighs (`policies/draft_length.py: OnlineDraftRule`, the cost model's rule on
measured pass times and acceptance; `--draft-rule always`: `FixedDraftRule`).

Draft sources:

  cached      the target drafts itself with only the experts already resident on the device: each MoE layer runs
              `OffloadedExperts._resident_only` (a missing expert skipped, the kept weights renormalised, as HOBBIT
              skips), so drafting loads nothing, computes nothing on the CPU, and leaves the cache (state, counters,
              replacement and prefetch policies) exactly as it was. It drafts on the target's own KV cache: the exact
              KV of the accepted tokens, then its K-1 draft positions, cropped back off before verification.
              In place on a CPU every expert is resident, so it is the full model drafting itself (self-drafting:
              every greedy draft is accepted, and each costs a full decode step).
  PATH|recipe a small model with the same tokenizer (vocabulary and special tokens checked), a plain transformers
              model fully resident on the device, with its own KV cache: cropped to the longest prefix it shares
              with the accepted tokens, then fed the rest in one forward.
  mtp         DeepSeek-V3's multi-token-prediction layers: not buildable here (`mtp_unavailable` says why).

`draft(ctx, pkv, k, sampling)` -> (drafts [K], q [K,V] numpy float32, or None for greedy): ctx is every token so
far, its last one not yet in `pkv` (the target's KV cache, n = len(ctx) - 1 entries); `pkv` is left with n entries.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..errors import MoectlError
from ..models.kv_cache import cache_kwargs
from ..policies.draft_length import AcceptanceCounter, FixedDraftRule, OnlineDraftRule


# --- sampling and the acceptance rule: numpy, in sampling.py (its names importable from here too) ---------------------
def as_numpy(logits) -> np.ndarray:
    """Logits as sampling.py takes them, float32 numpy: a torch tensor converted once (any dtype, any device),
    numpy passed through."""
    if isinstance(logits, torch.Tensor):
        return logits.float().cpu().numpy()
    return np.asarray(logits, dtype=np.float32)


# --- the loop -----------------------------------------------------------------------------------------------------
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
            accepted, emit, t_draft = 0, [sampling.pick(as_numpy(logits[0, -1]))[0]], t0
        else:
            n = pkv.get_seq_length()
            drafts, q = self.drafter.draft(ctx, pkv, k, sampling)
            t_draft = time.perf_counter()
            logits, pkv = eng.forward(torch.tensor([[ctx[-1]] + drafts]), pkv, verify=True)     # [1,K+1,V]
            accepted, nxt = sampling.accept(drafts, as_numpy(logits[0]), q)
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


# --- draft sources ------------------------------------------------------------------------------------------------
class CachedDraft:
    name = "cached"

    def __init__(self, eng):
        self.eng = eng
        self.in_place = eng.cache.in_place
        self.note = ("in place on the CPU every expert is resident: --draft cached drafts with the full model "
                     "(self-drafting; a draft costs a decode step)") if self.in_place else ""

    @torch.inference_mode()
    def draft(self, ctx: list[int], pkv, k: int, sampling) -> tuple[list[int], np.ndarray | None]:
        n = pkv.get_seq_length()
        rt, tok, drafts, qs = self.eng.runtime, ctx[-1], [], []
        rt.drafting = True
        try:
            for _ in range(k):
                x = torch.tensor([[tok]], device=self.eng.device)
                logits = self.eng.model(input_ids=x, **cache_kwargs(self.eng.model, pkv), use_cache=True).logits[0, -1]   # [V]
                tok, q = sampling.pick(as_numpy(logits))
                drafts.append(tok)
                qs.append(q)
        finally:
            rt.drafting = False
            rollback(pkv, n)                            # the draft's positions never happened
        return drafts, None if qs[0] is None else np.stack(qs)                # q [K,V]


class ModelDraft:
    def __init__(self, eng, source: str):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        from ..core.recipes import resolve_model
        from ..store.facts import built

        self.name, self.eng, self.note = source, eng, ""
        ref = built(resolve_model(source, None))
        try:
            tok = AutoTokenizer.from_pretrained(ref.path)
        except Exception as e:
            raise MoectlError(f"--draft {source}: cannot load its tokenizer from {ref.path}: {e}") from None
        check_same_tokenizer(eng.tokenizer, tok, source, eng.ref.name)
        hf_logging.disable_progress_bar()
        try:
            self.model = AutoModelForCausalLM.from_pretrained(ref.path, dtype=eng.dtype).to(eng.device).eval()
        except Exception as e:
            raise MoectlError(f"--draft {source}: cannot load a causal LM from {ref.path}: {e}") from None
        self.vocab = int(eng.config.vocab_size)
        self.pkv, self.seen = None, []              # the draft's KV cache holds `seen`

    @torch.inference_mode()
    def draft(self, ctx: list[int], pkv, k: int, sampling) -> tuple[list[int], np.ndarray | None]:
        from transformers import DynamicCache

        keep = 0
        while keep < min(len(self.seen), len(ctx) - 1) and self.seen[keep] == ctx[keep]:
            keep += 1
        if keep == 0 or self.pkv is None:
            self.pkv = DynamicCache(config=self.model.config)
            self.pkv.activate_past_recording()
        else:
            rollback(self.pkv, keep)
        x, drafts, qs = ctx[keep:], [], []
        for _ in range(k):
            ids = torch.tensor([x], device=self.eng.device)
            logits = self.model(input_ids=ids, **cache_kwargs(self.model, self.pkv), use_cache=True).logits[0, -1]   # [V']
            tok, q = sampling.pick(as_numpy(_to_vocab(logits, self.vocab)))
            drafts.append(tok)
            qs.append(q)
            x = [tok]
        self.seen = list(ctx) + drafts[:-1]
        return drafts, None if qs[0] is None else np.stack(qs)                # q [K,V]


def _to_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """The draft's logits [V'] over the target's vocabulary [V] (padded rows cut, missing ones never drawn)."""
    if logits.shape[-1] >= vocab:
        return logits[:vocab]
    return torch.cat([logits, logits.new_full((vocab - logits.shape[-1],), float("-inf"))])


def check_same_tokenizer(target, draft, source: str, model: str) -> None:
    """One clear error naming what differs when the draft's tokenizer is not the target's."""
    diffs = []
    a, b = target.get_vocab(), draft.get_vocab()
    if a != b:
        only = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])[:3]
        diffs.append(f"vocabulary ({len(a)} vs {len(b)} tokens; first differences {only})")
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token"):
        x, y = getattr(target, attr, None), getattr(draft, attr, None)
        if str(x) != str(y):
            diffs.append(f"{attr} {x!r} vs {y!r}")
    if sorted(map(str, target.all_special_tokens)) != sorted(map(str, draft.all_special_tokens)):
        diffs.append(f"special tokens {sorted(map(str, target.all_special_tokens))} vs "
                     f"{sorted(map(str, draft.all_special_tokens))}")
    if diffs:
        raise MoectlError(f"--draft {source}: its tokenizer is not {model}'s ({'; '.join(diffs)}); a draft model "
                          f"must share the target's tokenizer")


def mtp_unavailable(config) -> str:
    """Why `--draft mtp` cannot run on this model."""
    n = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    if n == 0:
        return (f"--draft mtp: this {config.model_type} checkpoint ships no multi-token-prediction layers "
                f"(num_nextn_predict_layers is 0 or absent)")
    return (f"--draft mtp: the checkpoint has {n} multi-token-prediction layer(s), but the {config.model_type} adapter "
            f"cannot load them: the model is transformers' own {type(config).__name__} forward, which has no MTP "
            f"module (its weights, model.layers.{config.num_hidden_layers}.*, are skipped when a skeleton is "
            f"built), so there is nothing to run them with; use --draft cached or a draft model")


def make_drafter(eng, source: str):
    """The draft named by `--draft`: cached | mtp | a path or recipe of a draft model."""
    if source == "cached":
        return CachedDraft(eng)
    if source == "mtp":
        raise MoectlError(mtp_unavailable(eng.config))
    return ModelDraft(eng, source)
