"""The repacked experts' routed rows 4 at a time by gemm (kernels/ggml_patch.py `_EXPERT_TILES`, `_EXPERT_GEMM_ROWS`):
inside the experts' row tiles each expert's routed rows go in groups of 4 through ggml's gemm (quantized once,
4-interleaved, as the dense forward_mul_mat does), the rest (count % 4) through gemv; `MOECTL_GGML_EXPERT_GEMM=0`
(`ggml.set_expert_gemm(False)`) runs every row by gemv, as the row tiles did before.

Checked, for each encoding this CPU's ggml repacks (Q4_0, Q4_K, IQ4_NL, MXFP4), 1 and 2 threads, experts given 0-20
routed rows (groups of 4 and remainders), several row tiles and a partial one, x shared by a token's experts (gate,
up: ne11 = 1) or one row per used expert (down: ne11 = U), an expert repeated within a token:
  - every row equals `gguf.quants.dequantize` + an fp32 matmul within the activation quantization llama.cpp does
    (test_ggml_kernels.check_product): gemm's 4-row quantization is ggml's q8 of each row;
  - the gemm on against off: within gemm's own difference from gemv, `GEMM_VS_GEMV` (below, measured);
  - bit-equal to the gemm off where no expert gets 4 rows (only gemv runs);
  - a workspace planned for a wide product, then a narrow one, then wide again in one handle (the work buffer is
    kept and grows: the gemm's room is part of each plan's size);
  - a tiny GGUF's greedy tokens on a 40-token prefill are the same with the gemm on and off.

The tolerance of on against off: gemm and gemv read the same weights and the same q8 activations (ggml's 4-row
quantizers give each row's q8 bytes: the dequantize check above holds row by row at its 2e-5 summation slack), so
they differ in fp32 summation order only. Measured (AVX-512 host, its native and AVX2 builds alike, these shapes):
Q4_0, IQ4_NL, MXFP4 bit-equal (their integer sums are exact, the fp32 steps in the same order); Q4_K up to 1e-7 of
the mean |W| @ |x|, where ggml's dense product, which llama.cpp itself computes by gemm for 4 rows and gemv for one
(forward_mul_mat), differs by 5e-8 for the same 4 rows. The bound, `GEMM_VS_GEMV` = 2e-5 of |W| @ |x| per output, is
check_product's summation slack (the one ggml's dense products are held to in test_ggml_kernels): the order of fp32
sums, not a host's measurement.

Legend: T = tokens, K = input width, N = output rows, A = stacked experts, U = experts used per token.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from moectl.errors import MoectlError
from moectl.kernels import ggml
from test_ggml_kernels import check_product, lib, weights  # noqa: F401  (autouse: ggml built here, or skip / fail)

torch.set_num_threads(1)

REPACKED = (Q.Q4_0, Q.Q4_K, Q.IQ4_NL, Q.MXFP4)
K = 1024
ROWS = 1024 + 8 * 3             # q4_K's ~256 KB tile is 448 rows of 576 bytes: 2 whole tiles and a partial one
COUNTS = (0, 1, 2, 3, 4, 5, 7, 8, 14, 20)   # routed rows per expert: gemv only, groups of 4, groups + remainders
GEMM_VS_GEMV = 2e-5             # of |W| @ |x| per output: fp32 summation order (module doc)
DISTANCE = 4096


def routed(counts, U: int = 2, seed: int = 0) -> torch.Tensor:
    """ids [T, U] routing expert a to counts[a] rows (T = sum / U): the experts' slots sorted, token t takes slots t,
    t + T, ...: distinct experts per token where no count exceeds T; tokens shuffled."""
    slots = [a for a, c in enumerate(counts) for _ in range(c)]
    assert len(slots) % U == 0
    T = len(slots) // U
    ids = torch.tensor(slots, dtype=torch.int32).reshape(U, T).T.contiguous()
    return ids[torch.randperm(T, generator=torch.Generator().manual_seed(seed))].contiguous()


def routed_case(counts, K: int, threads: int, per_expert_x: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [T, U] routing expert a to counts[a] rows (`routed`, seeded by `threads`), x: [T, U, K], one row per used
    expert (down), or [T, K], shared by a token's experts (gate, up))."""
    ids = routed(counts, seed=threads)
    T, U = ids.shape
    g = torch.Generator().manual_seed(5)
    return ids, torch.randn(T, U, K, generator=g) if per_expert_x else torch.randn(T, K, generator=g)


def gemm_on_off(fn):
    """(fn() with the row tiles' gemm on, fn() with it off), both with the row tiles (prefetch) on; the process's
    settings restored after."""
    try:
        ggml.set_prefetch(DISTANCE)
        ggml.set_expert_gemm(True)
        on = fn()
        ggml.set_expert_gemm(False)
        off = fn()
    finally:
        ggml.set_prefetch(ggml.prefetch_bytes())
        ggml.set_expert_gemm(ggml.expert_gemm())
    return on, off


def prefetch_off_is_stock(run, counter) -> None:
    """run() with the prefetch off (`MOECTL_GGML_PREFETCH=0`) and the experts' gemm switch on is stock ggml: equal to
    run() with the switch off, and the path's counter() does not move; the process's settings restored after."""
    _, off = gemm_on_off(run)
    try:
        ggml.set_prefetch(0)
        ggml.set_expert_gemm(True)
        before = counter()
        stock = run()
        assert counter() == before
    finally:
        ggml.set_prefetch(ggml.prefetch_bytes())
        ggml.set_expert_gemm(ggml.expert_gemm())
    assert torch.equal(stock, off)


@pytest.fixture(scope="module", params=REPACKED, ids=lambda t: t.name)
def experts(request):
    """(encoding, stacked raw [A * ROWS, row bytes] registered for repack, dequantized [A, ROWS, K])."""
    enc = request.param
    mp = pytest.MonkeyPatch()
    mp.setenv("MOECTL_GGML_REPACK", "all")
    if not ggml.repacks(enc, (ROWS, K)):
        mp.undo()
        pytest.skip(f"this CPU's ggml does not repack {enc.name}")
    A = len(COUNTS)
    raw, deq = weights(enc, A * ROWS, K, seed=int(enc))
    ggml.register_stable(raw)
    yield enc, raw, deq.reshape(A, ROWS, K)
    mp.undo()


def check_rows(enc, raw, deq, x, ids, y):
    """Every routed row of y [T, U, N] against dequantize @ x (x [T, K] or [T, U, K])."""
    A = deq.shape[0]
    rows = raw.reshape(A, deq.shape[1], -1)
    for a in range(A):
        t, u = torch.nonzero(ids == a, as_tuple=True)
        if len(t):
            xa = x[t] if x.dim() == 2 else x[t, u]
            check_product(enc, y[t, u], deq[a], xa, rows[a])


def gemm_bound(deq, x, ids) -> torch.Tensor:
    """GEMM_VS_GEMV of |W| @ |x| for each routed row: [T, U, N]."""
    T, U = ids.shape
    out = torch.zeros(T, U, deq.shape[1])
    for a in range(deq.shape[0]):
        t, u = torch.nonzero(ids == a, as_tuple=True)
        if len(t):
            xa = x[t] if x.dim() == 2 else x[t, u]
            out[t, u] = xa.abs() @ deq[a].abs().T
    return GEMM_VS_GEMV * out + 1e-9


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("per_expert_x", [False, True], ids=["gate_up", "down"])
def test_gemm_rows_are_right_and_within_gemms_difference(experts, threads, per_expert_x, monkeypatch):
    enc, raw, deq = experts
    monkeypatch.setenv("MOECTL_GGML_REPACK", "all")
    A = deq.shape[0]
    ids, x = routed_case(COUNTS, K, threads, per_expert_x)              # [T, U], [T, K] or [T, U, K]
    T, U = ids.shape
    on, off = gemm_on_off(lambda: ggml.mul_mat_id(enc, raw, (A, ROWS, K), x, ids, threads))
    assert ggml.repack_stats()["repacked"] > 0                          # the repacked path is what ran
    check_rows(enc, raw, deq, x, ids, on)
    diff = (on - off).abs()
    assert (diff <= gemm_bound(deq, x, ids)).all(), f"{enc.name}: gemm on - off {diff.max():.3g}"
    fours = torch.tensor([COUNTS[int(a)] >= 4 for a in ids.flatten()]).reshape(T, U)
    assert torch.equal(on[~fours], off[~fours])                         # fewer than 4 rows: the same gemv


@pytest.mark.parametrize("threads", [1, 2])
def test_under_four_rows_an_expert_is_bit_equal(experts, threads, monkeypatch):
    """No expert with 4 routed rows: only gemv runs, the gemm's switch changes nothing (a decode's step, a short
    prompt's); an expert repeated within a token."""
    enc, raw, deq = experts
    monkeypatch.setenv("MOECTL_GGML_REPACK", "all")
    A = deq.shape[0]
    ids = torch.tensor([[0, 2], [3, 3], [1, 0], [2, 9], [9, 1]], dtype=torch.int32)
    x = torch.randn(len(ids), K, generator=torch.Generator().manual_seed(6))
    on, off = gemm_on_off(lambda: ggml.mul_mat_id(enc, raw, (A, ROWS, K), x, ids, threads))
    assert torch.equal(on, off)
    check_rows(enc, raw, deq, x, ids, on)


def test_repeated_experts_within_a_token_take_the_gemm(experts, monkeypatch):
    """An expert twice in a token's ids (its rows grouped with the other tokens'): right row by row."""
    enc, raw, deq = experts
    monkeypatch.setenv("MOECTL_GGML_REPACK", "all")
    A = deq.shape[0]
    ids = torch.tensor([[4, 4], [4, 1], [1, 4], [4, 4], [7, 4]], dtype=torch.int32)     # expert 4: 7 rows
    x = torch.randn(len(ids), K, generator=torch.Generator().manual_seed(7))
    on, off = gemm_on_off(lambda: ggml.mul_mat_id(enc, raw, (A, ROWS, K), x, ids, 2))
    check_rows(enc, raw, deq, x, ids, on)
    assert (((on - off).abs()) <= gemm_bound(deq, x, ids)).all()


def test_a_kept_work_buffer_grows_with_the_gemms_room():
    """One handle: a wide product (K = 4096: its gemm groups and scratch), a narrow one (K = 256) in the same work
    buffer, then the wide one again: each equal to the same product in a fresh handle's first call."""
    enc = Q.Q4_0
    if not ggml.repacks(enc, (256, 4096)):
        pytest.skip(f"this CPU's ggml does not repack {enc.name}")
    mp = pytest.MonkeyPatch()
    mp.setenv("MOECTL_GGML_REPACK", "all")
    try:
        A, N = 4, 256
        runs = {}
        for k in (4096, 256):
            raw, _ = weights(enc, A * N, k, seed=k)
            ggml.register_stable(raw)
            ids = routed((6, 9, 1, 8))
            x = torch.randn(len(ids), k, generator=torch.Generator().manual_seed(k))
            runs[k] = (raw, x, ids)
        ggml.set_prefetch(DISTANCE)
        ggml.set_expert_gemm(True)
        got = []
        for k in (4096, 256, 4096):
            raw, x, ids = runs[k]
            got.append(ggml.mul_mat_id(enc, raw, (A, N, k), x, ids, 2))
        for k, y in zip((4096, 256, 4096), got):
            raw, x, ids = runs[k]
            h = ggml.require().mg_new(2, 0)
            try:
                want = torch.empty_like(y)
                ggml.require().mg_mul_mat_id(h, int(enc), raw.ctypes.data, A, N, k, x.data_ptr(), 1,
                                             ids.data_ptr(), ids.shape[1], ids.shape[0], want.data_ptr())
            finally:
                ggml.require().mg_free(h)
            assert torch.equal(y, want), k
    finally:
        ggml.set_prefetch(ggml.prefetch_bytes())
        ggml.set_expert_gemm(ggml.expert_gemm())
        mp.undo()


def test_the_switch_is_read_as_a_handle_is_made(monkeypatch):
    monkeypatch.delenv(ggml.EXPERT_GEMM_ENV, raising=False)
    assert ggml.expert_gemm() is True
    monkeypatch.setenv(ggml.EXPERT_GEMM_ENV, "0")
    assert ggml.expert_gemm() is False and ggml.describe()["expert_gemm"] is False
    monkeypatch.setenv(ggml.EXPERT_GEMM_ENV, "yes")
    with pytest.raises(MoectlError, match="MOECTL_GGML_EXPERT_GEMM='yes'"):
        ggml.expert_gemm()
    monkeypatch.setenv(ggml.EXPERT_GEMM_ENV, "0")
    seen = []
    monkeypatch.setattr(ggml, "set_expert_gemm", seen.append)
    monkeypatch.setattr(ggml._handles, "by_threads", {})
    h = ggml.handle(3)
    try:
        assert seen == [False]
    finally:
        ggml.require().mg_free(h)


def tiny_prefill_on_off(tmp_path, monkeypatch, expert_encoding, counter, k256: bool = False) -> dict[bool, int]:
    """A tiny Mixtral GGUF with `expert_encoding` experts (`k256`: rows of whole 256-weight blocks, as K-quants and
    IQ types need), a 40-token prompt, the prefill and 4 greedy steps with the experts' gemm switch on and off
    (prefetch on): the same greedy tokens, logits within 1e-3 of their scale. Returns {on: how much counter() grew
    over its run}."""
    from gguf_build import k256_mixtral, write_gguf
    from test_ggml_graph import _checkpoint, _load
    from test_runtime import _engine_run

    ckpt = k256_mixtral(tmp_path) if k256 else _checkpoint("mixtral", tmp_path)
    path = write_gguf(ckpt, tmp_path / "Q.gguf", dense_encoding=Q.Q8_0, expert_encoding=expert_encoding)
    prompt = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(8))
    runs, grew = {}, {}
    for on in (True, False):
        monkeypatch.setenv(ggml.EXPERT_GEMM_ENV, "1" if on else "0")
        monkeypatch.setenv(ggml.PREFETCH_ENV, str(DISTANCE))
        monkeypatch.setattr(ggml._handles, "by_threads", {})        # a new handle reads the switches
        eng = _load(path, tmp_path / f"run{on}")
        assert eng.graph is not None, eng.plan_note
        before = counter()
        runs[on] = _engine_run(eng, prompt, 4)
        grew[on] = counter() - before
    (logits_on, ids_on), (logits_off, ids_off) = runs[True], runs[False]
    assert ids_on == ids_off
    scale = max(b.abs().max().item() for b in logits_off)
    err = max((a - b).abs().max().item() for a, b in zip(logits_on, logits_off))
    assert err <= 1e-3 * scale, (err, scale)
    return grew


def test_a_tiny_gguf_prefill_keeps_its_greedy_tokens(tmp_path, monkeypatch):
    """A tiny Mixtral GGUF with Q4_0 experts (repacked), a 40-token prompt (experts routed 4 rows and more): the
    greedy tokens of the prefill and the steps after it are the same with the gemm on and off."""
    monkeypatch.setenv("MOECTL_GGML_REPACK", "all")
    grew = tiny_prefill_on_off(tmp_path, monkeypatch, Q.Q4_0, lambda: ggml.repack_stats()["graphs"])
    assert grew[True] > 0 and grew[False] > 0                           # its graphs read repacked experts
