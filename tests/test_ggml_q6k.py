"""moectl's own Q6_K matvec (moectl/kernels/ggml_q6k.c, issue 42): a one-token product over a Q6_K matrix (a decode
step's lm_head and dense matrices) runs it instead of ggml's mul_mat, as a custom op in the same graph.

Legend: T = tokens, K = input width, N = output rows.

It quantizes x with ggml's own quantize_row_q8_K and sums each block's integers as ggml's kernel does, so it equals
ggml's mul_mat but for fp32 summation order: within 1e-5 of |W| @ |x_hat| per entry (the fp32 bound) and within
1e-5 of max|y| (x_hat: x as q8_K; measured ~3e-7 of max|y|, the AVX2 kernel bit-equal). Every kernel is tested on this host: the AVX-512 one where the
CPU has it, and the AVX2 one (`MOECTL_GGML_OWN_Q6K=avx2`), against `MOECTL_GGML_OWN_Q6K=0` (ggml's).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from moectl.kernels import ggml
from test_ggml_kernels import activation, check_product, lib, weights  # noqa: F401  (lib: autouse, ggml built)

torch.set_num_threads(1)


SETTINGS = ("1", "avx2")            # MOECTL_GGML_OWN_Q6K: the best kernel for this CPU, and the AVX2 one


def product(monkeypatch, setting: str, raw, shape, x, threads: int) -> tuple[torch.Tensor, str]:
    """(ggml.mul_mat's y under MOECTL_GGML_OWN_Q6K=setting, the kernel that handle runs)."""
    with monkeypatch.context() as m:
        m.setenv("MOECTL_GGML_OWN_Q6K", setting)
        return ggml.mul_mat(int(T.Q6_K), raw, shape, x, n_threads=threads), ggml.own_q6k_kernel(threads)


def own_or_skip(monkeypatch, setting: str) -> str:
    with monkeypatch.context() as m:
        m.setenv("MOECTL_GGML_OWN_Q6K", setting)
        kind = ggml.own_q6k_kernel(1)
    if kind == "ggml":
        pytest.skip("no own Q6_K kernel on this CPU (x86 with AVX2 only): ggml's mul_mat runs")
    return kind


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("N, K", [(1, 256), (37, 256), (16, 512), (203, 768), (64, 2048)])
@pytest.mark.parametrize("setting", SETTINGS)
def test_matvec_equals_ggmls_mul_mat(setting, N, K, threads, monkeypatch):
    """The same bytes and x: the own kernel's y equals ggml's within fp32 summation order; K = 256 is one block,
    37 and 203 rows are not whole chunks of 16 (nor split evenly between 2 threads)."""
    kind = own_or_skip(monkeypatch, setting)
    assert kind == "avx2" if setting == "avx2" else kind in ("avx512vnni", "avx512bw", "avx2")
    raw, deq = weights(T.Q6_K, N, K, seed=N + K)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(K))
    before = ggml.own_q6k_products()
    got, _ = product(monkeypatch, setting, raw, (N, K), x, threads)
    assert ggml.own_q6k_products() == before + 1                          # it ran, not ggml's mul_mat
    want, off = product(monkeypatch, "0", raw, (N, K), x, threads)
    assert off == "ggml" and ggml.own_q6k_products() == before + 1
    x_hat, _ = activation(x, T.Q6_K)
    bound = x_hat.abs() @ deq.double().abs().T                            # [1, N]
    err = (got.double() - want.double()).abs()
    assert (err <= 1e-5 * bound).all(), float((err / bound).max())
    assert float(err.max()) <= 1e-5 * float(want.abs().max())


@pytest.mark.parametrize("setting", SETTINGS)
def test_matvec_equals_dequantize_then_matmul(setting, monkeypatch):
    """gguf's dequantisation @ x within the q8_K activation tolerance test_ggml_kernels.py derives for ggml."""
    own_or_skip(monkeypatch, setting)
    N, K = 48, 512
    raw, deq = weights(T.Q6_K, N, K, seed=int(T.Q6_K))
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(7))
    y, _ = product(monkeypatch, setting, raw, (N, K), x, 1)
    check_product(T.Q6_K, y, deq, x, raw)


def test_many_tokens_stay_on_ggml(monkeypatch):
    """T > 1 (a prefill's products) is ggml's mul_mat: the own kernel is a matvec."""
    own_or_skip(monkeypatch, "1")
    raw, _ = weights(T.Q6_K, 32, 256)
    before = ggml.own_q6k_products()
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    y, _ = product(monkeypatch, "1", raw, (32, 256), x, 1)
    assert ggml.own_q6k_products() == before
    want, _ = product(monkeypatch, "0", raw, (32, 256), x, 1)
    assert torch.equal(y, want)


@pytest.fixture(scope="module")
def q6k_dense(tmp_path_factory):
    """A tiny Mixtral with every dense matrix Q6_K (Q/K/V/O, router, lm_head, embedding; hidden 256, whole blocks)
    and Q4_K experts."""
    from gguf_build import k256_mixtral, write_gguf

    root = tmp_path_factory.mktemp("q6k_dense")
    return write_gguf(k256_mixtral(root), root / "tiny-q6k.gguf", dense_encoding=T.Q6_K, expert_encoding=T.Q4_K)


@pytest.mark.parametrize("setting", SETTINGS)
def test_decode_gives_ggmls_tokens(q6k_dense, setting, tmp_path, monkeypatch):
    """The one-graph decode of a Q6_K-lm_head file: the same greedy tokens with the own kernel as with ggml's
    (MOECTL_GGML_OWN_Q6K=0), logits within fp32 summation order of the products; the kept decode graph ran it."""
    from moectl.runtime.engine import Engine
    from test_gguf_run import PROMPT, STEPS
    from test_runtime import _engine_run

    own_or_skip(monkeypatch, setting)
    eng = Engine.load(str(q6k_dense), progress=False, threads=1, workdir=str(tmp_path))
    assert eng.graph is not None, eng.plan_note
    runs = {}
    for s in (setting, "0"):
        monkeypatch.setenv("MOECTL_GGML_OWN_Q6K", s)
        before = ggml.own_q6k_products()
        runs[s] = _engine_run(eng, PROMPT, STEPS)
        ran = ggml.own_q6k_products() - before
        # each decode step: 4 attention matrices and the router a layer (2 layers), and the lm_head (the prefill: ggml)
        assert ran == (0 if s == "0" else STEPS * (2 * 5 + 1)), ran
    (la, ta), (lb, tb) = runs[setting], runs["0"]
    assert ta == tb
    scale = max(float(b.abs().max()) for b in lb)
    assert max(float((a - b).abs().max()) for a, b in zip(la, lb)) <= 1e-4 * scale
    assert np.isfinite(scale) and scale > 0


@pytest.mark.parametrize("setting", ["0", "avx2", "1"])
def test_the_kernel_is_chosen_when_a_handle_is_made(setting, monkeypatch):
    """`MOECTL_GGML_OWN_Q6K=0`: no own kernel; avx2: the AVX2 one; 1: the best one for this CPU and the loaded build.
    Read when the shim's handle is made (a fresh one here, not `ggml.handle()`'s). `MOECTL_GGML_ISA` is not read
    there: the loaded library says what it was built for (set to avx2 under this process's native build, the
    AVX-512 kernel is still picked where the CPU has it; the avx2 build's own choice: the test below)."""
    want = {"0": "ggml", "avx2": "avx2", "1": own_or_skip(monkeypatch, "1")}[setting]
    lib = ggml.require()
    monkeypatch.setenv("MOECTL_GGML_OWN_Q6K", setting)
    monkeypatch.setenv("MOECTL_GGML_ISA", "avx2")             # after require(): the loaded build stays native
    h = lib.mg_new(1, 0)
    try:
        assert lib.mg_q6k_kernel(h).decode() == want
    finally:
        lib.mg_free(h)


def test_the_avx2_build_never_picks_an_avx512_kernel(monkeypatch):
    """A process on ggml's build restricted to AVX2 (`MOECTL_GGML_ISA=avx2`, a child: one process holds one build)
    runs the AVX2 kernel at the default setting, even on an AVX-512 host: the loaded library's
    ggml_cpu_has_avx512() decides, not the environment."""
    from test_ggml_isa import builds_or_skip, in_child

    own_or_skip(monkeypatch, "avx2")
    builds_or_skip("avx2")
    code = ("from moectl.kernels import ggml\n"
            "kind = ggml.own_q6k_kernel(1)\n"
            "assert not kind.startswith('avx512') and 'avx512' not in ggml.features(), (kind, ggml.features())\n"
            "print(kind)")
    assert in_child(code, "avx2", {"MOECTL_GGML_OWN_Q6K": "1"}).split() == ["avx2"]
