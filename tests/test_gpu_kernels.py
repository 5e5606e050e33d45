"""bench/gpu_kernels.py, the GPU check's kernel step, in its dry run (Triton's interpreter on the CPU): a row per
format and M with the kernels' output checked against today's dequantise path, the layer rows, and a markdown table
that says "dry run" and fits 80 columns."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not set (tests/conftest.py sets it)", allow_module_level=True)

import gpu_kernels  # noqa: E402  (bench/ is on the path: tests/conftest.py)

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


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
    assert capsys.readouterr().out.strip() == "error: unknown format q3_x; choose from " + ", ".join(gpu_kernels.FORMATS)
