"""moectl's own CPU kernels (`cpu_kernels.cpp`), compiled once on first use and called through ctypes.

Why hand-written: llama.cpp's q4 decode reads ~2x faster than torch's CPU int4 kernel
(`_weight_int4pack_mm_for_cpu`: bf16 activations, compute-bound at ~0.4 of this machine's read bandwidth), and
no library serves torch 2.13 on x86 with an int8-activation x int4-weight product: torchao's PyPI wheel has no
CPU kernels, torch's `_dyn_quant_matmul_4bit` is a reference loop on x86, bitsandbytes' CPU gemv is NF4 with bf16
activations, ggml-python is a source-only package that builds ggml with its own graph API (docs/benchmarks.md).
So the q4 product is ggml's recipe (activations quantized to int8 per block, `vpdpbusd` dot products) on
moectl's own q4 copies, and the one-row bf16 product uses `vdpbf16ps`. A decode token's attention is one too:
torch's CPU `scaled_dot_product_attention` takes 0.4 ms for one query over 64 cached positions on the Mixtral shape
and 3.6 ms over 512 at one thread, the hand-written loop ~0.03 and ~0.2 (`models/attention_cpu.py`).

Built with the system C++ compiler against torch's headers (threads: torch's own pool via at::parallel_for) into
`$MOECTL_HOME/kernels/<key>/`, keyed by the source, the flags and torch's version; a build takes ~2 s. Where the
kernels cannot run (no AVX-512 VNNI/BF16, no compiler, `MOECTL_CPU_KERNELS=0`, `MOECTL_GGML_ISA=avx2`: the process
restricted to AVX2, kernels/isa.py; a bad value of it too), `library()` is None and callers keep torch's kernels;
`why_not()` says which.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..core.recipes import moectl_home
from ..errors import MoectlError
from .isa import ENV, current

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
         "-mavx512vnni", "-mavx512bf16", "-mfma", "-mf16c"]
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16")

_why: list[str] = []


def _cpu_ok() -> str | None:
    try:
        flags = next((ln.split(":", 1)[1].split() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("flags")), [])
    except OSError:
        return "no /proc/cpuinfo to check the CPU's instruction sets"
    missing = [f for f in CPU_FLAGS if f not in flags]
    return f"this CPU lacks {', '.join(missing)}" if missing else None


def _compiler() -> str | None:
    found = (shutil.which(c) for c in (os.environ.get("CXX", ""), "c++", "g++", "clang++") if c)
    return next((path for path in found if path), None)


def _build(cxx: str) -> Path:
    # torch here, not at the top: its headers and libraries build these kernels, while the package's other modules
    # (kernels/ggml.py: a GGUF's one-graph run) are imported without torch
    import torch
    from torch.utils.cpp_extension import include_paths

    lib_dir = Path(torch.__file__).parent / "lib"
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    cmd = [cxx, *FLAGS, abi, *[f"-I{p}" for p in include_paths()], str(SOURCE), f"-L{lib_dir}", "-lc10",
           "-ltorch_cpu", f"-Wl,-rpath,{lib_dir}"]
    key = hashlib.sha256("\n".join([SOURCE.read_text(), " ".join(FLAGS), abi, torch.__version__, cxx]).encode())
    home = moectl_home() / "kernels" / key.hexdigest()[:16]
    out = home / "libmoectl_cpu.so"
    if out.exists():
        return out
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "lock", "w") as lock:                 # one build at a time (parallel test processes)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            with tempfile.TemporaryDirectory(dir=home) as tmp:
                so = Path(tmp) / out.name
                r = subprocess.run(cmd + ["-o", str(so)], capture_output=True, text=True)
                if r.returncode:
                    raise RuntimeError(f"{Path(cxx).name} failed: {r.stderr.strip()[-600:]}")
                os.replace(so, out)
    return out


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (then `why_not()` says why)."""
    if os.environ.get("MOECTL_CPU_KERNELS", "1") == "0":
        _why.append("MOECTL_CPU_KERNELS=0")
        return None
    try:
        isa = current()
    except MoectlError as e:               # a bad value: never wider than asked (the variable exists to restrict),
        _why.append(f"{e}; moectl's AVX-512 kernels off")      # and no error here: ggml's users raise it (isa.py)
        return None
    if isa != "native":                    # "moectl in its non-AVX-512 mode": the whole process, not ggml alone
        _why.append(f"{ENV}={isa}: no AVX-512 in this process")
        return None
    reason = _cpu_ok()
    cxx = _compiler()
    if reason is None and cxx is None:
        reason = "no C++ compiler (c++, g++ or clang++) to build them (Debian/Ubuntu: apt-get install g++)"
    if reason is None:
        try:
            lib = ctypes.CDLL(str(_build(cxx)))
        except (OSError, RuntimeError) as e:
            reason = f"building them failed: {e}"
    if reason is not None:
        _why.append(reason)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.moectl_q8_act.argtypes = [ptr, i64, i64, ptr, ptr, ptr]
    lib.moectl_lowbit_matmul.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr, ptr, i64, ptr]
    lib.moectl_bf16_gemv.argtypes = [ptr, i64, i64, ptr, ptr]
    lib.moectl_decode_attention.argtypes = [ptr, ptr, ptr, *[i64] * 9, ctypes.c_float, ptr, ptr]
    lib.moectl_experts_decode.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, ptr, ptr, i64, ptr, ptr]
    for f in (lib.moectl_q8_act, lib.moectl_lowbit_matmul, lib.moectl_bf16_gemv, lib.moectl_decode_attention,
              lib.moectl_experts_decode):
        f.restype = None
    return lib


def why_not() -> str:
    """Why `library()` is None; where it loaded, a sentence saying so (the README's check prints this: never None)."""
    lib = library()
    return _why[-1] if lib is None else f"nothing: moectl's CPU kernels are built and in use ({lib._name})"
