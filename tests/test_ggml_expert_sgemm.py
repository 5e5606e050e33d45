"""The experts not repacked by llamafile's tinyBLAS (kernels/ggml_patch.py `_SGEMM_EXPERT`): ggml-cpu.c's mul_mat_id
gathers each expert's routed rows (>= 2 of them) and runs tinyBLAS on 32 weight rows at a time with every routed
token inside, where stock ggml runs vec_dot one (row, token) pair at a time; on with the repacked experts' gemm
(`MOECTL_GGML_EXPERT_GEMM`, the prefetch on), `ggml.set_expert_gemm(False)`: stock's vec_dot.

Checked, for each encoding tinyBLAS takes with q8_0 activations (Q8_0; Q4_0, Q5_0, IQ4_NL where not repacked), 1 and
2 threads, experts given 0-20 routed rows, 200 rows an expert (6 chunks and a partial one), K = 1056 (not a multiple
of 256), x shared by a token's experts (gate, up: ne11 = 1) or one row per used expert (down: ne11 = U):
  - every row equals `gguf.quants.dequantize` + an fp32 matmul within the activation quantization llama.cpp does
    (test_ggml_kernels.check_product): tinyBLAS reads the same q8_0 rows vec_dot reads;
  - on against off within 2e-5 of |W| @ |x| (below);
  - bit-equal to off where no expert gets 2 rows (tinyBLAS does not run: its chunk count stays);
  - the prefetch off (`MOECTL_GGML_PREFETCH=0`) is stock ggml with the switch on;
  - a tiny Q8_0 GGUF's greedy tokens on a 40-token prefill are the same with it on and off;
  - the path is decided once an op (thread 0, before the row mapping's barrier): the switch flipped from another
    thread while products run gives no hang and each product equal to the switch on or off, never a mix; the same
    for the repacked experts' gemm (repack.cpp), whose gather barrier a thread could skip before.

The tolerance of on against off: both compute each block's integer dot exactly and scale it by the same fp16 scales;
they differ in the order of the fp32 sums over blocks (vec_dot: 8 lanes, then a horizontal sum; tinyBLAS: its tile's
lanes). Measured on this AVX-512 host (native and AVX2 builds) at these shapes: Q8_0, Q4_0, Q5_0 bit-equal (the fp32
steps in the same order), IQ4_NL within 3.1e-8 of |W| @ |x|. The bound is check_product's summation slack,
test_ggml_expert_gemm's `GEMM_VS_GEMV` = 2e-5 of |W| @ |x| per output (the one ggml's dense products, which llama.cpp
computes by tinyBLAS, are held to in test_ggml_kernels): the order of fp32 sums, not a host's measurement.

Legend: T = tokens, K = input width, N = output rows, A = stacked experts, U = experts used per token.
"""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from moectl.kernels import ggml
from test_ggml_expert_gemm import (DISTANCE, GEMM_VS_GEMV, check_rows, gemm_bound, gemm_on_off, prefetch_off_is_stock,
                                   routed, routed_case, tiny_prefill_on_off)
from test_ggml_kernels import lib, weights  # noqa: F401  (autouse: ggml built here, or skip / fail)

torch.set_num_threads(1)

SGEMM = (Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.IQ4_NL)
K = 1024 + 32                   # not a multiple of 256: q8_0's 32-blocks only
ROWS = 200                      # 6 chunks of 32 rows and a partial one
COUNTS = (0, 1, 2, 3, 4, 5, 7, 8, 14, 20)   # routed rows per expert: vec_dot (0, 1), tinyBLAS tiles and remainders
assert GEMM_VS_GEMV == 2e-5    # the bound here too (`gemm_bound`): of |W| @ |x| per output, fp32 summation order


def sgemm_chunks() -> int:
    """The chunks tinyBLAS computed in mul_mat_id so far (the patch's counter)."""
    return ctypes.c_int64.in_dll(ggml.library(), "ggml_moectl_sgemm_chunks").value


@pytest.fixture(scope="module", params=SGEMM, ids=lambda t: t.name)
def experts(request):
    """(encoding, stacked raw [A * ROWS, row bytes], dequantized [A, ROWS, K]); never registered: not repacked."""
    enc = request.param
    A = len(COUNTS)
    raw, deq = weights(enc, A * ROWS, K, seed=int(enc))
    return enc, raw, deq.reshape(A, ROWS, K)


def on_off_counted(fn):
    """(on, off, tinyBLAS chunks with it on, with it off): `gemm_on_off`, counting."""
    counts = []

    def counted():
        before = sgemm_chunks()
        y = fn()
        counts.append(sgemm_chunks() - before)
        return y

    on, off = gemm_on_off(counted)
    return on, off, counts[0], counts[1]


@pytest.mark.parametrize("per_expert_x", [False, True], ids=["gate_up", "down"])
@pytest.mark.parametrize("threads", [1, 2])
def test_sgemm_rows_are_right_and_within_summation_order(experts, threads, per_expert_x, monkeypatch):
    """Experts given 0-20 rows, gate/up and down layouts: right row by row, within summation order of off, bit-equal
    to off for the experts with one row; tinyBLAS ran every chunk of the experts with 2 rows or more."""
    enc, raw, deq = experts
    monkeypatch.setenv("MOECTL_GGML_REPACK", "0")
    ids, x = routed_case(COUNTS, K, threads, per_expert_x)              # [T, U], [T, K] or [T, U, K]
    on, off, n_on, n_off = on_off_counted(lambda: ggml.mul_mat_id(enc, raw, (len(COUNTS), ROWS, K), x, ids, threads))
    T, U = ids.shape
    chunks = -(-ROWS // 32)
    assert n_on == chunks * sum(c >= 2 for c in COUNTS) and n_off == 0  # tinyBLAS ran, for every expert with >= 2
    check_rows(enc, raw, deq, x, ids, on)
    diff = (on - off).abs()
    assert (diff <= gemm_bound(deq, x, ids)).all(), f"{enc.name}: sgemm on - off {diff.max():.3g}"
    twos = torch.tensor([COUNTS[int(a)] >= 2 for a in ids.flatten()]).reshape(T, U)
    assert torch.equal(on[~twos], off[~twos])                           # one row: the same vec_dot


@pytest.mark.parametrize("threads", [1, 2])
def test_under_two_rows_an_expert_is_bit_equal(experts, threads, monkeypatch):
    """No expert with 2 routed rows (a decode's step): tinyBLAS does not run, the switch changes nothing."""
    enc, raw, deq = experts
    monkeypatch.setenv("MOECTL_GGML_REPACK", "0")
    A = deq.shape[0]
    ids = torch.tensor([[0, 2], [3, 5], [1, 4], [6, 9]], dtype=torch.int32)
    x = torch.randn(len(ids), K, generator=torch.Generator().manual_seed(6))
    on, off, n_on, _ = on_off_counted(lambda: ggml.mul_mat_id(enc, raw, (A, ROWS, K), x, ids, threads))
    assert n_on == 0 and torch.equal(on, off)
    check_rows(enc, raw, deq, x, ids, on)


def test_repeated_experts_within_a_token(experts, monkeypatch):
    """An expert twice in a token's ids, one x row per used expert (down): its rows gathered with the other tokens',
    each to its own dst row."""
    enc, raw, deq = experts
    monkeypatch.setenv("MOECTL_GGML_REPACK", "0")
    ids = torch.tensor([[4, 4], [4, 1], [1, 4], [4, 4], [7, 4]], dtype=torch.int32)     # expert 4: 7 rows
    x = torch.randn(*ids.shape, K, generator=torch.Generator().manual_seed(7))           # [T, U, K]
    on, off, n_on, _ = on_off_counted(lambda: ggml.mul_mat_id(enc, raw, (deq.shape[0], ROWS, K), x, ids, 2))
    assert n_on == 2 * -(-ROWS // 32)                                   # experts 4 and 1
    check_rows(enc, raw, deq, x, ids, on)
    assert ((on - off).abs() <= gemm_bound(deq, x, ids)).all()


def test_prefetch_off_is_stock(experts, monkeypatch):
    """`MOECTL_GGML_PREFETCH=0` (`set_prefetch(0)`) with the gemm switch on: tinyBLAS does not run, the product is
    stock ggml's vec_dot (bit-equal to the switch off)."""
    enc, raw, deq = experts
    monkeypatch.setenv("MOECTL_GGML_REPACK", "0")
    ids, x = routed_case(COUNTS, K, 2, False)
    prefetch_off_is_stock(lambda: ggml.mul_mat_id(enc, raw, (len(COUNTS), ROWS, K), x, ids, 2), sgemm_chunks)


def _flipping(products, flip) -> tuple[list, bool]:
    """(products() run while another thread calls flip(i) with i = 0, 1, 2, ... in a loop, whether products
    finished within a minute: no hang)."""
    stop = threading.Event()

    def flipper():
        i = 0
        while not stop.is_set():
            flip(i)
            i += 1

    out: list = []
    worker = threading.Thread(target=lambda: out.extend(products()), daemon=True)
    flipping = threading.Thread(target=flipper, daemon=True)
    flipping.start()
    worker.start()
    worker.join(60)
    stop.set()
    flipping.join()
    return out, not worker.is_alive()


@pytest.mark.parametrize("enc", [Q.Q8_0, Q.IQ4_NL, Q.Q4_K, Q.Q5_K], ids=lambda t: t.name)
def test_the_path_is_decided_once_an_op(enc, monkeypatch):
    """The switch flipped from another thread while 2-thread products run (Q8_0, IQ4_NL not repacked: tinyBLAS here;
    Q4_K repacked: the row tiles' gemm, whose gather barrier every thread must reach; Q5_K: moectl's expert-rows
    kernel, test_ggml_expert_rows.py): no hang, every product equal to the switch on or to it off, none a mix of the
    two (IQ4_NL's, Q4_K's and Q5_K's on and off differ in summation order; Q8_0's are bit-equal: no hang only)."""
    monkeypatch.setenv("MOECTL_GGML_REPACK", "all")
    A, N, k = 8, 256, 1024
    raw, _ = weights(enc, A * N, k, seed=11)
    if enc == Q.Q4_K:
        if not ggml.repacks(enc, (N, k)):
            pytest.skip(f"this CPU's ggml does not repack {enc.name}")
        ggml.register_stable(raw)
    ids = routed((9, 7, 0, 12, 4, 8, 2, 6))                                # [T, U]
    x = torch.randn(len(ids), k, generator=torch.Generator().manual_seed(12))
    run = lambda: ggml.mul_mat_id(enc, raw, (A, N, k), x, ids, 2)     # noqa: E731
    on, off = gemm_on_off(run)
    assert torch.equal(on, off) == (enc == Q.Q8_0)                      # a mix would show
    try:
        ggml.set_prefetch(DISTANCE)
        got, finished = _flipping(lambda: [run() for _ in range(200)], lambda i: ggml.set_expert_gemm(i % 2 == 0))
    finally:
        ggml.set_prefetch(ggml.prefetch_bytes())
        ggml.set_expert_gemm(ggml.expert_gemm())
    assert finished, "the products hung with the switch flipping"
    assert len(got) == 200
    n_on = sum(torch.equal(y, on) for y in got)                       # measured: 78-90 of 200 where they differ
    assert n_on + sum(torch.equal(y, off) and not torch.equal(y, on) for y in got) == len(got)


def test_a_tiny_q8_0_gguf_prefill_keeps_its_greedy_tokens(tmp_path, monkeypatch):
    """A tiny Mixtral GGUF with Q8_0 experts, a 40-token prompt (experts routed 2 rows and more): the greedy tokens of
    the prefill and the steps after it are the same with tinyBLAS on and off, and tinyBLAS ran."""
    grew = tiny_prefill_on_off(tmp_path, monkeypatch, Q.Q8_0, sgemm_chunks)
    assert grew[True] > 0 and grew[False] == 0
