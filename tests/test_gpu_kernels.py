"""bench/gpu_kernels.py, the GPU check's kernel step, in its dry run (Triton's interpreter on the CPU): a row per
format and M with the kernels' output checked against today's dequantise path, the layer rows, and a markdown table
that says "dry run" and fits 80 columns."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

import gpu_kernels  # (bench/ is on the path: tests/conftest.py)

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1"
                    or importlib.util.find_spec("triton") is None,
                    reason="the dry run is the CPU's: Triton's interpreter (tests/conftest.py sets it without a GPU)")
def test_dry_run_rows_and_table(tmp_path):
    r = gpu_kernels.run(tmp_path, dry_run=True, formats=("hqq4", "q4_k"), ms=(1, 64))
    assert r["dry_run"] and r["lowbit_gbps"] is None
    assert [(x["format"], x["M"]) for x in r["rows"]] == [("hqq4", 1), ("hqq4", 64), ("q4_k", 1), ("q4_k", 64)]
    for x in r["rows"] + r["layers"]:
        assert x["triton"] > 0 and x["dequant"] > 0
        assert x["triton_err"] < 2e-2            # bf16 outputs both sides (the interpreter truncates): ~1 step
        assert "tinygemm" not in x and "gemlite" not in x       # CUDA only
    assert [(x["format"], x["k"]) for x in r["layers"]] == [("hqq4", 2), ("q4_k", 2)]
    md = (tmp_path / "gpu-kernels.md").read_text()
    assert md.startswith("# Low-bit expert kernels (dry run")
    assert max(len(line) for line in md.splitlines()) <= 80
    assert json.loads((tmp_path / "gpu-kernels.json").read_text())["rows"] == r["rows"]


def test_bad_format_is_one_error_line(capsys):
    assert gpu_kernels.main(["--formats", "q4_k,q3_x", "--dry-run"]) == 2
    want = "error: unknown format q3_x; choose from " + ", ".join(gpu_kernels.FORMATS)
    assert capsys.readouterr().out.strip() == want


def test_measured_lowbit_rate_prices_resident_lowbit_experts():
    """A hardware profile's `gpu_lowbit_gbps` (what the kernels step measures) is the rate of a resident low-bit
    expert at decode in the cost model and in the simulator's lowbit-only rows; bf16 experts keep the memory
    bandwidth; without the field nothing changes."""
    import dataclasses

    import numpy as np

    from moectl.core.cache_model import LOW
    from moectl.core.shapes import load_shape
    from moectl.core.trace import DECODE, Trace
    from moectl.policies.precision import LowbitOnly
    from moectl.policies.replacement import LRU
    from moectl.sim.cost import CostModel, load_hardware
    from moectl.sim.simulator import Simulator
    from moectl.sim.steps import trace_steps

    hw, shape = load_hardware("h100-pcie5"), load_shape("mixtral")
    base = CostModel(hw, shape)
    slow = CostModel(dataclasses.replace(hw, gpu_lowbit_gbps=100.0), shape)
    q4 = base.expert_bytes / 4
    assert slow.expert_s(1, q4, lowbit=True) == pytest.approx(q4 / 100e9)
    assert slow.expert_s(1, q4) == base.expert_s(1, q4) == base.expert_s(1, q4, lowbit=True)
    # one layer, the same two experts every token: resident after the first, computed at the low-bit rate
    ex = np.tile(np.array([[[0, 1]]], dtype=np.int16), (4, 1, 1))
    tr = Trace("t", 1, 8, 2, ["r"] * 4, np.arange(4, dtype=np.int32), np.full(4, DECODE, dtype=np.uint8), ex, None)

    def ms(cost):
        return Simulator({LOW: [2]}, {LOW: LRU()}, None, cost, precision=LowbitOnly(),
                         nbytes={LOW: q4}).run(trace_steps(tr))["ms_per_token"]
    per_token = 2e3 * (q4 / 100e9 - base.expert_s(1, q4))     # ms: two experts a token, each slower by this
    # the 6 hits of 8 uses at least pay it (a miss's compute may hide behind the next copy), at most all 8
    assert 0.75 * per_token - 1e-9 <= ms(slow) - ms(base) <= per_token + 1e-9


def test_bad_compile_archs_is_one_error_line(capsys):
    assert gpu_kernels.main(["--compile", "sm90"]) == 2
    assert capsys.readouterr().out.strip() == "error: --compile 'sm90': write CUDA archs as numbers, e.g. 80,90"
