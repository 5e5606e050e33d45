"""moectl beside llama.cpp on the SAME GGUF file (issue 42): llama.cpp's converter and llama-quantize make the files,
`llama-bench` runs them, `moectl` runs the same file in place on the CPU (experts by ggml's kernels where they lie in
the mapped file: moectl/kernels/ggml.py), same threads.

1. A synthetic checkpoint of a recipe's shapes (`make-synthetic`: mixtral, qwen3-moe = 128 small experts top-8,
   gpt-oss-20b = MXFP4 experts; make-synthetic writes these families only), `--layers` deep, converted by `convert_hf_to_gguf.py` to BF16
   and quantized by `llama-quantize` to each `--types` (GPT-OSS: the converter's MXFP4 experts, then the types for
   the rest).
2. Per file and thread count, `--repeat` alternating rounds: decode ms/token (llama-bench `-p 0 -n GEN`; moectl:
   a prompt, then GEN drawn tokens fed one at a time, no logits read), prefill tokens/s (`-p PREFILL -n 0`; moectl
   one forward of PREFILL tokens), peak RSS per process, and load to first token (moectl: `Engine.load` + one
   token; llama.cpp: the wall time of `llama-bench -p 0 -n 1 -r 1` less its one token).
Medians, [min-max], the ratio moectl / llama.cpp of the medians (decode: <= 1.0 is moectl at least as fast).

    PYTHONPATH=. python bench/gguf_vs_llamacpp.py --shape qwen3-moe --layers 4 --threads 1 2 --repeat 3
    PYTHONPATH=. python bench/gguf_vs_llamacpp.py --shape mixtral --layers 2 --types Q4_K_M Q4_0 Q8_0 Q6_K
    PYTHONPATH=. python bench/gguf_vs_llamacpp.py --shape gpt-oss-20b --layers 2 --types Q8_0
    MOECTL_GGML=0 ... (the torch-int4 path it replaces)

The machine is shared: run it alone, and read the spread next to the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import llamacpp  # noqa: E402

DEFAULT_TYPES = ["Q4_K_M", "Q4_0", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_XS", "Q3_K_M", "Q2_K", "BF16"]


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def prepare(shape: str, layers: int, work: Path, types: list[str], threads: int = 2) -> dict[str, Path]:
    """{type: GGUF file}: the synthetic checkpoint converted (BF16) and quantized by llama.cpp's own tools, once."""
    from vs_llamacpp import converted_bf16

    _, bf16 = converted_bf16(shape, layers, work, {})
    files = {}
    for qt in types:
        g = bf16 if qt == "BF16" else work / f"model-{qt}.gguf"
        if not g.exists():
            _log(f"llama-quantize {qt}")
            llamacpp.quantize(bf16, g, qt, threads)
        files[qt] = g
    return files


MOECTL_RUN = """
import json, resource, time, torch
t0 = time.perf_counter()
from moectl.runtime.engine import Engine
eng = Engine.load({gguf!r}, device="cpu", threads={threads}, progress=False, gating="none")
with torch.inference_mode():
    out, pkv = eng.forward(torch.tensor([[1]]), None, last_only=True)
t_load = time.perf_counter() - t0
note = getattr(eng, "plan_note", None)
g = torch.Generator().manual_seed(0)
V = eng.config.vocab_size
with torch.inference_mode():
    ids = torch.randint(0, min(V, 1024), (1, {prefill}), generator=g)
    t0 = time.perf_counter(); eng.forward(ids, None, last_only=True); t_pre = time.perf_counter() - t0
    out, pkv = eng.forward(ids[:, :{prompt}], None, last_only=True)
    feed = torch.randint(0, min(V, 1024), ({gen}, 1, 1), generator=g)
    t0 = time.perf_counter()
    for t in range({gen}):
        out, pkv = eng.forward(feed[t], pkv)
    t_dec = time.perf_counter() - t0
print("RESULT " + json.dumps({{"prefill_tps": {prefill} / t_pre, "decode_ms": t_dec / {gen} * 1000, "load_s": t_load,
                              "rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "note": note}}))
"""


def moectl_run(gguf: Path, threads: int, gen: int, prompt: int, prefill: int) -> dict:
    """One fresh process on the file: load + first token, a prefill, a decode; its peak RSS."""
    code = MOECTL_RUN.format(gguf=str(gguf), threads=threads, gen=gen, prompt=prompt, prefill=prefill)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode or not line:
        raise SystemExit(f"moectl run failed on {gguf}:\n{r.stdout[-1500:]}\n{r.stderr[-3000:]}")
    return json.loads(line[-1][7:])


def llama_run(gguf: Path, threads: int, gen: int, prefill: int) -> dict:
    t0 = time.perf_counter()
    one = llamacpp.bench(gguf, threads, prompt=0, gen=1, reps=1)
    load_s = time.perf_counter() - t0 - 1 / one["tokens_per_s"]
    dec = llamacpp.bench(gguf, threads, prompt=0, gen=gen, reps=1)
    pre = llamacpp.bench(gguf, threads, prompt=prefill, gen=0, reps=1)
    return {"prefill_tps": pre["tokens_per_s"], "decode_ms": 1000 / dec["tokens_per_s"], "load_s": load_s,
            "rss_gb": max(dec["rss_gb"], pre["rss_gb"], one["rss_gb"])}


def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def compare(shape: str, layers: int, work: Path, types: list[str], threads: list[int], repeat: int, gen: int,
            prompt: int, prefill: int) -> dict:
    files = prepare(shape, layers, work, types)
    rows = []
    for qt, path in files.items():
        for t in threads:
            runs = {"moectl": [], "llama.cpp": []}
            for r in range(repeat):
                for tool in (("moectl", "llama.cpp") if r % 2 == 0 else ("llama.cpp", "moectl")):
                    _log(f"{qt} t={t} round {r + 1}/{repeat}: {tool}")
                    runs[tool].append(moectl_run(path, t, gen, prompt, prefill) if tool == "moectl"
                                      else llama_run(path, t, gen, prefill))
            row = {"type": qt, "threads": t, "file_gb": path.stat().st_size / 1e9,
                   "note": runs["moectl"][0].get("note")}
            for tool, rs in runs.items():
                row[tool] = {k: summary([x[k] for x in rs]) for k in ("decode_ms", "prefill_tps", "rss_gb", "load_s")}
            m, l = row["moectl"], row["llama.cpp"]
            row["ratio"] = {k: m[k]["median"] / l[k]["median"] for k in m}
            rows.append(row)
    return {"shape": shape, "layers": layers, "rows": rows, "load": os.getloadavg(),
            "llamacpp_version": llamacpp.VERSION}


def print_table(res: dict) -> None:
    """Fits 80 columns: one line per file and thread count."""
    print(f"\n{res['shape']} x {res['layers']} layers, same GGUF both tools (medians of {res['rows'][0]['moectl']['decode_ms']['n']}; "
          f"load avg {res['load'][0]:.1f})")
    print(f"{'type':7} {'thr':>3} {'ms/tok moectl':>13} {'llama':>6} {'ratio':>5} {'pp tok/s':>8} {'llama':>6} "
          f"{'RSS GB':>6} {'llama':>5} {'load s':>6} {'llama':>5}")
    for r in res["rows"]:
        m, l, q = r["moectl"], r["llama.cpp"], r["ratio"]
        print(f"{r['type']:7} {r['threads']:>3} {m['decode_ms']['median']:13.1f} {l['decode_ms']['median']:6.1f} "
              f"{q['decode_ms']:5.2f} {m['prefill_tps']['median']:8.1f} {l['prefill_tps']['median']:6.1f} "
              f"{m['rss_gb']['median']:6.2f} {l['rss_gb']['median']:5.2f} {m['load_s']['median']:6.1f} "
              f"{l['load_s']['median']:5.1f}")
    notes = {r["note"] for r in res["rows"] if r["note"]}
    for n in notes:
        print(f"  moectl: {n}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-moe", help="a recipe make-synthetic writes: mixtral, qwen3-moe, "
                    "gpt-oss-20b")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of the synthetic model")
    ap.add_argument("--types", nargs="+", default=DEFAULT_TYPES, help="llama-quantize types (BF16: the converted "
                    "file itself)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=3, help="alternating rounds per file and thread count")
    ap.add_argument("--gen", type=int, default=32, help="decode tokens timed")
    ap.add_argument("--prompt", type=int, default=16, help="context before the decode")
    ap.add_argument("--prefill", type=int, default=64, help="prefill tokens timed")
    ap.add_argument("--work", type=Path, default=None, help="where the files go (default "
                    "$MOECTL_HOME/gguf_vs_llamacpp/<shape>-<layers>/)")
    ap.add_argument("--json", type=Path, help="write the results here too")
    a = ap.parse_args()
    from moectl.core.recipes import moectl_home

    work = a.work or moectl_home() / "gguf_vs_llamacpp" / f"{a.shape}-{a.layers}"
    work.mkdir(parents=True, exist_ok=True)
    llamacpp.build(echo=_log)
    res = compare(a.shape, a.layers, work, a.types, a.threads, a.repeat, a.gen, a.prompt, a.prefill)
    print_table(res)
    if a.json:
        a.json.write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
