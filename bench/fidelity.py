"""Can a model tell fidelity apart? The criteria of issue 31, measured on `--model` (default: reference).

On held-out text (the model's recipe calibration set: calibration/reference.yaml for the reference model, whose
training never saw it; calibration/default.yaml for tiny), teacher-forced windows, every figure a relative
perplexity delta against the same model's lossless pass on the same windows, with twice its paired standard
error over the windows ("± 2se": the sampling noise of the held-out text):

  moectl copies     every expert computed from its `moectl quantize` copy (q8/q4/q3/q2, group 64, axis 1, and
                    q2g16 axis 0 as Mixtral-offloading): `moectl eval --lowbit qNg64 --precision lowbit-only`
                    with the experts in RAM (computed in place, so no expert is ever served at full precision)
  expert drop       per MoE layer, the transformers model with that layer's top-1 expert dropped (the second
                    carries the token alone, weight renormalized to 1) vs its second dropped (top-1 alone)
  run-to-run        the lossless pass repeated with 2 threads instead of 1: the measurement's own noise
  scoreboard        the scoreboard's "ppl delta" column (plan/proxy.py's eight settings) with this model as the
                    proxy: its own T_g from `moectl sensitivity --target-ppl-delta 0.01` on its held-out set
  llama.cpp         (helper C's build; MOECTL_LLAMACPP_ROOT overrides where its tools are) F32 / Q8_0 / Q4_0 / Q4_K_M GGUFs of the same checkpoint,
                    `llama-perplexity` on the same held-out text, with its own ± and the F32 run repeated

Criteria: Q4_0 and Q4_K_M raise perplexity by more than the noise; q2 raises it clearly more than q4; dropping
a layer's top-1 expert costs more than dropping its second.

Run: .venv/bin/python bench/fidelity.py [--model reference] [--max-tokens 16384] [--llamacpp] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moectl.calib.dataset import load_calibration  # noqa: E402
from moectl.calib.fidelity import paired_2se, token_windows, window_nll  # noqa: E402
from moectl.quant.quantize import quantize_model  # noqa: E402
from moectl.runtime.engine import Engine  # noqa: E402
from bench.models import MODEL_HELP, bench_model, held_out_dataset  # noqa: E402

COPIES = [(8, 64, 1), (4, 64, 1), (3, 64, 1), (2, 64, 1), (2, 16, 0)]
LLAMACPP_TYPES = ["Q8_0", "Q4_K_M", "Q4_0"]


def delta(per_window: list[float], base: list[float], scored: int) -> dict:
    """Relative perplexity delta vs `base` on the same windows and twice its paired standard error."""
    rel = math.exp((sum(per_window) - sum(base)) / scored) - 1
    return {"ppl_delta": rel, "ppl_delta_2se": paired_2se(per_window, base, scored),
            "ppl": math.exp(sum(per_window) / scored)}


@torch.inference_mode()
def hf_window_nll(model, windows) -> list[float]:
    out = []
    for ids in windows:
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1].float()
        out.append(float(F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum")))
    return out


def drop_rank(block, rank: int | None):
    """Hook the block's router so each token's `rank`-th expert (0 = top-1) is dropped and the other carries
    the token alone (top-2: weight 1); rank None drops every expert (the block adds nothing). Returns the hook."""
    def hook(_module, _inputs, output):
        logits, weights, index = output                       # [T,E], [T,K], [T,K]
        if rank is None:
            return logits, weights * 0, index
        keep = torch.ones_like(weights)
        keep[:, rank] = 0
        weights = weights * keep
        return logits, weights / weights.sum(-1, keepdim=True), index
    return block.gate.register_forward_hook(hook)


def expert_drop(ckpt: Path, windows, scored: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    base = hf_window_nll(model, windows)
    rows = []
    for i, layer in enumerate(model.model.layers):
        row, pw = {"layer": i}, {}
        for rank, name in ((0, "drop_top1"), (1, "drop_second")):
            handle = drop_rank(layer.mlp, rank)
            try:
                pw[name] = hf_window_nll(model, windows)
            finally:
                handle.remove()
            row[name] = delta(pw[name], base, scored)
        row["top1_vs_second"] = delta(pw["drop_top1"], pw["drop_second"], scored)    # paired: its own noise
        rows.append(row)
        print(f"layer {i}: drop top-1 {row['drop_top1']['ppl_delta']:+.2%} ± {row['drop_top1']['ppl_delta_2se']:.2%}"
              f", drop second {row['drop_second']['ppl_delta']:+.2%} ± {row['drop_second']['ppl_delta_2se']:.2%}",
              flush=True)
    handles = [drop_rank(layer.mlp, None) for layer in model.model.layers]     # how much do experts matter at all?
    try:
        no_experts = delta(hf_window_nll(model, windows), base, scored)
    finally:
        for h in handles:
            h.remove()
    print(f"every expert of every layer dropped: {no_experts['ppl_delta']:+.2%}", flush=True)
    return {"base_ppl": math.exp(sum(base) / scored), "layers": rows, "no_experts": no_experts}


def moectl_copies(model: str, workdir: str, windows, base, scored: int, threads: int,
                  methods: tuple[str, ...] = ("rtn",)) -> list[dict]:
    """Every COPIES setting made by each of `methods` (`moectl quantize --method`: rtn, CPU's default; hqq,
    HQQ's optimiser, a GPU's), computed for every expert, against the lossless pass on the same windows."""
    rows = []
    for (bits, group, axis), method in ((c, m) for m in methods for c in COPIES):
        meta = quantize_model(model, bits, group, axis, workdir=workdir, progress=False, method=method)
        eng = Engine.load(model, workdir=workdir, lowbit=f"q{bits}g{group}", precision="lowbit-only",
                          threads=threads, progress=False)
        r = window_nll(eng, windows)
        rel_err = sum(x["rel_error"] for x in meta["layers"]) / len(meta["layers"])
        rows.append({"copy": f"q{bits}g{group} axis {axis}" + (f" ({method})" if len(methods) > 1 else ""),
                     "method": method, "rel_weight_error": rel_err,
                     "bytes_per_expert": meta["bytes_per_expert"], **delta(r["per_window"], base, scored)})
        print(f"{rows[-1]['copy']}: Δppl {rows[-1]['ppl_delta']:+.2%} ± {rows[-1]['ppl_delta_2se']:.2%} "
              f"(weight error {rel_err:.3f})", flush=True)
    return rows


def llamacpp_module():
    """llamacpp (helper C's, issue 28); before that branch is merged, the file MOECTL_LLAMACPP_PY names."""
    import importlib.util
    import os

    try:
        import llamacpp
        return llamacpp
    except ImportError:
        path = os.environ.get("MOECTL_LLAMACPP_PY")
        if not path:
            raise
    spec = importlib.util.spec_from_file_location("llamacpp", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["llamacpp"] = module
    spec.loader.exec_module(module)
    return module


def llamacpp_rows(ckpt: Path, texts: list[str], out_dir: Path, ctx: int, threads: int, chunks: int | None) -> dict:
    """F32 / Q8_0 / Q4_K_M / Q4_0 of the checkpoint by llama.cpp's own converter and quantizer, scored by
    llama-perplexity on the same held-out text (helper C's bench/llamacpp.py)."""
    import os

    llamacpp = llamacpp_module()
    root = Path(os.environ["MOECTL_LLAMACPP_ROOT"]) if os.environ.get("MOECTL_LLAMACPP_ROOT") else llamacpp.home()
    out_dir.mkdir(parents=True, exist_ok=True)
    text = out_dir / "heldout.txt"
    text.write_text("\n\n".join(texts))
    f32 = out_dir / "m-F32.gguf"
    if not f32.exists():
        llamacpp.convert(ckpt, f32, "f32", root=root)
    def ppl(gguf):                          # one retry: a run under heavy load once printed no final estimate
        try:
            return llamacpp.perplexity(gguf, text, ctx=ctx, threads=threads, chunks=chunks, root=root)
        except Exception:
            return llamacpp.perplexity(gguf, text, ctx=ctx, threads=threads, chunks=chunks, root=root)

    runs = {"F32": ppl(f32), "F32 (repeat)": ppl(f32)}
    for t in LLAMACPP_TYPES:
        q = out_dir / f"m-{t}.gguf"
        if not q.exists():
            llamacpp.quantize(f32, q, t, root=root)
        runs[t] = ppl(q)
        err = runs[t].get("stderr")             # None over the first `chunks` chunks (a running estimate)
        print(f"llama.cpp {t}: ppl {runs[t]['ppl']:.4f}" + (f" ± {err:.4f}" if err is not None else "")
              + f" (F32 {runs['F32']['ppl']:.4f})", flush=True)
    # paired, token by token against F32's saved logits (llama-perplexity --kl-divergence): the delta's own noise
    paired = {t: llamacpp.kl_divergence(f32, out_dir / f"m-{t}.gguf", text, ctx=ctx, threads=threads, chunks=chunks,
                                        root=root, logits=out_dir / f"F32-{ctx}-{chunks or 'all'}.kld")
              for t in ["F32"] + LLAMACPP_TYPES}
    for t, r in paired.items():
        print(f"llama.cpp {t} vs F32, paired: PPL ratio {r['ppl_ratio'] - 1:+.3%} ± {2 * r['ppl_ratio_err']:.3%} (2se), "
              f"KLD {r['kld']}, same top token {r['same_top']}", flush=True)
    return {"ctx": ctx, "chunks": chunks, "runs": runs, "paired": paired,
            "size_bytes": {p.stem: p.stat().st_size for p in out_dir.glob("m-*.gguf")}}


def scoreboard_proxy(model: str, workdir: Path, dataset: str) -> dict:
    """The scoreboard's ppl column (`plan/proxy.py`) measured on this model: its own T_g first (`moectl
    sensitivity --target-ppl-delta 0.01` on its held-out set, as the tiny model's was), then the eight settings."""
    import subprocess

    from moectl.artifacts.sensitivity import JSON_NAME
    from moectl.plan.proxy import proxies

    if not (workdir / JSON_NAME).exists():
        subprocess.run([sys.executable, "-m", "moectl.cli", "sensitivity", "--model", model, "--dataset", dataset,
                        "--target-ppl-delta", "0.01"], check=True)
    return proxies(workdir, ev={"dataset": dataset})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="reference", help=MODEL_HELP)
    ap.add_argument("--dataset", default=None, help="held-out text (default: the model recipe's calibration set)")
    ap.add_argument("--max-tokens", type=int, default=16384, help="held-out tokens scored")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default="copies,drop,llamacpp,proxy",
                    help="comma list of copies, drop, llamacpp, proxy (the scoreboard's ppl column)")
    ap.add_argument("--llamacpp-ctx", type=int, default=256)
    ap.add_argument("--llamacpp-chunks", type=int, default=32, help="llama-perplexity --chunks (0: the whole text)")
    ap.add_argument("--methods", default="rtn", help="comma list of `moectl quantize --method`s the copies are made "
                    "by (rtn, hqq)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    ref = bench_model(a.model)
    only = set(a.only.split(","))
    res = {"model": a.model, "dataset": a.dataset or held_out_dataset(ref)}

    eng = Engine.load(a.model, threads=a.threads, progress=False)
    windows = token_windows(eng.tokenizer, load_calibration(res["dataset"]), a.window, a.max_tokens)
    base = window_nll(eng, windows)
    scored = base["scored"]
    torch.set_num_threads(2)
    again = window_nll(eng, windows)
    torch.set_num_threads(a.threads)
    res |= {"scored_tokens": scored, "windows": len(windows), "ppl": math.exp(base["nll"] / scored),
            "run_to_run": delta(again["per_window"], base["per_window"], scored)}
    print(f"{a.model}: {scored} held-out tokens in {len(windows)} windows of {a.window}, ppl {res['ppl']:.4f}; "
          f"run-to-run (2 vs 1 thread) {res['run_to_run']['ppl_delta']:+.5%}", flush=True)
    del eng
    if "copies" in only:
        res["copies"] = moectl_copies(a.model, str(ref.workdir), windows, base["per_window"], scored, a.threads,
                                      tuple(a.methods.split(",")))
    if "drop" in only:
        res["drop"] = expert_drop(ref.path, windows, scored)
    if "llamacpp" in only:
        texts = load_calibration(res["dataset"])
        try:
            res["llamacpp"] = llamacpp_rows(ref.path, texts, ref.workdir / "llamacpp", a.llamacpp_ctx, 2,
                                           a.llamacpp_chunks or None)
        except Exception as e:              # the tools are optional (helper C's build): say so, keep the rest
            res["llamacpp"] = {"not_measured": f"{type(e).__name__}: {e}"}
            print(f"llama.cpp not measured: {res['llamacpp']['not_measured']}", flush=True)
    if "proxy" in only:
        res["proxy"] = scoreboard_proxy(a.model, ref.workdir, res["dataset"])
    res["seconds"] = round(time.perf_counter() - t0)
    print_tables(res)
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))


def print_tables(res: dict) -> None:
    pm = lambda r: f"{r['ppl_delta']:+.2%} ± {r['ppl_delta_2se']:.2%}"       # noqa: E731
    print(f"\n{res['model']}: ppl {res['ppl']:.3f} on {res['scored_tokens']} held-out tokens; run-to-run "
          f"{res['run_to_run']['ppl_delta']:+.4%}")
    if "copies" in res:
        print("\n| moectl copy (every expert) | weight error | Δppl ± 2se |\n|---|---|---|")
        for r in res["copies"]:
            print(f"| {r['copy']} | {r['rel_weight_error']:.3f} | {pm(r)} |")
    if "drop" in res:
        print("\n| MoE layer | drop top-1 | drop second | top-1 vs second | top-1 costs more beyond noise |"
              "\n|---|---|---|---|---|")
        for r in res["drop"]["layers"]:
            d = r["top1_vs_second"]
            print(f"| {r['layer']} | {pm(r['drop_top1'])} | {pm(r['drop_second'])} | {pm(d)} | "
                  f"{'yes' if d['ppl_delta'] > d['ppl_delta_2se'] else 'NO'} |")
        print(f"every expert of every layer dropped: {pm(res['drop']['no_experts'])}")
    lc = res.get("llamacpp", {})
    if "runs" in lc:
        f32 = lc["runs"]["F32"]["ppl"]
        print(f"\n| llama.cpp (ctx {lc['ctx']}, {lc['chunks'] or 'all'} chunks) | ppl | vs F32 | paired vs F32 ± 2se | "
              f"beyond noise | KLD | same top token |\n|---|---|---|---|---|---|---|")
        for name, r in lc["runs"].items():
            q = lc.get("paired", {}).get(name.split(" ")[0]) if name != "F32 (repeat)" else None
            pair = (f"{q['ppl_ratio'] - 1:+.3%} ± {2 * q['ppl_ratio_err']:.3%} | "
                    f"{'yes' if abs(q['ppl_ratio'] - 1) > 2 * q['ppl_ratio_err'] else 'no'} | {q['kld'] or 0:.5f} | "
                    f"{q['same_top'] or 0:.2%}") if q else "| | |"
            print(f"| {name} | {r['ppl']:.4f} | {r['ppl'] / f32 - 1:+.2%} | {pair} |")
    px = res.get("proxy", {})
    if px.get("settings"):
        print("\n| scoreboard setting | ppl delta ± 2se | greedy agreement | experts/token/layer |\n|---|---|---|---|")
        for key, r in px["settings"].items():
            if "not_measured" in r:
                print(f"| {key} | not measured: {r['not_measured']} | | |")
                continue
            print(f"| {key} | {r['ppl_delta_rel']:+.2%} ± {r.get('ppl_delta_2se') or float('nan'):.2%} | "
                  f"{r['greedy_agreement']:.3f} | {r['experts_per_token']:.2f} |")
    print(f"({res['seconds']} s)")


if __name__ == "__main__":
    main()
