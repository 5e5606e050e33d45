"""`make gpu-check`: every CUDA path run, checked and timed in one command, the first time a GPU is lent.

    python bench/gpu_check.py [--out DIR] [--dry-run] [--layers N] [--wheels DIR] [--skip STEP,...]

Steps, in order (each one a command, printed by --dry-run; the report keeps every command, figure and failure):
  1 install    a CUDA torch and the project's packages, never in the CPU `.venv`:
               - if an interpreter on this machine already has a CUDA torch (GPU images ship one), every step runs
                 on it, with `--wheels DIR` installed into `.venv-cuda/site` (first on PYTHONPATH, beside the
                 checkout): no download, and the report names its torch beside the pin. Not a venv made from it:
                 such images hold torch in a venv of their own, which `--system-site-packages` would not see;
               - else a venv `.venv-cuda` with torch==TORCH_VERSION from the PyTorch index of the newest CUDA tag
                 the driver can run (`nvidia-smi` prints the driver's highest CUDA version; TORCH_CUDA_TAGS lists
                 the pin's wheels), then `pip install -e .`.
  2 tests      `pytest -m cuda`: the CUDA twins of the runtime's CPU tests (tests/test_cuda.py).
  3 copy       one Mixtral expert (352 MB bf16) host -> device: the runtime's chunked copy engine from pinned memory
               against a plain `tensor.to(device, non_blocking=True)` of the same bytes (pageable and pinned);
               then a decode token's attention through torch's SDPA, the first call at each new KV length (what a
               decode does) and at a length seen before, with and without cuDNN's backend.
  4 bench      a Mixtral-shaped synthetic (`--layers`, default 2: 5.6 GB of experts), the
               shared Mixtral trace replayed, `moectl bench --device cuda` at a budget of 25 % of the experts, one
               row per setup (fetch only, --cpu-experts auto, HOBBIT, moectl-q4, --prefill stream), each beside
               the simulator's prediction of the same run on this machine's measured figures (bench's own
               `predicted` column; the measured hardware profile is written to hardware-measured.yaml too).
  5 llamacpp   llama.cpp's `--n-cpu-moe` on the same model as GGUF at Q4_0 (bench/llamacpp_cuda.py: built with CUDA
               here from the source pack carried beside the checkout, `--llamacpp-src`, made on a machine with the
               index by `python bench/llamacpp_cuda.py --pack llamacpp-src.tar.gz`; skipped, with the reason, when
               there is no pack or no nvcc). Its row sits beside moectl-q4's in the report.
  6 report     gpu-check.json and gpu-check.md under --out (default $OUT, else ./gpu-check); exit 1 if any
               correctness check failed (tests, or a run that errored).

On a machine without CUDA it says so in one line and does --dry-run: every step's command printed, and the parts a
CPU can run executed (the synthetic build at one layer, the simulator's predictions of the bench rows), so the
script cannot rot unnoticed; `make test` runs that dry run (tests/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH_VERSION = "2.13.0"                            # the Makefile's pin
TORCH_CUDA_TAGS = {"cu126": (12, 6), "cu128": (12, 8), "cu130": (13, 0)}   # wheels the pinned version is built for
VENV = ROOT / ".venv-cuda"
SITE = VENV / "site"                                # --wheels, when the machine's own CUDA interpreter is used
SHARED_TRACE = "mixtral-8x7b.gsm8k.jsonl"
EXPERT_BYTES_MIXTRAL = 3 * 4096 * 14336 * 2         # one bf16 Mixtral expert: gate, up, down
# The rows of step 4: name -> the `moectl bench` options that make the setup (the cache size is added).
BENCH_ROWS = {
    "fetch-only": ["--cpu-experts", "never"],
    "cpu-experts-auto": ["--cpu-experts", "auto"],
    "hobbit": ["--cpu-experts", "never", "--lowbit", "q4g64", "--precision", "hobbit"],
    "moectl-q4": ["--cpu-experts", "auto", "--lowbit", "q4g64", "--precision", "lowbit-only"],
    "prefill-stream": ["--cpu-experts", "never", "--prefill", "stream"],
}
CACHE_SHARE = 0.25                                  # the budget: a quarter of the experts
NEEDED = ("torch", "transformers", "accelerate", "safetensors", "datasets", "typer", "rich", "yaml", "hqq",
          "fastapi", "uvicorn", "openai", "httpx", "pytest")


@dataclass
class Step:
    name: str
    cmd: list[str]
    cpu: bool = False                               # runs in the dry run too
    status: str = "pending"                         # ok | failed | skipped | printed
    seconds: float = 0.0
    output: str = ""
    figures: dict = field(default_factory=dict)

    @property
    def line(self) -> str:
        return " ".join(shlex.quote(c) for c in self.cmd)


# What the lent GPU machines' image lacks, or holds at other versions than constraints.txt (read off the first run,
# docs/gpu-check.md): `--fetch-wheels DIR` downloads these, at constraints.txt's versions, for the image's Python,
# on a machine with the package index; the check then takes `--wheels DIR`.
IMAGE_LACKS = ("transformers", "huggingface_hub", "hf-xet", "tokenizers", "httpx2", "httpcore2", "truststore",
               "datasets", "dill", "multiprocess", "fastapi", "starlette", "pydantic", "pydantic_core",
               "annotated-types", "typing-inspection", "uvicorn", "openai", "jiter", "sniffio", "termcolor", "gguf",
               "typer", "typing_extensions", "opentelemetry-api", "annotated-doc", "shellingham",
               "sentencepiece")                # llama.cpp's converter imports it for Llama-family vocabularies
NO_WHEEL = ("hqq",)                                 # source only on the index: built into a wheel here
IMAGE_PYTHON = "3.12"
MANYLINUX = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64")


def pinned_versions(constraints: Path = ROOT / "constraints.txt") -> dict[str, str]:
    """{normalised name: version} from constraints.txt."""
    out = {}
    for line in constraints.read_text().splitlines():
        if "==" in line and not line.lstrip().startswith("#"):
            name, version = line.split("==", 1)
            out[_norm(name)] = version.strip()
    return out


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def wheel_commands(dest: Path, python: str = sys.executable) -> list[list[str]]:
    """The pip commands `--fetch-wheels` runs: binary wheels for the image's Python, then the source-only ones
    built here (pure Python)."""
    pins = pinned_versions()
    missing = [n for n in IMAGE_LACKS + NO_WHEEL if _norm(n) not in pins]
    if missing:
        raise SystemExit(f"error: constraints.txt pins no version of {', '.join(missing)}")
    plat = [a for p in MANYLINUX for a in ("--platform", p)]
    return [[python, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
             IMAGE_PYTHON, "--implementation", "cp", *plat, "-d", str(dest),
             *[f"{n}=={pins[_norm(n)]}" for n in IMAGE_LACKS]],
            [python, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest),
             *[f"{n}=={pins[_norm(n)]}" for n in NO_WHEEL]]]


# --- facts about this machine --------------------------------------------------------------------------------
def driver_cuda() -> tuple[int, int] | None:
    """The highest CUDA version the driver runs (`nvidia-smi`'s header), or None without a driver."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def pick_cuda_tag(cuda: tuple[int, int]) -> str | None:
    """The newest of the pin's CUDA wheel tags the driver can run (a driver runs every CUDA up to its own)."""
    fit = [tag for tag, v in TORCH_CUDA_TAGS.items() if v <= cuda]
    return max(fit, key=lambda t: TORCH_CUDA_TAGS[t]) if fit else None


def python_with_cuda_torch() -> str | None:
    """An interpreter on this machine whose torch already sees a GPU (GPU images ship one), else None."""
    for py in dict.fromkeys([os.environ.get("GPU_CHECK_PYTHON"), "python3", sys.executable]):
        if not py or shutil.which(py) is None:
            continue
        probe = subprocess.run([py, "-c", "import torch; print(torch.__version__, torch.cuda.is_available())"],
                               capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.split()[-1:] == ["True"]:
            return shutil.which(py)
    return None


def host_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_layers(ram: int, expert_bytes: int = EXPERT_BYTES_MIXTRAL, experts: int = 8) -> int:
    """Layers of the Mixtral-shaped synthetic: 2 (5.6 GB of experts), or what half the host RAM holds. On an H200
    machine the whole check then takes ~5 min (docs/gpu-check.md), inside a lent machine's 10-minute call;
    `--layers 7` makes the 20 GB of a real cache budget."""
    per_layer = expert_bytes * experts
    return max(1, min(2, int(0.5 * ram // per_layer)))


# --- the steps -----------------------------------------------------------------------------------------------
def step_python(a, cuda: bool) -> str:
    """The interpreter every step runs on: the machine's own CUDA one, else the venv the install step makes."""
    if not cuda:
        return sys.executable
    return getattr(a, "cuda_python", None) or str(VENV / "bin" / "python")


def plan_steps(a, cuda: bool) -> list[Step]:
    py = step_python(a, cuda)
    moectl = [py, "-m", "moectl.cli"]
    steps = [Step("install", install_cmd(a)),
             Step("tests", [py, "-m", "pytest", "-q", "-m", "cuda", "tests", "-p", "no:cacheprovider",
                                    "--continue-on-collection-errors"]),
             Step("copy", [py, str(Path(__file__)), "--measure-copy", "--device", "cuda", "--json"]),
             Step("attention", [py, str(Path(__file__)), "--measure-attention", "--device", "cuda", "--json"]),
             Step("synthetic", moectl + ["make-synthetic", "--shape", a.shape, "--layers", str(a.layers), "--out",
                                         str(a.model), "--json"], cpu=True),
             Step("quantize", moectl + ["quantize", "--model", str(a.model), "--bits", "4", "--group-size", "64",
                                        "--device", "cuda" if cuda else "cpu", "--json"])]
    for row, opts in BENCH_ROWS.items():
        steps.append(Step(f"bench:{row}", moectl + ["bench", "--model", str(a.model), "--device", "cuda",
                                                    "--replay-trace", str(a.trace), "--cache-experts",
                                                    str(a.cache_experts), "--baselines", "", "--prefetch", "none",
                                                    "--prompt-len", "32", "--gen-len", "16", "--repeat", "3",
                                                    "--json"] + opts))
        steps.append(Step(f"predict:{row}", moectl + simulate_args(a, opts), cpu=True))
    steps.append(Step("llamacpp", [py, str(ROOT / "bench" / "llamacpp_cuda.py"), "--src", str(a.llamacpp_src),
                                   "--model", str(a.model), "--cache-experts", str(a.cache_experts), "--json"]))
    return steps


def install_cmd(a) -> list[str]:
    """One shell line: the venv, its torch, the project (printed as is by --dry-run)."""
    have = getattr(a, "cuda_python", None)
    if have:
        # the project itself comes from PYTHONPATH (the checkout), so nothing is installed but the wheels
        line = f"rm -rf {SITE} && mkdir -p {SITE}"
        if a.wheels:
            line += f" && {have} -m pip install -q --no-index --no-deps --no-compile --target {SITE} {a.wheels}/*.whl"
        py = have
    else:
        tag = pick_cuda_tag(a.driver_cuda) if a.driver_cuda else None
        tag = a.cuda_tag or tag or "cu128"
        line = (f"{sys.executable} -m venv {VENV} && {VENV}/bin/pip install -q torch=={TORCH_VERSION} "
                f"--index-url https://download.pytorch.org/whl/{tag}")
        if a.wheels:
            line += f" && {VENV}/bin/pip install -q --no-index --no-deps {a.wheels}/*.whl"
        line += f" && {VENV}/bin/pip install -q --no-deps --no-build-isolation -e {ROOT}"
        py = f"{VENV}/bin/python"
    # what the tests and commands import: a GPU image without an index lacks some (carry them: --wheels)
    check = (f" && {py} -c \"import importlib.util as u, sys; m = [n for n in {NEEDED!r} "
             "if u.find_spec(n) is None]; sys.exit('missing for the CUDA steps (pass --wheels DIR): ' + ', '.join(m)) "
             "if m else None\"")
    return ["bash", "-c", line + check]


def simulate_args(a, opts: list[str]) -> list[str]:
    """`moectl simulate` of the bench row with options `opts`: the same trace, cache and policies."""
    keep = {"--cpu-experts", "--lowbit", "--precision"}
    sim = ["simulate", "--trace", str(a.trace), "--model-shape", a.shape, "--cache-fraction", str(CACHE_SHARE),
           "--hardware", str(a.hardware), "--json"]
    for k, v in zip(opts[::2], opts[1::2]):
        if k in keep:
            sim += [k, v]
    return sim


# --- step 3: the copy engine ---------------------------------------------------------------------------------
def measure_copy(device: str, nbytes: int = EXPERT_BYTES_MIXTRAL, repeat: int = 5) -> dict:
    """GB/s of one expert's bytes host -> `device`: the runtime's chunked copy (pinned source, a copy stream,
    `split_rows` chunks, one event each, through `Loader`) against plain `.to(device, non_blocking=True)`."""
    import torch

    from moectl.runtime.machine import best_s
    from moectl.core.copy_chunks import CHUNK_BYTES, split_rows
    from moectl.runtime.loader import CopyJob, DEMAND, Loader

    rows, row_bytes = nbytes // 4096, 4096
    pageable = torch.ones(rows, row_bytes, dtype=torch.uint8)
    pinned = pageable.pin_memory()
    dst = torch.empty(rows, row_bytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    loader = Loader(threaded=True, stream=stream)

    def chunked():
        job = CopyJob(0, 0, 0, DEMAND)
        for r0, r1 in split_rows(rows, row_bytes, CHUNK_BYTES):
            def run(j, i, r0=r0, r1=r1):
                with torch.cuda.stream(stream):
                    dst[r0:r1].copy_(pinned[r0:r1], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                return ev
            job.chunks.append((f"rows[{r0}:{r1}]", run))
        loader.submit(job)
        loader.wait(job)
        for ev in job.events:
            ev.synchronize()

    def plain(src):
        def run():
            src.to(device, non_blocking=True)
            torch.cuda.synchronize(device)
        return run

    def best(fn):
        return nbytes / best_s(fn, repeat) / 1e9

    out = {"bytes": nbytes, "chunk_bytes": CHUNK_BYTES, "chunks": len(split_rows(rows, row_bytes, CHUNK_BYTES)),
           "chunked_pinned_gbps": best(chunked), "plain_pinned_gbps": best(plain(pinned)),
           "plain_pageable_gbps": best(plain(pageable))}
    loader.close()
    out["chunked_over_plain_pinned"] = out["chunked_pinned_gbps"] / out["plain_pinned_gbps"]
    return out


# --- step 3b: a decode token's attention, first call at each new length ----------------------------------------
def measure_attention(device: str, lengths: int = 8, start: int = 100) -> dict:
    """Milliseconds of one decode token's attention on the Mixtral shape (1 query, 32 heads, 8 KV heads of 128)
    through torch's SDPA as transformers calls it, at `lengths` new KV lengths in turn (what a decode does: every
    step a length not seen before) and again at a length already seen; once with torch's default backends and
    once without cuDNN's. On the first GPU run the profile showed cuDNN's attention at 45 ms of host time a call
    over a request of new lengths, the median bench request (lengths seen before) hid it; this tells a per-shape
    plan build from a one-time cost."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def one(L: int):
        q = torch.randn(1, 32, 1, 128, device=device, dtype=torch.bfloat16)
        k, v = (torch.randn(1, 8, L, 128, device=device, dtype=torch.bfloat16) for _ in range(2))
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) * 1e3

    out = {}
    for name, backends in (("default", None), ("no_cudnn", [SDPBackend.FLASH_ATTENTION,
                                                              SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])):
        base = start + (0 if name == "default" else 10 * lengths)       # lengths neither run has seen
        with sdpa_kernel(backends) if backends else nullcontext():
            first = [one(base + i) for i in range(lengths)]
            again = [one(base + lengths - 1) for _ in range(lengths)]
        out[name] = {"first_call_ms": sorted(first)[len(first) // 2], "first_call_max_ms": max(first),
                     "seen_length_ms": sorted(again)[len(again) // 2]}
    return out


# --- running and reporting -----------------------------------------------------------------------------------
def run_step(s: Step, env: dict, timeout: float) -> None:
    t0 = time.perf_counter()
    try:
        p = subprocess.run(s.cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
        s.output = (p.stdout + p.stderr)[-4000:]
        s.status = "ok" if p.returncode == 0 else "failed"
        if p.returncode == 0 and "--json" in s.cmd:
            s.figures = last_json(p.stdout)
    except subprocess.TimeoutExpired:
        s.status, s.output = "failed", f"timed out after {timeout:.0f} s"
    s.seconds = time.perf_counter() - t0


def last_json(text: str) -> dict:
    """The commands' --json output: the whole text as one JSON object (pretty-printed), else its last line that
    parses as one (after progress lines), else {}."""
    try:
        v = json.loads(text)
        return v if isinstance(v, dict) else {"value": v}
    except ValueError:
        pass
    for line in reversed(text.strip().splitlines()):
        try:
            v = json.loads(line)
        except ValueError:
            continue
        return v if isinstance(v, dict) else {"value": v}
    return {}


def rows_table(steps: list[Step]) -> list[dict]:
    """One row per bench setup: measured ms/token (bench), the simulator's prediction of that same run (bench's
    `predicted`: the run's own routing, this machine's measured figures) and their ratio; and the simulator on the
    whole trace at the full Mixtral shape (`moectl simulate`, what the dry run can compute)."""
    by = {s.name: s for s in steps}
    rows = []
    for row in BENCH_ROWS:
        b, p = by.get(f"bench:{row}"), by.get(f"predict:{row}")
        run = (b.figures.get("runs") or {}).get("moectl", {}) if b else {}
        pred = ((b.figures.get("predicted") or {}).get("moectl") or {}) if b else {}
        measured, bench_pred = run.get("decode_ms_per_token"), pred.get("decode_ms_per_token")
        simulated = p.figures.get("ms_per_token") if p else None
        rows.append({"row": row, "measured_ms_per_token": measured, "predicted_ms_per_token": bench_pred,
                     "measured_over_predicted": measured / bench_pred if measured and bench_pred else None,
                     "whole_trace_simulated_ms_per_token": simulated,
                     "hit_rate": run.get("hit_rate"), "predicted_hit_rate": pred.get("hit_rate"),
                     "bytes_per_token": run.get("bytes_per_token"),
                     "cpu_experts_per_token": run.get("cpu_experts_per_token"),
                     "first_request_ms_per_token": (run.get("decode_ms_per_token_each") or [None])[0],
                     **{k: run.get(f"{k}_ms_per_token") for k in ("expert_stage", "device_side", "cpu_side")},
                     "threads": run.get("threads")})
    return rows


def verdicts(rows: list[dict]) -> list[str]:
    """What the report says of the defaults: --cpu-experts auto against never, the simulator within 1.3x."""
    out = []
    by = {r["row"]: r for r in rows}
    a, n = by["cpu-experts-auto"]["measured_ms_per_token"], by["fetch-only"]["measured_ms_per_token"]
    if a and n:
        out.append(f"--cpu-experts auto {a:.1f} ms/token vs never {n:.1f}: "
                   + ("auto wins, the default stands" if a <= n else
                      "AUTO LOSES on this machine: correct the default (or the cost model) with this evidence"))
    for r in rows:
        q = r["measured_over_predicted"]
        if q is not None and not (1 / 1.3 <= q <= 1.3):
            out.append(f"{r['row']}: measured/predicted {q:.2f} is outside 1.3x: correct the hardware profile")
    return out


def write_report(out: Path, steps: list[Step], meta: dict) -> dict:
    rows = rows_table(steps)
    failed = [s.name for s in steps if s.status == "failed" and not s.name.startswith("llamacpp")]
    report = {"format": "moectl-gpu-check-v1", "meta": meta, "failed": failed, "rows": rows,
              "verdicts": verdicts(rows),
              "steps": [{"name": s.name, "command": s.line, "status": s.status, "seconds": round(s.seconds, 2),
                         "figures": s.figures, "output_tail": s.output[-1500:] if s.status == "failed" else "",
                         **({"why": s.output} if s.status == "skipped" and s.output else {})}
                        for s in steps]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-check.json").write_text(json.dumps(report, indent=1))
    (out / "gpu-check.md").write_text(markdown(report))
    return report


def markdown(r: dict) -> str:
    m = r["meta"]
    f = lambda v, fmt=".1f": "-" if v is None else format(v, fmt)       # noqa: E731
    lines = [f"# moectl gpu-check ({'dry run' if m['dry_run'] else 'on ' + str(m.get('gpu'))})", "",
             f"machine: {m['host']}, {m['cpu']}; python {m['python']}; torch {m.get('torch')}; "
             f"driver CUDA {m.get('driver_cuda')}; model {m['model']} ({m['layers']} layers); "
             f"cache {m['cache_experts']} experts ({CACHE_SHARE:.0%})", ""]
    copy = next((s["figures"] for s in r["steps"] if s["name"] == "copy" and s["figures"]), None)
    if copy:
        lines += ["## Copy engine (one Mixtral expert host -> device)", "",
                  "| path | GB/s |", "|---|---|",
                  f"| runtime: chunked ({copy['chunks']} chunks), pinned, copy stream | {copy['chunked_pinned_gbps']:.1f} |",
                  f"| plain .to(non_blocking) from pinned | {copy['plain_pinned_gbps']:.1f} |",
                  f"| plain .to(non_blocking) from pageable | {copy['plain_pageable_gbps']:.1f} |", ""]
    att = next((s["figures"] for s in r["steps"] if s["name"] == "attention" and s["figures"]), None)
    if att:
        lines += ["## A decode token's attention (Mixtral shape, torch SDPA), ms", "",
                  "| backends | first call at a new length (median / max) | at a length seen before |", "|---|---|---|"]
        lines += [f"| {k} | {v['first_call_ms']:.3f} / {v['first_call_max_ms']:.3f} | {v['seen_length_ms']:.3f} |"
                  for k, v in att.items()] + [""]
    lines += ["## Bench rows: measured vs the simulator's prediction of the same run", "",
              "Median request of three; `first` is the first request's decode (one-time costs). The expert stage is "
              "the layers' expert time (wall); `CPU side` the worker's CPU experts.", "",
              "| row | measured ms/token | first | expert stage | CPU side | predicted ms/token | measured/predicted "
              "| hit rate (predicted) | simulated, whole trace at the full shape |",
              "|---|---|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        lines.append(f"| {x['row']} | {f(x['measured_ms_per_token'])} | {f(x.get('first_request_ms_per_token'))} | "
                     f"{f(x.get('expert_stage'))} | {f(x.get('cpu_side'))} | {f(x['predicted_ms_per_token'])} | "
                     f"{f(x['measured_over_predicted'], '.2f')} | {f(x['hit_rate'], '.1%')} "
                     f"({f(x.get('predicted_hit_rate'), '.1%')}) | {f(x['whole_trace_simulated_ms_per_token'])} |")
    ll = next((s for s in r["steps"] if s["name"] == "llamacpp"), None)
    q4 = next((x for x in r["rows"] if x["row"] == "moectl-q4"), {})
    if ll and ll["figures"]:
        g = ll["figures"]
        lines += ["", "## moectl-q4 beside llama.cpp (Q4_0, --n-cpu-moe, same model and budget)", "",
                  "| tool | decode ms/token | prefill tokens/s |", "|---|---|---|",
                  f"| moectl-q4 | {f(q4.get('measured_ms_per_token'))} | - |",
                  f"| llama.cpp Q4_0, --n-cpu-moe {g['n_cpu_moe']} | {f(g['decode_ms_per_token'])} | "
                  f"{f(g['prefill_tokens_per_s'], '.0f')} |"]
    elif ll:
        lines += ["", f"llama.cpp step: {ll['status']}" + (f" ({ll['why']})" if ll.get("why") else "")]
    lines += ["", "## Verdicts", ""] + [f"- {v}" for v in r["verdicts"] or ["(no measured rows)"]]
    lines += ["", "## Steps", "", "| step | status | s | command |", "|---|---|---|---|"]
    for s in r["steps"]:
        lines.append(f"| {s['name']} | {s['status']} | {s['seconds']} | `{s['command']}` |")
    for s in r["steps"]:
        if s["status"] == "failed":
            lines += ["", f"### {s['name']} failed", "", "```", s["output_tail"], "```"]
    return "\n".join(lines) + "\n"


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="report directory (default $OUT, else ./gpu-check)")
    p.add_argument("--dry-run", action="store_true", help="print every step, run only what a CPU can")
    p.add_argument("--layers", type=int, default=None, help="layers of the synthetic (default: 2, 5.6 GB of "
                   "experts, or what half the host RAM holds; 1 in a dry run)")
    p.add_argument("--shape", default="mixtral", help="recipe (or yaml) whose shape the synthetic takes")
    p.add_argument("--model", type=Path, default=None, help="where the synthetic goes (default: under --out)")
    p.add_argument("--trace", type=Path, default=ROOT.parent / "shared" / "traces" / SHARED_TRACE)
    p.add_argument("--wheels", type=Path, default=None, help="wheels for packages the CUDA venv lacks (no index)")
    p.add_argument("--llamacpp-src", type=Path, default=ROOT / "llamacpp-src.tar.gz",
                   help="llama.cpp's source pack for step 5 (bench/llamacpp_cuda.py --pack makes it)")
    p.add_argument("--cuda-tag", default=None, help="PyTorch wheel tag to install (default: picked from the driver)")
    p.add_argument("--skip", default="", help="comma list of steps to skip (install, tests, copy, synthetic, "
                   "quantize, bench, llamacpp)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per step")
    p.add_argument("--fetch-wheels", type=Path, default=None, metavar="DIR",
                   help="download the wheels the lent machines' image lacks into DIR (needs the package index), "
                        "then exit; carry DIR and pass --wheels DIR there")
    p.add_argument("--measure-copy", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--measure-attention", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)   # the measure steps print JSON anyway
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    if a.fetch_wheels:
        a.fetch_wheels.mkdir(parents=True, exist_ok=True)
        for cmd in wheel_commands(a.fetch_wheels):
            if subprocess.run(cmd).returncode:
                print(f"error: {' '.join(cmd[:5])} ... failed")
                return 2
        print(f"wheels in {a.fetch_wheels}: carry it and run with --wheels {a.fetch_wheels}")
        return 0
    if a.measure_copy:
        print(json.dumps(measure_copy(a.device)))
        return 0
    if a.measure_attention:
        print(json.dumps(measure_attention(a.device)))
        return 0
    a.driver_cuda = driver_cuda()
    cuda = a.driver_cuda is not None and not a.dry_run
    a.cuda_python = python_with_cuda_torch() if cuda else None
    if not cuda and not a.dry_run:
        print("gpu-check: no CUDA on this machine (no nvidia-smi / driver): running --dry-run")
    a.dry_run = not cuda
    a.out = a.out or Path(os.environ.get("OUT") or ROOT / "gpu-check")
    a.model = a.model or a.out / "synthetic"
    a.layers = a.layers or (1 if a.dry_run else default_layers(host_ram_bytes()))
    if not a.trace.is_file():
        print(f"error: the shared Mixtral trace {a.trace} is missing (shared/ beside the checkout, or --trace)")
        return 2
    experts = a.layers * 8
    a.cache_experts = max(a.layers, round(CACHE_SHARE * experts))
    a.out.mkdir(parents=True, exist_ok=True)
    a.hardware = a.out / "hardware-measured.yaml"
    # the checkout first, then the carried wheels (they shadow the image's older transformers and the like)
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(SITE)]))
    skip = {x.strip() for x in a.skip.split(",") if x.strip()}
    steps = plan_steps(a, cuda)
    for s in steps:
        if s.name.split(":")[0] in skip:
            s.status = "skipped"
        elif s.name == "llamacpp" and (why := llamacpp_unavailable(a, cuda)):
            s.status, s.output = "skipped", why
            print(f"[{s.name}] skipped: {why}")
        elif a.dry_run and not s.cpu:
            s.status = "printed"
            print(f"[dry run] {s.name}: {s.line}")
        else:
            print(f"[{s.name}] {s.line}", flush=True)
            if s.name == "synthetic" and (a.model / "config.json").is_file():
                s.status, s.output = "ok", "already built"
                continue
            run_step(s, env, a.timeout)
            print(f"[{s.name}] {s.status} in {s.seconds:.1f} s", flush=True)
        if s.name == "install":                     # the interpreter exists now: measure the machine on it
            write_hardware(a.hardware, step_python(a, cuda), cuda, env)
    meta = {"dry_run": a.dry_run, "host": platform.node(), "cpu": platform.processor() or platform.machine(),
            "python": platform.python_version(), "driver_cuda": a.driver_cuda, "model": str(a.model),
            "layers": a.layers, "cache_experts": a.cache_experts, "torch_pin": TORCH_VERSION,
            "torch": _torch_version(step_python(a, cuda), env), "gpu": _gpu_name()}
    report = write_report(a.out, steps, meta)
    print(f"gpu-check: report in {a.out / 'gpu-check.md'}; "
          + (f"FAILED: {', '.join(report['failed'])}" if report["failed"] else "no correctness failure"))
    return 1 if report["failed"] else 0


def llamacpp_unavailable(a, cuda: bool) -> str | None:
    """Why step 5 cannot run here (None: it can, or the dry run prints it)."""
    if not a.llamacpp_src.is_file():
        return (f"no llama.cpp source pack at {a.llamacpp_src}: make it where the package index is reachable "
                f"(python bench/llamacpp_cuda.py --pack {a.llamacpp_src.name}) and carry it beside the checkout")
    if cuda and shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists():
        return "no nvcc (CUDA toolkit) on this machine: llama.cpp cannot be built with CUDA here"
    return None


def write_hardware(path: Path, py: str, cuda: bool, env: dict) -> None:
    """This machine's measured figures as a hardware profile (`moectl simulate --hardware FILE`); on a machine
    without CUDA the 'device' is this CPU (what an emulated device is)."""
    code = ("import json,sys,yaml; from moectl.runtime.machine import machine_figures, machine_hardware; "
            f"h = machine_hardware(machine_figures({'cuda' if cuda else 'cpu'!r})); "
            "d = dict(h.__dict__); d['name'] = 'measured'; sys.stdout.write(yaml.safe_dump(d))")
    p = subprocess.run([py, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    if p.returncode != 0:            # the rest of the check still runs; the predict steps fail for want of the file
        print(f"gpu-check: measuring this machine failed:\n{p.stderr[-2000:]}", flush=True)
        return
    path.write_text("# measured by bench/gpu_check.py (moectl.runtime.machine.machine_figures)\n" + p.stdout)


def _torch_version(py: str, env: dict) -> str | None:
    p = subprocess.run([py, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True, env=env)
    return p.stdout.strip() or None


def _gpu_name() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    p = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                       capture_output=True, text=True)
    return p.stdout.strip() or None


if __name__ == "__main__":
    sys.exit(main())
