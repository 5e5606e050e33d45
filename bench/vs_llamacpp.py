"""moectl beside llama.cpp itself, on this machine: same checkpoint, same precision, same threads, alternating runs.

1. llama.cpp is built from the `llama-cpp-python` sdist (`bench/llamacpp.py`, cached in
   `$MOECTL_HOME/llamacpp/<version>/`); a checkpoint made by `moectl make-synthetic` (random weights, a recipe's
   real shapes, a byte-level BPE tokenizer) is converted by llama.cpp's own `convert_hf_to_gguf.py` to BF16 and
   quantized by its own `llama-quantize` to Q8_0, Q4_0 and Q4_K_M; moectl makes its q8g64 / q4g64 copies with
   `moectl quantize` (`--method rtn`, the CPU default; both timed).
2. Speed, per precision and thread count, the two tools alternating, `--repeat` rounds: decode ms/token (a
   32-token prompt, then 64 drawn tokens fed one at a time, no logits read, as llama-bench's generation test
   feeds `std::rand() % n_vocab`; llama-bench `-p 0 -n 64`, which decodes after an empty context) and
   prefill tokens/s (512 tokens; llama-bench `-p 512 -n 0`), and each process's peak RSS. moectl computes the
   experts in place on the CPU (`--device cpu`; `--lowbit qNg64 --precision lowbit-only` for q8 / q4), in a
   fresh process per run. Medians and the spread (min-max) are reported.
3. `--fidelity`: the trained tiny model converted to F32 GGUF, quantized to Q8_0 / Q4_0 / Q4_K_M, perplexity
   under `llama-perplexity`; the same checkpoint lossless / q8g64 / q4g64 under moectl's own scorer; both on
   the same held-out text, each tool's delta against its own full-precision run.

    PYTHONPATH=. python bench/vs_llamacpp.py --build                       # build llama.cpp only
    PYTHONPATH=. python bench/vs_llamacpp.py --shape mixtral --layers 2 --threads 1 2 --repeat 3 --json out.json
    PYTHONPATH=. python bench/vs_llamacpp.py --fidelity

The machine is shared: run it alone when you can, and read the spread next to the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llamacpp  # noqa: E402
import moectl_timed  # noqa: E402

# q4-ggml: moectl's own copies in ggml's Q4_0 blocks (`moectl quantize --format ggml-q4_0`: llama.cpp's Q4_0 recipe,
# computed by ggml on the CPU: the kernel llama.cpp's Q4_0 file gets, on a host without moectl's AVX-512 kernels)
LLAMA_TYPES = {"bf16": ["BF16"], "q8": ["Q8_0"], "q4": ["Q4_0", "Q4_K_M"], "q4-ggml": ["Q4_0"]}
MOECTL_LOWBIT = {"bf16": None, "q8": "q8g64", "q4": "q4g64", "q4-ggml": "ggml-q4_0"}


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------- moectl's side
def moectl_run(ckpt: str, workdir: str, lowbit: str | None, threads: int, prompt: int, gen: int,
               prefill: int, dense_lowbit: str | None = None) -> dict:
    """One fresh process (bench/moectl_timed.py, as gguf_vs_llamacpp.py's): load in place on the CPU, a warm-up,
    a prefill of `prefill` tokens and a decode of `gen` tokens after `prompt`; peak RSS of the process.
    `dense_lowbit` q8 / q4: attention + lm_head low-bit too."""
    load = {"model": ckpt, "workdir": workdir, "lowbit": lowbit, "precision": "lowbit-only" if lowbit else None,
            "dense_lowbit": dense_lowbit}
    return moectl_timed.moectl_run(load, threads, prompt, gen, prefill)


def moectl_quantize(ckpt: str, workdir: str, lowbit: str) -> float:
    """`moectl quantize` (rtn, the CPU default) of every expert into the copies `lowbit` names (q4g64, q8g64, or
    ggml-q4_0: ggml's blocks); returns seconds (0 when already made)."""
    from moectl.formats.ggml_copies import is_ggml_copy
    from moectl.quant.quantize import quantize_model

    t0 = time.perf_counter()
    kw = {"fmt": lowbit} if is_ggml_copy(lowbit) else {}
    meta = quantize_model(ckpt, 4 if kw else int(lowbit[1]), 64, 1, device="cpu", workdir=workdir, progress=False,
                          **kw)
    return 0.0 if meta.get("up_to_date") else time.perf_counter() - t0


# ------------------------------------------------------------------------------------------- llama.cpp's side
def llama_run(gguf: Path, threads: int, gen: int, prefill: int, depth: int = 0) -> dict:
    """llama-bench: a decode of `gen` after `depth` tokens of context (`-d`, untimed: moectl's side decodes after
    its prompt), a prefill of `prefill`."""
    rows, rss = llamacpp.bench_rows(gguf, ["-t", threads, "-p", 0, "-n", gen, "-d", depth, "-r", 1])
    dec = {"tokens_per_s": rows[0]["avg_ts"], "rss_gb": rss}
    pre = llamacpp.bench(gguf, threads, prompt=prefill, gen=0, reps=1)
    return {"prefill_tps": pre["tokens_per_s"], "decode_ms": 1000 / dec["tokens_per_s"],
            "rss_gb": max(dec["rss_gb"], pre["rss_gb"])}


def shape_recipe(shape: str) -> dict:
    """The recipe `shape` names: a recipe's name, or a yaml file of one (as `make-synthetic --shape` takes: e.g.
    bench/shapes/qwen3-moe-thin48.yaml)."""
    from moectl.core.recipes import load_recipe

    p = Path(shape).expanduser()
    if p.suffix.lower() in (".yaml", ".yml") and p.is_file():
        import yaml

        return yaml.safe_load(p.read_text()) or {}
    return load_recipe(shape)


def shape_label(shape: str) -> str:
    """A shape's name in a work directory's name: a recipe's name, or a yaml file's stem."""
    return Path(shape).stem if Path(shape).suffix.lower() in (".yaml", ".yml") else shape


def converted_bf16(shape: str, layers: int, work: Path, made: dict) -> tuple[Path, Path]:
    """(checkpoint, its BF16 GGUF): the synthetic checkpoint of `shape` at `layers` layers and llama.cpp's own
    conversion of it, each made once under `work` (the conversion's seconds into `made`)."""
    from moectl.core.shapes import load_shape
    from moectl.synth.checkpoint import write_synthetic

    ckpt = work / "checkpoint"
    if not (ckpt / "config.json").exists():
        if ckpt.exists():                   # an interrupted write (config.json is written last): start again
            shutil.rmtree(ckpt)
        _log(f"make-synthetic {shape} --layers {layers}")
        family = shape_recipe(shape).get("family", "mixtral")
        write_synthetic(load_shape(shape), ckpt, layers, family=family, dtype=None, progress=False)
    bf16 = work / "model-BF16.gguf"
    if not bf16.exists():
        _log("convert_hf_to_gguf.py --outtype bf16")
        t0 = time.perf_counter()
        part = bf16.with_name(bf16.name + ".part")          # an interrupted run leaves no file that looks made
        llamacpp.convert(ckpt, part, "bf16", log=Path(str(bf16) + ".convert.log"))
        part.replace(bf16)
        made["convert_s"] = time.perf_counter() - t0
    return ckpt, bf16


def prepare(shape: str, layers: int, work: Path, precisions: list[str]) -> dict:
    """The checkpoint, llama.cpp's GGUFs and moectl's copies (each made once, timed)."""
    made = {}
    ckpt, bf16 = converted_bf16(shape, layers, work, made)
    ggufs = {"BF16": bf16}
    for p in precisions:
        for qt in LLAMA_TYPES[p]:
            if qt == "BF16":
                continue
            g = work / f"model-{qt}.gguf"
            if not g.exists():
                _log(f"llama-quantize {qt}")
                t0 = time.perf_counter()
                llamacpp.quantize(bf16, g, qt)
                made[f"llama_quantize_{qt}_s"] = time.perf_counter() - t0
            ggufs[qt] = g
        if MOECTL_LOWBIT[p]:
            _log(f"moectl quantize {MOECTL_LOWBIT[p]} (rtn)")
            s = moectl_quantize(str(ckpt), str(work), MOECTL_LOWBIT[p])
            if s:
                made[f"moectl_quantize_{MOECTL_LOWBIT[p]}_s"] = s
    return {"checkpoint": ckpt, "ggufs": ggufs, "made": made}


def gguf_bytes_per_token(gguf: Path) -> float:
    """Bytes one decode token reads from a GGUF: every tensor but the embedding table, routed experts' tensors
    (`*_exps`) at top-k / E of their size (gguf-py's reader, from the same llama.cpp tree)."""
    sys.path.insert(0, str(llamacpp.source_dir() / "gguf-py"))
    from gguf import GGUFReader

    r = GGUFReader(str(gguf))
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    k = int(r.fields[f"{arch}.expert_used_count"].parts[-1][0])
    e = int(r.fields[f"{arch}.expert_count"].parts[-1][0])
    total = 0.0
    for t in r.tensors:
        if t.name.startswith("token_embd"):
            continue
        total += t.n_bytes * (k / e if "_exps" in t.name else 1.0)
    return total


def moectl_bytes_per_token(ckpt: Path, workdir: Path, lowbit: str | None, dense_lowbit: str | None = None) -> float:
    """The same for moectl: dense tensors but the embedding, plus top-k experts per layer (the copy's bytes); with
    `dense_lowbit` (moectl's kernels' layouts, 2 bf16 per 64 weights) q8 the attention projections and lm_head
    q8g64, q4 the attention projections q4g64 and the lm_head q6g64 (models/dense_cpu.py)."""
    from moectl.store.facts import inspect_model

    info = inspect_model(str(ckpt), str(workdir), None)
    per_expert = info["bytes_per_expert"]
    if lowbit:
        per_expert = json.loads((workdir / f"experts-{lowbit}.json").read_text())["bytes_per_expert"]
    cfg = json.loads((ckpt / "config.json").read_text())
    embed = cfg["vocab_size"] * cfg["hidden_size"] * 2 if "bfloat16" in str(cfg.get("torch_dtype")) else \
        cfg["vocab_size"] * cfg["hidden_size"] * 4
    dense = info["dense_bytes"] - embed
    if dense_lowbit:
        H, V = cfg["hidden_size"], cfg["vocab_size"]
        hd = cfg.get("head_dim") or H // cfg["num_attention_heads"]
        q, kv = cfg["num_attention_heads"] * hd, cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * hd
        attn = cfg["num_hidden_layers"] * (2 * H * q + 2 * H * kv)                  # q, o, k, v
        attn_bits, head_bits = (4, 6) if dense_lowbit == "q4" else (8, 8)
        per = lambda bits: bits / 8 + 4 / 64                                        # noqa: E731 (bytes a weight)
        dense -= (attn + V * H) * 2 - (attn * per(attn_bits) + V * H * per(head_bits))   # bf16 -> low-bit
    return dense + info["moe_layers"] * info["top_k"] * per_expert


def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def compare(shape: str, layers: int, work: Path, threads: list[int], precisions: list[str], repeat: int,
            gen: int = 64, prompt: int = 32, prefill: int = 512, dense_lowbit: str | None = None,
            moectl_only: bool = False) -> dict:
    prep = prepare(shape, layers, work, precisions)
    rows = []
    for p in precisions:
        for t in threads:
            tools = [("moectl", MOECTL_LOWBIT[p] or "bf16")] + [("llama.cpp", qt) for qt in LLAMA_TYPES[p]]
            if dense_lowbit and p != "bf16":                   # moectl with its dense weights low-bit too
                tools.insert(1, ("moectl", f"{MOECTL_LOWBIT[p]}+dense-{dense_lowbit}"))
            if moectl_only:
                tools = [t for t in tools if t[0] == "moectl"]
            runs: dict = {k: [] for k in tools}
            for r in range(repeat):
                order = tools if r % 2 == 0 else tools[::-1]          # alternate which tool goes first
                for tool, name in order:
                    _log(f"{p} t={t} round {r + 1}/{repeat}: {tool} {name}")
                    if tool == "moectl":
                        res = moectl_run(str(prep["checkpoint"]), str(work), MOECTL_LOWBIT[p], t, prompt, gen,
                                         prefill, dense_lowbit if "+dense" in name else None)
                    else:
                        res = llama_run(prep["ggufs"][name], t, gen, prefill, prompt)
                    runs[(tool, name)].append(res)
            for (tool, name), rs in runs.items():
                nbytes = moectl_bytes_per_token(prep["checkpoint"], work, MOECTL_LOWBIT[p],
                                                dense_lowbit if "+dense" in name else None) if tool == "moectl" \
                    else gguf_bytes_per_token(prep["ggufs"][name])
                dec = summary([x["decode_ms"] for x in rs])
                rows.append({"precision": p, "threads": t, "tool": tool, "format": name,
                             "bytes_per_token": nbytes, "decode_gbps": nbytes / dec["median"] / 1e6,
                             "decode_ms": summary([x["decode_ms"] for x in rs]),
                             "prefill_tps": summary([x["prefill_tps"] for x in rs]),
                             "rss_gb": summary([x["rss_gb"] for x in rs])})
    from moectl.runtime.machine import mem_read_gbps

    return {"shape": shape, "layers": layers, "made": prep["made"], "rows": rows, "mem_read_gbps": mem_read_gbps(),
            "load": os.getloadavg(), "llamacpp_version": llamacpp.VERSION}


def print_table(res: dict) -> None:
    print(f"\n{res['shape']} x {res['layers']} layers (medians of {res['rows'][0]['decode_ms']['n']} alternating "
          f"runs, [min-max]; load average at the end {res['load'][0]:.1f} on 2 cores: a shared machine)")
    print(f"{'precision':9} {'thr':>3} {'tool':10} {'format':15} {'decode ms/tok':>22} {'prefill tok/s':>22} "
          f"{'RSS GB':>6} {'GB/s':>5}")
    for r in res["rows"]:
        d, pf = r["decode_ms"], r["prefill_tps"]
        print(f"{r['precision']:9} {r['threads']:>3} {r['tool']:10} {r['format']:15} "
              f"{d['median']:7.1f} [{d['min']:6.1f}-{d['max']:6.1f}] {pf['median']:7.1f} [{pf['min']:6.1f}-"
              f"{pf['max']:6.1f}] {r['rss_gb']['median']:6.2f} {r['decode_gbps']:5.1f}")
    print(f"  host memory read {res['mem_read_gbps']:.1f} GB/s (GB/s column: bytes a decode token reads / its time)")
    for k, v in res["made"].items():
        print(f"  {k}: {v:.1f} s")


# ------------------------------------------------------------------------------------------- fidelity
def fidelity(work: Path, ctx: int = 128, max_tokens: int = 16384, threads: int = 1, model: str = "tiny") -> dict:
    """Perplexity deltas, each tool against its own full-precision run, on the model's held-out text (`model`:
    tiny, or the reference model `make bench-fidelity` builds, on calibration/reference.yaml)."""
    from moectl.calib.builtin_corpus import builtin_corpus
    from moectl.calib.dataset import load_calibration
    from moectl.calib.fidelity import token_windows, window_nll
    from moectl.quant.quantize import quantize_model
    from moectl.runtime.engine import Engine
    from moectl.synth.tiny import ensure_tiny

    import math

    if model == "tiny":
        ckpt = ensure_tiny(Path(os.environ.get("MOECTL_HOME", "~/.cache/moectl")).expanduser() / "tiny")
        text = "\n\n".join(builtin_corpus("validation"))
    else:
        from bench.models import bench_model, held_out_dataset

        ref = bench_model(model)
        if not (ref.path / "config.json").is_file():
            raise SystemExit(f"error: no {model} model at {ref.path}: make bench-fidelity builds it")
        ckpt, text = ref.path, "\n\n".join(load_calibration(held_out_dataset(ref)))
    wd = ckpt.parent
    eng = Engine.load(str(ckpt), workdir=str(wd), progress=False, gating="none", device="cpu")
    ids = eng.tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
    text = eng.tokenizer.decode(ids)                       # the same tokens for both tools
    work.mkdir(parents=True, exist_ok=True)
    (work / "heldout.txt").write_text(text)
    out = {"tokens": len(ids), "ctx": ctx, "llama.cpp": {}, "moectl": {}}
    f32 = work / "tiny-F32.gguf"
    llamacpp.convert(ckpt, f32, "f32")
    for qt in ("F32", "Q8_0", "Q4_0", "Q4_K_M"):
        g = f32 if qt == "F32" else llamacpp.quantize(f32, work / f"tiny-{qt}.gguf", qt)
        out["llama.cpp"][qt] = llamacpp.perplexity(g, work / "heldout.txt", ctx, threads, chunks=len(ids) // ctx - 8)
    windows = token_windows(eng.tokenizer, [text], ctx, max_tokens)
    # fp32 rows: the copies dequantised per use (no CPU kernel takes fp32); bf16 rows: what a bf16 checkpoint runs
    # on this CPU, moectl's int8-activation kernels (q8g64 / q4g64, `moectl/kernels`) and `--dense-lowbit q4`
    rows = (("lossless", None, "float32", None), ("q8g64", "q8g64", "float32", None),
            ("q4g64", "q4g64", "float32", None), ("q4g64-hqq", "q4g64", "float32", None),
            ("bf16 lossless", None, "bfloat16", None), ("bf16 q8g64", "q8g64", "bfloat16", None),
            ("bf16 q4g64", "q4g64", "bfloat16", None), ("bf16 q4g64+dense-q4", "q4g64", "bfloat16", "q4"))
    for name, lowbit, dtype, dense in rows:
        if lowbit and "bf16" not in name:
            quantize_model(str(ckpt), int(lowbit[1]), 64, 1, device="cpu", workdir=str(wd), progress=False,
                           method="hqq" if name.endswith("hqq") else "rtn")
        if name == "bf16 q8g64":                         # the rtn copies the fp32 rows used (hqq's were last)
            for bits in (8, 4):
                quantize_model(str(ckpt), bits, 64, 1, device="cpu", workdir=str(wd), progress=False, method="rtn")
        e = Engine.load(str(ckpt), workdir=str(wd), lowbit=lowbit, precision="lowbit-only" if lowbit else None,
                        progress=False, gating="none", device="cpu", dtype=dtype, dense_lowbit=dense)
        r = window_nll(e, windows)
        out["moectl"][name] = {"ppl": math.exp(r["nll"] / r["scored"]), "scored": r["scored"],
                               "kernel": type(e.store.lowbit.format).__name__ if lowbit else None}
    for tool, base in (("llama.cpp", "F32"), ("moectl", "lossless")):
        b = out[tool][base]["ppl"]
        for k, v in out[tool].items():
            ref = out["moectl"]["bf16 lossless"]["ppl"] if k.startswith("bf16") else b
            v["delta_pct"] = (v["ppl"] / ref - 1) * 100
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", action="store_true", help="only build llama.cpp (cached)")
    ap.add_argument("--shape", default="mixtral")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--precisions", nargs="+", default=["bf16", "q8", "q4"], choices=list(LLAMA_TYPES))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--q4-types", nargs="+", default=LLAMA_TYPES["q4"], help="llama.cpp's q4 formats to compare")
    ap.add_argument("--prepare-only", action="store_true", help="make the checkpoint, GGUFs and copies, then stop")
    ap.add_argument("--work", default=None, help="where the checkpoint, GGUFs and copies go "
                    "(default $MOECTL_HOME/vs_llamacpp/<shape>-<layers>)")
    ap.add_argument("--fidelity", action="store_true", help="perplexity deltas on the trained tiny model")
    ap.add_argument("--fidelity-model", default="tiny", help="--fidelity's model: tiny, or reference (make "
                    "bench-fidelity builds it)")
    ap.add_argument("--clean", action="store_true", help="delete the GGUFs afterwards")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--dense-lowbit", default=None, choices=["q8", "q4"],
                    help="also run moectl with --dense-lowbit (attention + lm_head int8) at q8 / q4")
    ap.add_argument("--moectl-only", action="store_true", help="skip llama.cpp's runs (moectl's variants only)")
    a = ap.parse_args()
    LLAMA_TYPES["q4"] = list(a.q4_types)
    llamacpp.build(echo=_log)
    if a.build:
        return
    home = Path(os.environ.get("MOECTL_HOME", "~/.cache/moectl")).expanduser() / "vs_llamacpp"
    if a.fidelity:
        res = fidelity(Path(a.work or home / ("fidelity" if a.fidelity_model == "tiny" else
                                               f"fidelity-{a.fidelity_model}")), model=a.fidelity_model)
        for tool in ("llama.cpp", "moectl"):
            for k, v in res[tool].items():
                print(f"{tool:10} {k:10} ppl {v['ppl']:8.4f}  delta {v['delta_pct']:+.3f} %")
    else:
        work = Path(a.work or home / f"{shape_label(a.shape)}-{a.layers}")
        work.mkdir(parents=True, exist_ok=True)
        if a.prepare_only:
            print(json.dumps(prepare(a.shape, a.layers, work, a.precisions)["made"]))
            return
        res = compare(a.shape, a.layers, work, a.threads, a.precisions, a.repeat, dense_lowbit=a.dense_lowbit,
                      moectl_only=a.moectl_only)
        print_table(res)
        from moectl.runtime.machine import record_vs_llamacpp

        record_vs_llamacpp(res)                       # machine.json: this machine's measured rates
        if a.clean:
            for g in work.glob("*.gguf"):
                g.unlink()
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
