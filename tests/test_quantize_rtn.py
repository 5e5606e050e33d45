"""`moectl quantize --method rtn` (the CPU's default): round-to-nearest copies in HQQ's layout."""

import pytest
import torch

from moectl.errors import MoectlError
from moectl.quant.methods import check_method
from moectl.quant.quantize import quantize_model
from moectl.runtime.engine import Engine
from model_factory import build_family


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    d = tmp_path_factory.mktemp("rtn") / "mixtral"
    build_family("mixtral", d)
    return d


def test_rtn_is_the_cpu_default_and_dequantises_as_hqq_without_its_optimiser(mixtral, tmp_path):
    from hqq.core.quantize import Quantizer

    from moectl.store.lowbit import LowbitCopies

    rtn = quantize_model(str(mixtral), 4, 64, 1, workdir=str(tmp_path / "r"), progress=False, device="cpu")
    hqq = quantize_model(str(mixtral), 4, 64, 1, workdir=str(tmp_path / "h"), progress=False, method="hqq")
    assert rtn["method"] == "rtn" and hqq["method"] == "hqq"
    # the optimiser lowers the weight error a little; round-to-nearest stays in the same range
    for r, h in zip(rtn["layers"], hqq["layers"]):
        assert h["rel_error"] < r["rel_error"] < 1.25 * h["rel_error"]
    eng = Engine.load(str(mixtral), workdir=str(tmp_path / "r"), progress=False)
    copies = LowbitCopies(tmp_path / "r", "q4g64", eng.fingerprint, eng.adapter, 4, torch.float32, progress=False)
    full = eng.store.format.views(eng.store.host(1, 2))
    got = copies.format.weights(copies.format.views(copies.host(1, 2)))
    for name in ("gate_up", "down"):
        W_q, m = Quantizer.quantize(full[name], nbits=4, group_size=64, axis=1, device="cpu", optimize=False)
        m["compute_dtype"] = torch.float32
        assert torch.equal(got[name], Quantizer.dequantize(W_q, m))
    # another method is another copy set: not "up to date"
    again = quantize_model(str(mixtral), 4, 64, 1, workdir=str(tmp_path / "r"), progress=False, method="hqq")
    assert not again.get("up_to_date") and again["method"] == "hqq"


def test_method_choice():
    assert check_method(None, "cpu") == "rtn" and check_method(None, "cuda") == "hqq"
    with pytest.raises(MoectlError, match="choose rtn or hqq"):
        check_method("gptq", "cpu")
