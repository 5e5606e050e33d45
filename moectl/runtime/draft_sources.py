"""Draft sources for speculative decoding (`--draft`): who proposes the next K tokens.

Legend: K = tokens drafted, V = the target's vocabulary, n = tokens in the target's KV cache.

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

`draft(ctx, pkv, k, sampling)` -> (drafts [K], q [K,V] or None for greedy): ctx is every token so far, its last
one not yet in `pkv` (the target's KV cache, n = len(ctx) - 1 entries); `pkv` is left with n entries.
"""

from __future__ import annotations

import torch

from ..errors import MoectlError
from .spec_decode import rollback


class CachedDraft:
    name = "cached"

    def __init__(self, eng):
        self.eng = eng
        self.in_place = eng.cache.in_place
        self.note = ("in place on the CPU every expert is resident: --draft cached drafts with the full model "
                     "(self-drafting; a draft costs a decode step)") if self.in_place else ""

    @torch.inference_mode()
    def draft(self, ctx: list[int], pkv, k: int, sampling) -> tuple[list[int], torch.Tensor | None]:
        n = pkv.get_seq_length()
        rt, tok, drafts, qs = self.eng.runtime, ctx[-1], [], []
        rt.drafting = True
        try:
            for _ in range(k):
                x = torch.tensor([[tok]], device=self.eng.device)
                logits = self.eng.model(input_ids=x, past_key_values=pkv, use_cache=True).logits[0, -1]   # [V]
                tok, q = sampling.pick(logits)
                drafts.append(tok)
                qs.append(q)
        finally:
            rt.drafting = False
            rollback(pkv, n)                            # the draft's positions never happened
        return drafts, None if qs[0] is None else torch.stack(qs)


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
    def draft(self, ctx: list[int], pkv, k: int, sampling) -> tuple[list[int], torch.Tensor | None]:
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
            logits = self.model(input_ids=ids, past_key_values=self.pkv, use_cache=True).logits[0, -1]   # [V']
            tok, q = sampling.pick(_to_vocab(logits, self.vocab))
            drafts.append(tok)
            qs.append(q)
            x = [tok]
        self.seen = list(ctx) + drafts[:-1]
        return drafts, None if qs[0] is None else torch.stack(qs)


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
