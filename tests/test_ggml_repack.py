"""llama.cpp's CPU repack in moectl's ggml shim (moectl/kernels/ggml_shim.c, issue 42): a weight in registered stable
memory (a mapped GGUF) that ggml's CPU_REPACK buffer type takes on this CPU is copied into its interleaved layout on
first use -- a stacked tensor's experts as the ids name them -- and every later graph reads that copy.

Legend: T = tokens, K = input width, N = output rows, A = stacked experts, U = experts used per token, H = hidden
size, I = expert intermediate size.

The tolerance, found: the repacked kernels quantize x exactly as the plain ones (q8_0 / q8_K per block, the same
values), so the products differ only in fp32 summation order: at most 1.3e-6 of max|y| over Q4_0, Q4_K, IQ4_NL and
MXFP4 at T = 1, 3, 4, 64 (measured; ~25 % of the entries bit-equal, MXFP4 80 %). The tests allow 2e-5 of
|W| @ |x| per entry, the fp32 summation bound test_ggml_kernels.py uses.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from moectl.kernels import ggml
from test_ggml_kernels import lib  # noqa: F401  (autouse: ggml built here, or skip / fail as there)

REPACKED = (T.Q4_0, T.Q4_K, T.IQ4_NL, T.MXFP4)        # what ggml repacks with AVX2 (8 rows interleaved)
N, K = 64, 512


@pytest.fixture(autouse=True)
def _repack_on(monkeypatch):
    monkeypatch.setenv("MOECTL_GGML_REPACK", "all")               # every type (the default too)


def repacked_here(enc: T, shape=(N, K)) -> None:
    if not ggml.repacks(enc, shape):
        pytest.skip(f"this CPU's ggml does not repack {enc.name} (llama.cpp interleaves it with AVX2, or NEON "
                    "with i8mm / dotprod, for rows a multiple of 8 or 4)")


def weights(enc: T, rows: int, cols: int, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """(ggml's quantizer's bytes [rows, row bytes], their dequantisation fp32 [rows, cols])."""
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05
    raw = ggml.quantize(int(enc), w)
    deq = torch.from_numpy(np.ascontiguousarray(quants.dequantize(raw, enc), dtype=np.float32)).reshape(rows, cols)
    return raw, deq


def xs(tokens: int, cols: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(tokens, cols, generator=torch.Generator().manual_seed(seed))


def plain(monkeypatch, fn):
    """fn() with the repack switched off (the file's own layout, as before)."""
    with monkeypatch.context() as m:
        m.setenv("MOECTL_GGML_REPACK", "0")
        return fn()


def within_summation(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    assert got.shape == want.shape
    err = (got - want).abs()
    assert (err <= 2e-5 * bound).all(), float((err / bound).max())


def delta(before: dict) -> dict:
    now = ggml.repack_stats()
    return {k: now[k] - before[k] for k in now}


@pytest.mark.parametrize("tokens", [1, 64])
@pytest.mark.parametrize("enc", REPACKED, ids=lambda t: t.name)
def test_mul_mat_reads_a_copy_made_once(enc, tokens, monkeypatch):
    """y = x W^T over registered bytes equals the plain layout's product within fp32 summation; the first call
    repacks the matrix (one copy, its own bytes), the second reuses it."""
    repacked_here(enc)
    raw, deq = weights(enc, N, K)
    x = xs(tokens, K)
    want = plain(monkeypatch, lambda: ggml.mul_mat(enc, raw, (N, K), x))
    ggml.register_stable(raw)
    before = ggml.repack_stats()
    got = ggml.mul_mat(enc, raw, (N, K), x)
    assert delta(before) == {"copies": 1, "repacked": 1, "bytes": raw.nbytes, "graphs": 1}
    within_summation(got, want, x.abs() @ deq.abs().T)
    again = ggml.mul_mat(enc, raw, (N, K), x)
    assert delta(before) == {"copies": 1, "repacked": 1, "bytes": raw.nbytes, "graphs": 2}
    assert torch.equal(again, got)


@pytest.mark.parametrize("enc", REPACKED, ids=lambda t: t.name)
def test_mul_mat_id_repacks_the_experts_its_ids_name(enc, monkeypatch):
    """A stack of A = 4 experts: ids naming experts 0 and 2 repack those two (the stack allocated whole), a later
    call naming 2 and 3 repacks only 3; the products equal the plain layout's; a 2-d matrix of the stack (expert 3's
    own address) reads the stack's copy."""
    A = 4
    repacked_here(enc)
    raw, deq = weights(enc, A * N, K)                                    # [A * N, row bytes]: A matrices [N, K]
    x = xs(3, K)
    ids = torch.tensor([[0, 2], [2, 0], [0, 2]], dtype=torch.int32)      # [T, U]
    want = plain(monkeypatch, lambda: ggml.mul_mat_id(enc, raw, (A, N, K), x, ids))
    ggml.register_stable(raw)
    before = ggml.repack_stats()
    got = ggml.mul_mat_id(enc, raw, (A, N, K), x, ids)
    assert delta(before) == {"copies": 1, "repacked": 2, "bytes": raw.nbytes, "graphs": 1}
    w = deq.reshape(A, N, K)
    bound = torch.stack([torch.stack([x[t].abs() @ w[e].abs().T for e in ids[t].tolist()]) for t in range(3)])
    within_summation(got, want, bound)
    ids2 = torch.tensor([[2, 3]], dtype=torch.int32)
    got2 = ggml.mul_mat_id(enc, raw, (A, N, K), x[:1], ids2)
    want2 = plain(monkeypatch, lambda: ggml.mul_mat_id(enc, raw, (A, N, K), x[:1], ids2))
    assert delta(before)["repacked"] == 3 and delta(before)["copies"] == 1
    within_summation(got2, want2, torch.stack([x[0].abs() @ w[e].abs().T for e in (2, 3)])[None])
    row3 = raw[3 * N:4 * N]                                              # expert 3's matrix, inside the stack
    y3 = ggml.mul_mat(enc, row3, (N, K), x)
    assert delta(before) == {"copies": 1, "repacked": 3, "bytes": raw.nbytes, "graphs": 3}
    within_summation(y3, plain(monkeypatch, lambda: ggml.mul_mat(enc, row3, (N, K), x)), x.abs() @ w[3].abs().T)


@pytest.mark.parametrize("tokens", [1, 5])
def test_moe_layer_equals_the_plain_layout(tokens, monkeypatch):
    """One MoE layer (gate/up Q4_K, down Q4_0: both repacked; llama.cpp's build_moe_ffn graph) equals the plain
    layout's within 1e-5 of its scale (summation order, carried through SiLU and the down product); three copies."""
    A, H, I, U = 4, 256, 256, 2
    for enc in (T.Q4_K, T.Q4_0):
        repacked_here(enc, (I, H))
    g, _ = weights(T.Q4_K, A * I, H, 2)
    u, _ = weights(T.Q4_K, A * I, H, 3)
    d, _ = weights(T.Q4_0, A * H, I, 4)
    x = xs(tokens, H)
    ids = torch.tensor([[(t + j) % A for j in range(U)] for t in range(tokens)], dtype=torch.int32)
    wts = torch.full((tokens, U), 0.5)
    encs = (T.Q4_K, T.Q4_K, T.Q4_0)

    def run():
        return ggml.moe(encs, g, u, d, A, H, I, x, ids, wts)

    want = plain(monkeypatch, run)
    for a in (g, u, d):
        ggml.register_stable(a)
    before = ggml.repack_stats()
    got = run()
    used = len(set(ids.flatten().tolist()))
    assert delta(before) == {"copies": 3, "repacked": 3 * used, "bytes": g.nbytes + u.nbytes + d.nbytes,
                             "graphs": 1}
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_unregistered_memory_is_not_repacked(monkeypatch):
    """Bytes in no registered range (a transient host buffer) are read as they lie; and nothing with
    MOECTL_GGML_REPACK=0."""
    repacked_here(T.Q4_0)
    raw, _ = weights(T.Q4_0, N, K)
    x = xs(2, K)
    before = ggml.repack_stats()
    ggml.mul_mat(T.Q4_0, raw, (N, K), x)
    assert delta(before) == {"copies": 0, "repacked": 0, "bytes": 0, "graphs": 0}
    ggml.register_stable(raw)
    monkeypatch.setenv("MOECTL_GGML_REPACK", "0")
    ggml.mul_mat(T.Q4_0, raw, (N, K), x)
    assert delta(before) == {"copies": 0, "repacked": 0, "bytes": 0, "graphs": 0}
    assert not ggml.repacks(T.Q4_0, (N, K))                              # the sizes say so too


def test_strided_stacks_are_repacked(monkeypatch):
    """Experts `stride` bytes apart (moectl's own ggml copies: one expert a row gate|up|down, plus padding here) in a
    registered range: each of the three strided stacks gets a contiguous copy, the routed experts repacked from their
    own rows; the layer equals the plain layout's within 1e-5 of its scale; a 2-d matrix of an expert's row (its up,
    at that row's address) reads the up stack's copy, not the gate's, though gate and up have one shape."""
    A, H, I = 3, 256, 256
    repacked_here(T.Q4_0, (I, H))
    mat = ggml.require().mg_row_size(int(T.Q4_0), H) * I                 # bytes of one [256, 256] Q4_0 matrix
    rows = [weights(T.Q4_0, 3 * 256, 256, 5 + e) for e in range(A)]     # gate | up | down of expert e
    padded = np.zeros((A, 3 * mat + 64), np.uint8)                       # one expert a row, 64 bytes of padding
    for e, (raw, _) in enumerate(rows):
        padded[e, :3 * mat] = raw.reshape(-1)
    gate = padded.ctypes.data
    up, down, stride = gate + mat, gate + 2 * mat, padded.shape[1]
    ids, wts = torch.tensor([[0, 2], [2, 0]], dtype=torch.int32), torch.full((2, 2), 0.5)
    x = xs(2, H)

    def run():
        return ggml.moe((T.Q4_0,) * 3, gate, up, down, A, H, I, x, ids, wts, expert_stride=stride)

    want = plain(monkeypatch, run)
    ggml.register_stable(padded)
    before = ggml.repack_stats()
    got = run()
    assert delta(before) == {"copies": 3, "repacked": 3 * 2, "bytes": 3 * A * mat, "graphs": 1}
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    deq_up = rows[2][1][I:2 * I]                                         # expert 2's up, dequantised
    y = ggml.mul_mat(T.Q4_0, up + 2 * stride, (I, H), x)
    assert delta(before) == {"copies": 3, "repacked": 6, "bytes": 3 * A * mat, "graphs": 2}
    within_summation(y, plain(monkeypatch, lambda: ggml.mul_mat(T.Q4_0, up + 2 * stride, (I, H), x)),
                     x.abs() @ deq_up.abs().T)
    assert (y - x @ deq_up.T).abs().max() <= 0.05 * (x @ deq_up.T).abs().max()     # up's product, not gate's


def test_the_sizes_query_says_what_is_repacked():
    """`repacks` (the shim's mg_repacks: ggml's own acceptance, nothing allocated) is true for the types this CPU's
    ggml interleaves and rows a multiple of 8, false for the others; the copy it predicts takes the matrix's bytes
    (test_mul_mat_reads_a_copy_made_once checks the allocation)."""
    before = ggml.repack_stats()
    if not ggml.repacks(T.Q4_0, (N, K)):
        pytest.skip("this CPU's ggml repacks nothing (no AVX2, no NEON dot product)")
    assert not ggml.repacks(T.Q4_0, (N + 4, K))                          # rows are interleaved 8 at a time
    for enc in (T.Q8_0, T.Q6_K, T.Q5_K, T.F32, T.BF16):                  # never on AVX2 (Q8_0 / K-quants: NEON only)
        if ggml.library().mg_features() & 1 and not ggml.library().mg_features() & 2:
            assert not ggml.repacks(enc, (N, K)), enc.name
    assert delta(before) == {"copies": 0, "repacked": 0, "bytes": 0, "graphs": 0}


def test_the_setting_picks_the_types(monkeypatch):
    """MOECTL_GGML_REPACK unset: every type ggml repacks, as llama.cpp; a list: those types; `0`: none. The sizes
    query and the graphs agree."""
    for enc in (T.Q4_0, T.Q4_K):
        repacked_here(enc)
    monkeypatch.delenv("MOECTL_GGML_REPACK", raising=False)
    assert ggml.repacks(T.Q4_0, (N, K)) and ggml.repacks(T.Q4_K, (N, K))
    monkeypatch.setenv("MOECTL_GGML_REPACK", "q4_0")
    assert ggml.repacks(T.Q4_0, (N, K)) and not ggml.repacks(T.Q4_K, (N, K))
    x = xs(1, K)
    q4k, _ = weights(T.Q4_K, N, K)
    ggml.register_stable(q4k)
    before = ggml.repack_stats()
    ggml.mul_mat(T.Q4_K, q4k, (N, K), x)
    assert delta(before)["copies"] == 0
    monkeypatch.setenv("MOECTL_GGML_REPACK", "iq4_nl,Q4_K")
    assert ggml.repacks(T.Q4_K, (N, K)) and not ggml.repacks(T.Q4_0, (N, K))
    ggml.mul_mat(T.Q4_K, q4k, (N, K), x)
    assert delta(before)["copies"] == 1
    monkeypatch.setenv("MOECTL_GGML_REPACK", "0")
    assert not ggml.repacks(T.Q4_K, (N, K))


def test_a_range_that_goes_drops_its_copies():
    """The registration lives as long as the array (a memory map): when it goes, its copies are freed, so a new
    array at the same addresses is never read through a stale copy."""
    repacked_here(T.Q4_0)
    x = xs(1, K)
    gc.collect()                # earlier tests' maps go now, not while this one counts
    start = ggml.repack_stats()
    raw, _ = weights(T.Q4_0, N, K)
    ggml.register_stable(raw)
    ggml.mul_mat(T.Q4_0, raw[:N // 2], (N // 2, K), x)
    ggml.mul_mat(T.Q4_0, raw, (N, K), x)
    assert delta(start)["copies"] == 2
    del raw
    gc.collect()
    assert delta(start)["copies"] == 0 and delta(start)["bytes"] == 0
    for seed in range(3):                              # new bytes, wherever the allocator puts them: their own product
        raw, deq = weights(T.Q4_0, N, K, 10 + seed)
        ggml.register_stable(raw)
        got = ggml.mul_mat(T.Q4_0, raw, (N, K), x)
        assert (got - x @ deq.T).abs().max() <= 0.02 * (x @ deq.T).abs().max()
        del raw
        gc.collect()


@pytest.fixture(scope="module")
def q4_0_gguf(tmp_path_factory):
    """A tiny Mixtral whose dense matrices and experts are Q4_0 (every Linear's rows a multiple of 8)."""
    from gguf_build import k256_mixtral, write_gguf

    root = tmp_path_factory.mktemp("repack")
    return write_gguf(k256_mixtral(root), root / "tiny-Q4_0.gguf", dense_encoding=T.Q4_0, expert_encoding=T.Q4_0)


def test_a_gguf_in_place_gives_the_same_logits_repacked(q4_0_gguf, tmp_path, monkeypatch):
    """The file in place with ggml: a prefill and decode steps read the repacked copies of its attention, lm_head
    and stacked experts, and the logits equal the plain layout's within 1e-5 of their scale (fp32 summation order
    through 2 layers; the same greedy tokens); `inspect` states the bytes those copies take, and they are what the
    shim allocated (every stack is allocated whole at its first use: 2 layers x 3 stacks x 4 experts)."""
    from moectl.runtime.engine import Engine
    from moectl.store.facts import inspect_model
    from test_gguf_run import PROMPT, STEPS
    from test_runtime import _engine_run

    monkeypatch.setenv("MOECTL_GGML", "1")
    repacked_here(T.Q4_0, (256, 256))
    info = inspect_model(str(q4_0_gguf), str(tmp_path / "inspect"), device="cpu")
    said = info["gguf"]["cpu_in_place"]["ggml_repack"]
    expert_matrix = 256 * 256 // 32 * 18                                # Q4_0: 18 bytes a 32-weight block
    assert said["experts"] == 2 * 3 * 4 * expert_matrix
    dense_matrices = 2 * (256 * 256 + 2 * 128 * 256 + 256 * 256) + 512 * 256     # q k v o per layer, lm_head
    assert said["dense"] == dense_matrices // 32 * 18
    assert info["memory"]["ggml_repack"] == said

    gc.collect()
    before = ggml.repack_stats()
    eng = Engine.load(str(q4_0_gguf), progress=False, threads=1, workdir=str(tmp_path / "on"))
    logits, ids = _engine_run(eng, PROMPT, STEPS)
    made = delta(before)
    assert made["bytes"] == said["total"]
    assert made["copies"] == 2 * 4 + 1 + 2 * 3 and made["graphs"] > 0
    assert 2 * 4 + 1 < made["repacked"] <= 2 * 4 + 1 + 2 * 3 * 4         # dense once each; experts as routed to

    monkeypatch.setenv("MOECTL_GGML_REPACK", "0")
    before_off = ggml.repack_stats()
    off = Engine.load(str(q4_0_gguf), progress=False, threads=1, workdir=str(tmp_path / "off"))
    want_logits, want = _engine_run(off, PROMPT, STEPS)
    assert delta(before_off)["graphs"] == 0
    assert ids == want
    scale = max(b.abs().max().item() for b in want_logits)
    err = max((a - b).abs().max().item() for a, b in zip(logits, want_logits))
    assert err <= 1e-5 * scale, (err, scale)                          # found: 1.7e-7 of the scale


def mapping_rss(address: int) -> int:
    """Resident bytes of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_mapped_files_copied_pages_leave_the_process(tmp_path):
    """A file's copy-on-write map (a GGUF's): once a matrix is repacked its pages leave the process's RSS (the copy
    stands in for them, so the host figures hold the same total), and reading them again gives the file's bytes.
    Anonymous memory registered the same way keeps its pages (dropping them would zero them)."""
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/smaps")
    repacked_here(T.Q4_0, (1024, 1024))
    raw, _ = weights(T.Q4_0, 1024, 1024)                                 # 576 KiB: 144 pages
    path = tmp_path / "w.bin"
    raw.tofile(path)
    mapped = np.memmap(path, mode="c").reshape(raw.shape)
    assert int(mapped.sum(dtype=np.int64)) == int(raw.sum(dtype=np.int64))          # every page read in
    assert mapping_rss(mapped.ctypes.data) >= raw.nbytes
    ggml.register_stable(mapped)
    x = xs(1, 1024)
    y = ggml.mul_mat(T.Q4_0, mapped, (1024, 1024), x)
    assert mapping_rss(mapped.ctypes.data) <= 4096                      # only a page shared with other bytes may stay
    assert np.array_equal(mapped, raw)                                  # faulted back from the file, unchanged
    assert torch.equal(ggml.mul_mat(T.Q4_0, mapped, (1024, 1024), x), y)
    anon = raw.copy()
    ggml.register_stable(anon)
    ggml.mul_mat(T.Q4_0, anon, (1024, 1024), x)
    assert np.array_equal(anon, raw)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_one_graph_repacks_an_expert_when_a_token_first_routes_to_it(q4_0_gguf, tmp_path, monkeypatch, threads):
    """A whole forward's graph computes its routing inside: its stacks' copies are made whole (bytes allocated) but
    an expert is repacked only when a token first routes to it, by an op the graph runs between the routing and
    the experts (its threads share the work), never all of them before the first token (issue 42's load: llama.cpp
    repacks every expert at load). After each forward, the repacked count is the dense matrices' plus 3 (gate, up,
    down) for each expert any token so far routed to, layer by layer; the logits equal the plain layout's."""
    from moectl.runtime.engine import Engine

    import shutil

    monkeypatch.setenv("MOECTL_GGML", "1")
    repacked_here(T.Q4_0, (256, 256))
    own = shutil.copy(q4_0_gguf, tmp_path / "own.gguf")       # its own map: no copy an earlier test made of the file
    gc.collect()
    before = ggml.repack_stats()
    eng = Engine.load(str(own), progress=False, threads=threads, workdir=str(tmp_path / "on"))
    graph = eng.graph
    assert graph is not None, eng.plan_note
    dense = 2 * 4 + 1                                       # q k v o per layer, lm_head: repacked at first use
    routed = [set() for _ in range(graph.n_layer)]
    kv, outs = None, []
    for tokens in ([5], [7], [11, 13, 17, 19], [23]):
        logits, kv = graph.forward(np.array(tokens), kv)
        outs.append(logits)
        for layer, ids in enumerate(graph.last_ids):                  # [L, T, U]
            routed[layer] |= {int(a) for a in ids.reshape(-1) if a >= 0}
        made = delta(before)
        assert made["repacked"] == dense + 3 * sum(map(len, routed)), (made, routed)
        if len(outs) == 1:                  # the first token: U of the E experts a layer, not the whole stacks
            assert sum(map(len, routed)) == graph.n_layer * graph.U < graph.n_layer * graph.n_expert

    monkeypatch.setenv("MOECTL_GGML_REPACK", "0")
    off = Engine.load(str(own), progress=False, threads=threads, workdir=str(tmp_path / "off"))
    kv = None
    for tokens, got in zip(([5], [7], [11, 13, 17, 19], [23]), outs):
        want, kv = off.graph.forward(np.array(tokens), kv)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def own_copy_graph(q4_0_gguf, tmp_path, monkeypatch):
    """(the one graph of a private copy of the Q4_0 file: its own mapping, no copies held from earlier tests; the
    copy's path), with what earlier tests' copies still held left repacked first."""
    import shutil

    from moectl.runtime.engine import Engine

    monkeypatch.setenv("MOECTL_GGML", "1")
    repacked_here(T.Q4_0, (256, 256))
    own = shutil.copy(q4_0_gguf, tmp_path / "own.gguf")
    graph = Engine.load(str(own), progress=False, threads=1, workdir=str(tmp_path / "on")).graph
    gc.collect()
    ggml.finish_repack()
    return graph, own


def test_finishing_the_first_use_repack_repacks_every_expert_left(q4_0_gguf, tmp_path, monkeypatch):
    """`ggml.finish_repack()` (a benchmark's steady state, llama.cpp's state after its load): after one token routed
    U of each layer's E experts, it repacks the rest of every stack held (3 matrices an expert) and nothing more on
    a second call; later forwards repack nothing and give the plain layout's logits."""
    graph, own = own_copy_graph(q4_0_gguf, tmp_path, monkeypatch)
    _, kv = graph.forward(np.array([5]), None)
    routed = sum(len({int(a) for a in ids.reshape(-1)}) for ids in graph.last_ids)
    before = ggml.repack_stats()
    assert ggml.finish_repack() == 3 * (graph.n_layer * graph.n_expert - routed)
    assert delta(before)["repacked"] == 3 * (graph.n_layer * graph.n_expert - routed)
    assert ggml.finish_repack() == 0
    before = ggml.repack_stats()
    got, _ = graph.forward(np.array([7, 11]), kv)
    assert delta(before)["repacked"] == 0

    from moectl.runtime.engine import Engine

    monkeypatch.setenv("MOECTL_GGML_REPACK", "0")
    off = Engine.load(str(own), progress=False, threads=1, workdir=str(tmp_path / "off"))
    _, kv = off.graph.forward(np.array([5]), None)
    want, _ = off.graph.forward(np.array([7, 11]), kv)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_a_forward_whose_only_copies_are_its_experts_counts_as_a_graph_that_used_one(q4_0_gguf, tmp_path,
                                                                                     monkeypatch):
    """The whole forward's graph hands its stacks' copies to its MUL_MAT_IDs as it is built (rp_lazy), never by a
    second look-up at the graph's end: with only the experts repacked (MOECTL_GGML_REPACK=q4_0 on a file whose dense
    matrices are Q8_0, which AVX2's ggml never repacks), each forward still counts as a graph that read a copy, and
    its routed experts are repacked and nothing else."""
    from gguf_build import k256_mixtral, write_gguf
    from moectl.runtime.engine import Engine

    monkeypatch.setenv("MOECTL_GGML", "1")
    monkeypatch.setenv("MOECTL_GGML_REPACK", "q4_0")
    repacked_here(T.Q4_0, (256, 256))
    if ggml.repacks(T.Q8_0, (256, 256)):
        pytest.skip("this CPU's ggml repacks Q8_0 too (NEON): the dense matrices would have copies")
    path = write_gguf(k256_mixtral(tmp_path), tmp_path / "q8-dense.gguf", dense_encoding=T.Q8_0,
                      expert_encoding=T.Q4_0)
    eng = Engine.load(str(path), progress=False, threads=1, workdir=str(tmp_path / "on"))
    graph = eng.graph
    assert graph is not None, eng.plan_note
    gc.collect()
    before = ggml.repack_stats()
    graph.forward(np.array([5, 7]), None)
    routed = sum(len({int(a) for a in ids.reshape(-1)}) for ids in graph.last_ids)      # [L, T, U] -> experts
    assert delta(before) == {"copies": graph.n_layer * 3, "repacked": 3 * routed,
                             "bytes": graph.n_layer * 3 * graph.n_expert * (256 * 256 // 32 * 18), "graphs": 1}


def test_the_first_use_repack_finishes_in_bounded_pieces(q4_0_gguf, tmp_path, monkeypatch):
    """`ggml.finish_repack(max_bytes)` (an idle server's piece): at least one matrix, and stops once `max_bytes` of
    copies are written -- 1 byte: one matrix; 2 matrices' bytes + 1: three -- and `repack_progress()` says the
    matrices repacked out of those held as it goes, all of them once the pieces run out."""
    graph, _ = own_copy_graph(q4_0_gguf, tmp_path, monkeypatch)
    done0, held0 = ggml.repack_progress()
    assert done0 == held0
    graph.forward(np.array([5]), None)
    routed = sum(len({int(a) for a in ids.reshape(-1)}) for ids in graph.last_ids)
    dense, experts = 2 * 4 + 1, 3 * graph.n_layer * graph.n_expert      # q k v o a layer, lm_head; gate up down
    done, held = ggml.repack_progress()
    assert (done - done0, held - held0) == (dense + 3 * routed, dense + experts)
    matrix = 256 * 256 // 32 * 18                                        # a Q4_0 [256, 256] expert matrix's bytes
    assert ggml.finish_repack(1) == 1
    assert ggml.finish_repack(2 * matrix + 1) == 3
    assert ggml.repack_progress() == (done + 4, held)
    pieces = 0
    while ggml.finish_repack(matrix):
        pieces += 1
    assert pieces == experts - 3 * routed - 4
    assert ggml.repack_progress() == (held, held)
