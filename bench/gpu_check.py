"""`make gpu-check`: issue 44's question answered in one device call: moectl against llama.cpp's `--n-cpu-moe`.

    python bench/gpu_check.py [--out DIR] [--dry-run] [--bundle FILE] [--minutes 9] [--skip STEP,...]

Is moectl faster than `llama-bench -ngl 99 --n-cpu-moe N` on the same GGUF at the same VRAM? On a fresh lent
machine (no package index, no compiler time), from the bundle `make gpu-bundle` made here:
  install     unpack the bundle (llama.cpp's CUDA tools and converter, the wheels the image lacks) and install the
              wheels into .venv-cuda/site, first on PYTHONPATH beside the checkout; every step runs on the image's
              own CUDA torch (seconds)
  tests       `pytest -m cuda`: the CUDA twins of the runtime's CPU tests
  then, for a Mixtral-shaped and a Qwen3-shaped synthetic (LAYERS layers, the real expert sizes):
  synthetic   `moectl make-synthetic` (safetensors)
  gguf        llama.cpp's own converter (BF16), then its `llama-quantize` to Q4_K_M; the BF16 file is deleted
  llamacpp    `llama-bench -ngl 99 --n-cpu-moe N -p 512 -n GEN`: N = the layers whose experts a budget of a quarter
              of the experts cannot hold (llama.cpp places experts by whole layers); the VRAM it really used is read
              off its own log (model + KV + compute buffers on CUDA0) and nvidia-smi's peak
  budget      moectl's --budget: that measured VRAM (else, before it is measured, the GGUF's tensors on the device)
  fits        moectl's own sizing (inspect_model) at that budget: when its dense weights, KV reserve, workspace and
              one slot per layer do not fit, its GGUF rows are skipped with that reason
  bench       `moectl bench` on the same .gguf at that budget: fetch only (--cpu-experts never), before a plan
              exists; then `moectl plan-cache` on the GGUF at that budget with this machine's measured profile; then
              the default (--cpu-experts auto) with the plan's row beside it (bench-auto); each row with the
              simulator's prediction from this machine's measured profile (bench's own `predicted`)
  quantize    `moectl quantize` of the safetensors original to q4g64, on the device
  bench-q4    moectl's own q4 copies (moectl-q4) at the same budget
  kernels     the device kernels per format and M (bench/gpu_kernels.py); writes the measured low-bit rate into
              the hardware profile before the moectl-q4 rows
  copy, attention   the copy engine and a decode token's attention (the first run's open questions), if time is left
  report      gpu-check.md whose first table is every row with moectl / llama.cpp per row, gpu-check.json
Every step has an estimate in minutes (STEP_MINUTES); the plan is printed first, and a step whose estimate is more
than the minutes left (--minutes, default 9: one device call is 10) is skipped and said, never half-run. A step
whose input failed or was skipped is skipped too. `--skip STEP,...` skips steps by kind (e.g. quantize, copy) or
by name (gguf:qwen3-moe).

On a machine without CUDA (`make test` runs it): --dry-run. Every step's command is printed and what a CPU can do
runs, on tiny synthetics of both shapes: the checkpoints, their GGUF (llama.cpp's converter and llama-quantize of
the CPU build when there is one, else gguf-py through tests/gguf_build.py), N, the budgets, the plans; the report is
written from `--sample FILE` (a recorded sample of the device steps' outputs, tests/gpu_check_sample.json) when
given, and the bundle checker runs on `--bundle` when there is one.
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
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))                       # moectl from this checkout (the lent image has none installed)
TORCH_VERSION = "2.13.0"                            # the Makefile's pin
TORCH_CUDA_TAGS = {"cu126": (12, 6), "cu128": (12, 8), "cu130": (13, 0)}   # wheels the pinned version is built for
VENV = ROOT / ".venv-cuda"
SITE = VENV / "site"                                # the bundle's wheels, when the machine's CUDA interpreter is used
BUNDLE = ROOT / "gpu-bundle.tar.xz"                 # made by `make gpu-bundle`, carried
UNPACKED = ROOT / ".gpu-bundle"                     # where the install step unpacks it
EXPERT_BYTES_MIXTRAL = 3 * 4096 * 14336 * 2         # one bf16 Mixtral expert: gate, up, down
SHAPES = ("mixtral", "qwen3-moe")
LAYERS = 4                      # a quarter of the experts is then one whole layer's: llama.cpp keeps N = 3 on the CPU
CACHE_SHARE = 0.25                                  # the budget: a quarter of the experts
QUANT = "Q4_K_M"
PROMPT, GEN = 512, 32                               # prefill 512 tokens, then GEN decoded
# Minutes each step is expected to take on a lent machine (16 cores, H100/H200) at LAYERS layers. From the first
# run: install 2.6 s, tests 38 s, a 2-layer Mixtral synthetic 34 s, its quantize 28 s; scaled by bytes (Mixtral
# 11.3 GB of experts at 4 layers, Qwen3 4.8 GB). Guesses, to be corrected from the first run of this check: the
# converter + llama-quantize (~0.5 GB/s), llama-bench and moectl bench (model load + 3 requests of 512 + 32
# tokens). The core rows of both shapes come to ~9 minutes; the rest runs if time is left.
STEP_MINUTES = {"install": 0.5, "tests": 1.0,             # install: + measuring this machine's profile after it
                "synthetic:mixtral": 1.2, "gguf:mixtral": 1.0, "llamacpp:mixtral": 0.6, "budget:mixtral": 0.0,
                "fits:mixtral": 0.1, "plan:mixtral": 0.2, "bench:mixtral": 0.6, "bench-auto:mixtral": 1.0,
                "quantize:mixtral": 1.0, "bench-q4:mixtral": 0.6,
                "synthetic:qwen3-moe": 0.6, "gguf:qwen3-moe": 0.6, "llamacpp:qwen3-moe": 0.5, "budget:qwen3-moe": 0.0,
                "fits:qwen3-moe": 0.1, "plan:qwen3-moe": 0.2, "bench:qwen3-moe": 0.5, "bench-auto:qwen3-moe": 0.8,
                "quantize:qwen3-moe": 0.5, "bench-q4:qwen3-moe": 0.5,
                "kernels": 1.0, "copy": 0.3, "attention": 0.2}
NEEDED = ("torch", "transformers", "accelerate", "safetensors", "datasets", "typer", "rich", "yaml", "hqq",
          "fastapi", "uvicorn", "openai", "httpx", "pytest", "gguf", "sentencepiece")
# The dry run's tiny stand-ins of the two shapes: the recipe's family, dimensions K-quant blocks divide (256).
TINY = {"mixtral": {"num_experts": 8, "top_k": 2}, "qwen3-moe": {"num_experts": 16, "top_k": 4}}
TINY_DIMS = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 64, "vocab_size": 1024}


@dataclass
class Step:
    name: str                                       # kind[:shape]
    cmd: list[str]
    cpu: bool = False                               # runs in the dry run too
    needs: tuple[str, ...] = ()                     # steps that must be ok first
    status: str = "pending"                         # ok | failed | skipped | printed | sample
    seconds: float = 0.0
    output: str = ""
    figures: dict = field(default_factory=dict)
    inline: object = None                           # a function run in this process instead of a command

    @property
    def line(self) -> str:
        return " ".join(shlex.quote(str(c)) for c in self.cmd)

    @property
    def kind(self) -> str:
        return self.name.split(":")[0]

    @property
    def minutes(self) -> float:
        return STEP_MINUTES.get(self.name, STEP_MINUTES.get(self.kind, 0.5))


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


# --- the budget: a quarter of the experts, in whole layers for llama.cpp ----------------------------------------
def n_cpu_moe(layers: int, experts_per_layer: int, share: float = CACHE_SHARE) -> tuple[int, int]:
    """(experts the budget holds, llama.cpp's --n-cpu-moe): the layers whose experts that many, placed in whole
    layers, cannot hold stay on the CPU."""
    cache = max(1, round(share * layers * experts_per_layer))
    return cache, max(0, layers - cache // experts_per_layer)


def gguf_device_bytes(gguf: Path, ncmoe: int) -> dict:
    """What `-ngl 99 --n-cpu-moe N` puts on the device, from the GGUF's tensors: everything but the token
    embeddings (llama.cpp keeps them on the CPU) and the experts (`blk.i.ffn_*_exps`) of the first N layers.
    Also the bytes of one layer's experts and the layer count."""
    from gguf import GGUFReader

    r = GGUFReader(str(gguf))
    device = experts = 0
    per_layer: dict[int, int] = {}
    for t in r.tensors:
        m = re.match(r"blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.", t.name)
        if m:
            per_layer[int(m.group(1))] = per_layer.get(int(m.group(1)), 0) + int(t.n_bytes)
            experts += int(t.n_bytes)
            if int(m.group(1)) < ncmoe:
                continue
        elif t.name.startswith("token_embd."):
            continue
        device += int(t.n_bytes)
    return {"device_weight_bytes": device, "expert_bytes": experts, "layers": len(per_layer),
            "layer_expert_bytes": max(per_layer.values(), default=0)}


BUFFER = re.compile(r"(CUDA\d+)\s+(model|KV|compute|output) buffer size =\s*([0-9.]+) MiB")


def llamacpp_vram(log: str) -> dict:
    """The device memory llama.cpp allocated, from its own log (`-v`): per kind of buffer on CUDA0 the largest it
    reported (llama-bench makes a context per test), in bytes, and their sum."""
    seen: dict[str, float] = {}
    for dev, kind, mib in BUFFER.findall(log):
        if dev == "CUDA0":
            seen[kind] = max(seen.get(kind, 0.0), float(mib))
    out = {f"{k.lower()}_bytes": int(v * 2**20) for k, v in seen.items()}
    out["total_bytes"] = sum(out.values())
    return out


# Until llama.cpp has run, its KV and compute buffers are a guess beside the weights it puts on the device (its
# compute buffer for a 512-token batch is some hundreds of MB on these shapes); the measurement replaces it.
BUFFERS_GUESS = 512 * 2**20


def budget_for(step_figs: dict, estimate: dict) -> tuple[int, str]:
    """moectl's --budget in bytes: the VRAM llama.cpp really used (its buffers), else the estimate from the GGUF."""
    vram = (step_figs or {}).get("vram") or {}
    if vram.get("total_bytes"):
        return int(vram["total_bytes"]), "measured: llama.cpp's CUDA0 buffers (model + KV + compute)"
    return (int(estimate["device_weight_bytes"]) + BUFFERS_GUESS,
            "estimated: the GGUF's tensors on the device with -ngl 99 --n-cpu-moe N, + 512 MiB for KV and compute")


# --- llama.cpp from the bundle ---------------------------------------------------------------------------------
def cuda_lib_dirs(py: str) -> list[str]:
    """The lent image's CUDA libraries (libcudart, libcublas) as its torch has them: the `nvidia` wheels beside torch
    (cu13: one nvidia/cu13/lib; cu12: nvidia/<lib>/lib each). The bundle's binaries load these."""
    code = "import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))"
    p = subprocess.run([py, "-c", code], capture_output=True, text=True)
    site = Path(p.stdout.strip()) / "nvidia" if p.returncode == 0 else None
    if not site or not site.is_dir():
        return []
    return sorted(str(d) for d in site.glob("**/lib") if any(d.glob("libcu*.so*")))


def llama_env(llamacpp: Path, lib_dirs: list[str]) -> dict:
    return dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join([str(llamacpp / "bin"), *lib_dirs,
                                                             os.environ.get("LD_LIBRARY_PATH", "")]))


def nvidia_smi_used_mib() -> int | None:
    p = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                       capture_output=True, text=True)
    return int(p.stdout.split()[0]) if p.returncode == 0 and p.stdout.strip() else None


def llama_bench(gguf: Path, ncmoe: int, llamacpp: Path, lib_dirs: list[str], threads: int, reps: int = 3) -> dict:
    """`llama-bench -ngl 99 --n-cpu-moe N -p PROMPT -n GEN -v -o json`: decode ms/token, prefill tokens/s, the VRAM
    its buffers took (its log) and nvidia-smi's peak above the idle GPU (sampled every 0.2 s)."""
    cmd = [str(llamacpp / "bin" / "llama-bench"), "-m", str(gguf), "-ngl", "99", "--n-cpu-moe", str(ncmoe),
           "-t", str(threads), "-p", str(PROMPT), "-n", str(GEN), "-r", str(reps), "-v", "-o", "json"]
    idle, peak, done = nvidia_smi_used_mib(), [0], threading.Event()

    def sample():
        while not done.wait(0.2):
            peak[0] = max(peak[0], nvidia_smi_used_mib() or 0)
    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    p = subprocess.run(cmd, capture_output=True, text=True, env=llama_env(llamacpp, lib_dirs))
    done.set()
    watcher.join()
    if p.returncode:
        raise SystemExit(f"error: llama-bench failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    rows = json.loads(p.stdout[p.stdout.index("["):p.stdout.rindex("]") + 1])
    pp = next(r for r in rows if r.get("n_prompt", 0) > 0)
    tg = next(r for r in rows if r.get("n_gen", 0) > 0)
    return {"decode_ms_per_token": 1000 / tg["avg_ts"], "decode_stddev_tokens_per_s": tg["stddev_ts"],
            "prefill_tokens_per_s": pp["avg_ts"], "n_cpu_moe": ncmoe, "vram": llamacpp_vram(p.stderr),
            "nvidia_smi_peak_over_idle_bytes": (peak[0] - (idle or 0)) * 2**20 if peak[0] else None,
            "gpu": tg.get("gpu_info"), "backends": tg.get("backends"), "build_commit": tg.get("build_commit"),
            "command": " ".join(cmd)}


def make_gguf(model: Path, out: Path, llamacpp: Path | None, lib_dirs: list[str]) -> dict:
    """The checkpoint as a Q4_K_M GGUF: llama.cpp's converter to BF16 and its llama-quantize (the bundle's, or the
    CPU build's), the BF16 file deleted after. Without llama.cpp's tools here (a dry run on a machine that never
    built them) gguf-py writes it the converter's way (tests/gguf_build.py: Q4_K experts, F32 the rest)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import llamacpp as lc

    src = llamacpp / "convert" if llamacpp else lc.source_dir()
    quantize = llamacpp / "bin" / "llama-quantize" if llamacpp else lc.tool("llama-quantize")
    import importlib.util

    have = (src / "convert_hf_to_gguf.py").is_file() and importlib.util.find_spec("sentencepiece") and quantize.exists()
    if llamacpp and not have:                           # the device run: llama.cpp's own tools or nothing
        raise SystemExit(f"error: llama.cpp's converter or llama-quantize is missing under {llamacpp} (the bundle "
                         "was not installed?), or sentencepiece is")
    if have:
        bf16 = lc.convert(model, out.with_name(out.stem + "-BF16.gguf"), "bf16", src=src)
        log = Path(str(out) + ".log")
        lc._run([quantize, bf16, out, QUANT, os.cpu_count() or 2], log, env=llama_env(quantize.parent, lib_dirs))
        bf16.unlink()
        return {"gguf": str(out), "bytes": out.stat().st_size, "made_by": f"llama.cpp converter + llama-quantize {QUANT}"}
    sys.path.insert(0, str(ROOT / "tests"))
    from gguf import GGMLQuantizationType as T
    from gguf_build import write_gguf

    write_gguf(model, out, expert_encoding=T.Q4_K, dense_encoding=T.F32)
    return {"gguf": str(out), "bytes": out.stat().st_size,
            "made_by": "gguf-py (tests/gguf_build.py): no llama.cpp converter + llama-quantize on this machine"}


# --- the plan of steps -----------------------------------------------------------------------------------------
def step_python(a, cuda: bool) -> str:
    """The interpreter every step runs on: the machine's own CUDA one, else the venv the install step makes."""
    if not cuda:
        return sys.executable
    return getattr(a, "cuda_python", None) or str(VENV / "bin" / "python")


def shape_arg(a, shape: str) -> str:
    """make-synthetic's --shape: the recipe, or in a dry run its tiny stand-in (a yaml written under --out)."""
    if not a.dry_run:
        return shape
    import yaml

    recipe = yaml.safe_load((ROOT / "recipes" / f"{shape}.yaml").read_text())
    tiny = {"name": f"tiny-{shape}", "family": recipe["family"],
            "shape": {**recipe["shape"], **TINY_DIMS, **TINY[shape], "num_layers": LAYERS, "moe_layers": LAYERS}}
    path = a.out / f"tiny-{shape}.yaml"
    path.write_text(yaml.safe_dump(tiny))
    return str(path)


def experts_of(shape: str) -> int:
    from moectl.core.shapes import load_shape

    return int(load_shape(shape)["num_experts"])


def plan_steps(a, cuda: bool) -> list[Step]:
    py = step_python(a, cuda)
    me = [py, str(Path(__file__))]
    moectl = [py, "-m", "moectl.cli"]
    dev = "cuda" if cuda else "cpu"
    steps = [Step("install", install_cmd(a)),
             Step("tests", [py, "-m", "pytest", "-q", "-m", "cuda", "tests", "-p", "no:cacheprovider",
                            "--continue-on-collection-errors"], needs=("install",))]
    late = []
    for shape in SHAPES:
        d = a.out / shape
        model, gguf, wd, wq = d / "model", d / f"model-{QUANT}.gguf", d / "wd-gguf", d / "wd-q4"
        experts = TINY[shape]["num_experts"] if a.dry_run else experts_of(shape)
        cache, ncmoe = n_cpu_moe(LAYERS, experts)
        a.shapes[shape] = {"model": model, "gguf": gguf, "experts": experts, "cache_experts": cache,
                           "n_cpu_moe": ncmoe, "workdir": wd}
        budget = f"{{budget:{shape}}}"                   # filled in once the budget step has run
        row = ["--device", "cuda", "--budget", budget, "--prompt-len", str(PROMPT), "--gen-len", str(GEN),
               "--repeat", "3", "--json"]
        steps += [
            Step(f"synthetic:{shape}", moectl + ["make-synthetic", "--shape", shape_arg(a, shape), "--layers",
                                                 str(LAYERS), "--out", str(model), "--json"], cpu=True),
            Step(f"gguf:{shape}", me + ["--make-gguf", str(model), "--gguf-out", str(gguf), "--llamacpp",
                                        str(a.llamacpp or ""), "--json"], cpu=True,
                 needs=(f"synthetic:{shape}", "install")),
            Step(f"llamacpp:{shape}", me + ["--llama-bench", str(gguf), "--n-cpu-moe", str(ncmoe), "--llamacpp",
                                            str(a.llamacpp or ""), "--json"], needs=(f"gguf:{shape}", "install")),
            Step(f"budget:{shape}", ["(this process)", "budget", shape], cpu=True, needs=(f"gguf:{shape}",),
                 inline=lambda a=a, shape=shape: set_budget(a, shape)),
            Step(f"fits:{shape}", ["(this process)", "moectl.store.facts.inspect_model", str(gguf), "--budget",
                                   budget], cpu=True, needs=(f"budget:{shape}",),
                 inline=lambda a=a, shape=shape: moectl_fits(a, shape)),
            # fetch only before the plan exists: a workdir's plan.yaml would lend it its policies
            Step(f"bench:{shape}", moectl + ["bench", "--model", str(gguf), "--workdir", str(wd), *row,
                                             "--cpu-experts", "never", "--baselines", ""],
                 needs=(f"fits:{shape}", "install")),
            Step(f"plan:{shape}", moectl + ["plan-cache", "--model", str(gguf), "--budget", budget, "--hardware",
                                            str(a.hardware), "--workdir", str(wd), "--json"],
                 cpu=True, needs=(f"fits:{shape}",)),
            Step(f"bench-auto:{shape}", moectl + ["bench", "--model", str(gguf), "--workdir", str(wd), *row,
                                                  "--baselines", "moectl-plan"],
                 needs=(f"plan:{shape}", "install"))]
        late += [
            Step(f"quantize:{shape}", moectl + ["quantize", "--model", str(model), "--workdir", str(wq), "--bits", "4",
                                                "--group-size", "64", "--device", dev, "--json"],
                 needs=(f"synthetic:{shape}", "install")),
            Step(f"bench-q4:{shape}", moectl + ["bench", "--model", str(model), "--workdir", str(wq), *row,
                                                "--lowbit", "q4g64", "--precision", "lowbit-only", "--baselines", ""],
                 needs=(f"quantize:{shape}", f"budget:{shape}"))]
    # issue 43: low-bit expert kernels per format and M (bench/gpu_kernels.py), writing the measured low-bit expert
    # rate into the hardware profile before the moectl-q4 rows are predicted from it; its dry run: the
    # interpreter, two formats (tests/test_triton_lowbit.py checks every format)
    steps.append(Step("kernels", [py, str(ROOT / "bench" / "gpu_kernels.py"), "--out", str(a.out / "kernels"),
                                  "--hardware", str(a.hardware), "--json"]
                      + ([] if cuda else ["--dry-run", "--formats", "hqq4,q4_k"]), cpu=True, needs=("install",)))
    steps += late
    steps += [Step("copy", me + ["--measure-copy", "--device", "cuda", "--json"], needs=("install",)),
              Step("attention", me + ["--measure-attention", "--device", "cuda", "--json"], needs=("install",))]
    return steps


def set_budget(a, shape: str) -> dict:
    """The budget step: N and the bytes of the GGUF on the device (estimate), then the VRAM llama.cpp used when its
    step ran; the later commands get it as --budget."""
    s = a.shapes[shape]
    est = gguf_device_bytes(s["gguf"], s["n_cpu_moe"])
    ll = a.by_name.get(f"llamacpp:{shape}")
    budget, how = budget_for(ll.figures if ll and ll.status == "ok" else {}, est)     # a sample is not this model
    s["budget"] = budget
    return {"budget_bytes": budget, "how": how, "estimate": est, "cache_experts": s["cache_experts"],
            "n_cpu_moe": s["n_cpu_moe"], "experts_per_layer": s["experts"], "layers": est["layers"]}


class StepSkipped(Exception):
    """An in-process step that finds its rows cannot run: it and what needs it are skipped, with this reason."""


def moectl_fits(a, shape: str) -> dict:
    """The fits step: can moectl run the GGUF at llama.cpp's VRAM at all (its dense weights, a KV reserve for 4096
    tokens, its workspace and one expert slot per layer)? If not, its GGUF rows are skipped and the report says
    why, rather than three bench commands failing on the same error."""
    from moectl.errors import MoectlError
    from moectl.store.facts import inspect_model

    s = a.shapes[shape]
    try:
        info = inspect_model(str(s["gguf"]), str(s["workdir"]), budget=str(s["budget"]))
    except MoectlError as e:
        raise StepSkipped(f"moectl cannot run this GGUF at llama.cpp's VRAM: {e}") from None
    return {"device_min_bytes": info["device_min_bytes"], "dense_bytes": info["dense_bytes"],
            "kv_reserve_bytes": info["kv_reserve_bytes"], "budget_bytes": s["budget"]}


def install_cmd(a) -> list[str]:
    """One shell line: the bundle unpacked, its wheels into .venv-cuda/site (printed as is by --dry-run)."""
    have = getattr(a, "cuda_python", None) or "python3"
    line = (f"{have} {ROOT / 'bench' / 'gpu_bundle.py'} --install {a.bundle} --into {UNPACKED} && rm -rf {SITE} && "
            f"mkdir -p {SITE} && {have} -m pip install -q --no-index --no-deps --no-compile --target {SITE} "
            f"{UNPACKED}/wheels/*.whl")
    # what the tests and commands import: a GPU image without an index lacks some (the bundle carries them)
    check = (f" && {have} -c \"import importlib.util as u, sys; m = [n for n in {NEEDED!r} "
             "if u.find_spec(n) is None]; sys.exit('missing for the CUDA steps (not in the bundle): ' + ', '.join(m)) "
             "if m else None\"")
    return ["bash", "-c", line + check]


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


# --- the report ------------------------------------------------------------------------------------------------
# The moectl rows: (row name, step kind, bench's run name).
MOECTL_ROWS = (("fetch only", "bench", "moectl"), ("auto (default)", "bench-auto", "moectl"),
               ("plan-cache's plan", "bench-auto", "moectl-plan"), ("moectl-q4", "bench-q4", "moectl"))
DECODE_GOAL, PREDICTION_BAND = 0.7, 1.3          # issue 44: decode <= 0.7x llama.cpp's; within 1.3x of prediction


def rows_table(steps: list[Step]) -> list[dict]:
    """Per shape: llama.cpp's row, then moectl's four, each with decode ms/token, prefill tokens/s, the
    simulator's prediction of that run (bench's `predicted`), and moectl / llama.cpp per row."""
    by = {s.name: s for s in steps}
    rows = []
    for shape in SHAPES:
        ll = by.get(f"llamacpp:{shape}")
        g = ll.figures if ll and ll.status in ("ok", "sample") else {}
        base_d, base_p = g.get("decode_ms_per_token"), g.get("prefill_tokens_per_s")
        rows.append({"shape": shape, "row": f"llama.cpp --n-cpu-moe {g.get('n_cpu_moe', '?')}",
                     "decode_ms_per_token": base_d, "prefill_tokens_per_s": base_p, "predicted_ms_per_token": None,
                     "measured_over_predicted": None, "decode_vs_llamacpp": 1.0 if base_d else None,
                     "prefill_vs_llamacpp": 1.0 if base_p else None})
        for label, kind, run in MOECTL_ROWS:
            s = by.get(f"{kind}:{shape}")
            f = s.figures if s and s.status in ("ok", "sample") else {}
            r = (f.get("runs") or {}).get(run) or {}
            pred = ((f.get("predicted") or {}).get(run) or {}).get("decode_ms_per_token")
            d, p = r.get("decode_ms_per_token"), r.get("prefill_tokens_per_s")
            rows.append({"shape": shape, "row": label, "decode_ms_per_token": d, "prefill_tokens_per_s": p,
                         "predicted_ms_per_token": pred,
                         "measured_over_predicted": d / pred if d and pred else None,
                         "decode_vs_llamacpp": d / base_d if d and base_d else None,
                         "prefill_vs_llamacpp": p / base_p if p and base_p else None,
                         "hit_rate": r.get("hit_rate"), "cpu_experts_per_token": r.get("cpu_experts_per_token")})
    return rows


def verdicts(rows: list[dict]) -> list[str]:
    """The issue's goals, judged row by row: moectl's default decode <= 0.7x llama.cpp's ms/token on each shape,
    its prefill tokens/s >= llama.cpp's, and every moectl row within 1.3x of its prediction."""
    out = []
    for r in rows:
        if r["row"] == "auto (default)" and r["decode_vs_llamacpp"] is not None:
            ok = r["decode_vs_llamacpp"] <= DECODE_GOAL
            out.append(f"{r['shape']}: default decode {r['decode_vs_llamacpp']:.2f}x llama.cpp's ms/token: "
                       + ("meets" if ok else "MISSES") + f" the goal (<= {DECODE_GOAL})")
        if r["row"] == "auto (default)" and r["prefill_vs_llamacpp"] is not None:
            ok = r["prefill_vs_llamacpp"] >= 1.0
            out.append(f"{r['shape']}: default prefill {r['prefill_vs_llamacpp']:.2f}x llama.cpp's tokens/s: "
                       + ("meets" if ok else "MISSES") + " the goal (>= 1)")
        q = r["measured_over_predicted"]
        if q is not None and not (1 / PREDICTION_BAND <= q <= PREDICTION_BAND):
            out.append(f"{r['shape']} {r['row']}: measured/predicted {q:.2f} is outside {PREDICTION_BAND}x: correct "
                       "the profile or the model from this measurement")
    return out


def write_report(out: Path, steps: list[Step], meta: dict) -> dict:
    rows = rows_table(steps)
    failed = [s.name for s in steps if s.status == "failed"]
    report = {"format": "moectl-gpu-check-v2", "meta": meta, "failed": failed, "rows": rows,
              "verdicts": verdicts(rows),
              "skipped": {s.name: s.output for s in steps if s.status == "skipped"},
              "steps": [{"name": s.name, "command": s.line, "status": s.status, "seconds": round(s.seconds, 2),
                         "minutes_planned": s.minutes, "figures": s.figures,
                         "output_tail": s.output[-1500:] if s.status == "failed" else "",
                         **({"why": s.output} if s.status == "skipped" and s.output else {})}
                        for s in steps]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu-check.md").write_text(markdown(report))
    return report


def markdown(r: dict) -> str:
    m = r["meta"]
    f = lambda v, fmt=".1f": "-" if v is None else format(v, fmt)       # noqa: E731
    where = "dry run" if m["dry_run"] else "on " + str(m.get("gpu"))
    lines = [f"# moectl against llama.cpp --n-cpu-moe, same GGUF, same VRAM ({where})", ""]
    if m.get("sample"):
        lines += [f"**Figures from the recorded sample {m['sample']}, not measured here.**", ""]
    lines += ["| shape | row | ms/tok | prefill/s | pred. | m/p | decode x | prefill x |",
              "|---|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        lines.append(f"| {x['shape']} | {x['row']} | {f(x['decode_ms_per_token'])} | "
                     f"{f(x['prefill_tokens_per_s'], '.0f')} | {f(x['predicted_ms_per_token'])} | "
                     f"{f(x['measured_over_predicted'], '.2f')} | {f(x['decode_vs_llamacpp'], '.2f')} | "
                     f"{f(x['prefill_vs_llamacpp'], '.2f')} |")
    lines += ["", f"Q4_K_M GGUFs made by llama.cpp's converter and llama-quantize; {LAYERS} layers of each shape with "
              f"the real expert sizes; prefill {PROMPT} tokens (`prefill/s`: tokens/s), then {GEN} decoded (`ms/tok`: "
              "decode ms/token). `pred.`: the simulator's ms/token for that run on this machine's measured profile, "
              "`m/p` measured over it (goal: within 1.3x). `decode x` is moectl's ms/token "
              f"over llama.cpp's (goal <= {DECODE_GOAL} for the default), `prefill x` its tokens/s over llama.cpp's "
              "(goal >= 1). moectl-q4 runs moectl's own q4g64 copies of the safetensors original; moectl reserves KV for "
              "4096 tokens inside the same budget.", ""]
    for shape, b in (m.get("budgets") or {}).items():
        lines.append(f"- {shape}: {b.get('experts_per_layer')} experts x {b.get('layers')} layers, budget "
                     f"{b.get('budget_bytes', 0) / 2**30:.2f} GiB ({b.get('how')}), {b.get('cache_experts')} "
                     f"experts' worth; llama.cpp --n-cpu-moe {b.get('n_cpu_moe')}")
    lines += ["", "## Verdicts", ""] + [f"- {v}" for v in r["verdicts"] or ["(no measured rows)"]]
    if r["skipped"]:
        lines += ["", "## Skipped", ""] + [f"- {k}: {v or 'skipped by --skip'}" for k, v in r["skipped"].items()]
    lines += ["", f"machine: {m['host']}, {m['cpu']}; python {m['python']}; torch {m.get('torch')}; "
              f"driver CUDA {m.get('driver_cuda')}; minutes planned {m.get('minutes')}", "",
              "## Steps", "", "| step | status | s | planned min | command |", "|---|---|---|---|---|"]
    for s in r["steps"]:
        lines.append(f"| {s['name']} | {s['status']} | {s['seconds']} | {s['minutes_planned']} | `{s['command']}` |")
    for s in r["steps"]:
        if s["status"] == "failed":
            lines += ["", f"### {s['name']} failed", "", "```", s["output_tail"], "```"]
    return "\n".join(lines) + "\n"


# --- the run ---------------------------------------------------------------------------------------------------
def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="report directory (default $OUT, else ./gpu-check)")
    p.add_argument("--dry-run", action="store_true", help="print every step, run only what a CPU can")
    p.add_argument("--bundle", type=Path, default=BUNDLE, help="the bundle `make gpu-bundle` made (default "
                   "%(default)s); a dry run checks it when there is one")
    p.add_argument("--minutes", type=float, default=9.0, help="device minutes for the whole check: a step whose "
                   "estimate is more than what is left is skipped (default %(default)s)")
    p.add_argument("--skip", default="", help="comma list of steps to skip, by kind (install, tests, synthetic, "
                   "gguf, llamacpp, plan, bench, bench-auto, quantize, bench-q4, kernels, copy, attention) or by "
                   "name (gguf:qwen3-moe)")
    p.add_argument("--sample", type=Path, default=None, help="dry run: fill the device steps' figures from this "
                   "recorded sample (tests/gpu_check_sample.json) and write the report from them")
    p.add_argument("--timeout", type=float, default=420, help="seconds at most per step")
    p.add_argument("--fetch-wheels", type=Path, default=None, metavar="DIR",
                   help="download the wheels the lent machines' image lacks into DIR (needs the package index), "
                        "then exit (make gpu-bundle does this)")
    p.add_argument("--cuda-tag", default=None, help=argparse.SUPPRESS)
    # the check's own device steps, run as commands (printed in the report like every other step)
    p.add_argument("--make-gguf", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--gguf-out", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--llama-bench", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--n-cpu-moe", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--llamacpp", default="", help=argparse.SUPPRESS)
    p.add_argument("--measure-copy", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--measure-attention", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)   # the measure steps print JSON anyway
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def sub_command(a) -> int | None:
    """The check's own steps, each run as a command of this script; None when this is the check itself."""
    llamacpp = Path(a.llamacpp) if a.llamacpp else None
    if a.fetch_wheels:
        a.fetch_wheels.mkdir(parents=True, exist_ok=True)
        for cmd in wheel_commands(a.fetch_wheels):
            if subprocess.run(cmd).returncode:
                print(f"error: {' '.join(cmd[:5])} ... failed")
                return 2
        print(f"wheels in {a.fetch_wheels}")
        return 0
    if a.measure_copy:
        print(json.dumps(measure_copy(a.device)))
        return 0
    if a.measure_attention:
        print(json.dumps(measure_attention(a.device)))
        return 0
    libs = cuda_lib_dirs(sys.executable) if shutil.which("nvidia-smi") else []
    if a.make_gguf:
        print(json.dumps(make_gguf(a.make_gguf, a.gguf_out, llamacpp, libs)))
        return 0
    if a.llama_bench:
        print(json.dumps(llama_bench(a.llama_bench, a.n_cpu_moe, llamacpp, libs, os.cpu_count() or 4)))
        return 0
    return None


def skip_reason(s: Step, by_name: dict, skip: set[str], minutes_left: float | None) -> str | None:
    """Why step `s` does not run (None: it runs): --skip names it or its kind, an input of it did not run, or its
    estimate is more than the minutes left (None: no clock, the dry run). Never started, so never half-run."""
    if s.name in skip or s.kind in skip:
        return "--skip"
    unmet = [n for n in s.needs if by_name[n].status not in ("ok", "sample", "printed")]
    if unmet:
        return f"needs {', '.join(unmet)}, which did not run"
    if minutes_left is not None and s.minutes > minutes_left:
        return f"its estimate, {s.minutes:g} min, is more than the {minutes_left:.1f} left"
    return None


def fill(cmd: list[str], a) -> list[str]:
    """The budget placeholders of later commands, once the budget steps have run."""
    out = []
    for c in cmd:
        for shape, s in a.shapes.items():
            if "budget" in s:
                c = c.replace(f"{{budget:{shape}}}", str(s["budget"]))
        out.append(c)
    return out


def run_or_skip(s: Step, a, cuda: bool, env: dict, skip: set[str], sample: dict, t_start: float) -> None:
    """One step: skipped (with the reason), printed (dry run; a recorded sample's figures when given) or run."""
    left = a.minutes - (time.monotonic() - t_start) / 60
    why = skip_reason(s, a.by_name, skip, None if a.dry_run else left)
    if why:
        s.status, s.output = "skipped", why
    elif a.dry_run and not s.cpu:
        s.cmd = fill(s.cmd, a)
        if s.name in sample:
            s.status, s.figures = "sample", sample[s.name]
        else:
            s.status = "printed"
        print(f"[dry run] {s.name}: {s.line}")
        return
    else:
        s.cmd = fill(s.cmd, a)
        print(f"[{s.name}] {s.line}", flush=True)
        if s.kind == "synthetic" and (Path(s.cmd[s.cmd.index("--out") + 1]) / "config.json").is_file():
            s.status, s.output = "ok", "already built"
            return
        if s.inline is not None:
            t0 = time.perf_counter()
            try:
                s.figures, s.status = s.inline(), "ok"
            except (FileNotFoundError, StepSkipped) as e:
                s.status, s.output = "skipped", str(e)
            except Exception as e:                         # noqa: BLE001: the report keeps it, the check goes on
                s.status, s.output = "failed", f"{type(e).__name__}: {e}"
            s.seconds = time.perf_counter() - t0
        else:
            run_step(s, env, min(a.timeout, max(60.0, left * 60 + 30)))
        print(f"[{s.name}] {s.status} in {s.seconds:.1f} s", flush=True)
    if s.status == "skipped":
        print(f"[{s.name}] skipped: {s.output}", flush=True)
    if s.name == "install" and s.status == "ok":
        write_hardware(a.hardware, step_python(a, cuda), cuda, env)   # the interpreter exists now: measure
        # the in-process steps (budget, fits) import gguf and moectl: the bundle's wheels first, as the
        # commands have them on PYTHONPATH (the image lacks gguf and holds an older transformers)
        sys.path[:0] = [str(ROOT), str(SITE)]
        import importlib

        importlib.invalidate_caches()


def main(argv=None) -> int:
    a = parse(argv)
    done = sub_command(a)
    if done is not None:
        return done
    t_start = time.monotonic()
    a.driver_cuda = driver_cuda()
    cuda = a.driver_cuda is not None and not a.dry_run
    a.cuda_python = python_with_cuda_torch() if cuda else None
    if not cuda and not a.dry_run:
        print("gpu-check: no CUDA on this machine (no nvidia-smi / driver): running --dry-run")
    a.dry_run = not cuda
    if a.sample and not a.dry_run:
        print("error: --sample is for the dry run only (a GPU run measures)")
        return 2
    a.out = a.out or Path(os.environ.get("OUT") or ROOT / "gpu-check")
    a.out.mkdir(parents=True, exist_ok=True)
    a.hardware = a.out / "hardware-measured.yaml"
    a.llamacpp = UNPACKED / "llamacpp" if cuda else None
    a.shapes = {}
    sample = json.loads(a.sample.read_text())["steps"] if a.sample else {}
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(SITE)]))
    skip = {x.strip() for x in a.skip.split(",") if x.strip()}
    steps = plan_steps(a, cuda)
    a.by_name = {s.name: s for s in steps}
    total = sum(s.minutes for s in steps if not (s.name in skip or s.kind in skip))
    print(f"gpu-check: {a.minutes:g} minutes; planned (minutes): "
          + ", ".join(f"{s.name} {s.minutes:g}" for s in steps if not (s.name in skip or s.kind in skip))
          + f"; {total:.1f} in all" + (" (more than there is: the last steps will be skipped)" if total > a.minutes
                                        else ""), flush=True)
    bundle_problems = None
    if a.dry_run and a.bundle.exists():
        sys.path.insert(0, str(ROOT / "bench"))
        import gpu_bundle

        bundle_problems = gpu_bundle.check(a.bundle)
        print(f"gpu-check: bundle {a.bundle}: " + ("; ".join(bundle_problems) or "complete, within the carry limit"))
    if a.dry_run:                                     # this CPU's profile, for the plans (a GPU's: after install)
        write_hardware(a.hardware, sys.executable, False, env)
    for s in steps:
        run_or_skip(s, a, cuda, env, skip, sample, t_start)
    budgets = {shape: a.by_name[f"budget:{shape}"].figures for shape in SHAPES if a.by_name[f"budget:{shape}"].figures}
    meta = {"dry_run": a.dry_run, "host": platform.node(), "cpu": platform.processor() or platform.machine(),
            "python": platform.python_version(), "driver_cuda": a.driver_cuda, "layers": LAYERS,
            "torch_pin": TORCH_VERSION, "torch": _torch_version(step_python(a, cuda), env), "gpu": _gpu_name(),
            "minutes": a.minutes, "wall_minutes": round((time.monotonic() - t_start) / 60, 2), "budgets": budgets,
            "sample": str(a.sample) if a.sample else None, "bundle_problems": bundle_problems}
    report = write_report(a.out, steps, meta)
    print(f"gpu-check: report in {a.out / 'gpu-check.md'}; "
          + (f"FAILED: {', '.join(report['failed'])}" if report["failed"] else "no step failed")
          + (f"; skipped: {', '.join(report['skipped'])}" if report["skipped"] else ""))
    return 1 if report["failed"] else 0


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
