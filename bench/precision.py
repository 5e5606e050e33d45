"""Mixed precision on misses, on the trained tiny model with a small cache: full only vs HOBBIT hi/lo vs hi/lo/skip
vs low-bit only, with HQQ copies at q8/q4/q3/q2 (group 64, axis 1).

Every configuration has the same expert-cache bytes (`--cache-experts` full slots' worth, 2 of 8 per layer; the
low-bit pools take `--lowbit-fraction`, default 0.25, of them under HOBBIT, all but one full slot per layer under
low-bit only) and LRU. Per configuration:
  misses/token, bytes/token   decode steps of a teacher-forced pass over held-out text (every token one decode
                              step with the KV cache, as in generation; a miss of either precision counts once)
  Δppl decode                 perplexity of that pass vs the full-precision pass on the same tokens
  Δppl eval, agreement        `moectl eval`'s figures (perplexity of teacher-forced windows, i.e. prefill-mode
                              batches; greedy agreement of decoded continuations vs lossless)
hi/lo = T1 0.6, T2 1.0 (never skip); hi/lo/skip = T1 0.6, T2 0.9 (the seed's Mixtral values).

`--model reference` runs it on the reference model (make bench-fidelity) and its held-out text (bench/models.py);
`--cache-experts` then defaults to a quarter of its experts (12 of 48 on tiny).

Run: .venv/bin/python bench/precision.py [--model tiny] [--max-tokens 1024] [--threads 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moectl.calib.dataset import load_calibration  # noqa: E402
from moectl.calib.fidelity import evaluate, paired_2se, token_windows  # noqa: E402
from moectl.quant.quantize import quantize_model  # noqa: E402
from moectl.core.sizing import DEFAULT_LOWBIT_FRACTION
from moectl.runtime.engine import Engine  # noqa: E402
from bench.models import MODEL_HELP, bench_model, experts_of, held_out_dataset  # noqa: E402

CONFIGS = [("hi/lo", dict(precision="hobbit", t1=0.6, t2=1.0)),
           ("hi/lo/skip", dict(precision="hobbit", t1=0.6, t2=0.9)),
           ("lowbit-only", dict(precision="lowbit-only"))]


@torch.inference_mode()
def decode_pass(eng, windows) -> dict:
    """Teacher-forced decode: each window's first token as a prompt, then one decode step per next token."""
    nll, n, per_window = 0.0, 0, []
    before = eng.cache.snapshot()
    for ids in windows:
        eng.begin_request("bench")
        logits, pkv = eng.forward(torch.tensor([ids[:1]]))
        per_window.append(0.0)
        for i in range(1, len(ids)):
            per_window[-1] -= float(torch.log_softmax(logits[0, -1].float(), -1)[ids[i]])
            n += 1
            logits, pkv = eng.forward(torch.tensor([[ids[i]]]), pkv)
        nll += per_window[-1]
    after = eng.cache.snapshot()
    tokens = n + len(windows)
    return {"nll": nll, "scored": n, "ppl": math.exp(nll / n), "per_window": per_window,
            "misses_per_token": (after["misses"] - before["misses"]) / tokens,
            "low_misses_per_token": (after.get("low_misses", 0) - before.get("low_misses", 0)) / tokens,
            "skips_per_token": (after.get("skips", 0) - before.get("skips", 0)) / tokens,
            "bytes_per_token": (after["bytes_loaded"] - before["bytes_loaded"]) / tokens}


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2%}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help=MODEL_HELP)
    ap.add_argument("--max-tokens", type=int, default=1024, help="held-out tokens scored by eval")
    ap.add_argument("--decode-tokens", type=int, default=512, help="held-out tokens of the decode pass")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--cache-experts", type=int, default=None, help="full slots' worth of cache bytes "
                                                                       "(default: a quarter of the experts)")
    ap.add_argument("--bits", default="8,4,3,2")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    ref = bench_model(a.model)
    workdir = ref.workdir
    layers, experts = experts_of(ref)
    a.cache_experts = a.cache_experts or layers * experts // 4
    kw = dict(workdir=str(workdir), cache_experts=a.cache_experts, emulate_device=True, prefetch="none",
              progress=False)
    full = Engine.load(a.model, **kw)
    held = token_windows(full.tokenizer, load_calibration(held_out_dataset(ref)), a.window, a.max_tokens)
    dec = held[: max(1, a.decode_tokens // a.window)]
    prompts = [w[:32] for w in held[:4]]
    base = decode_pass(full, dec)
    ev = evaluate(full, held, prompts, 32, workdir)
    rows = [{"bits": "-", "config": "full", **base, "ppl_delta_decode": 0.0, "ppl_delta_eval": ev["ppl_delta_rel"],
             "ppl_delta_eval_2se": ev["ppl_delta_2se"],
             "agreement": ev["greedy_agreement"], "full_bytes_per_expert": full.store.expert_nbytes}]
    for bits in [int(b) for b in a.bits.split(",")]:
        meta = quantize_model(a.model, bits, 64, 1, workdir=str(workdir), progress=False)
        for name, pk in CONFIGS:
            eng = Engine.load(a.model, lowbit=f"q{bits}g64", **pk, **kw)
            d = decode_pass(eng, dec)
            ev = evaluate(eng, held, prompts, 32, workdir)
            rows.append({"bits": bits, "config": name, **d, "ppl_delta_decode": d["ppl"] / base["ppl"] - 1,
                         "ppl_delta_decode_2se": paired_2se(d["per_window"], base["per_window"], d["scored"]),
                         "ppl_delta_eval": ev["ppl_delta_rel"], "ppl_delta_eval_2se": ev["ppl_delta_2se"],
                         "agreement": ev["greedy_agreement"],
                         "low_bytes_per_expert": meta["bytes_per_expert"],
                         "rel_weight_error": sum(x["rel_error"] for x in meta["layers"]) / len(meta["layers"]),
                         "slots_full_low": [sum(eng.cache.slots_per_layer),
                                            sum(p.capacity for pools in eng.cache.state.pools
                                                for k, p in pools.items() if k == "low")]})
            print(json.dumps({k: rows[-1][k] for k in ("bits", "config", "misses_per_token", "bytes_per_token",
                                                         "ppl_delta_decode", "ppl_delta_eval", "agreement")}),
                  flush=True)
    print(f"\n{a.model}, {a.cache_experts} full slots' worth of cache bytes, LRU, default --lowbit-fraction "
          f"{DEFAULT_LOWBIT_FRACTION}; decode pass {sum(len(w) for w in dec)} tokens, eval {ev['tokens']} tokens")
    print("| bits | config | misses/token | low-bit misses/token | skipped/token | bytes/token | Δppl decode ± 2se | "
          "Δppl eval ± 2se | greedy agreement |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['bits']} | {r['config']} | {r['misses_per_token']:.2f} | {r['low_misses_per_token']:.2f} | "
              f"{r['skips_per_token']:.2f} | {r['bytes_per_token'] / 1e3:.0f} KB | {r['ppl_delta_decode']:+.2%} ± "
              f"{_pct(r.get('ppl_delta_decode_2se'))} | "
              f"{r['ppl_delta_eval']:+.2%} ± {_pct(r['ppl_delta_eval_2se'])} | {r['agreement']:.3f} |")
    print(f"({time.perf_counter() - t0:.0f} s)")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
