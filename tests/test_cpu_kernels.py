"""CPU kernels of the decode path: one-token bf16 products through torch's native GEMV (kernels/gemv.py)."""

import torch
import torch.nn.functional as F

from moectl.kernels import gemv
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


def test_vs_llamacpp_rates_are_recorded_beside_the_machine_figures(tmp_path):
    import json

    from moectl.runtime import machine

    res = {"shape": "mixtral", "layers": 2, "mem_read_gbps": 10.0, "llamacpp_version": "0.3.36", "load": (3.0,),
           "rows": [{"tool": "llama.cpp", "format": "Q4_0", "threads": 2, "decode_gbps": 4.0,
                     "decode_ms": {"median": 25.0}},
                    {"tool": "moectl", "format": "q4g64", "threads": 2, "decode_gbps": 1.5,
                     "decode_ms": {"median": 70.0}}]}
    entry = machine.record_vs_llamacpp(res, tmp_path / "m.json")
    saved = json.loads((tmp_path / "m.json").read_text())
    assert saved["format"] == machine.FORMAT and list(saved["vs_llamacpp"].values()) == [entry]
    assert entry["rates"]["llama.cpp|Q4_0|threads 2"]["share_of_mem_read"] == 0.4
    assert entry["rates"]["moectl|q4g64|threads 2"]["decode_ms"] == 70.0
