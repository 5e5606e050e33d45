"""ggml's CPU backend (llama.cpp's own kernels) as moectl's kernel for GGUF experts, through a small C shim.

Legend: T = tokens, K = input width, N = output rows, A = experts stacked in one tensor, U = experts used per token,
H = hidden size, I = expert intermediate size.

Why: a GGUF's experts are blocks llama.cpp computes with its own dot products (x quantized to q8_0 / q8_K per
block, every encoding, AVX2 / AVX-512 / NEON); repacking them onto torch's int4 kernel covered four encodings, and
dequantising per use costs tens of ms a matrix (docs/gguf.md). ggml is built from the same pinned llama.cpp source the
comparison uses (llama-cpp-python's sdist, `LLAMACPP_VERSION`), CPU backend only, shared libraries, native flags for
this machine, no OpenMP (ggml's own threadpool: torch's OpenMP runtime shares the process), into
`$MOECTL_HOME/llamacpp/<version>/ggml/` on first use (cached; minutes, see `BUILD_NOTE`), and the
shim (`ggml_shim.c`, one C file against ggml's headers) beside it. The shim's calls build a tiny ggml graph over
tensors that point at the caller's memory: the memory-mapped file's bytes or a host buffer holding them; nothing is
copied or dequantised, save llama.cpp's own CPU repack: a matrix in a registered stable range (`register_stable`: the
mapped file) that ggml's CPU_REPACK buffer type takes gets an interleaved copy on first use (a stacked tensor's
experts as they are routed to), read by every later graph (docs/gguf.md; `MOECTL_GGML_REPACK=0`: off).

Where ggml cannot be built (no cmake or C compiler, no network for the source, a failed build) or `MOECTL_GGML=0`,
`library()` is None, `why_not()` says why, and callers keep torch's path (moectl/store/gguf/cpu.py).

torch is imported by the functions that take or make its tensors, not by the module: a GGUF's one-graph run
(runtime/ggml_model.py) loads, builds and calls the shim without it (`library`, `handle`, `threads`,
`register_stable`; the build needs cmake and a compiler only), so its load does not pay torch's import.

moectl's ggml carries one patch (kernels/ggml_patch.py): software prefetch in the one-token products, the distance
`MOECTL_GGML_PREFETCH` (`prefetch_bytes`, `set_prefetch`), and with it the repacked experts' row tiles, their routed
rows 4 at a time by gemm, and the experts not repacked (Q8_0, ...) by llamafile's tinyBLAS on their gathered rows,
unless `MOECTL_GGML_EXPERT_GEMM=0` (`expert_gemm`, `set_expert_gemm`). It is built from a patched copy of the vendored
ggml/ (`overlay`), so llama.cpp's own tools (bench/llamacpp.py) stay stock.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..core.paths import bytes_under
from ..core.recipes import format_bytes, moectl_home
from ..errors import MoectlError
from . import ggml_patch
from . import isa as isas

if TYPE_CHECKING:                   # annotations only: the functions that take or make tensors import torch
    import torch

LLAMACPP_VERSION = "0.3.36"                      # llama-cpp-python's sdist: vendors llama.cpp (bench/llamacpp.py too)
SHIM = Path(__file__).with_name("ggml_shim.c")
SHIM_SOURCES = (SHIM, SHIM.with_name("ggml_q6k.c"))     # the shim and what it includes (its build key hashes both)
BUILD_NOTE = "minutes (11 measured on 2 busy cores)"   # docs/gguf.md
SHIM_NOTE = "seconds"                                   # the shim alone: one C file against the built libraries
# CPU backend only: no GPU backends, tools or tests; ggml's threadpool instead of OpenMP (torch's libgomp is in the
# process, and two OpenMP runtimes oversubscribe). The ISA flags come from kernels/isa.py (`cmake_flags`: native,
# -march=native, by default; `MOECTL_GGML_ISA=avx2`: AVX2 and nothing wider, built into ggml-avx2/).
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DGGML_OPENMP=OFF",
               "-DGGML_BACKEND_DL=OFF", "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF", "-DGGML_VULKAN=OFF",
               "-DGGML_LLAMAFILE=ON",
               # configured through llama.cpp's top level (the sdist's ggml/ lacks the files a standalone ggml needs),
               # with none of llama.cpp's own targets
               "-DLLAMA_BUILD_COMMON=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_TOOLS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_CURL=OFF",
               "-DLLAMA_OPENSSL=OFF"]

_why: list[str] = []
_off: list[str] = []              # `unavailable`: why ggml is off for a report that goes on without it


def setting_error() -> str | None:
    """Why this process's ggml setting cannot be used (a bad `MOECTL_GGML_ISA`: kernels/isa.py's message), or None.
    A run that would use ggml stops on it (`library`); a report (`inspect`) goes on without ggml and says this."""
    try:
        isas.current()
    except MoectlError as e:
        return str(e)
    return None


@contextlib.contextmanager
def unavailable(why: str):
    """ggml off in this process while inside, as with `MOECTL_GGML=0`, `why` said where its state is asked
    (`library`, `why_not`, `planned`, `describe`): nothing reads `MOECTL_GGML_ISA`, so a bad one stops nothing."""
    _off.append(why)
    try:
        yield
    finally:
        _off.pop()


def _switched_off() -> str | None:
    """Why ggml is off by setting (`MOECTL_GGML=0`, or inside `unavailable`), or None."""
    if os.environ.get("MOECTL_GGML", "1") == "0":
        return "MOECTL_GGML=0"
    return f"ggml is unavailable: {_off[-1]}" if _off else None


def llamacpp_home() -> Path:
    """Where the pinned llama.cpp source and ggml's build live: `$MOECTL_GGML_ROOT`, else
    `$MOECTL_HOME/llamacpp/<version>/` (the test suite pins it to the user's, so tests with a private
    MOECTL_HOME do not rebuild ggml)."""
    root = os.environ.get("MOECTL_GGML_ROOT")
    return Path(root).expanduser() if root else moectl_home() / "llamacpp" / LLAMACPP_VERSION


def source_dir(root: Path | None = None) -> Path:
    """The vendored llama.cpp tree of the pinned sdist (where bench/llamacpp.py unpacks it too)."""
    return (root or llamacpp_home()) / "src" / f"llama_cpp_python-{LLAMACPP_VERSION}" / "vendor" / "llama.cpp"


def _run(cmd: list, log: Path, env=None) -> None:
    with open(log, "a") as f:
        f.write("$ " + " ".join(map(str, cmd)) + "\n")
        f.flush()
        r = subprocess.run(list(map(str, cmd)), stdout=f, stderr=subprocess.STDOUT, env=env)
    if r.returncode:
        raise RuntimeError(f"{Path(str(cmd[0])).name} failed (exit {r.returncode}); see {log}")


def fetch_source(root: Path, log: Path, echo) -> Path:
    """The pinned sdist, fetched (`pip download`) and unpacked once under `root`; returns the llama.cpp tree."""
    src = source_dir(root)
    if (src / "ggml" / "CMakeLists.txt").exists():
        return src
    sdist = root / f"llama_cpp_python-{LLAMACPP_VERSION}.tar.gz"
    if not sdist.exists():
        echo(f"fetching llama-cpp-python {LLAMACPP_VERSION} (source, for ggml) ...")
        _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
              f"llama-cpp-python=={LLAMACPP_VERSION}", "-d", root], log)
    with tarfile.open(sdist) as tf:
        tf.extractall(root / "src", filter="data")
    return src


def _tools() -> tuple[str, str]:
    cmake = shutil.which("cmake")
    cc = next((p for p in (shutil.which(c) for c in (os.environ.get("CC", ""), "cc", "gcc", "clang") if c) if p), None)
    if cmake is None:
        raise RuntimeError("no cmake to build ggml (Debian/Ubuntu: apt-get install cmake)")
    if cc is None or not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        raise RuntimeError("no C/C++ compiler to build ggml (Debian/Ubuntu: apt-get install g++)")
    return cmake, cc


def _shim_key() -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in SHIM_SOURCES)).hexdigest()[:12]


def ggml_home(root: Path | None = None, isa: str | None = None) -> Path:
    """Where ggml's build for `isa` (default: this process's, `MOECTL_GGML_ISA`) lives: `<root>/ggml/` for native,
    `<root>/ggml-avx2/` for avx2 (root: `llamacpp_home()`), never mixed."""
    return (root or llamacpp_home()) / isas.build_dir(isa or isas.current(), "ggml")


# moectl's entries per patch key in a `ggml_home`, each `<prefix>-<key>` (`keyed`): the marker `build` writes once
# the libraries are made, cmake's build tree, the libraries and the shim, the patched source (`overlay`). The one
# list `build` names them by and `stale_builds` prunes other keys' by.
KEYED = ("BUILT", "build", "lib", "src")


def keyed(home: Path, prefix: str, key: str | None = None) -> Path:
    """`home`'s entry `prefix` (one of `KEYED`) for patch `key` (default: the current `ggml_patch.build_key()`)."""
    if prefix not in KEYED:
        raise ValueError(f"{prefix!r} is not one of {KEYED}")
    return home / f"{prefix}-{key or ggml_patch.build_key()}"


def lib_dir(root: Path | None = None, isa: str | None = None) -> Path:
    """ggml's libraries and the shim for this patch (kernels/ggml_patch.py `KEY`) in `ggml_home(root, isa)`: a
    changed patch builds into a new directory, never reusing (or overwriting under a running process) an old one."""
    return keyed(ggml_home(root, isa), "lib")


def _built_marker(root: Path | None = None, isa: str | None = None) -> Path:
    """The file `build` writes in `ggml_home(root, isa)` once ggml's libraries for this patch are made."""
    return keyed(ggml_home(root, isa), "BUILT")


def libraries_built(root: Path | None = None, isa: str | None = None) -> bool:
    """Whether ggml's libraries for this patch and `isa` are made (minutes); the shim over them is one C file that
    `build` compiles in seconds where it is missing (a changed shim source)."""
    return _built_marker(root, isa).exists()


def shim_path(root: Path | None = None, isa: str | None = None) -> Path:
    """The shim's library in `lib_dir(root, isa)`."""
    return lib_dir(root, isa) / f"libmoectl_ggml-{_shim_key()}.so"


def overlay(src: Path, dst: Path) -> Path:
    """A private llama.cpp tree at `dst` for moectl's ggml build: `src`'s ggml/ copied and patched
    (kernels/ggml_patch.py), every other top-level entry a symlink into `src`, so llama.cpp's tools built from `src`
    (bench/llamacpp.py) stay stock. Made anew each time (a half-made one from a killed build is not trusted)."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    for entry in src.iterdir():
        if entry.name == "ggml":
            shutil.copytree(entry, dst / "ggml", symlinks=True)
        else:
            (dst / entry.name).symlink_to(entry)
    ggml_patch.apply(dst / "ggml")
    return dst


def build(root: Path | None = None, jobs: int | None = None, echo=None, isa: str | None = None) -> Path:
    """ggml's shared libraries and the shim for `isa` (default: `MOECTL_GGML_ISA`, kernels/isa.py), built once into
    `ggml_home(root, isa)`; returns the shim's path. Parallel processes wait on one lock; a finished build is
    reused."""
    echo = echo or (lambda s: print(s, file=sys.stderr, flush=True))
    isa = isas.check(isa or isas.current())
    root = root or llamacpp_home()
    home = ggml_home(root, isa)
    lib = lib_dir(root, isa)
    key = ggml_patch.build_key()                # the patch's identity: its own source copy, build and libraries
    shim = shim_path(root, isa)
    if shim.exists():
        return shim
    cmake, cc = _tools()
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if shim.exists():
            return shim
        log = home / "build.log"
        if not libraries_built(root, isa):
            t0 = time.monotonic()
            stock = fetch_source(root, log, echo)
            echo(f"building ggml's CPU backend ({isa}; llama.cpp from llama-cpp-python {LLAMACPP_VERSION}, moectl's "
                 f"prefetch patch {key}) into {home}: first use only, {BUILD_NOTE}; log: {log}")
            src = overlay(stock, keyed(home, "src", key))   # an anchor not found: RuntimeError, said by why_not()
            bld = keyed(home, "build", key)
            _run([cmake, "-S", src, "-B", bld, *CMAKE_FLAGS, *isas.cmake_flags(isa)], log)
            _run([cmake, "--build", bld, "-j", jobs or max(1, min(os.cpu_count() or 1, 8)), "--target", "ggml-cpu"],
                 log)
            lib.mkdir(exist_ok=True)
            for so in (bld / "bin").glob("libggml*.so*"):
                shutil.copy2(so, lib / so.name, follow_symlinks=True)
            inc = home / "include"
            shutil.rmtree(inc, ignore_errors=True)
            shutil.copytree(stock / "ggml" / "include", inc)
            _built_marker(root, isa).write_text(f"{LLAMACPP_VERSION}\n{time.monotonic() - t0:.0f} s\n{isa}\n{key}\n")
        tmp = shim.with_suffix(".tmp")
        _run([cc, "-O2", *isas.shim_flags(isa), "-shared", "-fPIC", "-std=c11", f"-I{home / 'include'}", SHIM,
              f"-L{lib}", "-lggml-cpu", "-lggml-base", "-lm", f"-Wl,-rpath,{lib}", "-o", tmp], log)
        os.replace(tmp, shim)
        if os.environ.get("MOECTL_GGML_PRUNE", "1") != "0":      # under the lock: no build of this ISA is half-way
            remove_stale(home, key, shim, echo)
    return shim


STALE_KEYED = re.compile(rf"({'|'.join(KEYED)})-(p[0-9a-f]+)")  # a patch key's entries (`keyed`)
LEGACY = ("BUILT", "build", "lib")                  # the unpatched layout before ggml_patch (lib/ held the shim)
STALE_SHIM = re.compile(r"libmoectl_ggml-[0-9a-f]+\.(so|tmp)")  # an earlier shim source's (or a killed build's)


def stale_builds(home: Path, key: str, shim: Path) -> list[Path]:
    """What in `home` (one ISA's `ggml_home`) is moectl's own ggml build for a patch key other than `key` (the
    current `ggml_patch.build_key()`) or the legacy unpatched layout, and the shims of other shim sources beside
    `shim` (the current one): entries named as `build()` names them, nothing else. `home` holds moectl's ggml alone
    (llama.cpp's tools build into `bin*/`, `build*/` and `BUILT*` of the root above it, bench/llamacpp.py; the other
    ISA's build is its own `home`); the current key's entries, `include/`, `lock` and `build.log` are kept, and a
    name this code never made is left."""
    out = [e for e in home.iterdir()
           if e.name in LEGACY or ((m := STALE_KEYED.fullmatch(e.name)) and m.group(2) != key)]
    out += [e for e in shim.parent.iterdir() if STALE_SHIM.fullmatch(e.name) and e.name != shim.name]
    return sorted(out)


def remove_stale(home: Path, key: str, shim: Path, echo) -> int:
    """Remove `stale_builds(home, key, shim)` after a build of the current key (the caller holds the build's lock),
    and say in one line what went and the bytes freed (returned). Why: each patch key and shim source was a new build
    beside the old ones (hundreds of MB each, never reused once the source moved on). A process still running an
    old build keeps it: on Linux a deleted library a process has mapped stays readable to it until it exits (the
    directory entry goes, the file's pages stay), so only a later start of that old moectl would rebuild. What
    cannot be removed (permissions) is left and not counted. `MOECTL_GGML_PRUNE=0` keeps everything (checkouts of
    moectl with different patches sharing one folder would otherwise rebuild in turn; the test suite sets it)."""
    stale = stale_builds(home, key, shim)
    freed = 0
    for entry in stale:
        size = bytes_under(entry)
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)        # rmtree removes a symlink inside, never its target
        else:
            try:
                entry.unlink()
            except OSError:
                pass
        freed += size - (bytes_under(entry) if os.path.lexists(entry) else 0)
    if stale:
        echo(f"removed ggml's earlier builds in {home} ({', '.join(e.name for e in stale)}): "
             f"{format_bytes(freed)} freed")
    return freed


def library() -> ctypes.CDLL | None:
    """The shim over ggml's CPU backend (built on first use), or None (then `why_not()` says why). `MOECTL_GGML=0`
    is read on every call (a run or a test may switch it); `MOECTL_GGML_ISA` too: a bad value is a MoectlError, and
    one process holds one build (its libraries share their names), so another ISA than the loaded one is too.
    Inside `unavailable` it is None and reads no setting."""
    if off := _switched_off():
        _why.append(off)
        return None
    want = isas.current()
    if _loaded_isa and _loaded_isa[0] != want:
        raise MoectlError(f"this process loaded ggml's {_loaded_isa[0]} build; {isas.ENV}={want} takes a new process")
    return _load()


_loaded_isa: list[str] = []       # the ISA of the build `_load` loaded


@functools.lru_cache(maxsize=1)
def _load() -> ctypes.CDLL | None:
    isa = isas.current()
    try:
        lib = ctypes.CDLL(str(build(isa=isa)))
    except (OSError, RuntimeError) as e:
        _why.append(f"ggml could not be built: {e}")
        return None
    _loaded_isa[:] = [isa]
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.mg_new.argtypes, lib.mg_new.restype = [i32, i32], ptr
    lib.mg_free.argtypes, lib.mg_free.restype = [ptr], None
    lib.mg_mul_mat.argtypes, lib.mg_mul_mat.restype = [ptr, i32, ptr, i64, i64, ptr, i64, ptr], None
    lib.mg_mul_mat2.argtypes = [ptr, i32, ptr, i64, i32, ptr, i64, i64, ptr, i64, ptr, ptr]
    lib.mg_mul_mat2.restype = None
    lib.mg_mul_mat_id.argtypes = [ptr, i32, ptr, i64, i64, i64, ptr, i64, ptr, i64, i64, ptr]
    lib.mg_mul_mat_id.restype = None
    lib.mg_moe.argtypes = [ptr, i32, ptr, i32, ptr, i32, ptr, i64, i64, i64, ptr, ptr, ptr, i64, i64, ptr]
    lib.mg_moe.restype = None
    lib.mg_experts.argtypes = [ptr, i64, ptr, ptr, i64, i64, ptr, i64, ptr, ptr]
    lib.mg_experts.restype = None
    lib.mg_quantize.argtypes, lib.mg_quantize.restype = [i32, ptr, ptr, i64, i64, ptr], ctypes.c_size_t
    lib.mg_requires_imatrix.argtypes, lib.mg_requires_imatrix.restype = [i32], i32
    lib.mg_row_size.argtypes, lib.mg_row_size.restype = [i32, i64], ctypes.c_size_t
    lib.mg_features.restype = i32
    # moectl's ggml patch (kernels/ggml_patch.py), in libggml-cpu: found through the shim's handle (its dependency)
    lib.ggml_moectl_set_prefetch_bytes.argtypes, lib.ggml_moectl_set_prefetch_bytes.restype = [i32], None
    lib.ggml_moectl_set_expert_gemm.argtypes, lib.ggml_moectl_set_expert_gemm.restype = [i32], None
    lib.ggml_moectl_set_rows_max.argtypes, lib.ggml_moectl_set_rows_max.restype = [i32], None
    lib.ggml_moectl_set_rows_min.argtypes, lib.ggml_moectl_set_rows_min.restype = [i32], None
    lib.ggml_moectl_rows_kernel.argtypes, lib.ggml_moectl_rows_kernel.restype = [i32], ptr
    lib.mg_vec_dot_type.argtypes, lib.mg_vec_dot_type.restype = [i32], i32
    lib.mg_repacks.argtypes, lib.mg_repacks.restype = [i32, i64, i64], i32
    lib.mg_repack_register.argtypes, lib.mg_repack_register.restype = [ptr, i64, i32], None
    lib.mg_repack_unregister.argtypes, lib.mg_repack_unregister.restype = [ptr, i64], None
    lib.mg_repack_stats.argtypes, lib.mg_repack_stats.restype = [ptr], None
    lib.mg_repack_finish.argtypes, lib.mg_repack_finish.restype = [i64], i64
    lib.mg_repack_progress.argtypes, lib.mg_repack_progress.restype = [ptr], None
    lib.mg_q6k_kernel.argtypes, lib.mg_q6k_kernel.restype = [ptr], ctypes.c_char_p
    lib.mg_q6k_products.argtypes, lib.mg_q6k_products.restype = [], i64
    lib.mg_moe_oai.argtypes = [ptr, i32, ptr, i32, ptr, i32, ptr, ptr, ptr, ptr, ctypes.c_float, ctypes.c_float, i64,
                               i64, i64, ptr, ptr, ptr, i64, i64, ptr]
    lib.mg_moe_oai.restype = None
    lib.mg_moe_strided.argtypes = [ptr, i32, ptr, i32, ptr, i32, ptr, i64, i64, i64, i64, ptr, ptr, ptr, i64, i64, ptr]
    lib.mg_moe_strided.restype = None
    lib.mg_read_bandwidth.argtypes, lib.mg_read_bandwidth.restype = [i64, i32, i32, ptr], i32
    return lib


FEATURES = ("avx2", "avx512", "avx512_vnni", "avx_vnni", "fma", "f16c")     # the shim's mg_features bits, in order


def features(lib: ctypes.CDLL | None = None) -> list[str]:
    """The CPU features the loaded ggml was built for and runs with (ggml's own `ggml_cpu_has_*`, through the shim's
    `mg_features`): read from the library, not assumed from MOECTL_GGML_ISA."""
    bits = (lib or require()).mg_features()
    return [n for i, n in enumerate(FEATURES) if bits >> i & 1]


def built_for(feats: list[str]) -> str:
    """The widest x86 ISA in `features()`' list: "AVX-512", "AVX2" or "older than AVX2"."""
    return "AVX-512" if "avx512" in feats else "AVX2" if "avx2" in feats else "older than AVX2"


def describe() -> dict:
    """What ggml this process would run, without building anything (`inspect`): {"isa": the MOECTL_GGML_ISA setting,
    "built": whether its build is here, "features" and "built_for": read from the loaded library (`features()`,
    `built_for()`; None where it is not built or switched off), "why_not": None, or why not, "prefetch_bytes": the
    patch's prefetch distance a handle gets (`prefetch_bytes()`, 0: off), "expert_gemm": whether its experts' row
    tiles run gemm (`expert_gemm()`), "expert_rows": {"least", "most": the routed rows an expert for moectl's
    expert-rows kernels (`expert_rows_min()`, `expert_rows()`), "on": whether a handle runs them (the prefetch and
    the experts' gemm on, and least <= most: the patch's own condition), "types": the encodings the loaded build has
    one for (None where it is not loaded)}}."""
    off = _switched_off()
    bad = off and setting_error()           # switched off: a bad ISA setting is reported as given, not raised
    setting = os.environ[isas.ENV] if bad else isas.current()
    out = {"isa": setting, "built": not bad and built(), "features": None, "built_for": None, "why_not": None,
           "prefetch_bytes": prefetch_bytes(), "expert_gemm": expert_gemm(),
           "expert_rows": {"least": expert_rows_min(), "most": expert_rows(), "on": False, "types": None}}
    rows = out["expert_rows"]
    rows["on"] = out["prefetch_bytes"] > 0 and out["expert_gemm"] and rows["least"] <= rows["most"]
    if off:
        out["why_not"] = off
    elif not (out["built"] or _load.cache_info().currsize):       # what is missing, and what first use costs
        out["why_not"] = (f"its {setting} shim is not compiled yet (ggml's libraries are built; first use compiles "
                          f"the shim: {SHIM_NOTE})" if libraries_built() else
                          f"its {setting} build is not made yet (first use builds it: {BUILD_NOTE})")
    elif library() is None:
        out["why_not"] = _why[-1]
    else:
        out["features"] = features()
        out["built_for"] = built_for(out["features"])
        out["expert_rows"]["types"] = [name for name, code in ROWS_ENCODINGS.items() if rows_kernel(code)]
    return out


def built() -> bool:
    """Whether the shim of this source is built (nothing is started)."""
    return shim_path().exists()


def planned() -> bool:
    """Whether `library()` is expected to load: not switched off, and built, or cmake and a compiler here to build
    it (for sizes said before a run: `inspect`, the host-memory check)."""
    if _switched_off():
        return False
    if _load.cache_info().currsize:
        return _load() is not None
    try:
        return built() or bool(_tools())
    except RuntimeError:
        return False


def why_not() -> str | None:
    """Why `library()` is None (None when it loaded)."""
    return None if library() is not None else _why[-1]


def available() -> bool:
    return library() is not None


def require() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise MoectlError(f"ggml's CPU backend is not available: {why_not()}")
    return lib


class _Handle(threading.local):
    """One shim handle (ggml threadpool, arena, work buffer) per calling thread, thread count and
    `MOECTL_GGML_OWN_Q6K` setting (the shim reads it once, at the handle's creation: a run that switches it, an A/B
    or a test, gets a handle of each, each with its own kept decode graph)."""

    def __init__(self):
        self.by_threads: dict[tuple[int, str], int] = {}


_handles = _Handle()


_THREADS: list[int] = []          # `set_threads`: the run's --threads, once a load has set it


def set_threads(n: int) -> None:
    """ggml's threads from now on (a load sets its --threads here: torch's own count may then be 1, see
    runtime/load.py)."""
    _THREADS[:] = [max(1, int(n))]


def threads() -> int:
    """ggml's threads: the run's --threads (`set_threads`), else torch's intra-op count where torch is loaded (it
    is not imported for this), else the CPU count."""
    if _THREADS:
        return _THREADS[0]
    torch = sys.modules.get("torch")
    return max(1, torch.get_num_threads() if torch is not None else os.cpu_count() or 1)


PREFETCH_ENV = "MOECTL_GGML_PREFETCH"
PREFETCH_DEFAULT = 4096         # bytes; unset MOECTL_GGML_PREFETCH: the measured best (docs/gguf.md, "Prefetch")


def prefetch_bytes() -> int:
    """The prefetch distance of ggml's one-token products (kernels/ggml_patch.py), bytes: `MOECTL_GGML_PREFETCH`
    (0: off, stock ggml), unset: `PREFETCH_DEFAULT`. A MoectlError for a value that is not a whole number >= 0."""
    raw = os.environ.get(PREFETCH_ENV, "").strip()
    if not raw:
        return PREFETCH_DEFAULT
    if not raw.isdigit():
        raise MoectlError(f"{PREFETCH_ENV}={raw!r}: give a distance in bytes (a whole number, 0: off)")
    return int(raw)


def set_prefetch(nbytes: int) -> None:
    """Set the prefetch distance (bytes, 0: off) of every later product in this process: one global in moectl's
    patched ggml, read by each product's loop, so an A/B alternates in one process without a rebuild."""
    require().ggml_moectl_set_prefetch_bytes(int(nbytes))


EXPERT_GEMM_ENV = "MOECTL_GGML_EXPERT_GEMM"


def expert_gemm() -> bool:
    """Whether the repacked experts' row tiles (on with the prefetch, kernels/ggml_patch.py) run each expert's routed
    rows 4 at a time by gemm (the rest by gemv), and the experts not repacked whose product takes q8_0 activations
    (Q8_0; Q4_0, Q5_0, IQ4_NL not repacked) run llamafile's tinyBLAS on their gathered rows: `MOECTL_GGML_EXPERT_GEMM`
    unset or 1, yes; 0, every row by gemv / vec_dot (the A/B). A MoectlError for another value."""
    raw = os.environ.get(EXPERT_GEMM_ENV, "").strip()
    if raw not in ("", "0", "1"):
        raise MoectlError(f"{EXPERT_GEMM_ENV}={raw!r}: give 1 (the experts' routed rows 4 at a time by gemm) or 0")
    return raw != "0"


def set_expert_gemm(on: bool) -> None:
    """Switch the experts' gemm (`expert_gemm`) for every later product in this process: one global in moectl's
    patched ggml, like `set_prefetch`'s distance, so an A/B alternates in one process. Safe while a graph computes on
    another thread: each op reads it once (thread 0, ahead of the op's barrier), so a product is all on or all off."""
    require().ggml_moectl_set_expert_gemm(int(bool(on)))


EXPERT_ROWS_ENV = "MOECTL_GGML_EXPERT_ROWS"


def expert_rows() -> int:
    """The most routed rows an expert for which its product runs moectl's expert-rows kernel where its type has one
    (kernels/ggml_rows: Q5_K, Q6_K, Q3_K, IQ4_XS, IQ3_XXS, IQ2_XXS on AVX-512; from `expert_rows_min` rows, with the
    experts' gemm on: kernels/ggml_patch.py `_ROWS_EXPERT`): `MOECTL_GGML_EXPERT_ROWS` unset, every expert
    (`ggml_patch.ROWS_MAX_DEFAULT`); N, those with at most N (8: only below ggml's tiled kernel's threshold); 0, none
    (stock's vec_dot and tiled kernel). A MoectlError for a value that is not a whole number >= 0."""
    raw = os.environ.get(EXPERT_ROWS_ENV, "").strip()
    if not raw:
        return ggml_patch.ROWS_MAX_DEFAULT
    if not raw.isdigit():
        raise MoectlError(f"{EXPERT_ROWS_ENV}={raw!r}: give the most routed rows an expert for moectl's rows kernels "
                          "(a whole number, 0: off)")
    return int(raw)


EXPERT_ROWS_MIN_ENV = "MOECTL_GGML_EXPERT_ROWS_MIN"


def expert_rows_min() -> int:
    """The least routed rows an expert for which moectl's expert-rows kernels run (`expert_rows`):
    `MOECTL_GGML_EXPERT_ROWS_MIN` unset, `ggml_patch.ROWS_MIN_DEFAULT` (1: a decode's experts, one row each, too);
    2, a decode's by ggml's vec_dot. A MoectlError for a value that is not a whole number >= 1."""
    raw = os.environ.get(EXPERT_ROWS_MIN_ENV, "").strip()
    if not raw:
        return ggml_patch.ROWS_MIN_DEFAULT
    if not raw.isdigit() or int(raw) < 1:
        raise MoectlError(f"{EXPERT_ROWS_MIN_ENV}={raw!r}: give the least routed rows an expert for moectl's rows "
                          "kernels (a whole number >= 1)")
    return int(raw)


def set_expert_rows_min(rows_min: int) -> None:
    """Set `expert_rows_min` for every later product in this process (read once an op, as `set_expert_rows`)."""
    require().ggml_moectl_set_rows_min(int(rows_min))


def set_expert_rows(rows_max: int) -> None:
    """Set `expert_rows`'s threshold for every later product in this process (a global in moectl's patched ggml,
    read once an op by thread 0, like `set_expert_gemm`)."""
    require().ggml_moectl_set_rows_max(int(rows_max))


# the encodings moectl's expert-rows kernels are written for (kernels/ggml_rows), ggml's type codes
ROWS_ENCODINGS = {"Q5_K": 13, "Q6_K": 14, "Q3_K": 11, "IQ4_XS": 23, "IQ3_XXS": 18, "IQ2_XXS": 16}


def rows_kernel(enc) -> bool:
    """Whether this build has an expert-rows kernel for encoding `enc` (a GGMLQuantizationType or its int)."""
    return bool(require().ggml_moectl_rows_kernel(int(enc)))


def handle(n_threads: int | None = None) -> int:
    n = n_threads or threads()
    key = (n, own_q6k_setting())
    h = _handles.by_threads.get(key)
    if h is None:
        poll = int(os.environ.get("MOECTL_GGML_POLL", "0"))     # 0: ggml's workers sleep between calls
        set_prefetch(prefetch_bytes())                          # MOECTL_GGML_PREFETCH, read as a handle is made
        set_expert_gemm(expert_gemm())                          # MOECTL_GGML_EXPERT_GEMM, the same
        set_expert_rows(expert_rows())                          # MOECTL_GGML_EXPERT_ROWS, the same
        set_expert_rows_min(expert_rows_min())                  # MOECTL_GGML_EXPERT_ROWS_MIN, the same
        h = _handles.by_threads[key] = require().mg_new(n, poll)
    return h


def own_q6k_setting() -> str:
    """`MOECTL_GGML_OWN_Q6K`: unset or 1, a one-token product over a Q6_K matrix (a decode step's lm_head and dense
    Q6_K matrices) runs moectl's own matvec (ggml_q6k.c: AVX-512 where the CPU has it, else AVX2) instead of ggml's
    mul_mat; 0, ggml's (the A/B, and an escape hatch); avx2, the AVX2 kernel even on an AVX-512 host (tests)."""
    return os.environ.get("MOECTL_GGML_OWN_Q6K", "1")


def own_q6k_kernel(n_threads: int | None = None) -> str:
    """The kernel the current handle's one-token Q6_K products run: "avx512vnni", "avx512bw", "avx2", or "ggml"
    (switched off, or no kernel for this CPU)."""
    return require().mg_q6k_kernel(handle(n_threads)).decode()


def own_q6k_products() -> int:
    """Products the own Q6_K matvec has computed in this process, every handle's (tests: a graph ran it)."""
    return int(require().mg_q6k_products())


def _f32(x: torch.Tensor) -> torch.Tensor:
    import torch

    return x.detach().to(torch.float32).contiguous()


def _ptr(a) -> int:
    """The address of a torch tensor's or numpy array's data, or `a` itself (an address)."""
    if isinstance(a, np.ndarray):
        return a.ctypes.data
    return a.data_ptr() if hasattr(a, "data_ptr") else int(a)


def mul_mat(encoding: int, w, shape: tuple[int, int], x: torch.Tensor, n_threads: int | None = None) -> torch.Tensor:
    """y [T, N] = x [T, K] @ W^T, W [N, K] (`shape`) in GGUF `encoding` at `w` (a tensor, an array or an address);
    fp32, x quantized as ggml quantizes it (its vec_dot type)."""
    import torch

    N, K = shape
    x = _f32(x).reshape(-1, K)
    y = torch.empty(x.shape[0], N, dtype=torch.float32)
    require().mg_mul_mat(handle(n_threads), int(encoding), _ptr(w), N, K, x.data_ptr(), x.shape[0], y.data_ptr())
    return y


def mul_mat_id(encoding: int, w, shape: tuple[int, int, int], x: torch.Tensor, ids: torch.Tensor,
               n_threads: int | None = None) -> torch.Tensor:
    """ggml_mul_mat_id: y [T, U, N], y[t, u] = W[ids[t, u]] @ x[t] (x [T, K], or [T, U, K]: one row per used
    expert); W = A matrices [N, K] (`shape` = (A, N, K)) stacked at `w`."""
    import torch

    A, N, K = shape
    ids = ids.to(torch.int32).contiguous()
    T, U = ids.shape
    x = _f32(x)
    XB = 1 if x.dim() == 2 else x.shape[1]
    y = torch.empty(T, U, N, dtype=torch.float32)
    require().mg_mul_mat_id(handle(n_threads), int(encoding), _ptr(w), A, N, K, x.data_ptr(), XB, ids.data_ptr(), U,
                            T, y.data_ptr())
    return y


def moe(encodings: tuple[int, int, int], gate, up, down, A: int, H: int, I: int, x: torch.Tensor, ids: torch.Tensor,
        weights: torch.Tensor, n_threads: int | None = None, biases: tuple | None = None,
        swiglu_oai: tuple[float, float] | None = None, expert_stride: int = 0) -> torch.Tensor:
    """One MoE layer as llama.cpp computes it: y [T, H] = sum_u weights[t, u] down_e(silu(gate_e x) * up_e x) with
    e = ids[t, u]; gate/up [A, I, H] and down [A, H, I] stacked (a GGUF's ffn_*_exps) in `encodings`.
    GPT-OSS's (openai-moe's build_moe_ffn) with `biases` = (bg [A, I], bu [A, I], bd [A, H]) F32 where they lie (a
    GGUF's ffn_*_exps.bias) and `swiglu_oai` = (alpha, limit): y [T, H] = sum_u weights[t, u]
    (down_e(swiglu_oai(gate_e x + bg_e, up_e x + bu_e)) + bd_e), swiglu_oai(g, u) = g' sigmoid(alpha g') (u' + 1),
    g' = min(g, limit), u' = clamp(u, -limit, limit).
    `expert_stride`: bytes from one expert's matrix to the next's when the experts are not back to back (moectl's
    ggml copies: one expert a row of a [A, bytes per expert] buffer, gate, up and down at `gate`, `up`, `down` in
    row 0); 0: stacked as a GGUF's."""
    import torch

    ids = ids.to(torch.int32).contiguous()
    T, U = ids.shape
    x, wts = _f32(x), _f32(weights)
    y = torch.empty(T, H, dtype=torch.float32)
    tg, tu, td = map(int, encodings)
    if swiglu_oai is None and expert_stride:
        require().mg_moe_strided(handle(n_threads), tg, _ptr(gate), tu, _ptr(up), td, _ptr(down), expert_stride, A,
                                 H, I, x.data_ptr(), ids.data_ptr(), wts.data_ptr(), U, T, y.data_ptr())
    elif swiglu_oai is None:
        require().mg_moe(handle(n_threads), tg, _ptr(gate), tu, _ptr(up), td, _ptr(down), A, H, I, x.data_ptr(),
                         ids.data_ptr(), wts.data_ptr(), U, T, y.data_ptr())
    else:
        assert not expert_stride, "GPT-OSS's experts are a GGUF's stacked tensors"
        bg, bu, bd = map(_ptr, biases)
        require().mg_moe_oai(handle(n_threads), tg, _ptr(gate), tu, _ptr(up), td, _ptr(down), bg, bu, bd,
                             *swiglu_oai, A, H, I, x.data_ptr(), ids.data_ptr(), wts.data_ptr(), U, T, y.data_ptr())
    return y


def experts(mats: list[tuple], H: int, I: int, x: torch.Tensor, coef: torch.Tensor,
            n_threads: int | None = None) -> torch.Tensor:
    """y [T, H] = sum_e coef[e, t] down_e(silu(gate_e x) * up_e x) for n experts given as
    [((enc, addr) gate, (enc, addr) up, (enc, addr) down)], all on the same x [T, H]: one graph, one call."""
    import torch

    n = len(mats)
    types = (ctypes.c_int32 * (3 * n))(*[int(m[j][0]) for m in mats for j in range(3)])
    ptrs = (ctypes.c_void_p * (3 * n))(*[_ptr(m[j][1]) for m in mats for j in range(3)])
    x, coef = _f32(x), _f32(coef).reshape(n, -1)
    y = torch.empty(x.shape[0], H, dtype=torch.float32)
    require().mg_experts(handle(n_threads), n, types, ptrs, H, I, x.data_ptr(), x.shape[0], coef.data_ptr(),
                         y.data_ptr())
    return y


def vec_dot_type(encoding: int) -> int:
    """The encoding ggml quantizes x to against a weight in `encoding` (Q8_0, Q8_1, Q8_K; F16/BF16/F32)."""
    return int(require().mg_vec_dot_type(int(encoding)))


QUANTIZE_ROWS = 4096      # rows converted to fp32 at a time: a 151936 x 2048 bf16 lm_head is not copied whole (1.2 GB)


def quantize(encoding: int, w: torch.Tensor, imatrix: torch.Tensor | None = None,
             rows_at_a_time: int = QUANTIZE_ROWS) -> np.ndarray:
    """ggml's own quantizer: W [N, K] (any float dtype) -> the encoding's bytes (uint8 [N, row bytes]). Types that
    need an importance matrix (IQ2_XXS, IQ2_XS, IQ1_S) get `imatrix` [K], or ones. ggml quantizes each row on its
    own, so W goes through fp32 `rows_at_a_time` rows at a time (the same bytes as whole, a bounded transient)."""
    import torch

    lib = require()
    w = w.detach()
    N, K = w.shape
    row = lib.mg_row_size(int(encoding), K)
    out = np.zeros((N, row), dtype=np.uint8)
    if imatrix is None and lib.mg_requires_imatrix(int(encoding)):
        imatrix = torch.ones(K)
    im = _f32(imatrix) if imatrix is not None else None
    for r0 in range(0, N, max(1, int(rows_at_a_time))):
        chunk = _f32(w[r0:r0 + rows_at_a_time])
        lib.mg_quantize(int(encoding), chunk.data_ptr(), out[r0:].ctypes.data, chunk.shape[0], K,
                        im.data_ptr() if im is not None else None)
    return out


class GgmlLinear:
    """x [T, K] -> x @ W^T for one or two GGUF matrices where they lie (gate and up of an expert: one call, their
    outputs side by side, as `gate_up` is stacked). `mats`: [(encoding, address, (N, K))]; `keep`: what owns the
    memory (an mmap's array, a host buffer), held as long as this is."""

    def __init__(self, mats: list[tuple[int, int, tuple[int, int]]], keep=None, stacked=None):
        self.mats, self.keep = mats, keep
        # (expert, [(address of expert 0, experts[, stride]) per matrix]) where the matrices are rows of stacked
        # tensors (a GGUF's ffn_*_exps; with a stride in bytes, one expert a row of a buffer: moectl's ggml copies):
        # a decode step's layer is then one mul_mat_id call (`experts_decode`)
        self.stacked = stacked
        self.K = mats[0][2][1]
        self.N = sum(m[2][0] for m in mats)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        import torch

        lead, dtype = x.shape[:-1], x.dtype
        xf = _f32(x).reshape(-1, self.K)
        T = xf.shape[0]
        lib, h = require(), handle()
        if len(self.mats) == 1:
            (enc, addr, (N, K)), = self.mats
            y = torch.empty(T, N, dtype=torch.float32)
            lib.mg_mul_mat(h, int(enc), addr, N, K, xf.data_ptr(), T, y.data_ptr())
        else:
            (e1, a1, (N1, _)), (e2, a2, (N2, _)) = self.mats
            y1, y2 = torch.empty(T, N1), torch.empty(T, N2)
            lib.mg_mul_mat2(h, int(e1), a1, N1, int(e2), a2, N2, self.K, xf.data_ptr(), T, y1.data_ptr(),
                            y2.data_ptr())
            y = torch.cat([y1, y2], dim=1)
        return y.to(dtype).reshape(*lead, self.N)


def expert_weights(tensors: dict[str, tuple[int, int, tuple[int, int]]], keep=None,
                   stacked: tuple[int, dict[str, tuple[int, int]]] | None = None) -> dict[str, GgmlLinear]:
    """An expert's {gate_up, down} callables from {gate, up, down: (encoding, address, (rows, cols))};
    `stacked`: (expert, {gate, up, down: (address of expert 0, experts)}) when they are rows of stacked tensors."""
    e, base = stacked if stacked is not None else (None, None)
    return {"gate_up": GgmlLinear([tensors["gate"], tensors["up"]], keep,
                                  (e, [base["gate"], base["up"]]) if base else None),
            "down": GgmlLinear([tensors["down"]], keep, (e, [base["down"]]) if base else None)}


def experts_decode(x: torch.Tensor, pairs: list[tuple[GgmlLinear, GgmlLinear]], coefs: list[float]) -> torch.Tensor:
    """A decode step's experts of one layer in one call: y [T, H] = sum_e coefs[e] down_e(silu(gate_e x) * up_e x),
    `pairs` = [(gate_up, down)] as `GgmlLinear`s (gate and up its two matrices); in x's dtype."""
    import torch

    H, I = pairs[0][1].N, pairs[0][1].K
    g0, d0 = pairs[0]
    if g0.stacked is not None and all(g.stacked is not None and d.stacked is not None and g.stacked[1] == g0.stacked[1]
                                      and d.stacked[1] == d0.stacked[1] for g, d in pairs):
        # rows of the same stacked tensors: llama.cpp's own mul_mat_id graph (x quantized once per matrix kind)
        (bg, A, bu, bd), stride = _stacked_bases(g0, d0)
        encs = (g0.mats[0][0], g0.mats[1][0], d0.mats[0][0])
        xs = x.reshape(-1, H)
        ids = torch.tensor([[g.stacked[0] for g, _ in pairs]], dtype=torch.int32).expand(xs.shape[0], -1)
        wts = torch.tensor([coefs], dtype=torch.float32).expand(xs.shape[0], -1)
        return moe(encs, bg, bu, bd, A, H, I, xs, ids, wts, expert_stride=stride).to(x.dtype)
    mats = [(g.mats[0][:2], g.mats[1][:2], d.mats[0][:2]) for g, d in pairs]
    coef = torch.tensor(coefs, dtype=torch.float32).repeat_interleave(x.reshape(-1, H).shape[0])
    return experts(mats, H, I, x.reshape(-1, H), coef).to(x.dtype)


def _stacked_bases(g0: GgmlLinear, d0: GgmlLinear) -> tuple[tuple[int, int, int, int], int]:
    """((gate's, experts, up's, down's address of expert 0), bytes between experts: 0 where back to back) of
    stacked (gate_up, down) whose entries are (address, experts[, stride])."""
    (g, A, *sg), (u, _, *su) = g0.stacked[1]
    (d, _, *sd), = d0.stacked[1]
    strides = {(sg or [0])[0], (su or [0])[0], (sd or [0])[0]}
    assert len(strides) == 1, "one stride for the three matrices"
    return (g, A, u, d), strides.pop()


# --- llama.cpp's CPU repack of the mapped file's matrices ---------------------------------------------------------

def repack_enabled() -> bool:
    """Whether the shim gives registered weights ggml's CPU_REPACK copies. `MOECTL_GGML_REPACK`: unset, 1 or all,
    every encoding ggml repacks on this CPU, as llama.cpp (docs/gguf.md); `0`: none; or a comma list of ggml's type
    names (q4_0,iq4_nl,mxfp4,q4_K). Read by the shim at every graph, so a run or a test may switch it."""
    return os.environ.get("MOECTL_GGML_REPACK", "1") != "0"


@functools.lru_cache(maxsize=4096)
def _repacks(encoding: int, K: int, N: int, setting: str) -> bool:
    lib = library()
    return bool(lib is not None and lib.mg_repacks(int(encoding), K, N))


def repacks(encoding: int, shape: tuple[int, int]) -> bool:
    """Whether ggml's CPU repack takes a matrix [N, K] (`shape`) in GGUF `encoding` on this CPU (AVX2: Q4_0, Q4_K,
    IQ4_NL, MXFP4 with N a multiple of 8) and `MOECTL_GGML_REPACK` asks for it (`repack_enabled`); False where ggml
    is not loaded or built (nothing is built here: `inspect` asks). Its copy takes the matrix's own bytes (`repacked_nbytes`)."""
    if not repack_enabled() or not (_load.cache_info().currsize or built()):
        return False
    N, K = shape
    return _repacks(int(encoding), int(K), int(N), os.environ.get("MOECTL_GGML_REPACK", "1"))


def repack_stats() -> dict[str, int]:
    """The shim's repack counters: copies held, matrices repacked (one expert of a stack counts one), bytes its
    copies take, graphs that read a copy."""
    out = (ctypes.c_int64 * 4)()
    require().mg_repack_stats(out)
    return dict(zip(("copies", "repacked", "bytes", "graphs"), out))


def finish_repack(max_bytes: int = 0) -> int:
    """Repack now the experts of the copies held that no token has routed to yet (the shim repacks an expert on
    first use; llama.cpp's loader repacks all at load): every one (`max_bytes` 0: a benchmark's steady state), or
    a piece of at least one matrix and about `max_bytes` of copies written (an idle server's, `serve/worker.py`).
    Returns the matrices repacked."""
    return int(require().mg_repack_finish(int(max_bytes)))


def repack_progress() -> tuple[int, int] | None:
    """(matrices repacked, matrices in the copies held: an expert of a stack counts one), or None where the shim is
    not loaded (nothing is built or loaded here: a server's state asks)."""
    if not _load.cache_info().currsize or library() is None:
        return None
    out = (ctypes.c_int64 * 2)()
    library().mg_repack_progress(out)
    return int(out[0]), int(out[1])


_registered: dict[int, object] = {}        # id of a registered root array -> its weakref.finalize


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def register_stable(a: np.ndarray) -> None:
    """Let the shim repack matrices that lie in `a`'s whole buffer (its root array: a memory-mapped GGUF's
    `np.memmap`), whose addresses hold the same bytes for as long as that array lives: the range is dropped, with the
    copies made of it, when the array goes (a test opens and closes many files; a new map may reuse the addresses).
    Never for a transient host buffer. A file's copy-on-write map (`np.memmap` mode "c", never written: moectl's
    GGUF maps; or "r") lets the shim drop a repacked matrix's pages from the process (the page cache keeps them; the copy
    stands in for them, not beside them). Does nothing where ggml is not loaded."""
    lib = library()
    root = _root(a)
    if lib is None or id(root) in _registered:
        return
    lo, n = root.ctypes.data, root.nbytes
    lib.mg_repack_register(lo, n, int(isinstance(root, np.memmap) and root.mode in ("c", "r")))

    def drop(lib=lib, lo=lo, n=n, key=id(root)):
        lib.mg_repack_unregister(lo, n)
        _registered.pop(key, None)

    _registered[id(root)] = weakref.finalize(root, drop)


# --- a layer's routed experts over several tokens (prefill); GPT-OSS's experts ------------------------------

class GgmlBiasedLinear(GgmlLinear):
    """A `GgmlLinear` plus a bias per output row (GPT-OSS's experts: `bias` [N] fp32, gate's then up's for the two
    matrices); `bias_stacked`: [(address of expert 0's bias, experts)] per matrix where the biases are rows of the
    file's stacked F32 ffn_*_exps.bias (the fused call points at them there)."""

    def __init__(self, mats, bias: torch.Tensor, keep=None, stacked=None, bias_stacked=None):
        super().__init__(mats, keep, stacked)
        self.bias, self.bias_stacked = bias, bias_stacked

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (super().__call__(x.float()) + self.bias).to(x.dtype)


def oai_expert_weights(tensors: dict, biases: dict[str, torch.Tensor], keep=None, stacked=None,
                       bias_stacked: dict[str, tuple[int, int]] | None = None) -> dict[str, GgmlBiasedLinear]:
    """A GPT-OSS expert's {gate_up, down} callables (x -> [gate x + bg | up x + bu], h -> down h + bd) from
    {gate, up, down: (encoding, address, (rows, cols))} and {gate, up, down: bias [rows] fp32}; `stacked` as
    `expert_weights`'s, `bias_stacked` {gate, up, down: (address of expert 0's bias, experts)}."""
    import torch

    e, base = stacked if stacked is not None else (None, None)
    bs = bias_stacked
    return {"gate_up": GgmlBiasedLinear([tensors["gate"], tensors["up"]], torch.cat([biases["gate"], biases["up"]]),
                                        keep, (e, [base["gate"], base["up"]]) if base else None,
                                        [bs["gate"], bs["up"]] if base and bs else None),
            "down": GgmlBiasedLinear([tensors["down"]], biases["down"], keep, (e, [base["down"]]) if base else None,
                                     [bs["down"]] if base and bs else None)}


def experts_routed(x: torch.Tensor, experts: dict[int, dict], ids: torch.Tensor, weights: torch.Tensor,
                   swiglu_oai: tuple[float, float] | None = None) -> torch.Tensor | None:
    """A layer's routed experts over all its tokens in one ggml graph, as llama.cpp's build_moe_ffn computes a
    prefill: y [T, H] = sum_k weights[t, k] expert_{ids[t, k]}(x[t]), `experts` {e: its {gate_up, down}
    `GgmlLinear`s}, all rows of the same stacked ffn_*_exps (else None: the caller computes them one by one).
    `swiglu_oai`: GPT-OSS's (alpha, limit), its experts `GgmlBiasedLinear`s with stacked biases; else SiLU(gate) * up.
    An entry of `ids` that is not in `experts` (a dropped expert: -1, or one the plan skipped) adds nothing: its
    weight is 0 and its id one of `experts`' (ggml_mul_mat_id reads every id it is given)."""
    import torch

    first = next(iter(experts.values()))
    g0, d0 = first["gate_up"], first["down"]
    oai = swiglu_oai is not None
    kind = GgmlBiasedLinear if oai else GgmlLinear
    for w in experts.values():
        g, d = w.get("gate_up"), w.get("down")
        if not (isinstance(g, kind) and isinstance(d, kind) and type(g) is type(g0)
                and g.stacked is not None and d.stacked is not None
                and g.stacked[1] == g0.stacked[1] and d.stacked[1] == d0.stacked[1]):
            return None
        if oai and (g.bias_stacked is None or g.bias_stacked != g0.bias_stacked or d.bias_stacked != d0.bias_stacked):
            return None
    H, I = d0.N, d0.K
    (bg, A, bu, bd), stride = _stacked_bases(g0, d0)
    encs = (g0.mats[0][0], g0.mats[1][0], d0.mats[0][0])
    xs = x.reshape(-1, H)
    row = ids.to(torch.int64).cpu()
    kept = torch.isin(row, torch.tensor(sorted(experts)))                        # [T, K]
    ids32 = torch.where(kept, row, next(iter(experts))).to(torch.int32)
    wts = torch.where(kept, weights.float().cpu(), torch.zeros(()))
    if oai:
        (cg, _), (cu, _) = g0.bias_stacked
        (cd, _), = d0.bias_stacked
        return moe(encs, bg, bu, bd, A, H, I, xs, ids32, wts, biases=(cg, cu, cd), swiglu_oai=swiglu_oai).to(x.dtype)
    return moe(encs, bg, bu, bd, A, H, I, xs, ids32, wts, expert_stride=stride).to(x.dtype)


# --- the memory roofline: what the cores can stream from DRAM (bench/gguf_vs_llamacpp.py, stop 54) ----------------

READ_PROBE_BYTES = 1 << 30        # far past any cache this code runs on (a 256 MB L3 would still be a quarter)


def read_bandwidth(nbytes: int = READ_PROBE_BYTES, threads: int = 1, passes: int = 7) -> dict:
    """Streaming-read bandwidth, GB/s (1e9 bytes a second): `threads` pthreads each read their own slice of one
    `nbytes` buffer, `passes` times, with the vector loads ggml's kernels use and their prefetch 4 KB ahead (the
    shim's `mg_read_bandwidth`; first touch untimed). A decode token reads each weight it uses once, so bytes read / this is the fastest a token can
    be on this machine. {"gbps": median, "min", "max", "passes": [GB/s of each], "bytes": read a pass, "threads"}.
    The median: a pass the machine's other work slowed is one figure of `passes`, not the figure."""
    out = (ctypes.c_double * passes)()
    rc = require().mg_read_bandwidth(int(nbytes), int(threads), int(passes), ctypes.addressof(out))
    if rc:
        why = {-1: f"cannot allocate {nbytes / 1e9:.2f} GB", -2: f"cannot start {threads} threads",
               -3: f"needs threads >= 1, passes >= 1 and at least 4 KiB a thread (got {nbytes} bytes, "
                   f"{threads} threads, {passes} passes)"}
        raise MoectlError(f"the read-bandwidth probe failed: {why.get(rc, f'code {rc}')}")
    gbps = [x / 1e9 for x in out]
    per_thread = nbytes // threads // 4096 * 4096
    return {"gbps": float(np.median(gbps)), "min": min(gbps), "max": max(gbps), "passes": gbps,
            "bytes": per_thread * threads, "threads": int(threads)}
