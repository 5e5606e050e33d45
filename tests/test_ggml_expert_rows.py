"""moectl's expert-rows kernels inside ggml's mul_mat_id (kernels/ggml_patch.py `_ROWS_EXPERT`, the kernels in
kernels/ggml_rows/): an expert whose type has a kernel (Q5_K, Q6_K, Q3_K, IQ4_XS, IQ3_XXS, IQ2_XXS on an AVX-512
build) and `MOECTL_GGML_EXPERT_ROWS_MIN`..`MOECTL_GGML_EXPERT_ROWS` routed rows (by default every expert with one)
runs it on chunks of 32 weight rows with every routed token inside (64 a call), where stock ggml runs vec_dot one
(row, token) pair at a time below 8 rows and its tiled kernel from 8; on with the experts' gemm (`MOECTL_GGML_EXPERT_GEMM`, the prefetch on), `ggml.set_expert_gemm(False)`: stock.

Checked through ggml's own mul_mat_id, for each encoding with a kernel on this build, 1 and 2 threads, experts given
0-70 routed rows (one past a call's 64 tokens), 200 rows an expert (6 chunks and a partial one), K = 1024 (4 blocks),
x shared by a token's experts (gate, up: ne11 = 1) or one row per used expert (down: ne11 = U):
  - every row equals `gguf.quants.dequantize` + an fp32 matmul within the activation quantization llama.cpp does
    (test_ggml_kernels.check_product): the kernels read the q8_K rows vec_dot reads;
  - on against off within `GEMM_VS_GEMV` (2e-5 of |W| @ |x|): each block's integer sums are exact in both, the fp32
    sums over blocks in another order;
  - the experts with one routed row (a decode's) through it by default, bit-equal to off (vec_dot) with the least
    at 2 (`MOECTL_GGML_EXPERT_ROWS_MIN`); with the most at 8 (`MOECTL_GGML_EXPERT_ROWS`) the experts above it
    bit-equal to off (ggml's tiled kernel), at 0 all; the prefetch off is stock;
  - the path decided once an op (the switch flipped from another thread: no hang, no mixed product) is
    test_ggml_expert_sgemm.py's `test_the_path_is_decided_once_an_op` for Q5_K;
  - a tiny GGUF's greedy tokens on a 40-token prefill are the same with the kernels on and off.
The kernels' own tests (every shape and row stride, against ggml's vec_dot called directly): test_ggml_rows_k.py,
test_ggml_rows_iq.py.

Legend: T = tokens, K = input width, N = output rows, A = stacked experts, U = experts used per token.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from moectl.kernels import ggml, ggml_patch
from test_ggml_expert_gemm import (check_rows, gemm_bound, gemm_on_off, prefetch_off_is_stock, routed_case,
                                   tiny_prefill_on_off)
from test_ggml_kernels import lib, weights  # noqa: F401  (autouse: ggml built here, or skip / fail)

torch.set_num_threads(1)

ROWS_TYPES = (Q.Q5_K, Q.Q6_K, Q.Q3_K, Q.IQ4_XS, Q.IQ3_XXS, Q.IQ2_XXS)
K = 4 * 256                     # check_product's bound stays well under the signal at this width
ROWS = 200                      # 6 chunks of 32 rows and a partial one
COUNTS = (0, 1, 2, 3, 4, 5, 7, 8, 14, 20, 70)   # routed rows per expert: vec_dot (0, 1); the kernel; 70 > 64 a call
CHUNKS = -(-ROWS // 32)
MIN = ggml_patch.ROWS_MIN_DEFAULT   # the least routed rows an expert for the kernel, unset MOECTL_GGML_EXPERT_ROWS_MIN


def rows_chunks() -> int:
    """The chunks the rows kernels computed in mul_mat_id so far (the patch's counter)."""
    return ctypes.c_int64.in_dll(ggml.library(), "ggml_moectl_rows_chunks").value


def with_rows(rows_min: int, rows_max: int, fn):
    """fn() with the rows kernels' least and most rows an expert set, the process's settings restored after (fn's
    2-thread handle made first: a new handle sets them from the environment)."""
    ggml.handle(2)
    try:
        ggml.set_expert_rows_min(rows_min)
        ggml.set_expert_rows(rows_max)
        return fn()
    finally:
        ggml.set_expert_rows_min(ggml.expert_rows_min())
        ggml.set_expert_rows(ggml.expert_rows())


def counted(fn):
    """(fn(), the rows chunks it computed)."""
    before = rows_chunks()
    y = fn()
    return y, rows_chunks() - before


@pytest.fixture(scope="module", params=ROWS_TYPES, ids=lambda t: t.name)
def experts(request):
    """(encoding, stacked raw [A * ROWS, row bytes], dequantized [A, ROWS, K]); skipped where this build has no
    kernel for the encoding (the AVX2 build: none)."""
    enc = request.param
    if not ggml.rows_kernel(enc):
        pytest.skip(f"this build of ggml has no expert-rows kernel for {enc.name}")
    A = len(COUNTS)
    raw, deq = weights(enc, A * ROWS, K, seed=int(enc))
    return enc, raw, deq.reshape(A, ROWS, K)


def test_an_avx512_build_has_every_kernel():
    """Where the loaded ggml was built with AVX-512 (its own feature bits), every encoding of ROWS_TYPES has one."""
    if "avx512" not in ggml.features():
        pytest.skip("this build of ggml has no AVX-512")
    assert [e.name for e in ROWS_TYPES if not ggml.rows_kernel(e)] == []
    assert {e.name: int(e) for e in ROWS_TYPES} == ggml.ROWS_ENCODINGS                   # ggml's type codes
    assert sorted(ggml.describe()["expert_rows"]["types"]) == sorted(e.name for e in ROWS_TYPES)   # inspect's


@pytest.mark.parametrize("env, on", [({}, True), ({"MOECTL_GGML_EXPERT_ROWS": "0"}, False),
                                     ({"MOECTL_GGML_EXPERT_GEMM": "0"}, False), ({"MOECTL_GGML_PREFETCH": "0"}, False),
                                     ({"MOECTL_GGML_EXPERT_ROWS_MIN": "3", "MOECTL_GGML_EXPERT_ROWS": "2"}, False)])
def test_describe_says_whether_a_handle_runs_them(env, on, monkeypatch):
    """inspect's "moectl's expert kernels" row: on where the patch's own condition holds (the prefetch and the experts'
    gemm on, the least rows an expert at most the most)."""
    for name in ("MOECTL_GGML_EXPERT_ROWS", "MOECTL_GGML_EXPERT_ROWS_MIN", "MOECTL_GGML_EXPERT_GEMM",
                 "MOECTL_GGML_PREFETCH"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert ggml.describe()["expert_rows"]["on"] is on
    assert not ggml.rows_kernel(Q.Q8_0) and not ggml.rows_kernel(Q.Q4_K)     # tinyBLAS's, repacked


@pytest.mark.parametrize("per_expert_x", [False, True], ids=["gate_up", "down"])
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_are_right_and_within_summation_order(experts, threads, per_expert_x, monkeypatch):
    """Experts given 0-70 rows, gate/up and down layouts: right row by row, within summation order of off; the
    kernel ran every chunk of the experts with `MIN` rows or more (the default), the rest bit-equal to off."""
    enc, raw, deq = experts
    monkeypatch.setenv("MOECTL_GGML_REPACK", "0")
    ids, x = routed_case(COUNTS, K, threads, per_expert_x)              # [T, U], [T, K] or [T, U, K]
    (on, n_on), (off, n_off) = gemm_on_off(lambda: counted(
        lambda: ggml.mul_mat_id(enc, raw, (len(COUNTS), ROWS, K), x, ids, threads)))
    assert n_on == CHUNKS * sum(c >= MIN for c in COUNTS) and n_off == 0
    check_rows(enc, raw, deq, x, ids, on)
    diff = (on - off).abs()
    assert (diff <= gemm_bound(deq, x, ids)).all(), f"{enc.name}: rows on - off {diff.max():.3g}"
    T, U = ids.shape
    kernel = torch.tensor([COUNTS[int(a)] >= MIN for a in ids.flatten()]).reshape(T, U)
    assert torch.equal(on[~kernel], off[~kernel])                       # below MIN: the same vec_dot


@pytest.mark.parametrize("rows_min, rows_max", [(2, 8), (2, 0), (1, 1 << 20)], ids=["2-8", "off", "1-all"])
def test_the_thresholds_leave_the_rest_to_stock(experts, rows_min, rows_max, monkeypatch):
    """`MOECTL_GGML_EXPERT_ROWS=8`: the experts above 8 rows run ggml's tiled kernel as stock does (bit-equal to the
    switch off there), those with 2-8 the kernel; 0: no expert runs it, the product is stock's;
    `MOECTL_GGML_EXPERT_ROWS_MIN=1`: the experts with one row (a decode's) run it too."""
    enc, raw, deq = experts
    monkeypatch.setenv("MOECTL_GGML_REPACK", "0")
    ids, x = routed_case(COUNTS, K, 2, False)
    run = lambda: counted(lambda: ggml.mul_mat_id(enc, raw, (len(COUNTS), ROWS, K), x, ids, 2))   # noqa: E731
    (on, n_on), (off, _) = gemm_on_off(lambda: with_rows(rows_min, rows_max, run))
    assert n_on == CHUNKS * sum(max(1, rows_min) <= c <= rows_max for c in COUNTS)
    T, U = ids.shape
    kernel = torch.tensor([rows_min <= COUNTS[int(a)] <= rows_max for a in ids.flatten()]).reshape(T, U)
    assert torch.equal(on[~kernel], off[~kernel])
    check_rows(enc, raw, deq, x, ids, on)
    if rows_min == 1:
        assert (on[kernel] - off[kernel]).abs().max() <= gemm_bound(deq, x, ids)[kernel].max()


@pytest.mark.parametrize("rows_min", [1, 2])
@pytest.mark.parametrize("threads", [1, 2])
def test_one_row_experts(experts, threads, rows_min, monkeypatch):
    """Every expert with at most one routed row (a decode's step): at the least of 1 row (the default) the kernel
    runs each (within summation order of off), at 2 it does not and the switch changes nothing."""
    enc, raw, deq = experts
    monkeypatch.setenv("MOECTL_GGML_REPACK", "0")
    ids = torch.tensor([[0, 2], [3, 5], [1, 4], [6, 9]], dtype=torch.int32)
    x = torch.randn(len(ids), K, generator=torch.Generator().manual_seed(6))
    run = lambda: counted(lambda: ggml.mul_mat_id(enc, raw, (deq.shape[0], ROWS, K), x, ids, threads))  # noqa: E731
    (on, n_on), (off, _) = gemm_on_off(lambda: with_rows(rows_min, 1 << 20, run))
    check_rows(enc, raw, deq, x, ids, on)
    if rows_min == 1:
        assert n_on == CHUNKS * 8 and ((on - off).abs() <= gemm_bound(deq, x, ids)).all()
    else:
        assert n_on == 0 and torch.equal(on, off)


def test_prefetch_off_is_stock(experts, monkeypatch):
    """`MOECTL_GGML_PREFETCH=0` with the gemm switch on: the kernel does not run, the product is stock ggml's."""
    enc, raw, deq = experts
    monkeypatch.setenv("MOECTL_GGML_REPACK", "0")
    ids, x = routed_case(COUNTS, K, 2, False)
    prefetch_off_is_stock(lambda: ggml.mul_mat_id(enc, raw, (len(COUNTS), ROWS, K), x, ids, 2), rows_chunks)


@pytest.mark.parametrize("enc", [Q.Q5_K, Q.IQ4_XS], ids=lambda t: t.name)
def test_a_tiny_gguf_prefill_keeps_its_greedy_tokens(enc, tmp_path, monkeypatch):
    """A tiny Mixtral GGUF with `enc` experts (256 wide), a 40-token prompt (experts routed 2 rows and more): the greedy tokens of
    the prefill and the steps after it are the same with the kernels on and off, and they ran."""
    if not ggml.rows_kernel(enc):
        pytest.skip(f"this build of ggml has no expert-rows kernel for {enc.name}")
    grew = tiny_prefill_on_off(tmp_path, monkeypatch, enc, rows_chunks, k256=True)
    assert grew[True] > 0 and grew[False] == 0
