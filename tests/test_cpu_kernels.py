"""CPU kernels of the decode path: one-token bf16 products through torch's native GEMV (models/gemv.py)."""

import torch
import torch.nn.functional as F

from moectl.models import gemv
from moectl.models.base import FamilyAdapter


def test_one_row_bf16_linear_matches_onednn_and_restores_the_flag():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(384, 256, generator=g) * 0.02).bfloat16()
    for rows in (1, 3):
        x = torch.randn(rows, 256, generator=g).bfloat16()
        ref = (x.float() @ w.float().T)
        got = gemv.linear(x, w)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 384)
        assert (got.float() - ref).abs().max() <= 2 ** -7 * ref.abs().max()      # bf16 rounding of the output
        assert torch.equal(got, F.linear(x, w)) or rows == 1                      # several rows: the same call
    assert torch._C._get_mkldnn_enabled()                                          # switched back on
    torch._C._set_mkldnn_enabled(False)
    try:
        gemv.linear(torch.randn(1, 256).bfloat16(), w)
        assert not torch._C._get_mkldnn_enabled()                                  # left as the caller had it
    finally:
        torch._C._set_mkldnn_enabled(True)


def test_expert_linear_takes_the_gemv_for_one_token(monkeypatch):
    calls = []
    real = gemv.linear
    monkeypatch.setattr(gemv, "linear", lambda x, w: calls.append(tuple(x.shape)) or real(x, w))
    w = torch.randn(8, 4).bfloat16()
    FamilyAdapter.linear(torch.randn(1, 4).bfloat16(), w)
    assert calls == [(1, 4)]
