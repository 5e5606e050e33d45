"""moectl beside llama.cpp on the SAME GGUF file (issue 42): llama.cpp's converter and llama-quantize make the files,
`llama-bench` runs them, `moectl` runs the same file in place on the CPU (experts by ggml's kernels where they lie in
the mapped file: moectl/kernels/ggml.py), same threads.

1. A synthetic checkpoint of a recipe's shapes (`make-synthetic`: qwen3-moe = 128 small experts top-8, mixtral = 8
   large experts top-2, gpt-oss-20b = 32 experts top-4 of GPT-OSS's shapes, qwen1.5-moe = 60 experts top-4 and a
   shared expert; make-synthetic writes these families only), `--layers` deep, converted by `convert_hf_to_gguf.py` to BF16 (the checkpoint is then deleted: only the
   conversion reads it) and quantized by `llama-quantize` to each `--types`. Default: issue 42's file set, Q4_K_M
   Q4_0 Q5_K_M Q6_K Q8_0 IQ4_XS BF16 and the "other" encodings IQ2_XXS IQ3_XXS Q2_K Q3_K_M; for gpt-oss-20b the
   MXFP4 file, MXFP4_MOE (experts MXFP4, the rest Q8_0: make-synthetic writes GPT-OSS's shapes as a Mixtral-family
   bf16 checkpoint, so the MXFP4 comes from llama-quantize, not from the converter). IQ2_XXS and IQ3_XXS (and
   IQ1_S / IQ2_XS / IQ2_S / IQ1_M) need an importance matrix: `llama-imatrix` on the BF16 file over 8 x 128 tokens
   of moectl's built-in corpus (a random-weight model: it gives llama-quantize its required input and the
   per-expert weighting a real imatrix has; a few experts no token routes to get none, as with a real text).
   `--drop-bf16` deletes the BF16 file once the rest is made (2-layer Mixtral: 6.3 GB; then BF16 is not timed);
   `--prepare-only` makes the files, prints them with their sizes and how long each took, and times nothing.
2. Per file (read once first, untimed: both tools start with it in the page cache) and thread count, `--repeat`
   alternating rounds, both tools in fresh processes: decode ms/token
   (llama-bench `-p 0 -n GEN`; moectl: a prompt, then GEN drawn tokens fed one at a time, no logits read),
   prefill tokens/s (`-p PREFILL -n 0 -r PREFILL_REPS`, its mean; moectl: the mean of PREFILL_REPS forwards of
   PREFILL tokens after a warm-up forward, as llama-bench warms up, each on the ids llama-bench feeds: both route
   the same rows), peak RSS per process, and load to first token
   (moectl: `Engine.load` + one token; llama.cpp: the wall time of `llama-bench -p 0 -n 1 -r 1` less its one token).
   moectl's side is bench/moectl_timed.py, the same script bench/vs_llamacpp.py times moectl with.
3. The memory roofline beside the decode (stop 54): a decode token reads each weight it uses once, so when decode is
   memory-bound neither tool can beat bytes read / the bandwidth the cores stream at, whatever its kernels. Per file,
   the bytes a token reads from the header alone (`decode_read_bytes`, moectl/store/gguf/experts.py: the dense
   tensors, the lm_head, one embedding row, top-k of each layer's experts, at the file's encodings); per row, a
   streaming-read probe at the row's threads just before and just after its rounds (`ggml.read_bandwidth`: pthreads
   reading a `--probe-gb` buffer with AVX2 loads and a software prefetch 4 KB ahead (stop 55), first touch untimed,
   `--probe-passes` passes each). The roofline
   table: MB/token, the probe's GB/s (median [min-max] of both probes' passes), each tool's achieved GB/s (bytes a
   token / its median ms a token) and that as a % of the probe's median, and the floor (ms/token at the probe's GB/s).
Medians, decode with [min-max], the ratio moectl / llama.cpp of the medians (decode: <= 1.0 is moectl at least as
fast). The JSON has every run's kernels (moectl: ggml and the CPU features it dispatches on, or why not; its
AVX-512 kernels or why not) and llama-bench's CPU and backend, and llama.cpp's system_info line (the ISA its CPU
backend was built with). On an AVX2-only host the table says its figures are the AVX2 ones. `--isa avx2` restricts
both tools to AVX2 on an AVX-512 host (issue 42's AVX2 table): llama.cpp's tools from bin-avx2/ (GGML_NATIVE=OFF
GGML_AVX2=ON, no AVX-512), moectl's children with MOECTL_GGML_ISA=avx2 (ggml built likewise, its AVX-512 kernels off);
the JSON's `isa` and the table's title say so, and nothing is timed where either side's library reports AVX-512.

    make bench-gguf                          # the issue's table: all three shapes, 1 and 2 threads, JSON in bench-gguf/
    make bench-gguf-avx2                     # its AVX2 table: Q4_K_M and Q8_0, both tools restricted to AVX2
    PYTHONPATH=. python bench/gguf_vs_llamacpp.py --shape qwen3-moe --layers 2 --prepare-only
    PYTHONPATH=. python bench/gguf_vs_llamacpp.py --gguf FILE.gguf --threads 1 2 --repeat 2   # files made elsewhere
    PYTHONPATH=. python bench/gguf_vs_llamacpp.py --shape mixtral --layers 2 --drop-bf16 --types Q4_K_M Q8_0
    MOECTL_GGML=0 ... (the torch-int4 path it replaces)

The machine is shared: run it alone, and read the spread next to the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import llamacpp  # noqa: E402
import moectl_timed  # noqa: E402
import vs_llamacpp  # noqa: E402
from moectl.errors import MoectlError  # noqa: E402
from moectl.kernels import isa as isas  # noqa: E402

# The file set issue 42 asks for, per shape: the encodings people download, then the "other" ones (<= 1.5x there)
FILE_SET = ["Q4_K_M", "Q4_0", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_XS", "BF16", "IQ2_XXS", "IQ3_XXS", "Q2_K", "Q3_K_M"]
# make-synthetic writes gpt-oss-20b as a Mixtral-family checkpoint with GPT-OSS's expert shapes (bf16), so the
# converter's file has BF16 experts; llama-quantize's MXFP4_MOE makes the GPT-OSS file (experts MXFP4, rest Q8_0)
GPT_OSS_SET = ["MXFP4_MOE"]
# llama-quantize refuses these without an importance matrix (llama-quant.cpp: tensor_requires_imatrix)
IMATRIX_TYPES = {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS"}
# 1024 tokens of the built-in corpus, a minute: on the Qwen3 shape 124 of 128 experts of layer 1 saw tokens
# (llama-imatrix: "partial data (96.88%)"); llama-quantize gives an expert without data weights of 1
IMATRIX_CTX, IMATRIX_CHUNKS = 128, 8


def default_types(shape: str) -> list[str]:
    return GPT_OSS_SET if vs_llamacpp.shape_label(shape).startswith("gpt-oss") else FILE_SET


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_imatrix(bf16: Path, work: Path, threads: int) -> Path:
    """llama-imatrix on the BF16 file over IMATRIX_CHUNKS x IMATRIX_CTX tokens of moectl's built-in corpus (its
    validation split): what a dynamic quant's maker does with a real text, on a random-weight model."""
    from moectl.calib.builtin_corpus import builtin_corpus

    out = work / "imatrix.gguf"
    if not out.exists():
        text = work / "imatrix-text.txt"
        text.write_text("\n\n".join(builtin_corpus("validation")))
        llamacpp.imatrix(bf16, text, out, IMATRIX_CTX, IMATRIX_CHUNKS, threads)
    return out


def prepare(shape: str, layers: int, work: Path, types: list[str], threads: int = 2, drop_bf16: bool = False,
            keep_checkpoint: bool = False) -> dict[str, Path]:
    """{type: GGUF file}: the synthetic checkpoint converted (BF16) and quantized by llama.cpp's own tools, each once
    (the seconds each step took go to `work`/prepare.json). The checkpoint is deleted once converted unless
    `keep_checkpoint`; `drop_bf16`: the BF16 file too once every other type is made (then BF16 is not timed)."""
    from vs_llamacpp import converted_bf16

    times_file = work / "prepare.json"
    took = json.loads(times_file.read_text()) if times_file.exists() else {}

    def timed(step: str, fn):
        t0 = time.perf_counter()
        out = fn()
        took[step] = round(time.perf_counter() - t0, 1)
        times_file.write_text(json.dumps(took, indent=1))
        return out

    bf16 = work / "model-BF16.gguf"
    quantized = {qt: work / f"model-{qt}.gguf" for qt in types if qt != "BF16"}
    if not bf16.exists() and (not all(g.exists() for g in quantized.values()) or (not drop_bf16 and "BF16" in types)):
        made: dict = {}
        timed("checkpoint+convert", lambda: converted_bf16(shape, layers, work, made))
    if not keep_checkpoint and (work / "checkpoint").exists() and bf16.exists():
        shutil.rmtree(work / "checkpoint")                   # only the conversion reads it
    files = {}
    for qt, g in quantized.items():
        if not g.exists():
            imatrix = work / "imatrix.gguf" if qt in IMATRIX_TYPES else None
            if imatrix and not imatrix.exists():
                _log("llama-imatrix")
                timed("llama-imatrix", lambda: make_imatrix(bf16, work, threads))
            _log(f"llama-quantize {qt}{' --imatrix' if imatrix else ''}")
            part = g.with_name(g.name + ".part")           # an interrupted run leaves no file that looks made
            timed(f"llama-quantize {qt}", lambda: llamacpp.quantize(bf16, part, qt, threads, imatrix=imatrix,
                                                                     log=Path(str(g) + ".log")))
            part.replace(g)
        files[qt] = g
    if "BF16" in types and not drop_bf16:
        files["BF16"] = bf16
    if drop_bf16 and bf16.exists():
        bf16.unlink()
    return files


def file_list(files: dict[str, Path], work: Path) -> str:
    """The files made, their sizes and how long each step took (`--prepare-only`'s report)."""
    took = json.loads((work / "prepare.json").read_text()) if (work / "prepare.json").exists() else {}
    lines = [f"{work}:"]
    for qt, g in files.items():
        s = took.get(f"llama-quantize {qt}")
        lines.append(f"  {g.name:28} {g.stat().st_size / 1e9:6.2f} GB" + (f"  made in {s:.0f} s" if s else ""))
    for step in ("checkpoint+convert", "llama-imatrix"):
        if step in took:
            lines.append(f"  {step}: {took[step]:.0f} s")
    lines.append(f"  total {sum(g.stat().st_size for g in files.values()) / 1e9:.2f} GB")
    return "\n".join(lines)


TORCH_FREE = [True]     # --engine torch: the torch Engine even where `moectl generate` takes the torch-free one
PREFILL_REPS = [3]      # --prefill-reps: timed prefills a run, both tools (llama-bench -r; moectl: the mean of as many)


def moectl_run(gguf: Path, threads: int, gen: int, prompt: int, prefill: int) -> dict:
    """One fresh process on the file (bench/moectl_timed.py, as vs_llamacpp.py's): load + first token, warm-up,
    a prefill, a decode; its peak RSS and kernels. The engine `moectl generate` runs on it: the torch-free one
    where it serves the file (runtime/graph_engine.py), else the torch Engine."""
    if TORCH_FREE[0]:
        try:
            return moectl_timed.moectl_run({"model": str(gguf)}, threads, prompt, gen, prefill, time_load=True,
                                           torch_free=True, prefill_reps=PREFILL_REPS[0])
        except SystemExit as e:
            if "does not serve" not in str(e):
                raise
    return moectl_timed.moectl_run({"model": str(gguf)}, threads, prompt, gen, prefill, time_load=True,
                                   prefill_reps=PREFILL_REPS[0])


def llama_run(gguf: Path, threads: int, gen: int, prefill: int, depth: int = 0) -> dict:
    """llama-bench's loop: load + one token (wall time less the token), a decode of `gen` after `depth` tokens of
    context (`-d`: filled untimed, as moectl's side decodes after its `prompt`; both then attend the same
    positions), a prefill of `prefill`; the largest peak RSS of the three, and what llama-bench reports of the CPU
    and backend it ran on."""
    t0 = time.perf_counter()
    one = llamacpp.bench(gguf, threads, prompt=0, gen=1, reps=1)
    load_s = time.perf_counter() - t0 - 1 / one["tokens_per_s"]
    dec_rows, dec_rss = llamacpp.bench_rows(gguf, ["-t", threads, "-p", 0, "-n", gen, "-d", depth, "-r", 1])
    pre = llamacpp.bench(gguf, threads, prompt=prefill, gen=0, reps=PREFILL_REPS[0])
    d = dec_rows[0]
    return {"prefill_tps": pre["tokens_per_s"], "decode_ms": 1000 / d["avg_ts"], "load_s": load_s,
            "rss_gb": max(dec_rss, pre["rss_gb"], one["rss_gb"]),
            "cpu": {k: d.get(k) for k in ("cpu_info", "backends", "repack", "build_commit", "n_threads")}}


def host_isa() -> str:
    """"AVX-512" or "AVX2" (or "older than AVX2"): the widest x86 vector ISA this host has (/proc/cpuinfo)."""
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    words = set(flags.split())
    return "AVX-512" if "avx512f" in words else "AVX2" if "avx2" in words else "older than AVX2"


def use_isa(name: str) -> str:
    """Restrict both tools to `name` (moectl/kernels/isa.py: native or avx2) for this process and the ones it starts:
    MOECTL_GGML_ISA for moectl's children (its ggml build, its AVX-512 kernels off) and for llama.cpp's tools
    (bench/llamacpp.py: bin-avx2/); with avx2 also torch's and oneDNN's CPU dispatch (read at their import), so a
    child that runs the torch Engine is no wider either."""
    os.environ[isas.ENV] = isas.check(name)
    if name == "avx2":
        os.environ["ATEN_CPU_CAPABILITY"] = "avx2"
        os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"
    return name


# what a restricted run must not report: llama.cpp's system_info names (`X = 1`), ggml's features (the shim's names)
WIDER_INFO = re.compile(r"\b((?:AVX512|AMX)\w*|AVX_VNNI) = 1\b")
WIDER_FEATURES = ("avx512", "avx512_vnni", "avx_vnni")


def wider_than_isa(isa: str, llama_info: str | None, ggml_features: list[str] | None, kernels: list[dict]) -> list[str]:
    """Why a comparison at `isa` is not what it says (empty: it is; always empty for native): llama.cpp's system_info
    line names an AVX-512 / AMX / AVX-VNNI feature in use (or there is none to read), moectl's ggml reports one
    (`ggml_features`: this process's library; `kernels`: each moectl run's own report), or a run used moectl's
    AVX-512 kernels."""
    if isa == "native":
        return []
    out = []
    if not llama_info:
        out.append("llama.cpp printed no system_info line to check")
    elif WIDER_INFO.search(llama_info):
        out.append(f"llama.cpp's system_info has {', '.join(m.group(0) for m in WIDER_INFO.finditer(llama_info))}")
    feats = set(ggml_features or []) | {f for k in kernels for f in k.get("ggml_features", [])}
    if feats & set(WIDER_FEATURES):
        out.append(f"moectl's ggml reports {', '.join(sorted(feats & set(WIDER_FEATURES)))}")
    if any(k.get("moectl_avx512") for k in kernels):
        out.append("a moectl run used its AVX-512 kernels")
    return out


def refuse_wider(isa: str, llama_info: str | None, ggml_features: list[str] | None, kernels: list[dict]) -> None:
    reasons = wider_than_isa(isa, llama_info, ggml_features, kernels)
    if reasons:
        sys.exit(f"error: not restricted to {isa.upper()}, so not compared: {'; '.join(reasons)}")


def ggml_features_here() -> list[str] | None:
    """The CPU features of the ggml this process loads (the build moectl's children load too: same
    MOECTL_GGML_ISA), or None where it does not load."""
    from moectl.kernels import ggml

    return ggml.features() if ggml.library() is not None else None


def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


FIGURES = ("decode_ms", "prefill_tps", "rss_gb", "load_s")


def warm_page_cache(path: Path) -> None:
    """Read the file once, untimed, so neither tool's first run meets it out of the page cache (the machine holds
    a few of the set's files at a time): llama.cpp reads the whole file at load (MAP_POPULATE), moectl asks for it
    in the background (MADV_WILLNEED) and touches it over its first tokens, so a cold file was a disk read inside
    moectl's timed tokens and inside llama.cpp's untimed load: the 1-thread Mixtral rows at 1.1-2x (stop 50)."""
    with open(path, "rb", buffering=0) as f:
        while f.read(1 << 24):
            pass


# the read probe (`--probe-gb`, `--probe-passes`): bytes of its buffer (far past the caches) and passes a probe
PROBE = {"bytes": 1 << 30, "passes": 7}


def token_read_bytes(path: Path) -> dict:
    """What a decode token of the file reads, from its header (moectl/store/gguf/experts.py `decode_read_bytes`)."""
    from moectl.store.gguf.experts import decode_read_bytes
    from moectl.store.gguf.files import GgufFiles

    return decode_read_bytes(GgufFiles(path))


def read_probe(threads: int) -> dict | None:
    """The streaming-read bandwidth at `threads` (moectl/kernels/ggml.py `read_bandwidth`), or None where ggml's shim
    does not load here (`MOECTL_GGML=0` switches it off for the probe too)."""
    from moectl.kernels import ggml

    if ggml.library() is None:
        return None
    return ggml.read_bandwidth(PROBE["bytes"], threads, PROBE["passes"])


def probe_lines(threads: list[int]) -> list[str]:
    """`--probe-only`'s report: the probe's GB/s at each thread count, median [min-max] of its passes."""
    out = [f"streaming read of {PROBE['bytes'] / 2**30:g} GiB, {PROBE['passes']} passes (GB/s, median [min-max]):"]
    for t in threads:
        p = read_probe(t)
        if p is None:
            sys.exit("error: the read probe needs ggml's shim, which does not load here (MOECTL_GGML=0, or no build)")
        out.append(f"  {t:>3} thr {_spread({'median': p['gbps'], 'min': p['min'], 'max': p['max']}, 20)}")
    return out


def roofline(read: dict, probes: list[dict | None], decode_ms: dict[str, float]) -> dict:
    """A row's roofline fields: the probes' passes pooled (median [min-max]); per tool the GB/s its median decode
    achieved (bytes a token / ms a token) and that as a % of the probes' median; the floor, ms/token at that median.
    Where no probe ran: the achieved GB/s alone."""
    achieved = {tool: read["total"] / (ms / 1e3) / 1e9 for tool, ms in decode_ms.items()}
    out = {"decode_read_bytes": read, "read_probe": probes, "achieved_gbps": achieved}
    passes = [x for p in probes if p for x in p["passes"]]
    if passes:
        bw = summary(passes)
        out.update(read_gbps=bw, roofline_pct={tool: 100 * g / bw["median"] for tool, g in achieved.items()},
                   roofline_ms=read["total"] / (bw["median"] * 1e9) * 1e3)
    return out


def compare(shape: str, layers: int, work: Path, types: list[str], threads: list[int], repeat: int, gen: int,
            prompt: int, prefill: int, drop_bf16: bool = False, files: dict[str, Path] | None = None,
            isa: str = "native") -> dict:
    """`files` ({label: GGUF}): time these instead of making the shape's (`--gguf`). `isa` (`use_isa` set it): with
    avx2, nothing is timed unless both tools' libraries report no AVX-512 (`refuse_wider`), checked before the runs
    and again on what each moectl run reports."""
    files = files or prepare(shape, layers, work, types, drop_bf16=drop_bf16)
    smallest = min(files.values(), key=lambda g: g.stat().st_size)
    info = llamacpp.system_info(smallest)
    refuse_wider(isa, info, ggml_features_here() if isa != "native" else None, [])
    rows = []
    for qt, path in files.items():
        warm_page_cache(path)
        read = token_read_bytes(path)
        for t in threads:
            before = read_probe(t)              # this row's bandwidth, just before and just after its rounds
            runs = {"moectl": [], "llama.cpp": []}
            for r in range(repeat):
                for tool in (("moectl", "llama.cpp") if r % 2 == 0 else ("llama.cpp", "moectl")):
                    _log(f"{qt} t={t} round {r + 1}/{repeat}: {tool}")
                    runs[tool].append(moectl_run(path, t, gen, prompt, prefill) if tool == "moectl"
                                      else llama_run(path, t, gen, prefill, prompt))
            row = {"type": qt, "threads": t, "file_gb": path.stat().st_size / 1e9,
                   "note": runs["moectl"][0].get("note"),
                   # per run: moectl's kernels (ggml and its CPU features, or why not), llama-bench's CPU/backend
                   "kernels": [x["kernels"] for x in runs["moectl"]],
                   # per run: the first-use repack the warm-up left, finished untimed (matrices, seconds)
                   "first_use_repack": [x.get("first_use_repack") for x in runs["moectl"]],
                   "llamacpp_cpu": [x["cpu"] for x in runs["llama.cpp"]]}
            for tool, rs in runs.items():
                row[tool] = {k: summary([x[k] for x in rs]) for k in FIGURES}
            m, l = row["moectl"], row["llama.cpp"]
            row["ratio"] = {k: m[k]["median"] / l[k]["median"] for k in m}
            # each round's two runs are seconds apart, rounds minutes: this host's speed drifts by 10-30 % between
            # rounds (docs/gguf.md, stop 51: a Mixtral Q8_0 decode 118 then 85 ms/token), so the median of each
            # round's own ratio is the steadier figure of the two
            row["paired_ratio"] = {k: statistics.median(a[k] / b[k] for a, b in zip(runs["moectl"], runs["llama.cpp"]))
                                   for k in FIGURES}
            row.update(roofline(read, [before, read_probe(t)], {tool: row[tool]["decode_ms"]["median"]
                                                                 for tool in runs}))
            refuse_wider(isa, info, None, row["kernels"])
            rows.append(row)
    return {"shape": shape, "layers": layers, "rows": rows, "load": os.getloadavg(),
            "llamacpp_version": llamacpp.VERSION, "host_isa": host_isa(), "isa": isa, "prefill_reps": PREFILL_REPS[0],
            "llamacpp_system_info": info,
            "read_probe_setup": {**PROBE, "why_not": None if any(r.get("read_gbps") for r in rows) else
                                 "ggml's shim did not load here: no probe"}}


def _spread(s: dict, width: int, prec: int = 1) -> str:
    """"median [min-max]" in `width` columns."""
    return f"{s['median']:.{prec}f} [{s['min']:.{prec}f}-{s['max']:.{prec}f}]".rjust(width)


def table(res: dict) -> list[str]:
    """The result as lines of at most 80 columns: decode (medians [min-max], ratio moectl / llama.cpp: <= 1.0 is
    moectl at least as fast), then prefill, peak RSS and load to first token (medians), then what ran them."""
    import textwrap

    n = res["rows"][0]["moectl"]["decode_ms"]["n"]
    restricted = res.get("isa", "native") != "native"
    out = textwrap.wrap(f"{res['shape']} x {res['layers']} layers, both tools restricted to {res['isa'].upper()} "
                        "(no AVX-512)", 80) if restricted else []
    out += [f"{res['shape']} x {res['layers']} layers, the same GGUF in both tools: medians of {n} alternating",
           f"runs [min-max]; load average {res['load'][0]:.1f} at the end; ratio: of the medians, paired: the",
           "median of each round's own ratio"]
    for label, path in res.get("files", {}).items():     # --gguf: the files' short names
        out += textwrap.wrap(f"{label} = {path}", 80, subsequent_indent="  ")
    out += ["", f"{'type':9} {'thr':>3} {'decode ms/token: moectl':>25} {'llama.cpp':>22} {'ratio':>6} {'paired':>6}"]
    for r in res["rows"]:
        m, l = r["moectl"], r["llama.cpp"]
        paired = r.get("paired_ratio", r["ratio"])["decode_ms"]         # a JSON from before stop 53 has none
        out.append(f"{r['type']:9} {r['threads']:>3} {_spread(m['decode_ms'], 25)} {_spread(l['decode_ms'], 22)} "
                   f"{r['ratio']['decode_ms']:6.2f} {paired:6.2f}")
    out += roofline_table(res["rows"])
    out += ["", f"{'type':9} {'thr':>3} {'prefill tok/s: moectl':>21} {'llama':>6} {'ratio':>5} "
                f"{'RSS GB':>6} {'llama':>5} {'load s':>6} {'llama':>5}"]
    for r in res["rows"]:
        m, l, q = r["moectl"], r["llama.cpp"], r["ratio"]
        out.append(f"{r['type']:9} {r['threads']:>3} {m['prefill_tps']['median']:21.1f} "
                   f"{l['prefill_tps']['median']:6.1f} {q['prefill_tps']:5.2f} {m['rss_gb']['median']:6.2f} "
                   f"{l['rss_gb']['median']:5.2f} {m['load_s']['median']:6.1f} {l['load_s']['median']:5.1f}")
    isa = res.get("host_isa")
    if restricted:
        out += [""] + textwrap.wrap(
            f"Both tools restricted to {res['isa'].upper()} on this {isa} host: llama.cpp built with GGML_NATIVE=OFF "
            f"GGML_{res['isa'].upper()}=ON and no AVX-512/AMX/AVX-VNNI (bin-{res['isa']}/), moectl's ggml the "
            f"same ({isas.ENV}={res['isa']}), its AVX-512 kernels off.", 80)
    elif isa == "AVX2":
        out += ["", "This host has AVX2 and no AVX-512: these are the AVX2 figures (llama.cpp built",
                "natively for it; moectl's AVX-512 kernels cannot run)."]
    cpu = res["rows"][0]["llamacpp_cpu"][0]
    cpu_part = res.get("llamacpp_system_info", "").partition("CPU :")[2]      # after the thread counts
    feats = re.findall(r"(\w+) = 1", cpu_part)
    out += textwrap.wrap(f"llama.cpp: {cpu.get('cpu_info')}, backend {cpu.get('backends')}, repack "
                         f"{cpu.get('repack')}; built with {' '.join(feats) or '?'}", 80)
    k = res["rows"][0]["kernels"][0]
    served = f"ggml ({' '.join(k['ggml_features'])})" if k["ggml"] else f"not ggml ({k['ggml_why_not']})"
    avx512 = "in use" if k["moectl_avx512"] else f"not in use ({k['moectl_avx512_why_not']})"
    out += textwrap.wrap(f"moectl: experts by {served}; its AVX-512 kernels {avx512}", 80)
    notes = list(dict.fromkeys(r["note"] for r in res["rows"] if r["note"]))    # each names its type and threads
    if notes:
        out += textwrap.wrap(f"moectl ({res['rows'][0]['type']}, {res['rows'][0]['threads']} thr): {notes[0]}", 80)
        if len(notes) > 1:
            out.append(f"  ({len(notes) - 1} more such notes, one per file and thread count: in the JSON's rows)")
    return out


def roofline_table(rows: list[dict]) -> list[str]:
    """Decode against the memory roofline, one line a row (none for a JSON from before stop 54): MB a token reads,
    the read probe's GB/s at the row's threads, each tool's achieved GB/s and its % of the probe, the floor."""
    if not any("decode_read_bytes" in r for r in rows):
        return []
    import textwrap

    n = next((r["read_gbps"]["n"] for r in rows if r.get("read_gbps")), 0)
    out = [""] + textwrap.wrap(
        "Decode against the memory roofline: MB/tok = what a token reads (header: dense + lm_head + 1 embedding row "
        f"+ top-k experts); read GB/s = the streaming-read probe at the row's threads ({n} passes, before and after "
        "the row's rounds); moectl, llama = GB/s (MB/tok / median ms/token); % = of the probe's median; floor = "
        "ms/token at the probe's median", 80)
    out.append(f"{'type':9} {'thr':>3} {'MB/tok':>7} {'read GB/s [min-max]':>19} {'moectl':>6} {'%':>4} "
               f"{'llama':>6} {'%':>4} {'floor ms':>8}")

    def cell(x: float | None, width: int, fmt: str) -> str:         # "-" where no probe ran
        return f"{x:{width}{fmt}}" if x is not None else "-".rjust(width)

    for r in rows:
        if "decode_read_bytes" not in r:
            continue
        got, bw, pct = r["achieved_gbps"], r.get("read_gbps"), r.get("roofline_pct", {})
        probe = _spread(bw, 19) if bw else "-".rjust(19)
        out.append(f"{r['type']:9} {r['threads']:>3} {r['decode_read_bytes']['total'] / 1e6:7.1f} {probe} "
                   f"{got['moectl']:6.1f} {cell(pct.get('moectl'), 4, '.0f')} {got['llama.cpp']:6.1f} "
                   f"{cell(pct.get('llama.cpp'), 4, '.0f')} {cell(r.get('roofline_ms'), 8, '.2f')}")
    return out


def print_table(res: dict) -> None:
    print("\n" + "\n".join(table(res)))


ROOFLINE_HELP = """\
Beside the decode ratios, the memory roofline (stop 54): a decode token reads every weight it uses
once, so a memory-bound decode takes at least bytes read / streaming bandwidth, whatever the
kernels. Per file, the bytes a token reads come from the GGUF header (dense tensors, lm_head, one
embedding row, top-k of each layer's experts, at the file's encodings); per row, a read probe
(pthreads streaming a --probe-gb buffer, the row's threads) runs just before and after its rounds.
The second table and the JSON rows' decode_read_bytes, read_probe, read_gbps, achieved_gbps,
roofline_pct and roofline_ms: each tool's GB/s and its % of the probe (near 100: memory-bound)."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=ROOFLINE_HELP)
    ap.add_argument("--shape", default="qwen3-moe", help="a recipe make-synthetic writes: mixtral, qwen3-moe, "
                    "gpt-oss-20b, qwen1.5-moe; or a yaml file of one (bench/shapes/qwen3-moe-thin48.yaml: Qwen3's "
                    "experts and vocabulary at hidden 512, for 48 layers)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of the synthetic model")
    ap.add_argument("--types", nargs="+", default=None, help="llama-quantize types (BF16: the converted file "
                    "itself; default: issue 42's file set, " + " ".join(FILE_SET) + "; gpt-oss-20b: " +
                    " ".join(GPT_OSS_SET) + ")")
    ap.add_argument("--prepare-only", action="store_true", help="make the files, print their list, sizes and "
                    "how long each took; time nothing")
    ap.add_argument("--drop-bf16", action="store_true", help="delete the BF16 file once the other types are made "
                    "(saves its size on disk; BF16 is then not timed)")
    ap.add_argument("--keep-checkpoint", action="store_true", help="keep the synthetic safetensors checkpoint after "
                    "the conversion (default: delete it)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=3, help="alternating rounds per file and thread count")
    ap.add_argument("--gen", type=int, default=32, help="decode tokens timed")
    ap.add_argument("--prompt", type=int, default=16, help="context before the decode")
    ap.add_argument("--prefill", type=int, default=64, help="prefill tokens timed")
    ap.add_argument("--prefill-reps", type=int, default=3, help="timed prefills a run, on both sides (llama-bench's "
                    "-r; moectl: the mean tokens/s of as many forwards): one alone moved 0.8-1.3x between runs")
    ap.add_argument("--work", type=Path, default=None, help="where the files go (default "
                    "$MOECTL_HOME/gguf_vs_llamacpp/<shape>-<layers>/)")
    ap.add_argument("--json", type=Path, help="write the results here too")
    ap.add_argument("--engine", choices=("auto", "torch"), default="auto", help="moectl's engine: auto = what "
                    "`moectl generate` runs (the torch-free one where it serves the file), torch = the torch Engine")
    ap.add_argument("--gguf", type=Path, nargs="+", help="time these GGUF files instead of making the shape's (e.g. "
                    "bench/gguf_gpt_oss.py --write-only's real GPT-OSS file: --shape gpt-oss-20b is a "
                    "Mixtral-architecture file of GPT-OSS's shapes)")
    ap.add_argument("--probe-gb", type=float, default=PROBE["bytes"] / 2**30, help="the read probe's buffer, GiB "
                    "(default %(default)g: far past the caches; the roofline table's read GB/s)")
    ap.add_argument("--probe-passes", type=int, default=PROBE["passes"], help="timed passes over it per probe, two "
                    "probes a row (default %(default)s)")
    ap.add_argument("--probe-only", action="store_true", help="run the read probe at --threads and print its GB/s; "
                    "make and time nothing")
    ap.add_argument("--isa", choices=isas.ISAS, default=None, help="both tools' instruction set: native (each built "
                    "for this CPU) or avx2 (llama.cpp's tools from bin-avx2/, moectl's ggml built for AVX2, its "
                    "AVX-512 kernels off; refused if either side reports AVX-512). Default: $MOECTL_GGML_ISA, else "
                    "native")
    a = ap.parse_args()
    try:
        isa = use_isa(a.isa or isas.current())
    except MoectlError as e:
        sys.exit(f"error: {e}")
    if a.probe_gb <= 0 or a.probe_passes < 1:
        sys.exit("error: --probe-gb must be > 0 and --probe-passes >= 1")
    PROBE.update(bytes=int(a.probe_gb * 2**30), passes=a.probe_passes)
    if a.probe_only:
        print("\n".join(probe_lines(a.threads)))
        return
    TORCH_FREE[0] = a.engine == "auto"
    if a.prefill_reps < 1:
        sys.exit(f"error: --prefill-reps must be at least 1 (got {a.prefill_reps})")
    PREFILL_REPS[0] = a.prefill_reps
    if a.gguf:
        from moectl.store.gguf.files import GgufFiles

        missing = [str(g) for g in a.gguf if not g.is_file()]
        if missing:
            sys.exit(f"error: no such GGUF file: {', '.join(missing)}")
        llamacpp.build(echo=_log)
        head = GgufFiles(a.gguf[0])
        # the table's type column is 9 wide: a longer file name is file1, file2, ... there, named above it
        labels = {(g.stem if len(g.stem) <= 9 else f"file{i + 1}"): g for i, g in enumerate(a.gguf)}
        res = compare(head.arch, int(head.get("{arch}.block_count")), a.gguf[0].parent, [], a.threads, a.repeat,
                      a.gen, a.prompt, a.prefill, files=labels, isa=isa)
        res["files"] = {k: str(g) for k, g in labels.items()}
        print_table(res)
        if a.json:
            a.json.write_text(json.dumps(res, indent=1, default=str))
        return
    from moectl.core.recipes import moectl_home

    work = a.work or moectl_home() / "gguf_vs_llamacpp" / f"{vs_llamacpp.shape_label(a.shape)}-{a.layers}"
    work.mkdir(parents=True, exist_ok=True)
    llamacpp.build(echo=_log)
    types = a.types or default_types(a.shape)
    if a.prepare_only:
        print(file_list(prepare(a.shape, a.layers, work, types, drop_bf16=a.drop_bf16,
                                keep_checkpoint=a.keep_checkpoint), work))
        return
    res = compare(a.shape, a.layers, work, types, a.threads, a.repeat, a.gen, a.prompt, a.prefill, a.drop_bf16,
                  isa=isa)
    if a.json:                                          # first: a table that fails to print loses nothing
        a.json.write_text(json.dumps(res, indent=1, default=str))
    print_table(res)


if __name__ == "__main__":
    main()
