"""llama.cpp itself, built here from the source the package index carries: the other side of `bench/vs_llamacpp.py`.

The `llama-cpp-python` source distribution vendors the whole llama.cpp tree (`vendor/llama.cpp`: its CMake
project, tools, `convert_hf_to_gguf.py` and `gguf-py`). `build()` fetches that sdist at a pinned version with
`pip download --no-binary :all: --no-deps`, unpacks it and builds the tools the comparison needs (CPU backend,
native flags, `-j2`) into `$MOECTL_HOME/llamacpp/<version>/`; a finished build (its `bin/` plus a stamp file) is
reused. Nothing of llama.cpp is changed: `convert()` runs its converter unmodified and only tells it the
pre-tokenizer of moectl's tiny tokenizers (`make-synthetic`'s and `build-tiny`'s byte-level BPE uses GPT-2's
split, which llama.cpp names "gpt-2"; the converter recognises a pre-tokenizer by a hash of the token ids of its
test text, and a new vocabulary has a new hash) by answering its `get_vocab_base_pre` with that name.

Torch-free: this module only runs processes and reads files.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from moectl.errors import MoectlError
from moectl.kernels import isa as isas
from moectl.kernels.ggml import LLAMACPP_VERSION as VERSION, llamacpp_home

# VERSION: llama-cpp-python's sdist; vendors llama.cpp, the source moectl's ggml (moectl/kernels/ggml.py) builds from
# llama-imatrix: the importance matrix llama-quantize needs for IQ2_XXS / IQ2_XS / IQ1_S (added later: an existing
# build compiles only it, the other targets are up to date)
TOOLS = ("llama-bench", "llama-perplexity", "llama-quantize", "llama-completion", "llama-tokenize", "llama-imatrix")
CUDA_TOOLS = ("llama-bench", "llama-quantize")      # what gpu-check's --n-cpu-moe row needs (bench/llamacpp_cuda.py)
# The CUDA build is made here, ahead of time, for the lent machines (no compiling there: bench/gpu_bundle.py carries
# it). Hopper only (H100/H200): each more architecture is another full pass of nvcc over ~190 kernel files.
CUDA_ARCHS = "90-real"
# cuBLAS for the link, from the package index at the version the lent machines' torch (2.11.0+cu130, through
# cuda-toolkit 13.0.2) ships: at run time the binaries load that torch's own libcublas.so.13 (LD_LIBRARY_PATH).
CUBLAS_WHEEL = "nvidia-cublas==13.1.0.3"
# The CPU code of the CUDA build is chosen at run time (GGML_BACKEND_DL): the lent machines' CPUs are not this one
# (the first was a Sapphire Rapids Xeon, AVX-512 + AMX), and `--n-cpu-moe` computes experts on it.
CPU_VARIANTS = ("x64", "haswell", "skylakex", "icelake", "zen4", "sapphirerapids")
# Not needed to build the tools or run the converter; left out of a carried source pack (`pack_source`).
PACK_SKIP = ("models", "docs", "media", "tests", "benches", "examples", "pocs", "ci", "scripts", "app",
             "tools/server", "tools/ui", "tools/cli", ".github", ".devops")


def home() -> Path:
    """Where llama.cpp's source and tools live: moectl's ggml's home (`$MOECTL_GGML_ROOT`, else
    `$MOECTL_HOME/llamacpp/<version>/`), so the test suite's private MOECTL_HOME finds the user's build."""
    return llamacpp_home()


def source_dir(root: Path | None = None) -> Path:
    return (root or home()) / "src" / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"


def bin_dir(root: Path | None = None, isa: str | None = None) -> Path:
    """The tools of the build for `isa` (default: `MOECTL_GGML_ISA`, moectl/kernels/isa.py): `bin/` native,
    `bin-avx2/` restricted to AVX2; the two builds share the source, never their objects or binaries."""
    return (root or home()) / isas.build_dir(isa or isas.current(), "bin")


def tool(name: str, root: Path | None = None, isa: str | None = None) -> Path:
    return bin_dir(root, isa) / name


def cuda_home() -> Path:
    """Where the CUDA build goes: beside the CPU one, never mixed with it."""
    return home().with_name(VERSION + "-cuda")


def nvcc() -> str | None:
    """The CUDA compiler a CUDA build would use: on PATH, else the toolkit's usual place; None when neither."""
    found = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    return found if Path(found).exists() else None


def built(root: Path | None = None, tools=TOOLS, isa: str | None = None) -> bool:
    root, isa = root or home(), isa or isas.current()
    return (root / isas.build_dir(isa, "BUILT")).exists() and all(tool(t, root, isa).exists() for t in tools)


def check_toolchain() -> None:
    """One clear error naming the Debian package when cmake or a C++ compiler is missing."""
    if shutil.which("cmake") is None:
        raise MoectlError("building llama.cpp needs cmake: install it (Debian/Ubuntu: apt-get install cmake)")
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        raise MoectlError("building llama.cpp needs a C++ compiler: install one (Debian/Ubuntu: apt-get install g++)")


def _run(cmd: list, log: Path, **kw) -> None:
    with open(log, "a") as f:
        f.write("$ " + " ".join(map(str, cmd)) + "\n")
        f.flush()
        r = subprocess.run(list(map(str, cmd)), stdout=f, stderr=subprocess.STDOUT, **kw)
    if r.returncode:
        raise MoectlError(f"{Path(str(cmd[0])).name} failed (exit {r.returncode}); see {log}")


def build(jobs: int = 2, root: Path | None = None, echo=print, cuda: bool = False, isa: str | None = None) -> Path:
    """Fetch, unpack and build llama.cpp's tools once; returns the build root (bin/, src/, build.log). `cuda`: the
    CUDA backend for this machine's GPU architecture, and only CUDA_TOOLS (from a carried source pack when the
    sdist is not there and cannot be fetched: see `pack_source`). `isa` (CPU build; default `MOECTL_GGML_ISA`):
    native, or avx2 into bin-avx2/ (build-avx2/, BUILT-avx2, build-seconds-avx2 beside the native ones)."""
    root = root or (cuda_home() if cuda else home())
    tools = CUDA_TOOLS if cuda else TOOLS
    isa = "native" if cuda else isas.check(isa or isas.current())
    if built(root, tools, isa):
        return root
    check_toolchain()
    if cuda and nvcc() is None:
        raise MoectlError("building llama.cpp with CUDA needs nvcc (the CUDA toolkit): none on PATH or in "
                          "/usr/local/cuda/bin")
    root.mkdir(parents=True, exist_ok=True)
    log = root / f"{isas.build_dir(isa, 'build')}.log"           # build.log; build-avx2.log
    sdist = root / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.exists():
        echo(f"fetching llama-cpp-python {VERSION} (source) ...")
        _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
              f"llama-cpp-python=={VERSION}", "-d", root], log)
    src = source_dir(root)
    if not (src / "CMakeLists.txt").exists():
        with tarfile.open(sdist) as tf:
            tf.extractall(root / "src", filter="data")
    bld, bins = root / isas.build_dir(isa, "build"), bin_dir(root, isa)
    deps = cuda_link_deps(root, log) if cuda else None
    echo(f"building {', '.join(tools)} ({isa}) into {bins} (minutes{', an hour or more on 2 cores' if cuda else ''}; "
         f"log: {log}) ...")
    t0 = time.time()
    _run(["cmake", "-S", src, "-B", bld, *cmake_flags(cuda, deps, isa)], log)
    # niced: minutes (the CUDA build: hours) of every core, often on a shared machine
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    _run([*nice, "cmake", "--build", bld, "-j", jobs, "--target", *(cuda_targets() if cuda else tools)], log)
    bins.mkdir(exist_ok=True)
    for t in tools:
        shutil.copy2(bld / "bin" / t, tool(t, root, isa))
    if cuda:                                    # the shared libraries beside the tools (their RPATH is $ORIGIN)
        for lib in (bld / "bin").glob("lib*.so*"):
            shutil.copy2(lib, bins / lib.name, follow_symlinks=True)
    seconds = root / isas.build_dir(isa, "build-seconds")
    if not seconds.exists():     # the first build's wall time (a rebuild reuses its objects),
        # with the time of an earlier, interrupted run of it that left its objects (build-seconds.partial)
        partial = seconds.with_name(seconds.name + ".partial")
        before = float(partial.read_text()) if partial.exists() else 0.0
        seconds.write_text(f"{before + time.time() - t0:.0f}\n")
    (root / isas.build_dir(isa, "BUILT")).write_text(VERSION + "\n")
    return root


def cmake_flags(cuda: bool = False, deps: dict | None = None, isa: str = "native") -> list[str]:
    """The configuration: no server, no curl, no tests. CPU: static tools with `isa`'s flags (moectl/kernels/isa.py:
    native = this machine's, avx2 = AVX2 and nothing wider), the same moectl's ggml takes. CUDA:
    built here for the lent machines, not this one: CUDA_ARCHS only, FlashAttention for an f16 KV cache only
    (llama-bench's default; GGML_CUDA_FA_QUANTS would add an instance set per pair), no NCCL; shared libraries
    with every CPU variant of CPU_VARIANTS loaded by what the CPU it runs on has (GGML_BACKEND_DL). `deps`
    (`cuda_link_deps`): where cuBLAS and the driver's link stub are, as this machine has neither."""
    common = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_METAL=OFF", "-DGGML_VULKAN=OFF", "-DLLAMA_CURL=OFF",
              "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=OFF"]
    if not cuda:
        return common + [*isas.cmake_flags(isa), "-DBUILD_SHARED_LIBS=OFF", "-DGGML_CUDA=OFF",
                         "-DLLAMA_BUILD_EXAMPLES=ON"]
    flags = common + ["-DGGML_NATIVE=OFF", "-DBUILD_SHARED_LIBS=ON", "-DGGML_BACKEND_DL=ON",
                      "-DGGML_CPU_ALL_VARIANTS=ON", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
                      "-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={CUDA_ARCHS}", "-DGGML_CUDA_FA_QUANTS=f16-f16",
                      "-DGGML_CUDA_NCCL=OFF", "-DCMAKE_BUILD_RPATH=$ORIGIN"]
    if deps:
        cuda_root = Path(deps["nvcc"]).parents[1]
        flags += [f"-DCUDAToolkit_ROOT={cuda_root}", f"-DCMAKE_CUDA_COMPILER={deps['nvcc']}",
                  f"-DCUDA_cublas_LIBRARY={deps['lib']}/libcublas.so",
                  f"-DCUDA_cublasLt_LIBRARY={deps['lib']}/libcublasLt.so",
                  f"-DCUDA_cuda_driver_LIBRARY={deps['stub']}",
                  f"-DCMAKE_CUDA_FLAGS=-I{deps['include']}", f"-DCMAKE_CXX_FLAGS=-I{deps['include']}"]
    return flags


def cuda_targets() -> list[str]:
    """What the CUDA build compiles: the tools, the CUDA backend and the CPU variants (loaded, not linked)."""
    return [*CUDA_TOOLS, "ggml-cuda", *(f"ggml-cpu-{v}" for v in CPU_VARIANTS)]


def cuda_link_deps(root: Path, log: Path, python: str = sys.executable) -> dict:
    """What linking the CUDA build needs beyond nvcc, which this machine's toolkit lacks: cuBLAS's headers and
    libraries (CUBLAS_WHEEL, from the package index; the binaries load the lent machine's own at run time) and a
    link stub of the driver library libcuda.so.1 (the real one comes with the lent machine's driver). The stub
    defines every `CUresult cu*(...)` cuda.h declares, as an empty function under the driver's soname: it is
    only linked against, never loaded."""
    deps = root / "deps"
    cublas = deps / "cublas" / "nvidia" / "cu13"
    if not (cublas / "lib" / "libcublas.so").exists():
        deps.mkdir(parents=True, exist_ok=True)
        _run([python, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", CUBLAS_WHEEL, "-d", deps],
             log)
        import zipfile

        wheel = next(deps.glob("nvidia_cublas-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extractall(deps / "cublas", [n for n in z.namelist() if "/include/" in n or "/lib/libcublas" in n])
        for name in ("libcublas", "libcublasLt"):
            (cublas / "lib" / f"{name}.so").symlink_to(f"{name}.so.13")
        wheel.unlink()                                                          # 420 MB; the headers are out
    # the toolkit's own nvcc, not a wrapper on PATH: CUDAToolkit_ROOT is read off its place
    compiler = "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else nvcc()
    if compiler is None:
        raise MoectlError("building llama.cpp with CUDA needs nvcc (the CUDA toolkit): none on PATH or in "
                          "/usr/local/cuda/bin")
    include = Path(compiler).parents[1] / "include"
    stub = deps / "stub" / "libcuda.so"
    if not stub.exists():
        import re

        stub.parent.mkdir(parents=True, exist_ok=True)
        pre = subprocess.run(["cc", "-E", "-P", f"-I{include}", str(include / "cuda.h")], capture_output=True,
                             text=True, check=True).stdout
        names = sorted(set(re.findall(r"CUresult\s+(cu\w+)\s*\(", pre)))
        (stub.parent / "libcuda_stub.c").write_text("".join(f"void {n}(void) {{}}\n" for n in names))
        _run(["cc", "-shared", "-fPIC", "-o", stub, "-Wl,-soname,libcuda.so.1", stub.parent / "libcuda_stub.c"],
             log)
    return {"nvcc": compiler, "include": str(cublas / "include"), "lib": str(cublas / "lib"), "stub": str(stub)}


def pack_source(out: Path, root: Path | None = None) -> Path:
    """The llama.cpp tree of the fetched sdist, less what the tools' build and the converter never read (PACK_SKIP:
    test models, docs, the web UI: 76 -> ~10 MB), as a tarball laid out like the sdist, so `build` unpacks it as
    one. A lent GPU machine has no package index: this is how the source travels with the checkout."""
    src = source_dir(root)
    if not (src / "CMakeLists.txt").exists():
        raise MoectlError(f"no llama.cpp source at {src}: build it here first (python bench/vs_llamacpp.py --build)")
    base = src.parents[2]                                     # .../src: arcnames start at llama_cpp_python-<ver>/
    skip = {src / p for p in PACK_SKIP}
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:gz") as tf:
        tf.add(src, arcname=str(src.relative_to(base)), filter=lambda ti: None if base / ti.name in skip else ti)
    return out


CONVERT_SHIM = """
import sys
sys.path.insert(0, {gguf!r})
sys.argv = [{script!r}] + {args!r}
sys.path.insert(0, {srcdir!r})
import convert_hf_to_gguf as c
try:
    from conversion.base import TextModel as base         # llama.cpp since its converter became a package
except ImportError:
    base = getattr(c, "TextModel", None) or c.Model
orig = base.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return orig(self, tokenizer)
    except NotImplementedError:
        if {pre!r}:
            return {pre!r}          # moectl's tiny tokenizer: GPT-2's byte-level split
        raise
base.get_vocab_base_pre = get_vocab_base_pre
c.main()
"""


def convert(model_dir: str | Path, out: str | Path, outtype: str = "f32", pre: str = "gpt-2",
            root: Path | None = None, log: Path | None = None, src: Path | None = None) -> Path:
    """llama.cpp's `convert_hf_to_gguf.py` on a Hugging Face checkpoint, told the tiny tokenizer's pre-tokenizer.
    `src`: a directory holding the converter, conversion/ and gguf-py/ (default: the build's source tree)."""
    import importlib.util

    if importlib.util.find_spec("sentencepiece") is None:     # its Llama-family vocab path imports it first
        raise MoectlError("llama.cpp's converter needs sentencepiece: pip install 'moectl[llamacpp]' "
                          "(make install-llamacpp)")
    src = src or source_dir(root)
    script = src / "convert_hf_to_gguf.py"
    if not script.exists():
        raise MoectlError(f"llama.cpp's converter is not at {script}: build first (bench/vs_llamacpp.py --build)")
    args = [str(model_dir), "--outfile", str(out), "--outtype", outtype]
    code = CONVERT_SHIM.format(gguf=str(src / "gguf-py"), script=str(script), args=args, srcdir=str(src), pre=pre)
    log = log or Path(str(out) + ".convert.log")
    _run([sys.executable, "-c", code], log)
    return Path(out)


def quantize(gguf_in: str | Path, gguf_out: str | Path, qtype: str, threads: int = 2,
             root: Path | None = None, imatrix: str | Path | None = None, log: Path | None = None) -> Path:
    """llama.cpp's own `llama-quantize` (Q8_0, Q4_0, Q4_K_M, ...); `imatrix`: an importance matrix (`imatrix()`),
    which the IQ1/IQ2 types require. Its log: `log`, default beside `gguf_out`."""
    extra = ["--imatrix", imatrix] if imatrix else []
    _run([tool("llama-quantize", root), *extra, gguf_in, gguf_out, qtype, threads],
         log or Path(str(gguf_out) + ".log"))
    return Path(gguf_out)


def imatrix(gguf: str | Path, text_file: str | Path, out: str | Path, ctx: int = 128, chunks: int = 8,
            threads: int = 2, root: Path | None = None) -> Path:
    """`llama-imatrix` on `chunks` chunks of `ctx` tokens of a text file: the importance matrix (GGUF format) that
    `llama-quantize --imatrix` reads. Its log (with llama.cpp's system_info line) is written beside `out`."""
    _run([tool("llama-imatrix", root), "-m", gguf, "-f", text_file, "-o", out, "-c", ctx, "--chunks", chunks,
          "-t", threads, "--no-ppl"], Path(str(out) + ".log"))
    return Path(out)


def system_info(gguf: str | Path, root: Path | None = None) -> str:
    """llama.cpp's `system_info` line for this build on this CPU (the ISA features its CPU backend was built with and
    uses, e.g. `AVX2 = 1`, and whether it repacks), from a one-token `llama-completion` run on `gguf`."""
    out, _ = run_tool("llama-completion", ["-m", gguf, "-p", "a", "-n", 1, "-t", 1, "-no-cnv", "--no-warmup",
                                           "-c", 64], root)
    lines = [ln for ln in out.splitlines() if "system_info" in ln]
    return lines[-1].split("system_info:", 1)[-1].strip() if lines else ""


def run_tool(name: str, args: list, root: Path | None = None) -> tuple[str, float]:
    """Run tool `name`; returns (stdout + stderr, peak RSS in GB of the tool's process, from `wait4`)."""
    exe = tool(name, root)
    if not exe.exists():
        raise MoectlError(f"{exe} is missing: build llama.cpp first (python bench/vs_llamacpp.py --build)")
    import tempfile

    # Into a file opened by a shell that then execs the tool (same pid, so wait4's peak RSS is the tool's): run
    # straight from Python, through a pipe or a file, llama.cpp's asynchronous logger lost its last lines here
    # (the perplexity tool's "Final estimate"); redirected by the shell it never did.
    with tempfile.NamedTemporaryFile("r", suffix=".log") as f:
        p = subprocess.Popen(["bash", "-c", 'exec "$0" "$@" > "$MOECTL_TOOL_LOG" 2>&1', str(exe), *map(str, args)],
                             env=dict(os.environ, MOECTL_TOOL_LOG=f.name))
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        out = Path(f.name).read_text(errors="replace")
    if p.returncode:
        raise MoectlError(f"{name} failed (exit {p.returncode}):\n{out[-2000:]}")
    return out, usage.ru_maxrss / 2**20                # ru_maxrss is in KiB on Linux


def kl_divergence(base: str | Path, gguf: str | Path, text_file: str | Path, ctx: int, threads: int = 1,
                  chunks: int | None = None, root: Path | None = None, logits: str | Path | None = None) -> dict:
    """`gguf` against `base` on the same chunks of a text file, through llama-perplexity's KL-divergence mode: the
    base's logits are saved once (`logits`, default beside `base`), then `gguf` is scored token by token against
    them. Returns {"ppl_ratio", "ppl_ratio_err", "ln_ratio", "ln_ratio_err", "kld", "same_top"}: the paired
    statistics llama.cpp prints (PPL(Q)/PPL(base) and its uncertainty over the same tokens), which a difference
    of two perplexities, each with its own error, cannot give."""
    import re

    logits = Path(logits) if logits else Path(f"{base}.kld-{ctx}-{chunks or 'all'}")
    args = ["-f", text_file, "-c", ctx, "-t", threads, "-b", ctx, "--kl-divergence-base", logits]
    if chunks:
        args += ["--chunks", chunks]
    if not logits.exists():
        run_tool("llama-perplexity", ["-m", base, *args], root)
    out, _ = run_tool("llama-perplexity", ["-m", gguf, *args, "--kl-divergence"], root)

    def stat(label: str, text: str) -> tuple[float, float] | None:
        # identical logits (a file against itself) print their spread as "-nan": no spread at all
        m = re.search(re.escape(label) + r"\s*:\s*([-0-9.]+|-?nan)\s*±\s*([0-9.]+|-?nan)", text)
        if m is None:
            return None
        value, err = (float(g.lstrip("-")) if "nan" in g else float(g) for g in m.groups())
        return (0.0 if value != value else value), (0.0 if err != err else err)
    for _ in range(3):         # its asynchronous logger can lose the last lines (often on a busy machine): again
        if stat("Mean PPL(Q)/PPL(base)", out) is not None:
            break
        out, _ = run_tool("llama-perplexity", ["-m", gguf, *args, "--kl-divergence"], root)
    ratio, ln_ratio = stat("Mean PPL(Q)/PPL(base)", out), stat("Mean ln(PPL(Q)/PPL(base))", out)
    if ratio is None or ln_ratio is None:
        raise MoectlError(f"llama-perplexity --kl-divergence printed no PPL(Q)/PPL(base):\n{out[-1500:]}")
    # the KL divergence and the top-token agreement come last; the last per-chunk line has both when they are lost
    kld, top = stat("Mean    KLD", out), re.search(r"Same top p\s*:\s*([0-9.]+)\s*±", out)
    rows = re.findall(r"^\s*\d+\s+[0-9.]+ ±\s+[0-9.]+\s+[-0-9.]+ ±\s+(?:[0-9.]+|-?nan)\s+([-0-9.]+) ±\s+([0-9.]+)\s+[-0-9.]+ ±"
                      r"\s+[0-9.]+ %\s+([0-9.]+) ±", out, re.M)
    if kld is None and rows:
        kld = float(rows[-1][0]), float(rows[-1][1])
    same_top = float(top.group(1)) if top else float(rows[-1][2]) if rows else None
    return {"ppl_ratio": ratio[0], "ppl_ratio_err": ratio[1], "ln_ratio": ln_ratio[0], "ln_ratio_err": ln_ratio[1],
            "kld": kld[0] if kld else None, "kld_err": kld[1] if kld else None,
            "same_top": same_top / 100 if same_top is not None else None}


def tokenize(gguf: str | Path, text: str, root: Path | None = None) -> list[int]:
    """llama.cpp's tokenization of `text` (no BOS added), by `llama-tokenize --ids`."""
    out, _ = run_tool("llama-tokenize", ["-m", gguf, "-p", text, "--ids", "--no-bos", "--log-disable"], root)
    line = [l for l in out.splitlines() if l.startswith("[")][-1]
    return [int(x) for x in line.strip("[]").split(",") if x.strip()]


def greedy_tokens(gguf: str | Path, prompt: str, n: int, threads: int = 1, root: Path | None = None,
                  workdir: Path | None = None) -> tuple[list[int], list[int]]:
    """(prompt ids, generated ids) of a greedy `llama-completion` run. The ids are read back from the session
    file `--prompt-cache-all` writes (magic, version, count, int32 tokens, then the KV state)."""
    import struct
    import tempfile

    with tempfile.TemporaryDirectory(dir=workdir) as d:
        session = Path(d) / "session.bin"
        run_tool("llama-completion", ["-m", gguf, "-p", prompt, "-n", n, "--temp", 0, "--top-k", 1, "-t", threads,
                                      "-no-cnv", "--no-warmup", "--prompt-cache", session, "--prompt-cache-all",
                                      "-c", 512, "--seed", 0, "--ignore-eos"], root)
        raw = session.read_bytes()
    magic, version, count = struct.unpack_from("<III", raw, 0)
    ids = list(struct.unpack_from(f"<{count}i", raw, 12))
    prompt_ids = tokenize(gguf, prompt, root)
    if ids[:len(prompt_ids)] != prompt_ids:
        raise MoectlError(f"llama-completion's session does not start with the prompt's tokens: {ids[:8]}...")
    return prompt_ids, ids[len(prompt_ids):]


def bench(gguf: str | Path, threads: int, prompt: int = 0, gen: int = 64, reps: int = 3,
          root: Path | None = None) -> dict:
    """`llama-bench -o json` at one thread count: {"tokens_per_s", "stddev", "samples", "rss_gb"}."""
    rows, rss = bench_rows(gguf, ["-t", threads, "-p", prompt, "-n", gen, "-r", reps], root)
    r = rows[0]
    return {"tokens_per_s": r["avg_ts"], "stddev": r["stddev_ts"], "samples": r.get("samples_ts", []),
            "rss_gb": rss}


def glibc_rand(n: int, seed: int = 1) -> list[int]:
    """The first `n` values of glibc's `rand()` after `srand(seed)` (1: never seeded), its default TYPE_3 generator:
    31 words seeded by 16807 * x mod 2^31 - 1, the first 310 outputs dropped, then r[i] = r[i-31] + r[i-3] mod 2^32,
    each output r >> 1. Exact (checked against libc's own in tests/test_bench_vs_llamacpp.py)."""
    r = [seed]
    for _ in range(30):
        hi, lo = divmod(r[-1], 127773)                   # Schrage's 16807 * x mod (2^31 - 1), as glibc's srandom_r
        w = 16807 * lo - 2836 * hi
        r.append(w + 2147483647 if w < 0 else w)
    r += r[:3]                                          # r[31..33] = r[0..2]
    for i in range(34, n + 344):
        r.append((r[i - 31] + r[i - 3]) & 0xFFFFFFFF)
    return [x >> 1 for x in r[344:]]


def bench_prompt_ids(n_vocab: int, n_prompt: int, prompts: int, bos: int | None = None) -> list[list[int]]:
    """The token ids llama-bench's prompt test feeds, one list per prompt in its order: `-p N -n 0 -r R` runs its
    warm-up prompt, then R timed ones (tools/llama-bench `test_prompt`: `std::rand() % n_vocab` each, the first
    token BOS instead where the vocabulary adds one; nothing seeds rand, so every run feeds the same ids).

    Why moectl's side feeds these (stop 57): which experts a prompt routes decides how its rows split between ggml's
    tiled kernel (an expert with >= 8 routed rows) and stock vec_dot (fewer), and on the IQ types a row costs vec_dot
    several times what it costs tiled. One fixed draw timed R times (moectl's until stop 57) routed 236-254 of a
    Qwen3-shaped layer's 512 rows to experts below 8 against 163-282 over other draws (mean ~208): a bias of one
    draw, not of moectl. With llama-bench's own ids both tools route the same rows."""
    stream = iter(glibc_rand(prompts * n_prompt))
    return [[bos if i == 0 and bos is not None else next(stream) % n_vocab for i in range(n_prompt)]
            for _ in range(prompts)]


def bench_rows(gguf: str | Path, args: list, root: Path | None = None) -> tuple[list[dict], float]:
    """`llama-bench -m gguf ARGS -o json`: its result rows (one per test it ran) and its peak RSS in GB."""
    import json

    out, rss = run_tool("llama-bench", ["-m", gguf, *args, "-o", "json"], root)
    return json.loads(out[out.index("["):out.rindex("]") + 1]), rss


def perplexity(gguf: str | Path, text_file: str | Path, ctx: int, threads: int = 1, chunks: int | None = None,
               root: Path | None = None) -> dict:
    """`llama-perplexity` on a text file: {"ppl", "stderr"}. With `chunks`, the perplexity over the first `chunks`
    chunks of `ctx` tokens: the running estimate it prints after chunk `chunks` (it is run for one chunk more:
    here its asynchronous logger lost the last chunk's line and the "Final estimate" line at exit, under load)."""
    import re

    args = ["-m", gguf, "-f", text_file, "-c", ctx, "-t", threads, "-b", ctx]
    if chunks:
        args += ["--chunks", chunks + 1]
    out, _ = run_tool("llama-perplexity", args, root)
    running = {int(i): float(v) for i, v in re.findall(r"\[(\d+)\]([0-9.]+),", out)}
    if chunks and chunks in running:
        return {"ppl": running[chunks], "stderr": None, "chunks": chunks}
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", out)
    if m and not chunks:
        return {"ppl": float(m.group(1)), "stderr": float(m.group(2)), "chunks": max(running, default=0)}
    raise MoectlError(f"llama-perplexity printed no estimate for {chunks or 'all'} chunks:\n{out[-1500:]}")
