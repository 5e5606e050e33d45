"""`make gpu-check`'s dry run: on this CPU machine every step's command is printed and the CPU parts run (the
synthetic build at one layer, the simulator's predictions of the bench rows), so the script cannot rot unnoticed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from shared_data import SHARED  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402

SMALL = """name: small-mixtral
family: mixtral
shape: {num_layers: 32, moe_layers: 32, hidden_size: 256, intermediate_size: 512, num_experts: 8, top_k: 2,
        num_attention_heads: 4, num_key_value_heads: 2, head_dim: 64, vocab_size: 1000, dtype: bfloat16}
"""


def test_cuda_tag_follows_the_driver():
    assert gpu_check.pick_cuda_tag((13, 0)) == "cu130"
    assert gpu_check.pick_cuda_tag((12, 9)) == "cu128"
    assert gpu_check.pick_cuda_tag((12, 6)) == "cu126"
    assert gpu_check.pick_cuda_tag((11, 8)) is None               # too old for the pinned torch's wheels


def test_wheels_for_the_image_come_at_the_pinned_versions(tmp_path):
    pins = gpu_check.pinned_versions()
    download, build = gpu_check.wheel_commands(tmp_path)
    assert "--only-binary=:all:" in download and download[download.index("--python-version") + 1] == "3.12"
    asked = {a.split("==")[0]: a.split("==")[1] for a in download + build if "==" in a}
    assert set(asked) == set(gpu_check.IMAGE_LACKS + gpu_check.NO_WHEEL)
    assert all(v == pins[gpu_check._norm(n)] for n, v in asked.items())         # constraints.txt's, every one
    assert asked["transformers"] == pins["transformers"] and build[3] == "wheel"


def test_synthetic_layers_follow_host_ram():
    per_layer = gpu_check.EXPERT_BYTES_MIXTRAL * 8                # 2.8 GB of experts per Mixtral layer
    assert gpu_check.default_layers(128 * 2**30) == 2                            # fits a lent machine's call
    assert gpu_check.default_layers(8 * 2**30) == int(0.5 * 8 * 2**30 // per_layer) == 1   # half a small host
    assert gpu_check.default_layers(2**30) == 1


@pytest.mark.skipif(not (SHARED / "traces" / gpu_check.SHARED_TRACE).is_file(), reason="needs ../shared/traces")
def test_dry_run_prints_every_step_and_runs_the_cpu_parts(tmp_path):
    shape = tmp_path / "small.yaml"
    shape.write_text(SMALL)
    out = tmp_path / "report"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run", "--shape", str(shape),
                        "--out", str(out), "--trace", str(SHARED / "traces" / gpu_check.SHARED_TRACE),
                        "--llamacpp-src", str(tmp_path / "no-pack.tar.gz")],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads((out / "gpu-check.json").read_text())
    steps = {s["name"]: s for s in r["steps"]}
    # the GPU steps are printed, never run, and every one is in the report with its command
    for name in ("install", "tests", "copy", "quantize") + tuple(f"bench:{b}" for b in gpu_check.BENCH_ROWS):
        assert steps[name]["status"] == "printed" and f"[dry run] {name}:" in p.stdout
    assert steps["llamacpp"]["status"] == "skipped"           # no llama.cpp source pack carried: said, with the fix
    assert "--pack" in steps["llamacpp"]["why"] and "llama.cpp step: skipped" in (out / "gpu-check.md").read_text()
    assert "-m cuda" in steps["tests"]["command"] and "--device cuda" in steps["bench:fetch-only"]["command"]
    # the synthetic really was built, at one layer, and loads as a Mixtral checkpoint
    assert steps["synthetic"]["status"] == "ok" and steps["synthetic"]["figures"]["layers"] == 1
    cfg = json.loads((out / "synthetic" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["num_local_experts"] == 8
    # the simulator's predictions ran for every row: numbers, and the setups differ where they should
    sim = {row: steps[f"predict:{row}"]["figures"] for row in gpu_check.BENCH_ROWS}
    assert all(s["ms_per_token"] > 0 for s in sim.values())
    assert sim["moectl-q4"]["precision"] == "lowbit-only" and sim["hobbit"]["precision"] == "hobbit"
    assert sim["cpu-experts-auto"]["cpu_experts"] == "auto" and sim["fetch-only"]["cpu_experts"] == "never"
    assert sim["moectl-q4"]["bytes_per_token"] < sim["fetch-only"]["bytes_per_token"]     # q4 moves fewer bytes
    assert r["failed"] == [] and r["meta"]["dry_run"] is True and r["meta"]["cache_experts"] == 2
    md = (out / "gpu-check.md").read_text()
    assert "dry run" in md and "| synthetic | ok |" in md
    # the measured hardware profile the predictions used is this machine's
    hw = (out / "hardware-measured.yaml").read_text()
    assert "pcie_gbps" in hw and "cpu_mem_gbps" in hw


def test_rows_and_verdicts_from_measured_figures():
    """The report's judgement of the defaults, on made-up bench output: auto losing to never is called out, and a
    row whose measured/predicted ratio is beyond 1.3x asks for the profile to be corrected."""
    steps = []
    for row, ms, pred in (("fetch-only", 100.0, 95.0), ("cpu-experts-auto", 120.0, 60.0)):
        s = gpu_check.Step(f"bench:{row}", [])
        s.figures = {"runs": {"moectl": {"decode_ms_per_token": ms, "hit_rate": 0.5}},
                     "predicted": {"moectl": {"decode_ms_per_token": pred}}}
        steps.append(s)
    rows = gpu_check.rows_table(steps)
    by = {r["row"]: r for r in rows}
    assert by["fetch-only"]["measured_over_predicted"] == pytest.approx(100 / 95)
    v = gpu_check.verdicts(rows)
    assert any("AUTO LOSES" in x for x in v)
    assert any(x.startswith("cpu-experts-auto: measured/predicted 2.00") for x in v)
    assert not any(x.startswith("fetch-only") for x in v)


def test_llamacpp_step_runs_from_a_carried_pack_and_its_row_sits_beside_moectl_q4(tmp_path):
    """With a source pack, step 5 is a command (printed in a dry run) for the same model and cache; llama.cpp keeps
    whole layers' experts on the CPU, as many as the device budget cannot hold; its figures go beside moectl-q4's."""
    sys.path.insert(0, str(ROOT / "bench"))
    import llamacpp_cuda

    assert llamacpp_cuda.n_cpu_moe(layers=8, experts_per_layer=8, cache_experts=16) == 6
    assert llamacpp_cuda.n_cpu_moe(layers=1, experts_per_layer=8, cache_experts=2) == 1   # not one whole layer
    pack = tmp_path / "llamacpp-src.tar.gz"
    pack.write_bytes(b"x")
    a = gpu_check.parse(["--llamacpp-src", str(pack), "--model", str(tmp_path / "m")])
    a.cache_experts, a.driver_cuda, a.layers, a.hardware = 16, None, 8, tmp_path / "hw.yaml"
    assert gpu_check.llamacpp_unavailable(a, cuda=False) is None
    step = next(s for s in gpu_check.plan_steps(a, cuda=False) if s.name == "llamacpp")
    assert "llamacpp_cuda.py" in step.line and "--cache-experts 16" in step.line and str(pack) in step.line
    ll = gpu_check.Step("llamacpp", [], status="ok")
    ll.figures = {"n_cpu_moe": 6, "decode_ms_per_token": 41.0, "prefill_tokens_per_s": 900.0}
    q4 = gpu_check.Step("bench:moectl-q4", [])
    q4.figures = {"runs": {"moectl": {"decode_ms_per_token": 30.0}}}
    md = gpu_check.write_report(tmp_path / "r", [q4, ll], {"dry_run": False, "host": "h", "cpu": "c", "python": "3",
                                                         "model": "m", "layers": 8, "cache_experts": 16})
    text = (tmp_path / "r" / "gpu-check.md").read_text()
    assert md["failed"] == [] and "| moectl-q4 | 30.0 |" in text and "| llama.cpp Q4_0, --n-cpu-moe 6 | 41.0 | 900 |" in text
