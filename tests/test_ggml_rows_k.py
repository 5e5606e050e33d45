"""The K-quant expert-rows kernels (moectl/kernels/ggml_rows/rows_k.c: Q5_K, Q6_K, Q3_K; the interface: rows.h):
out[j][r] = W[r] . act_j for m weight rows `row_bytes` apart and n q8_K activation rows (ggml's quantize_row_q8_K).

Checked for each type, tokens n = 1, 2, 3, 7, 8, 16, 33, 65 (65: two token groups of ROWS_G = 64), rows m = 1, 5, 16, 40
(odd: the single-row pass), K = 256, 4096, and real files' rows (qwen3-moe-2: K = 2048 gate/up, 768 down; mixtral-2:
4096 up, 14336 down):
  - against ggml's own vec_dot (its type traits, libggml-cpu) on the same q8_K rows: within 1e-5 of sum |w| |a| per
    output (`VS_VEC_DOT`): both compute each block's integer sums exactly and scale them by the same fp32 d_x d_a;
    they differ in the order of the fp32 sums (vec_dot: 8 lanes a block and the mins apart; here 16 lanes a block);
  - against `gguf.quants.dequantize(W)` @ the q8_K rows dequantized (d * qs) in float64: within fp32 rounding
    (`fp32_bound`: (nb + 32) 2^-24 of sum |w| |a|, nb blocks of 256 each adding a few roundings);
  - random bytes as blocks (every quant and scale value, the fp16 scales sane) against q8_K rows at -128 / 127: no
    int16 saturation anywhere;
  - each token's outputs written at out[j][0 .. m - 1] only (guard values around stay), activations read through
    their pointers (given in reverse order), rows read `row_bytes` apart (padding filled with junk between rows).
The plain AVX-512BW variant (no VNNI: vpmaddwd + vpaddd for vpdpwssd) is built and checked too (`-mno-avx512vnni`),
and an AVX2-only build answers NULL (`-mno-avx512f`).

The library comes from ONE fixture, `rows_library()`: ggml's libggml-cpu where the build exports
`ggml_moectl_rows_kernel` (the patch's), else kernels/ggml_rows/*.c compiled here with gcc (-O2 -march=native)
against the pinned ggml headers (no gcc or source: skip, saying why).

Micro-benchmark (indicative; not run by the suite): `python tests/test_ggml_rows_k.py [K ...]` prints ns per
(row, token) of the kernel and of ggml's vec_dot loop (one (row, token) pair at a time) at m = 64,
n = 1, 2, 4, 8, 16, 32, best of several reps (one thread); `... --mul-mat [K]`: against ggml's own mul_mat (its
tiled kernel from 8 tokens; GGML_CPU_TILED_MM=0: vec_dot) on 512 rows.

Legend: n = tokens, m = weight rows, K = input width, nb = K / 256 blocks a row.
"""

from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from moectl.kernels import ggml
from test_ggml_kernels import lib, weights  # noqa: F401  (autouse: ggml built here, or skip / fail)

torch.set_num_threads(1)

TYPES = (T.Q5_K, T.Q6_K, T.Q3_K)
TOKENS = (1, 2, 3, 7, 8, 16, 33, 65)
ROWS = (1, 5, 16, 40)
VS_VEC_DOT = 1e-5                       # of sum |w| |a| per output: the fp32 order of the block sums
Q8K_BYTES = 4 + 256 + 2 * 16            # block_q8_K: d fp32, qs [256] int8, bsums [16] int16
PAD = 3                                 # guard floats either side of each token's outputs
GUARD = -12345.0
SOURCES = ("rows.c", "rows_k.c", "rows_iq.c")
REAL = Path.home() / ".cache" / "moectl" / "gguf_vs_llamacpp"       # bench/gguf_vs_llamacpp.py's files

RowsFn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                          ctypes.c_int64, ctypes.c_void_p)
VecDotFn = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
FromFloatFn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class TypeTraitsCpu(ctypes.Structure):
    """ggml-cpu.h's struct ggml_type_traits_cpu."""
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


def compile_rows(out: Path, flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """kernels/ggml_rows/*.c built into `out` (a shared library) with gcc against the pinned ggml headers."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("no gcc to build the expert-rows kernels")
    src = ggml.source_dir() / "ggml"
    if not (src / "src" / "ggml-common.h").exists():
        pytest.skip(f"the pinned ggml source is absent ({src})")
    here = Path(ggml.__file__).parent / "ggml_rows"
    lib_dir = ggml.lib_dir()                    # ggml_abort and the fp16 table: libggml-base
    cmd = [gcc, "-O2", "-march=native", *flags, "-shared", "-fPIC", "-std=gnu11", f"-I{src / 'include'}",
           f"-I{src / 'src'}", f"-I{src / 'src' / 'ggml-cpu'}", *(str(here / f) for f in SOURCES), f"-L{lib_dir}",
           "-lggml-base", f"-Wl,-rpath,{lib_dir}", "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        pytest.fail(f"gcc failed on the expert-rows kernels:\n{r.stderr}")
    lib = ctypes.CDLL(str(out))
    lib.ggml_moectl_rows_kernel.argtypes, lib.ggml_moectl_rows_kernel.restype = [ctypes.c_int], ctypes.c_void_p
    return lib


def with_traits(lib: ctypes.CDLL) -> ctypes.CDLL:
    """ggml's library with its CPU type traits (`ggml_get_type_traits_cpu`) declared, the CPU backend initialised."""
    lib.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
    lib.ggml_get_type_traits_cpu.restype = ctypes.POINTER(TypeTraitsCpu)
    lib.ggml_cpu_init()
    return lib


@pytest.fixture(scope="module")
def ggml_lib(lib):
    """ggml, the reference (its quantizer, quantize_row_q8_K and vec_dot): test_ggml_kernels' `lib` (built, or skip /
    fail)."""
    return with_traits(lib)


@pytest.fixture(scope="module")
def rows_library(ggml_lib, tmp_path_factory):
    """The library exporting `ggml_moectl_rows_kernel(type)`: ggml's own libggml-cpu where its build has the kernels
    (the patch compiles kernels/ggml_rows/ into it, hashed into its key), else the kernels compiled here by gcc."""
    try:
        ggml_lib.ggml_moectl_rows_kernel.argtypes = [ctypes.c_int]
    except AttributeError:
        return compile_rows(tmp_path_factory.mktemp("rows") / "librows.so")
    ggml_lib.ggml_moectl_rows_kernel.restype = ctypes.c_void_p
    return ggml_lib


@pytest.fixture(scope="module")
def rows_library_bw(tmp_path_factory):
    """The kernels built without VNNI (plain AVX-512BW: vpmaddwd + vpaddd)."""
    return compile_rows(tmp_path_factory.mktemp("rows_bw") / "librows_bw.so", ("-mno-avx512vnni",))


def kernel(lib: ctypes.CDLL, enc: T) -> RowsFn:
    f = lib.ggml_moectl_rows_kernel(int(enc))
    if not f:
        pytest.skip(f"no {enc.name} expert-rows kernel on this build (it needs AVX-512F/BW)")
    return RowsFn(f)


def q8k(ggml_lib, x: torch.Tensor) -> np.ndarray:
    """x [n, K] -> ggml's quantize_row_q8_K of each row: uint8 [n, nb * Q8K_BYTES]."""
    n, K = x.shape
    q = np.zeros((n, K // 256 * Q8K_BYTES), dtype=np.uint8)
    from_float = FromFloatFn(ggml_lib.ggml_get_type_traits_cpu(int(T.Q8_K)).contents.from_float)
    xf = x.float().contiguous()
    for j in range(n):
        from_float(xf[j].data_ptr(), q[j].ctypes.data, K)
    return q


def q8k_values(q: np.ndarray) -> np.ndarray:
    """The q8_K rows' values d * qs, float64 [n, K]."""
    n = q.shape[0]
    b = q.reshape(n, -1, Q8K_BYTES)
    d = b[:, :, :4].copy().view(np.float32).astype(np.float64)                  # [n, nb, 1]
    qs = b[:, :, 4:260].copy().view(np.int8).astype(np.float64)                 # [n, nb, 256]
    return (d * qs).reshape(n, -1)


def padded(raw: np.ndarray, extra: int, seed: int) -> tuple[np.ndarray, int]:
    """raw [m, row] in a buffer [m, row + extra] filled with junk past each row: (buffer, row_bytes)."""
    m, row = raw.shape
    buf = np.random.default_rng(seed).integers(0, 256, (m, row + extra), dtype=np.uint8)
    buf[:, :row] = raw
    return buf, row + extra


def run_rows(f: RowsFn, buf: np.ndarray, row_bytes: int, m: int, K: int, q: np.ndarray) -> np.ndarray:
    """The kernel on m rows of `buf` against the q8_K rows q [n, ...] (pointers in reverse order): out [n, m]; the
    guard values either side of each token's outputs checked."""
    n = q.shape[0]
    outs = np.full((n, PAD + m + PAD), GUARD, dtype=np.float32)
    order = list(range(n))[::-1]
    acts = (ctypes.c_void_p * n)(*[q[j].ctypes.data for j in order])
    ptrs = (ctypes.c_void_p * n)(*[outs[j].ctypes.data + 4 * PAD for j in order])
    f(buf.ctypes.data, row_bytes, m, K // 256, ctypes.addressof(acts), n, ctypes.addressof(ptrs))
    assert (outs[:, :PAD] == GUARD).all() and (outs[:, PAD + m:] == GUARD).all(), "written outside out[j][0..m-1]"
    return outs[:, PAD:PAD + m]


def vec_dot(ggml_lib, enc: T, raw: np.ndarray, K: int, q: np.ndarray) -> np.ndarray:
    """ggml's vec_dot of each (row, token) pair: [n, m]."""
    f = VecDotFn(ggml_lib.ggml_get_type_traits_cpu(int(enc)).contents.vec_dot)
    s = ctypes.c_float()
    y = np.zeros((q.shape[0], raw.shape[0]), dtype=np.float32)
    for j in range(q.shape[0]):
        for r in range(raw.shape[0]):
            f(K, ctypes.byref(s), 0, raw[r].ctypes.data, 0, q[j].ctypes.data, 0, 1)
            y[j, r] = s.value
    return y


def fp32_bound(nb: int, mag: np.ndarray) -> np.ndarray:
    """fp32 rounding of nb block sums (each a few roundings) and the 16 lanes' final sum, of sum |w| |a|."""
    return (nb + 32) * 2.0 ** -24 * mag


def check(ggml_lib, f: RowsFn, enc: T, raw: np.ndarray, K: int, n: int, seed: int) -> None:
    """The kernel on raw [m, row] against n random tokens: vec_dot's numbers and the float64 product, guards kept."""
    m = raw.shape[0]
    x = torch.randn(n, K, generator=torch.Generator().manual_seed(seed))
    q = q8k(ggml_lib, x)
    buf, row_bytes = padded(raw, 40 + 8 * (seed % 3), seed)
    y = run_rows(f, buf, row_bytes, m, K, q).astype(np.float64)
    w = np.asarray(quants.dequantize(raw, enc), dtype=np.float64).reshape(m, K)
    a = q8k_values(q)
    mag = np.abs(a) @ np.abs(w).T                                                # [n, m] sum |w| |a|
    ref = vec_dot(ggml_lib, enc, raw, K, q).astype(np.float64)
    err = np.abs(y - ref)
    assert (err <= VS_VEC_DOT * mag).all(), f"{enc.name} vs vec_dot: {(err / mag).max():.3g} of sum |w||a|"
    err = np.abs(y - a @ w.T)
    assert (err <= fp32_bound(K // 256, mag)).all(), f"{enc.name} vs float64: {(err / mag).max():.3g} of sum |w||a|"


@pytest.mark.parametrize("enc", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("K", (256, 4096))
@pytest.mark.parametrize("m", ROWS)
def test_rows_equal_vec_dot_and_the_float64_product(ggml_lib, rows_library, enc, K, m):
    f = kernel(rows_library, enc)
    raw, _ = weights(enc, m, K, seed=K + m)
    for n in TOKENS:
        check(ggml_lib, f, enc, raw, K, n, seed=1000 * m + n)


@pytest.mark.parametrize("enc", TYPES, ids=lambda t: t.name)
def test_plain_avx512bw_variant(ggml_lib, rows_library_bw, enc):
    """Without VNNI (vpmaddwd + vpaddd): the same checks on a few shapes."""
    f = kernel(rows_library_bw, enc)
    for m, K in ((5, 256), (16, 2048)):
        raw, _ = weights(enc, m, K, seed=7 + m)
        for n in (1, 3, 65):
            check(ggml_lib, f, enc, raw, K, n, seed=n)


# Where each type's fp16 scales lie in its block (the rest: any bytes are a valid block)
BLOCK_BYTES = {T.Q5_K: 176, T.Q6_K: 210, T.Q3_K: 110}
SCALES_AT = {T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q3_K: (108,)}


def random_blocks(enc: T, m: int, K: int, seed: int) -> np.ndarray:
    """m rows of random bytes, the fp16 scales set to sane values: every quant and 6-/8-bit scale value occurs,
    extremes included (Q6_K's int8 scale -128, 63 x -128 pairs)."""
    rng = np.random.default_rng(seed)
    bs, nb = BLOCK_BYTES[enc], K // 256
    raw = rng.integers(0, 256, (m, nb, bs), dtype=np.uint8)
    for off in SCALES_AT[enc]:
        d = rng.uniform(1e-4, 1e-3, (m, nb)).astype(np.float16)
        raw[:, :, off:off + 2] = d.view(np.uint8).reshape(m, nb, 2)
    return raw.reshape(m, nb * bs)


def extreme_q8k(n: int, K: int, seed: int) -> np.ndarray:
    """q8_K rows with qs anywhere in -128..127 (half of them at -128 or 127) and their bsums: [n, nb * Q8K_BYTES]."""
    rng = np.random.default_rng(seed)
    nb = K // 256
    qs = rng.integers(-128, 128, (n, nb, 256)).astype(np.int8)
    qs[:, :, ::2] = rng.choice(np.array([-128, 127], dtype=np.int8), (n, nb, 128))
    q = np.zeros((n, nb, Q8K_BYTES), dtype=np.uint8)
    q[:, :, :4] = np.full((n, nb, 1), 0.01, dtype=np.float32).view(np.uint8)
    q[:, :, 4:260] = qs.view(np.uint8)
    bsums = qs.astype(np.int16).reshape(n, nb, 16, 16).sum(-1).astype(np.int16)
    q[:, :, 260:] = bsums.view(np.uint8).reshape(n, nb, 32)
    return q.reshape(n, -1)


@pytest.mark.parametrize("enc", TYPES, ids=lambda t: t.name)
def test_random_blocks_and_extreme_activations(ggml_lib, rows_library, enc):
    """Any bytes of a block (the fp16 scales sane) against activations at -128 / 127: no int16 saturation, the
    same numbers as vec_dot and the float64 product."""
    f = kernel(rows_library, enc)
    K, m = 2048, 6
    raw = random_blocks(enc, m, K, seed=int(enc))
    w = np.asarray(quants.dequantize(raw, enc), dtype=np.float64).reshape(m, K)
    for n in (2, 17):
        q = extreme_q8k(n, K, seed=n)
        y = run_rows(f, raw, raw.shape[1], m, K, q).astype(np.float64)
        a = q8k_values(q)
        mag = np.abs(a) @ np.abs(w).T
        ref = vec_dot(ggml_lib, enc, raw, K, q).astype(np.float64)
        assert (np.abs(y - ref) <= VS_VEC_DOT * mag).all(), f"{enc.name} vs vec_dot"
        assert (np.abs(y - a @ w.T) <= fp32_bound(K // 256, mag)).all(), f"{enc.name} vs float64"


@functools.lru_cache(maxsize=4)
def real_tensors(path: Path) -> list:
    """A real file's tensors (gguf's reader, memory-mapped), read once a file."""
    from gguf import GGUFReader

    return GGUFReader(path).tensors


def real_rows(path: Path, tensor: str, enc: T, m: int) -> tuple[np.ndarray, int]:
    """m rows of expert 1 of a real file's `tensor` (layer 0) in `enc`: (uint8 [m, row bytes], K), or skip."""
    if not path.exists():
        pytest.skip(f"{path} is absent (bench/gguf_vs_llamacpp.py makes it)")
    for t in real_tensors(path):
        if t.name.endswith(tensor) and t.tensor_type == enc:
            K = int(t.shape[0])
            data = np.asarray(t.data)                                           # [experts, N, row bytes]
            return np.ascontiguousarray(data[1, 17:17 + m]), K
    pytest.skip(f"no {enc.name} {tensor} in {path.name}")


@pytest.mark.parametrize("model,file,tensor,enc", [
    ("qwen3-moe-2", "model-Q5_K_M.gguf", "ffn_gate_exps.weight", T.Q5_K),         # K = 2048
    ("qwen3-moe-2", "model-Q5_K_M.gguf", "ffn_down_exps.weight", T.Q5_K),         # K = 768
    ("qwen3-moe-2", "model-Q5_K_M.gguf", "ffn_down_exps.weight", T.Q6_K),
    ("qwen3-moe-2", "model-Q6_K.gguf", "ffn_up_exps.weight", T.Q6_K),
    ("qwen3-moe-2", "model-Q3_K_M.gguf", "ffn_gate_exps.weight", T.Q3_K),
    ("mixtral-2", "model-Q5_K_M.gguf", "ffn_up_exps.weight", T.Q5_K),             # K = 4096
    ("mixtral-2", "model-Q5_K_M.gguf", "ffn_down_exps.weight", T.Q6_K),           # K = 14336
], ids=lambda v: getattr(v, "name", str(v).split(".")[0].replace("model-", "")))
def test_real_file_rows(ggml_lib, rows_library, model, file, tensor, enc):
    f = kernel(rows_library, enc)
    raw, K = real_rows(REAL / model / file, tensor, enc, 24)
    for n in (1, 4, 16, 65):
        check(ggml_lib, f, enc, raw, K, n, seed=n)


def test_no_kernel_without_avx512(tmp_path):
    """Built for AVX2 only (MOECTL_GGML_ISA=avx2's flags: no __AVX512F__), the getter answers NULL for every type:
    ggml's own path runs."""
    lib = compile_rows(tmp_path / "librows_avx2.so", ("-mno-avx512f",))
    for enc in TYPES:
        assert not lib.ggml_moectl_rows_kernel(int(enc)), enc.name


def test_no_kernel_for_other_types(rows_library):
    """The dispatch answers NULL for types neither family has (Q4_K, Q8_0: ggml repacks them; F32)."""
    for enc in (T.Q4_K, T.Q8_0, T.Q2_K, T.F32):
        assert not rows_library.ggml_moectl_rows_kernel(int(enc)), enc.name


# The micro-benchmark's timing loops, in C (a Python loop over vec_dot calls would time Python): ns per (row, token)
BENCH_C = r"""
#include <stdint.h>
#include <stddef.h>
#include <time.h>
typedef void (*rows_fn)(const void *, size_t, int64_t, int64_t, const void *const *, int64_t, float *const *);
typedef void (*vec_dot_fn)(int, float *, size_t, const void *, size_t, const void *, size_t, int);
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);     /* CPU time: the machine is shared */
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
double bench_rows(rows_fn f, const uint8_t *w, size_t row, int64_t m, int64_t K, const void *const *acts, int64_t n,
                  float *const *out, int iters) {
    double t = now();
    for (int it = 0; it < iters; it++) f(w, row, m, K / 256, acts, n, out);
    return (now() - t) / iters / (m * n) * 1e9;
}
double bench_vec_dot(vec_dot_fn f, const uint8_t *w, size_t row, int64_t m, int64_t K, const void *const *acts,
                     int64_t n, float *const *out, int iters) {
    double t = now();
    for (int it = 0; it < iters; it++)
        for (int64_t j = 0; j < n; j++)         /* stock mul_mat_id: one (row, token) pair a call */
            for (int64_t r = 0; r < m; r++) f((int)K, out[j] + r, 0, w + r * row, 0, acts[j], 0, 1);
    return (now() - t) / iters / (m * n) * 1e9;
}
"""


def bench(Ks=(2048, 4096), reps: int = 7) -> None:
    """ns per (row, token): the kernel at m = 64 against ggml's vec_dot loop, best of `reps` (one thread)."""
    import tempfile

    tmp = Path(tempfile.mkdtemp())
    (tmp / "bench.c").write_text(BENCH_C)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", str(tmp / "bench.c"), "-o", str(tmp / "bench.so")], check=True)
    b = ctypes.CDLL(str(tmp / "bench.so"))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for fn in (b.bench_rows, b.bench_vec_dot):
        fn.argtypes, fn.restype = [p, p, ctypes.c_size_t, i64, i64, p, i64, p, ctypes.c_int], ctypes.c_double
    glib = with_traits(ggml.require())
    lib = compile_rows(tmp / "librows.so")
    m = 64
    print(f"{'type':6} {'K':>5} {'n':>3} {'kernel ns':>10} {'vec_dot ns':>11} {'x':>6}")
    for enc in TYPES:
        f = lib.ggml_moectl_rows_kernel(int(enc))
        vd = glib.ggml_get_type_traits_cpu(int(enc)).contents.vec_dot
        for K in Ks:
            raw, _ = weights(enc, m, K, seed=1)
            for n in (1, 2, 4, 8, 16, 32):
                q = q8k(glib, torch.randn(n, K))
                outs = np.zeros((n, m), dtype=np.float32)
                acts = (ctypes.c_void_p * n)(*[q[j].ctypes.data for j in range(n)])
                ptrs = (ctypes.c_void_p * n)(*[outs[j].ctypes.data for j in range(n)])
                args = (raw.ctypes.data, raw.shape[1], m, K, ctypes.addressof(acts), n, ctypes.addressof(ptrs))
                iters = max(1, 2000 // n)
                k = min(b.bench_rows(f, *args, iters) for _ in range(reps))
                v = min(b.bench_vec_dot(vd, *args, max(1, iters // 4)) for _ in range(reps))
                print(f"{enc.name:6} {K:5} {n:3} {k:10.1f} {v:11.1f} {v / k:6.2f}")


def bench_mul_mat(K: int = 2048, N: int = 512, reps: int = 25) -> None:
    """ns per (row, token): ggml's own mul_mat of N rows (its tiled kernel from 8 tokens unless GGML_CPU_TILED_MM=0;
    x's quantization and the graph included) against the kernel on the same rows in chunks of 64, alternated, best
    of `reps` (one thread, CPU time)."""
    import tempfile

    torch.set_num_threads(1)
    glib = with_traits(ggml.require())
    lib = compile_rows(Path(tempfile.mkdtemp()) / "librows.so")
    for enc in TYPES:
        raw, _ = weights(enc, N, K, seed=1)
        f = RowsFn(lib.ggml_moectl_rows_kernel(int(enc)))
        for n in (4, 8, 16, 32, 64):
            x = torch.randn(n, K)
            q = q8k(glib, x)
            outs = np.zeros((n, N), dtype=np.float32)
            acts = (ctypes.c_void_p * n)(*[q[j].ctypes.data for j in range(n)])
            ptrs = [(ctypes.c_void_p * n)(*[outs[j].ctypes.data + 4 * r0 for j in range(n)]) for r0 in range(0, N, 64)]

            def rows() -> float:
                t0 = time.thread_time()
                for c, r0 in enumerate(range(0, N, 64)):
                    f(raw[r0:].ctypes.data, raw.shape[1], 64, K // 256, ctypes.addressof(acts), n,
                      ctypes.addressof(ptrs[c]))
                return time.thread_time() - t0

            def mul_mat() -> float:
                t0 = time.thread_time()
                ggml.mul_mat(int(enc), raw, (N, K), x, 1)
                return time.thread_time() - t0

            a = b = float("inf")
            for _ in range(reps):
                a, b = min(a, mul_mat()), min(b, rows())
            print(f"{enc.name:5} K {K:5} n {n:3}: ggml mul_mat {a / (N * n) * 1e9:6.1f} ns, rows kernel "
                  f"{b / (N * n) * 1e9:6.1f} ns a (row, token): x{a / b:.2f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--mul-mat"]:
        bench_mul_mat(*(int(k) for k in sys.argv[2:3]))
    else:
        bench(tuple(int(k) for k in sys.argv[1:]) or (2048, 4096))
