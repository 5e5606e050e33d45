"""The IQ expert-rows kernels (moectl/kernels/ggml_rows/rows_iq.c: IQ4_XS, IQ3_XXS, IQ2_XXS, rows.h's interface):
out[j][r] = W[r] . act_j for m weight rows and n q8_K activation rows, each weight block unpacked once for the tokens.
Two kernels inside: tokens in lanes (VNNI builds; groups of 16, a last group of 6 or more) and tokens in vectors (the
rest, and builds without VNNI): n = 1, 2, 3 take the vectors, 7, 8, 16 the lanes, 33 and 100 both.

Checked, for each type, n = 1, 2, 3, 7, 8, 16, 33 tokens, m = 1, 5, 16, 40 rows, K = 256 and 4096 (ggml's quantizer,
random weights), and the real files' shapes (qwen3-moe-2's and mixtral-2's IQ GGUFs where present: K = 2048, 768,
1536 ...); rows `row_bytes` apart with garbage between them, tokens' q8_K rows and outputs scattered:
  - against ggml's own vec_dot on the same q8_K rows: within 1e-5 of sum |w| |a| (both sum each block's integers
    exactly and scale them in fp32; only the order of the fp32 sums over blocks differs);
  - against `gguf.quants.dequantize(W)` @ the q8_K rows dequantized (d * qs), in float64: within fp32 rounding,
    (nb + 8) 2^-23 sum |w| |a| (one rounding a block product, nb fp32 sums, the 16 lanes' tree, the dequantized w's);
  - out[j][0..m-1] written and nothing around it (guard values stay);
  - 100 tokens (more than the 64 a pass of the lanes kernel takes), 4 threads at once (a scratch each).
The library comes from one fixture, `rows_library()`: ggml's libggml-cpu where it exports `ggml_moectl_rows_kernel`
(the patch's build), else the ggml_rows/*.c files compiled here with gcc -march=native against the pinned source;
plus the same files compiled without AVX-512 VNNI (the madd + add variant of hosts without it).

Micro-benchmark (indicative: the machine is shared): `python tests/test_ggml_rows_iq.py` prints ns per (row, token)
of the kernel and of ggml's vec_dot one (row, token) pair at a time, m = 64, K = 2048 and 4096.

Legend: K = input width (nb blocks of 256), m = weight rows, n = tokens, rb = row bytes.
"""

from __future__ import annotations

import ctypes
import os
import functools
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from moectl.kernels import ggml
from test_ggml_kernels import lib, weights  # noqa: F401  (autouse: ggml built here, or skip / fail)
from test_ggml_rows_k import compile_rows

torch.set_num_threads(1)

TYPES = (T.IQ4_XS, T.IQ3_XXS, T.IQ2_XXS)
Q8_K = 15
QK_K = 256
Q8K = np.dtype([("d", "<f4"), ("qs", "i1", QK_K), ("bsums", "<i2", QK_K // 16)])     # block_q8_K, 292 bytes
VS_VEC_DOT = 1e-5               # of sum |w| |a|: the order of fp32 sums over blocks
FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64, ctypes.c_int64,
                      ctypes.POINTER(ctypes.c_void_p), ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p))
VEC_DOT = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                           ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class TraitsCpu(ctypes.Structure):
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


@functools.lru_cache(maxsize=1)
def ggml_cpu() -> ctypes.CDLL:
    """ggml's libggml-cpu of moectl's build (the reference vec_dot, quantize_row_q8_K)."""
    cpu = ctypes.CDLL(str(ggml.lib_dir() / "libggml-cpu.so"))
    cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(TraitsCpu)
    cpu.quantize_row_q8_K.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    cpu.ggml_cpu_init()                         # ggml's fp16 -> fp32 table, which vec_dot reads the scales by
    return cpu


def compiled(tmp: Path, flags: list[str]) -> ctypes.CDLL:
    """ggml_rows/*.c compiled with gcc -march=native and `flags` into a .so under `tmp` (test_ggml_rows_k's
    compile_rows: skip where gcc or the pinned source is absent)."""
    return compile_rows(tmp / f"rows{len(list(tmp.iterdir()))}.so", tuple(f for f in flags if f != "-march=native"))


def kernel_of(library: ctypes.CDLL, enc: T):
    """`ggml_moectl_rows_kernel(enc)` as a callable, or None (no kernel on this build)."""
    library.ggml_moectl_rows_kernel.restype = ctypes.c_void_p
    library.ggml_moectl_rows_kernel.argtypes = [ctypes.c_int]
    address = library.ggml_moectl_rows_kernel(int(enc))
    return FN(address) if address else None


@pytest.fixture(scope="module", params=["native", "no-vnni"])
def rows_library(request, tmp_path_factory):
    """The library exporting `ggml_moectl_rows_kernel`: "native", ggml's libggml-cpu where it has the symbol (the
    patch's build), else ggml_rows/*.c compiled here with -march=native; "no-vnni", compiled without AVX-512 VNNI
    (skipped where the host lacks AVX-512BW: its getter returns NULL, as an AVX2 build's does)."""
    if request.param == "native":
        cpu = ggml_cpu()
        if hasattr(cpu, "ggml_moectl_rows_kernel"):
            return cpu
        return compiled(tmp_path_factory.mktemp("rows"), ["-march=native"])
    return compiled(tmp_path_factory.mktemp("rows"), ["-march=native", "-mno-avx512vnni"])


def kernel(rows_library, enc: T):
    f = kernel_of(rows_library, enc)
    if f is None:
        pytest.skip(f"no {enc.name} rows kernel on this build (no AVX-512BW)")
    return f


def q8_k(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q8_K of x [n, K] fp32 -> block_q8_K [n, nb]."""
    n, K = x.shape
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros((n, K // QK_K), dtype=Q8K)
    cpu = ggml_cpu()
    for j in range(n):
        cpu.quantize_row_q8_K(x[j].ctypes.data, out[j].ctypes.data, K)
    return out


def q8_k_values(a: np.ndarray) -> np.ndarray:
    """The q8_K rows [n, nb] as float64 [n, K]: d * qs."""
    return (a["d"].astype(np.float64)[..., None] * a["qs"].astype(np.float64)).reshape(a.shape[0], -1)


def vec_dot(enc: T, raw: np.ndarray, a: np.ndarray) -> np.ndarray:
    """ggml's vec_dot of every (row, token) pair, one at a time: [n, m] float32."""
    traits = ggml_cpu().ggml_get_type_traits_cpu(int(enc)).contents
    assert traits.vec_dot_type == Q8_K
    dot = VEC_DOT(traits.vec_dot)
    m, n, K = raw.shape[0], a.shape[0], a.shape[1] * QK_K
    out = np.zeros((n, m), dtype=np.float32)
    s = ctypes.c_float()
    for j in range(n):
        for r in range(m):
            dot(K, ctypes.addressof(s), 0, raw[r].ctypes.data, 0, a[j].ctypes.data, 0, 1)
            out[j, r] = s.value
    return out


def run(f, raw: np.ndarray, a: np.ndarray, pad: int = 40, guard: int = 3, seed: int = 0) -> tuple[np.ndarray, ...]:
    """f on `raw` [m, rb] laid out rb + pad bytes apart (garbage between rows) and the q8_K rows `a` [n, nb] scattered
    in reverse order; out[j] points into a guarded buffer. Returns (out [n, m], the buffer, its expected guards)."""
    rng = np.random.default_rng(seed)
    m, rb = raw.shape
    n, nb = a.shape
    stride = rb + pad
    wbuf = rng.integers(0, 256, size=(m, stride), dtype=np.uint8)
    wbuf[:, :rb] = raw
    abuf = np.zeros((n, nb + 1), dtype=Q8K)                        # one block of slack a token
    abuf[::-1, :nb] = a                                            # token j lives in row n - 1 - j
    acts = (ctypes.c_void_p * max(n, 1))(*[abuf[n - 1 - j].ctypes.data for j in range(n)])
    row_out = m + 2 * guard + 5
    obuf = np.full((n, row_out), -7.25, dtype=np.float32)
    outs = (ctypes.c_void_p * max(n, 1))(*[obuf[j].ctypes.data + 4 * guard for j in range(n)])
    f(wbuf.ctypes.data, stride, m, nb, acts, n, outs)
    expect = np.full_like(obuf, -7.25)
    return obuf[:, guard:guard + m].copy(), obuf, expect, guard


def check(enc: T, f, raw: np.ndarray, deq: np.ndarray, a: np.ndarray, what: str) -> None:
    """f's products on `raw` [m, rb] (dequantized `deq` [m, K]) and q8_K rows `a` [n, nb]: against vec_dot, against
    float64 dequantize @ (d qs), and the outputs' guards."""
    m, n, nb = raw.shape[0], a.shape[0], a.shape[1]
    got, obuf, expect, guard = run(f, raw, a)
    av = q8_k_values(a)                                             # [n, K]
    scale = np.abs(av) @ np.abs(deq.astype(np.float64)).T          # [n, m] sum |w| |a|
    ref = vec_dot(enc, raw, a)
    err = np.abs(got - ref)
    assert (err <= VS_VEC_DOT * scale).all(), f"{what}: vs vec_dot {(err / scale).max():.3g} of sum |w||a|"
    exact = av @ deq.astype(np.float64).T
    err = np.abs(got - exact)
    bound = (nb + 8) * 2.0 ** -23 * scale
    assert (err <= bound).all(), f"{what}: vs dequantize {(err / scale).max():.3g} of sum |w||a|"
    obuf[:, guard:guard + m] = -7.25
    assert np.array_equal(obuf, expect), f"{what}: written outside out[j][0..m-1]"


_cache: dict = {}


def random_case(enc: T, K: int, m: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(raw [m, rb] by ggml's quantizer, dequantized [m, K], q8_K rows [n, nb]) at (enc, K): 40 rows and 33
    tokens made once, sliced."""
    key = (enc, K)
    if key not in _cache:
        raw, deq = weights(enc, 40, K, seed=int(enc) + K)
        x = torch.randn(33, K, generator=torch.Generator().manual_seed(K)).numpy()
        x[::5] *= 40.0                                              # some tokens far larger than others
        x[3, 7] = -90.0                                             # an outlier: q8_K's d set by one value
        _cache[key] = (raw, deq.numpy(), q8_k(x))
    raw, deq, a = _cache[key]
    return raw[:m], deq[:m], a[:n]


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 16, 33])
@pytest.mark.parametrize("K", [256, 4096])
@pytest.mark.parametrize("enc", TYPES, ids=lambda t: t.name)
def test_rows_equal_vec_dot_and_dequantize(rows_library, enc, K, n):
    """m = 1, 5, 16, 40 rows, n tokens: within fp32 summation order of vec_dot, within fp32 rounding of the float64
    product, nothing written around out[j][0..m-1]."""
    f = kernel(rows_library, enc)
    for m in (1, 5, 16, 40):
        raw, deq, a = random_case(enc, K, m, n)
        check(enc, f, raw, deq, a, f"{enc.name} K={K} m={m} n={n}")


def test_many_tokens_in_groups(rows_library):
    """n = 100 tokens (more than a group of 32: groups of 25), K = 768: each token's products right."""
    enc = T.IQ4_XS
    f = kernel(rows_library, enc)
    raw, deq = weights(enc, 9, 768, seed=5)
    x = torch.randn(100, 768, generator=torch.Generator().manual_seed(9)).numpy()
    check(enc, f, raw, deq.numpy(), q8_k(x), "IQ4_XS n=100")


def test_random_valid_blocks(rows_library):
    """Random bytes with sane fp16 scales (every grid index, sign pattern and scale, beyond what the quantizer
    writes): IQ4_XS, IQ3_XXS, IQ2_XXS at K = 1536, m = 7, n = 5."""
    K, m, n = 1536, 7, 5
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n, K)).astype(np.float32)
    a = q8_k(x)
    for enc in TYPES:
        f = kernel(rows_library, enc)
        block_bytes = quants.GGML_QUANT_SIZES[enc][1]
        raw = rng.integers(0, 256, size=(m, K // QK_K, block_bytes), dtype=np.uint8)
        raw[:, :, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)    # d: each block's first 2 bytes
        raw = raw.reshape(m, -1)
        deq = np.asarray(quants.dequantize(raw, enc), dtype=np.float32).reshape(m, K)
        check(enc, f, raw, deq, a, f"{enc.name} random blocks")


def test_empty_calls_write_nothing(rows_library):
    """n = 0 tokens, m = 0 rows: nothing written; K = 0 (nb = 0): each product is 0 (an empty sum)."""
    for enc in TYPES:
        f = kernel(rows_library, enc)
        raw, deq = weights(enc, 3, 256, seed=2)
        a = q8_k(np.ones((4, 256), dtype=np.float32))
        _, obuf, expect, _ = run(f, raw, a[:0])
        assert obuf.size == 0
        got, obuf, expect, guard = run(f, raw[:0], a)
        assert np.array_equal(obuf, expect)
        got, obuf, expect, guard = run(f, raw[:, :0], a[:, :0])
        assert np.array_equal(got, np.zeros((4, 3), dtype=np.float32))


def test_threads_each_their_own_scratch(rows_library):
    """The activations' scratch is per thread (kept for its later calls, freed when it exits): 4 threads, each with
    its own tokens (5: tokens in vectors; 21: lanes and vectors), 20 calls each, every product equal to one thread's
    alone."""
    enc, K = T.IQ3_XXS, 1024
    f = kernel(rows_library, enc)
    raw, _ = weights(enc, 12, K, seed=8)
    rng = [np.random.default_rng(i) for i in range(4)]
    cases = [q8_k(r.standard_normal((n, K)).astype(np.float32)) for r, n in zip(rng, (5, 21, 5, 21))]
    alone = [run(f, raw, a)[0] for a in cases]
    got: dict = {}

    def worker(i):
        got[i] = [run(f, raw, cases[i])[0] for _ in range(20)]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, a in enumerate(alone):
        assert len(got[i]) == 20 and all(np.array_equal(y, a) for y in got[i]), f"thread {i}"


def test_an_avx2_build_has_no_kernel(tmp_path):
    """Compiled for AVX2 only (as MOECTL_GGML_ISA=avx2 builds libggml-cpu): the getter returns NULL for every IQ type,
    so ggml's own path runs."""
    library = compiled(tmp_path, ["-march=haswell"])
    assert all(kernel_of(library, enc) is None for enc in TYPES)


def real_tensors() -> list[tuple[str, T, np.ndarray]]:
    """(name, type, the first 40 rows of expert 0 [40, rb]) of each IQ expert tensor shape in the real GGUFs."""
    from gguf import GGUFReader

    root = Path.home() / ".cache" / "moectl" / "gguf_vs_llamacpp"
    found, seen = [], set()
    for path in sorted(root.glob("*/model-IQ*.gguf")):
        for t in GGUFReader(path).tensors:
            if "exps" not in t.name or T(t.tensor_type) not in TYPES:
                continue
            K = int(t.shape[0])
            key = (T(t.tensor_type), K)
            if key in seen:
                continue
            seen.add(key)
            data = np.asarray(t.data)                              # [A, N, rb] uint8
            found.append((f"{path.parent.name}/{path.name}:{t.name}", T(t.tensor_type),
                          np.ascontiguousarray(data.reshape(-1, data.shape[-1])[:40])))
    return found


def test_real_files(rows_library):
    """The real IQ GGUFs' expert tensors (every (type, K) present: K = 2048, 768, 1536 ...), 40 rows, 16 tokens."""
    cases = real_tensors()
    if not cases:
        pytest.skip("no IQ GGUF under ~/.cache/moectl/gguf_vs_llamacpp (bench/gguf_vs_llamacpp.py makes them)")
    for name, enc, raw in cases:
        f = kernel(rows_library, enc)
        K = raw.shape[1] // quants.GGML_QUANT_SIZES[enc][1] * quants.GGML_QUANT_SIZES[enc][0]
        deq = np.asarray(quants.dequantize(raw, enc), dtype=np.float32).reshape(raw.shape[0], K)
        x = np.random.default_rng(K).standard_normal((16, K)).astype(np.float32)
        check(enc, f, raw, deq, q8_k(x), f"{name} K={K}")


PAIRS_C = """#include <stddef.h>
#include <stdint.h>
typedef void (*dot_t)(int, float *, size_t, const void *, size_t, const void *, size_t, int);
void pairs(dot_t dot, const char *w, size_t rb, int64_t m, const char *a, size_t ab, int64_t n, int K, float *o,
           int reps) {
    for (int rep = 0; rep < reps; ++rep)
        for (int64_t r = 0; r < m; ++r)
            for (int64_t j = 0; j < n; ++j) dot(K, o + j * m + r, 0, w + r * rb, 0, a + j * ab, 0, 1);
}
typedef void (*rows_t)(const void *, size_t, int64_t, int64_t, const void *const *, int64_t, float *const *);
void calls(rows_t f, const void *w, size_t rb, int64_t m, int64_t nb, const void *const *acts, int64_t n,
           float *const *out, int reps) {
    for (int rep = 0; rep < reps; ++rep) f(w, rb, m, nb, acts, n, out);
}
"""


def bench(reps: int = 5) -> None:
    """ns per (row, token): the kernel (m = 64 rows a call) against ggml's vec_dot one (row, token) pair at a time
    (stock mul_mat_id's loop, in C), K = 2048 and 4096, best of `reps` (indicative only: a busy machine)."""
    assert ggml.library() is not None, ggml.why_not()
    cpu = ggml_cpu()
    tmp = Path(tempfile.mkdtemp())
    library = cpu if hasattr(cpu, "ggml_moectl_rows_kernel") else compiled(tmp, ["-march=native"])
    (tmp / "pairs.c").write_text(PAIRS_C)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", str(tmp / "pairs.c"), "-o", str(tmp / "pairs.so")], check=True)
    loops = ctypes.CDLL(str(tmp / "pairs.so"))         # both timed in C loops: no ctypes call a product
    pairs, calls = loops.pairs, loops.calls
    pairs.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64, ctypes.c_void_p,
                      ctypes.c_size_t, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    calls.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64, ctypes.c_int64,
                      ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    m = 64
    print(f"{'type':8} {'K':>5} {'n':>3} {'kernel':>8} {'vec_dot':>8} {'x':>6}   ns per (row, token), best of {reps}")
    for enc in TYPES:
        library.ggml_moectl_rows_kernel.restype = ctypes.c_void_p
        f = library.ggml_moectl_rows_kernel(int(enc))
        dot = cpu.ggml_get_type_traits_cpu(int(enc)).contents.vec_dot
        for K in (2048, 4096):
            raw, _ = weights(enc, m, K, seed=1)
            for n in (1, 2, 4, 8, 16, 32):
                a = q8_k(np.random.default_rng(n).standard_normal((n, K)).astype(np.float32))
                acts = (ctypes.c_void_p * n)(*[a[j].ctypes.data for j in range(n)])
                o = np.zeros((n, m), dtype=np.float32)
                outs = (ctypes.c_void_p * n)(*[o[j].ctypes.data for j in range(n)])
                inner = max(1, 256 // n)
                ours = ref = float("inf")
                for _ in range(reps):
                    t0 = time.perf_counter_ns()
                    calls(f, raw.ctypes.data, raw.shape[1], m, K // QK_K, acts, n, outs, inner)
                    ours = min(ours, (time.perf_counter_ns() - t0) / (inner * m * n))
                    t0 = time.perf_counter_ns()
                    pairs(dot, raw.ctypes.data, raw.shape[1], m, a.ctypes.data, a.strides[0], n, K, o.ctypes.data,
                          inner)
                    ref = min(ref, (time.perf_counter_ns() - t0) / (inner * m * n))
                print(f"{enc.name:8} {K:5} {n:3} {ours:8.1f} {ref:8.1f} {ref / ours:6.2f}")


if __name__ == "__main__":
    os.environ.setdefault("MOECTL_GGML_PRUNE", "0")
    torch.set_num_threads(1)
    bench()
