"""What loading a model imports: a GGUF's load, first tokens and `inspect` leave hqq (and the torch compiler its
HQQLinear class pulls in through `@torch.compile`) unimported, and triton too on a CPU-only torch
(moectl/models/hf_modeling.py); moectl's own HQQ quantizer still works in the same process afterwards, and triton
still imports. Each check runs in a fresh interpreter: `sys.modules` of the test process holds whatever earlier
tests imported. `make test-latest` runs it on the newer transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from gguf_build import k256_mixtral, write_gguf

ROOT = Path(__file__).resolve().parents[1]
# a torch built for no GPU: transformers' model code leaves triton unimported too (hf_modeling.py)
CPU_ONLY_TORCH = not (torch.version.cuda or torch.version.hip or getattr(torch.version, "xpu", None))
COMPILER = ("hqq", "hqq.core.quantize", "torch._inductor.compile_fx") + (("triton",) if CPU_ONLY_TORCH else ())

CHILD = r"""
import json, sys
import torch
torch.set_num_threads(1)
from moectl.runtime.engine import Engine
from moectl.store.facts import inspect_model
eng = Engine.load(sys.argv[1], device="cpu", threads=1, progress=False)
out = eng.generate("the experts", max_new_tokens=2, stop_at_eos=False)
info = inspect_model(sys.argv[1], device="cpu")
seen = {m: m in sys.modules for m in sys.argv[2].split(",")}
# moectl's own HQQ quantizer, after all that (quantize and --lowbit import it when they run)
from moectl.formats.hqq import HqqFormat
fmt = HqqFormat(eng.adapter.layout(), 4, 64, 1, torch.float32)
torch.manual_seed(0)
w = {n: torch.randn(s) for n, s in zip(fmt.layout.names, fmt.layout.shapes)}
back = fmt.weights(fmt.views(fmt.quantize(w, optimize=False)))
err = max(float((back[n] - w[n]).abs().max() / w[n].abs().max()) for n in fmt.matrices)
import importlib.util
triton_after = importlib.util.find_spec("triton") is None or bool(__import__("triton").jit)   # importable again
print("RESULT " + json.dumps({"seen": seen, "tokens": len(out.token_ids), "experts": info["experts"],
                              "hqq_error": err, "hqq_after": "hqq.core.quantize" in sys.modules,
                              "triton_after": triton_after}))
"""


@pytest.fixture(scope="module")
def q4km(tmp_path_factory):
    """A Mixtral GGUF with K-quant experts and Q8_0 dense tensors (what a downloaded file holds)."""
    root = tmp_path_factory.mktemp("imports")
    return write_gguf(k256_mixtral(root), root / "tiny-Q4_K_M.gguf", dense_encoding=T.Q8_0, expert_encoding=T.Q4_K)


def test_gguf_load_generate_inspect_import_no_hqq(q4km):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", CHILD, str(q4km), ",".join(COMPILER)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads([line for line in p.stdout.splitlines() if line.startswith("RESULT ")][-1][len("RESULT "):])
    assert r["seen"] == {m: False for m in COMPILER}
    assert r["tokens"] == 2 and r["experts"] == 4
    assert r["hqq_after"] and 0 < r["hqq_error"] < 0.2          # 4-bit round-to-nearest: close, not exact
    assert r["triton_after"]


def test_model_code_import_hides_hqq_only_for_that_import(monkeypatch):
    """Run twice or after hqq is imported, import_model_code does nothing; the marker never outlives the import."""
    code = ("import sys; from moectl.models.hf_modeling import import_model_code; import_model_code(); "
            "a = 'transformers.cache_utils' in sys.modules and 'hqq' not in sys.modules; "
            "import_model_code(); import hqq.core.quantize; "
            "print(a, sys.modules['hqq'] is not None, hasattr(sys.modules['transformers.cache_utils'], 'Cache'))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["True", "True", "True"]
