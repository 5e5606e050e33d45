"""`moectl bench --model M --draft SOURCE`: the moectl configuration again with speculative decoding, beside the run
without it (`benchmark/model.py`), on the same prompt and cache size.

Each request is `Engine.generate` (greedy, no EOS stop: `gen_len` tokens) with the draft; the row gives the same
figures as the others (TTFT, decode ms/token, decode hit rate, expert bytes per token, stall) plus the draft's:
verification passes, accepted drafts and tokens per pass, acceptance per position (over every request: the file
`--acceptance-out` writes and `simulate --acceptance` reads), and whether the tokens equal the run without drafting
(greedy: they must).
"""

from __future__ import annotations

import torch


def draft_row(eng, ids: torch.Tensor, gen_len: int, repeat: int, plain_tokens: list[int] | None) -> dict:
    """`repeat` requests on the loaded engine (drafting on); the median request's times, cache figures over all."""
    cache, prompt = eng.cache, ids.reshape(-1).tolist()
    reqs, tot = [], {"hits": 0, "misses": 0, "bytes": 0, "wait": 0.0, "tokens": 0}
    tokens = None
    for _ in range(repeat):
        before = cache.snapshot()
        r = eng.generate(input_ids=prompt, max_new_tokens=gen_len, greedy=True, stop_at_eos=False)
        after = cache.snapshot()
        pre = r.per_token[0]                                   # the prefill forward's own counts
        for k, key in (("hits", "hits"), ("misses", "misses")):
            tot[k] += after["decode"][key] - before["decode"][key]
        tot["bytes"] += after["bytes_loaded"] - before["bytes_loaded"] - pre["bytes_loaded"]
        tot["wait"] += r.stats["load_wait_s"]
        tot["tokens"] += len(r.token_ids) - 1
        reqs.append(r.stats)
        tokens = r.token_ids
    med = sorted(reqs, key=lambda s: s["decode_ms_per_token"])[len(reqs) // 2]
    n, steps = tot["hits"] + tot["misses"], max(tot["tokens"], 1)
    d = med["draft"]
    return {"ttft_ms": med["ttft_ms"], "prefill_ms": med["prefill_ms"],
            "prefill_tokens_per_s": med["prefill_tokens_per_s"], "decode_ms_per_token": med["decode_ms_per_token"],
            "decode_steps": gen_len - 1, "repeat": repeat, "hit_rate": tot["hits"] / n if n else 1.0,
            "decode_misses": tot["misses"], "bytes_per_token": tot["bytes"] / steps,
            "stall_ms_per_token": tot["wait"] * 1e3 / steps, "threads": eng.threads,
            "draft": {k: d[k] for k in ("source", "draft_tokens", "rule", "note", "passes", "accepted_per_pass",
                                        "tokens_per_pass", "drafting_passes", "draft_ms_per_token")}
            | {"acceptance": eng.speculator.acceptance().to_json(),
               "same_tokens_as_without": None if plain_tokens is None else tokens == plain_tokens}}
