"""A GGUF's dense matrices and embedding in place (moectl/models/dense_gguf.py): ggml's product on the file's own
blocks equals gguf's reference dequantisation followed by an fp32 matmul within the activation quantisation
llama.cpp applies; the converter's Q/K row permutation is undone on the output; the embedding's rows are the
dequantised rows exactly; a backward (`moectl sensitivity`) multiplies by the dequantised matrix; a run holds the
file's bytes, not dequantised copies, and `inspect` and the host check say so; a tied lm_head reads the embedding's
bytes; MOECTL_GGML=0 loads them dequantised as before."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from torch import nn

from gguf_build import k256_mixtral, write_gguf
from moectl.models.dense_gguf import GgufEmbedding, GgufLinear, swap_in
from moectl.runtime.engine import Engine
from moectl.store.facts import dense_nbytes
from test_bad_input import run_cli
from test_gguf_run import GGML_LOGITS_RTOL, PROMPT, STEPS, ggml_or_skip
from test_runtime import _engine_run

N, K = 48, 512              # T = tokens, N = output rows, K = input columns


def _matrix(enc: T, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """(the encoding's bytes [N, row bytes], the weights they decode to, fp32 [N, K])."""
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)).numpy()
    if enc == T.F32:
        return w.view(np.uint8).reshape(N, -1), torch.from_numpy(w)
    if enc == T.BF16:
        b = torch.from_numpy(w).to(torch.bfloat16)
        return b.view(torch.uint8).numpy().reshape(N, -1), b.float()
    from moectl.kernels import ggml

    data = ggml.quantize(int(enc), torch.from_numpy(w)) if enc in (T.Q4_K, T.Q6_K, T.IQ4_XS) else \
        gguf_quantize(w, enc)
    return data, torch.from_numpy(gguf_dequantize(data, enc)).reshape(N, K)


@pytest.mark.parametrize("enc", [T.F32, T.BF16, T.Q8_0, T.Q4_0, T.Q4_K, T.Q6_K, T.IQ4_XS])
def test_linear_in_place_is_the_dequantised_product(enc):
    """y = x W^T from the file's blocks; x quantized per block (Q8_0 / Q8_K) as llama.cpp does: within 2 % of the
    output's scale (F32: exact up to summation order); rows permuted as `perm` asks."""
    ggml_or_skip()
    data, w = _matrix(enc)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1))                      # [T, K]
    lin = GgufLinear(nn.Linear(K, N, bias=True), int(enc), data, None, "w")
    with torch.no_grad():
        lin.bias.copy_(torch.arange(N) / N)
        y = lin(x)
    want = x @ w.T + lin.bias.detach()
    tol = 1e-4 if enc == T.F32 else 2e-2 if enc != T.BF16 else 1e-2
    assert (y - want).abs().max() <= tol * want.abs().max(), enc
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(2))
    lin.perm = perm
    with torch.no_grad():
        assert torch.allclose(lin(x) - lin.bias, (y - lin.bias)[:, perm])
    plain = GgufLinear(nn.Linear(K, N, bias=False), int(enc), data, None, "w")
    assert y.dtype == torch.float32 and plain(x.bfloat16()).dtype == torch.bfloat16


def test_linear_in_place_backward_multiplies_by_the_dequantised_matrix():
    ggml_or_skip()
    data, w = _matrix(T.Q8_0)
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(3))
    lin = GgufLinear(nn.Linear(K, N, bias=False), int(T.Q8_0), data, perm, "w")
    x = torch.randn(3, K, requires_grad=True)
    g = torch.randn(3, N)
    (lin(x) * g).sum().backward()
    assert torch.allclose(x.grad, g @ w[perm], atol=1e-4)                # y = x W[perm]^T


@pytest.mark.parametrize("enc", [T.Q8_0, T.Q4_K, T.F32])
def test_embedding_in_place_rows_are_the_dequantised_rows(enc):
    data, w = _matrix(enc)
    emb = GgufEmbedding(nn.Embedding(N, K), int(enc), data, torch.bfloat16, "token_embd.weight")
    ids = torch.tensor([[3, 7, 3, 0, N - 1]])
    out = emb(ids)
    assert out.shape == (1, 5, K) and out.dtype == torch.bfloat16
    assert torch.equal(out, w[ids].to(torch.bfloat16))


@pytest.fixture(scope="module")
def q8_models(tmp_path_factory):
    """Mixtral-shaped (the `llama` architecture: Q/K rows permuted by the converter) with Q8_0 dense tensors, one
    with its own output.weight, one with the lm_head tied to the embedding (no output.weight in the file)."""
    root, out = tmp_path_factory.mktemp("dense_in_place"), {}
    for tied in (False, True):
        ckpt = k256_mixtral(root / f"tied-{tied}", tied=tied)
        out[tied] = write_gguf(ckpt, root / f"tiny-{'tied' if tied else 'untied'}-Q8_0.gguf",
                               dense_encoding=T.Q8_0, expert_encoding=T.Q8_0)
    return out


@pytest.mark.parametrize("tied", [False, True], ids=["output-weight", "tied"])
def test_a_run_computes_the_dense_part_where_it_lies(q8_models, tied, tmp_path, monkeypatch):
    """In place with ggml: attention projections, lm_head and embedding are the file's bytes (no dequantised copy;
    the tied lm_head shares the embedding's), logits as the dequantised run's within the activation-quantisation
    tolerance, the same greedy tokens; the note says so. MOECTL_GGML=0: every dense weight dequantised as before."""
    ggml_or_skip()
    path = q8_models[tied]
    eng = Engine.load(str(path), progress=False, threads=1, workdir=str(tmp_path))
    m = eng.model
    swapped = [n for n, mod in m.named_modules() if isinstance(mod, (GgufLinear, GgufEmbedding))]
    assert len(swapped) == 2 * 4 + 2                     # q k v o per layer, lm_head, embedding
    assert isinstance(m.lm_head, GgufLinear) and isinstance(m.model.embed_tokens, GgufEmbedding)
    assert not any(n.endswith(("q_proj.weight", "lm_head.weight", "embed_tokens.weight"))
                   for n, _ in m.named_parameters())
    assert (m.lm_head.mapped is m.model.embed_tokens.mapped) == tied
    assert m.model.layers[0].self_attn.q_proj.perm is not None           # the converter's Q/K permutation undone
    assert "10 dense matrices" in eng.plan_note
    logits, ids = _engine_run(eng, PROMPT, STEPS)

    monkeypatch.setenv("MOECTL_GGML", "0")
    ref = Engine.load(str(path), progress=False, threads=1, workdir=str(tmp_path / "ref"))
    assert not any(isinstance(mod, (GgufLinear, GgufEmbedding)) for mod in ref.model.modules())
    want_logits, want = _engine_run(ref, PROMPT, STEPS)
    assert ids == want
    scale = max(b.abs().max().item() for b in want_logits)
    err = max((a - b).abs().max().item() for a, b in zip(logits, want_logits))
    assert err <= GGML_LOGITS_RTOL * scale, (err, scale)
    # what the run holds: the mapped tables' file bytes in place of their fp32 copies
    held, before = dense_nbytes(m, eng.config), dense_nbytes(ref.model, ref.config)
    assert held < before / 3, (held, before)


def test_inspect_and_the_host_check_count_the_mapped_bytes(q8_models, tmp_path, capsys, monkeypatch):
    """`inspect --device cpu` states the dense bytes the run then holds (the mapped matrices at their Q8_0 bytes);
    the load's host-memory check uses the same figure."""
    ggml_or_skip()
    path = q8_models[False]
    code, out, err = run_cli(["inspect", "--model", str(path), "--json", "--device", "cpu", "--workdir",
                              str(tmp_path)], capsys, monkeypatch)
    assert code == 0, err
    info = json.loads(out)
    eng = Engine.load(str(path), progress=False, threads=1, workdir=str(tmp_path))
    assert info["dense_bytes"] == dense_nbytes(eng.model, eng.config)
    # Q8_0: 34 bytes per 32 weights for the 10 matrices; norms and routers fp32
    mats = 2 * (2 * 256 * 256 + 2 * 128 * 256) + 2 * 512 * 256
    assert info["gguf"]["cpu_in_place"]["host_bytes"] - info["gguf"]["expert_bytes"] == \
        mats * 34 // 32 + 4 * (256 * 5 + 2 * 4 * 256)
    from moectl.runtime import load as load_mod

    seen = []

    monkeypatch.setattr(load_mod, "check_host_memory", lambda need, *a, **k: seen.append(need.dense))
    Engine.load(str(path), progress=False, threads=1, workdir=str(tmp_path))
    assert seen == [info["gguf"]["cpu_in_place"]["host_bytes"] - info["gguf"]["expert_bytes"]]


def test_swap_in_leaves_other_modules_alone():
    ggml_or_skip()
    data, _ = _matrix(T.Q8_0)
    model = nn.Sequential(nn.Linear(K, N), nn.LayerNorm(N))
    done = swap_in(model, {"0.weight": (int(T.Q8_0), data, None, "a"), "1.weight": (int(T.Q8_0), data, None, "b")},
                   torch.float32)
    assert done == ["0.weight"] and isinstance(model[0], GgufLinear) and isinstance(model[1], nn.LayerNorm)
