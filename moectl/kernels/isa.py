"""The x86 instruction set a ggml build targets: `MOECTL_GGML_ISA` = `native` (default) or `avx2`.

Why: issue 42 asks for the GGUF table "with both tools restricted to AVX2" (llama.cpp built with `GGML_NATIVE=OFF
GGML_AVX2=ON` and no AVX-512; moectl in its non-AVX-512 mode). On an AVX-512 host a native build of either tool uses
AVX-512, so the restricted table needs its own builds of both: moectl's ggml (kernels/ggml.py) and llama.cpp's tools
(bench/llamacpp.py) take their cmake flags and their build directory from here, so the two never mix with the native
ones and both sides are restricted the same way. In `avx2` mode moectl's own AVX-512 kernels (kernels/__init__.py)
are off too, so the whole process is non-AVX-512.

`native`: `-DGGML_NATIVE=ON` (-march=native: everything this CPU has). `avx2`: AVX, AVX2, FMA, F16C, BMI2 (and
SSE 4.2) on, every AVX-512, AMX and AVX-VNNI option of this llama.cpp version off (ggml/CMakeLists.txt), so no
-march=native anywhere (ggml/src/ggml-cpu/CMakeLists.txt then passes -mavx2 -mfma -mf16c -mbmi2 ...).

Read where it decides something, never at start-up: ggml's build, load and `describe` (kernels/ggml.py) and
llama.cpp's tools (bench/llamacpp.py) call `current()`, and a bad value there is a MoectlError naming the variable
and the valid ones (the CLI's one `error:` line); `moectl --help` and every command that never touches ggml run as
if it were unset, and `inspect` reports a GGUF without ggml, saying why (kernels/ggml.py: `unavailable`). moectl's
own AVX-512 kernels (kernels/__init__.py) read it too, but take a bad value as "not native" (off, `why_not()` says
why) rather than fail a run that uses no ggml: the variable exists to restrict, so a value that cannot be read never
widens the process.

Torch-free: reads the environment and returns lists.
"""

from __future__ import annotations

import os

from ..errors import MoectlError

ENV = "MOECTL_GGML_ISA"
ISAS = ("native", "avx2")
NATIVE_CMAKE = ["-DGGML_NATIVE=ON"]
AVX2_CMAKE = ["-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
              "-DGGML_F16C=ON", "-DGGML_BMI2=ON",
              # every wider option of this version off (their defaults are OFF with GGML_NATIVE=OFF; said anyway,
              # so a cached configure or a later default cannot turn one on)
              "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF",
              "-DGGML_AVX512_BF16=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
# the shim (kernels/ggml_shim.c) is compiled without -march in both modes; in avx2 mode it may use what ggml's
# avx2 build uses, no more
SHIM_FLAGS = {"native": [], "avx2": ["-mavx2", "-mfma", "-mf16c", "-mbmi2"]}


def check(name: str) -> str:
    """`name` if it is one of ISAS, else a MoectlError naming the valid ones."""
    if name not in ISAS:
        raise MoectlError(f"{ENV}={name!r} is not an ISA moectl builds ggml for: use one of {', '.join(ISAS)}")
    return name


def current() -> str:
    """The ISA of this process's ggml: `MOECTL_GGML_ISA`, default `native` (read on every call)."""
    return check(os.environ.get(ENV, "native").strip().lower() or "native")


def cmake_flags(name: str) -> list[str]:
    """The ggml ISA flags of a cmake configure for `name` (the rest of the configure is the caller's)."""
    return list(NATIVE_CMAKE if check(name) == "native" else AVX2_CMAKE)


def shim_flags(name: str) -> list[str]:
    """The compiler's ISA flags for the shim in `name` mode."""
    return list(SHIM_FLAGS[check(name)])


def build_dir(name: str, base: str) -> str:
    """A build directory's name for `name`: `base` for native (where the native build always was), `base-avx2`
    otherwise, so a restricted build never mixes with the native one."""
    return base if check(name) == "native" else f"{base}-{name}"
