"""Checkpoints as released quantized: GPT-OSS's MXFP4 experts and block-scaled FP8 (Qwen3-MoE) are served
packed, as they ship, and equal transformers' own dequantised load of the same files."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from quantized_checkpoints import (fp8_block_quantize, reference_dequantized, write_fp8_qwen3_moe,  # noqa: E402
                                   write_headers_only_gpt_oss, write_mxfp4_gpt_oss)
from test_runtime import LOSSLESS_ATOL, _engine_run, run_cli  # noqa: E402

from moectl.errors import MoectlError  # noqa: E402
from moectl.models.kv_cache import cache_kwargs, output_cache  # noqa: E402
from moectl.models.base import ExpertLayout  # noqa: E402
from moectl.formats import fp8_block, mxfp4  # noqa: E402
from moectl.runtime.engine import Engine  # noqa: E402

DECODE_STEPS = 8


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    root = tmp_path_factory.mktemp("released")
    return {"mxfp4": write_mxfp4_gpt_oss(root / "gpt-oss-mxfp4"), "fp8": write_fp8_qwen3_moe(root / "qwen3-fp8"),
            # DeepSeek-V3 as released: MLA projections, the dense first layer and the shared experts FP8 too
            "fp8-deepseek_v3": write_fp8_qwen3_moe(root / "dsv3-fp8", block=8, family="deepseek_v3")}


def _reference(path, prompt, steps):
    """Logits per step and greedy ids of transformers' dequantising load (Mxfp4Config / FineGrainedFP8Config)."""
    from transformers import DynamicCache

    ref = reference_dequantized(path)
    logits, ids, step = [], [], prompt
    with torch.no_grad():
        pkv = DynamicCache(config=ref.config)
        for _ in range(steps + 1):
            out = ref(input_ids=step, **cache_kwargs(ref, pkv), use_cache=True)
            pkv = output_cache(out)
            logits.append(out.logits[0])
            ids.append(int(out.logits[0, -1].argmax()))
            step = torch.tensor([[ids[-1]]])
    return logits, ids


def _file_tensor(path, key, row):
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return f.get_slice(key)[row]


# --- the dequantisers against transformers' --------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequantize_equals_transformers(dtype):
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 48, 4, 16), dtype=torch.uint8, generator=g)    # every code, both nibbles
    scales = torch.randint(0, 255, (3, 48, 4), dtype=torch.uint8, generator=g)         # every e8m0 but NaN
    ref = _convert_moe_packed_tensors(blocks, scales, dtype=dtype)                     # [E, in, out]
    ours = mxfp4.dequantize(blocks, scales, dtype)                                     # [E, out, in]
    assert ours.dtype == dtype and torch.equal(ours.transpose(1, 2), ref)


@pytest.mark.parametrize("shape,block", [((256, 384), (128, 128)), ((200, 300), (128, 128)), ((48, 64), (16, 32))])
def test_fp8_block_dequantize_equals_transformers(shape, block):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    q, s = fp8_block_quantize(w, block[0]) if block[0] == block[1] else _quantize_rect(w, block)
    assert s.shape == fp8_block.scale_shape(shape, block)
    ours = fp8_block.dequantize(q, s, block, torch.float32)
    assert (ours - w).abs().max() < 0.07 * w.abs().max()                # it is the weight, at FP8 precision
    if shape[0] % block[0] == 0 and shape[1] % block[1] == 0:          # transformers needs whole blocks
        assert torch.equal(Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.float32), ours)


def _quantize_rect(w, block):
    b0, b1 = block
    R, C = w.shape
    scale = w.reshape(R // b0, b0, C // b1, b1).abs().amax(dim=(1, 3)) / 448.0
    q = (w.reshape(R // b0, b0, C // b1, b1) / scale[:, None, :, None]).reshape(R, C).to(torch.float8_e4m3fn)
    return q, scale


# --- lossless against transformers' dequantised load -------------------------------------

@pytest.mark.parametrize("method", ["mxfp4", "fp8", "fp8-deepseek_v3"])
def test_released_checkpoint_equals_transformers_dequantised(method, released):
    path = released[method]
    prompt = torch.randint(2, 512, (1, 9), generator=torch.Generator().manual_seed(1))
    ref_logits, ref_ids = _reference(path, prompt, DECODE_STEPS)
    L = 3 if "deepseek" in method else 4                                  # DeepSeek's first layer is dense
    runs = {"1 slot/layer (device slots)": dict(cache_experts=L, emulate_device=True),
            "1 slot/layer, disk tier": dict(cache_experts=L, offload="disk"),
            "everything cached (in place)": dict()}
    for what, kw in runs.items():
        eng = Engine.load(str(path), dtype="float32", progress=False, **kw)
        assert eng.store.format.name.startswith(method.split("-")[0])
        logits, ids = _engine_run(eng, prompt, DECODE_STEPS)
        assert ids == ref_ids, what
        for a, b in zip(logits, ref_logits):
            torch.testing.assert_close(a, b, rtol=0, atol=LOSSLESS_ATOL)
        if "1 slot" in what:
            st = eng.cache.snapshot()
            assert eng.cache.slots_per_layer == [1] * L and st["misses"] > 0
            assert st["bytes_loaded"] == (st["misses"] + st["prefetches"]) * eng.store.expert_nbytes


def test_gpt_oss_expert_is_held_as_mxfp4(released):
    """The bytes held per expert are the release's: 4.25 bits per weight plus the biases, in the RAM tier and
    in each device slot; in the checkpoint's bf16 they are the file's bytes exactly."""
    path = released["mxfp4"]
    cfg = json.loads((path / "config.json").read_text())
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    weights = 3 * H * I                                                   # gate, up, down
    eng = Engine.load(str(path), progress=False)                         # the checkpoint's dtype: bf16
    fmt = eng.store.format
    assert eng.store.raw and eng.dtype == torch.bfloat16
    assert eng.store.expert_nbytes == fmt.nbytes == weights * 4.25 / 8 + (2 * I + H) * 2
    assert eng.store.buffers[0].dtype == torch.uint8 and eng.store.buffers[0].shape == (8, fmt.nbytes)
    bits = sum(p.nbytes for p in fmt.parts if not p.name.endswith("bias")) * 8 / weights
    assert bits == mxfp4.BITS_PER_WEIGHT == 4.25
    e, layer = 5, 2
    buf, views = eng.store.host(layer, e), fmt.views(eng.store.host(layer, e))
    pre = f"model.layers.{layer}.mlp.experts."
    for part, key in (("gate_up.blocks", "gate_up_proj_blocks"), ("gate_up.scales", "gate_up_proj_scales"),
                      ("gate_up_bias", "gate_up_proj_bias"), ("down.blocks", "down_proj_blocks"),
                      ("down.scales", "down_proj_scales"), ("down_bias", "down_proj_bias")):
        assert torch.equal(views[part], _file_tensor(path, pre + key, e)), part
    assert buf.numel() == fmt.nbytes                      # nothing else: no dequantised copy is kept anywhere
    slots = Engine.load(str(path), cache_experts=8, emulate_device=True, progress=False).cache
    assert slots.pool[0].dtype == torch.uint8 and slots.pool[0].shape == (2, fmt.nbytes)
    assert slots.stats.expert_nbytes == fmt.nbytes


def test_fp8_expert_is_held_as_fp8(released):
    path = released["fp8"]
    cfg = json.loads((path / "config.json").read_text())
    H, I, b = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["quantization_config"]["weight_block_size"][0]
    eng = Engine.load(str(path), progress=False)
    scales = 2 * (I // b) * (H // b) + (H // b) * (I // b)
    assert eng.store.expert_nbytes == 3 * H * I + scales * 4                  # 1 byte per weight + F32 block scales
    views = eng.store.format.views(eng.store.host(1, 3))
    pre = "model.layers.1.mlp.experts.3."
    assert views["up.weight"].dtype == torch.float8_e4m3fn
    assert torch.equal(views["up.weight"].view(torch.uint8),
                       _file_tensor(path, pre + "up_proj.weight", slice(None)).view(torch.uint8))
    assert torch.equal(views["down.scale_inv"], _file_tensor(path, pre + "down_proj.weight_scale_inv", slice(None)))
    # the attention projections (FP8 on disk too) were dequantised into the model once
    q = eng.model.model.layers[0].self_attn.q_proj.weight
    assert q.dtype == torch.bfloat16 and not q.is_meta


# --- clear errors -----------------------------------------------------------------------

@pytest.mark.parametrize("qc,words", [
    ({"quant_method": "gptq", "bits": 4}, ["'gptq'", "mxfp4", "fp8"]),
    ({"quant_method": "awq"}, ["'awq'"]),
    ({"quant_method": "fp8", "activation_scheme": "static"}, ["weight_block_size"]),
])
def test_other_quantization_is_a_clear_error(qc, words, released, tmp_path):
    d = tmp_path / "other"
    shutil.copytree(released["fp8"], d)
    cfg = json.loads((d / "config.json").read_text()) | {"quantization_config": qc}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MoectlError) as err:
        Engine.load(str(d), progress=False)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_mxfp4_blocks_without_quantization_config_is_a_clear_error(released, tmp_path):
    d = tmp_path / "noqc"
    shutil.copytree(released["mxfp4"], d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MoectlError, match="quantization_config"):
        Engine.load(str(d), progress=False)


# --- sizes: inspect from the shard headers, the simulator's cost model ---------------------

MXFP4_EXPERT = 3 * 2880 * 2880 * 17 // 32 + (2 * 2880 + 2880) * 2      # gpt-oss: codes + scales + bf16 biases


def test_inspect_gpt_oss_120b_at_mxfp4_size(tmp_path, capsys, monkeypatch):
    """`inspect --model gpt-oss-120b` on a checkpoint of the release's real shapes (headers only, sparse file):
    the experts at MXFP4 size (~61 GB, not ~230 GB of bf16) and the memory a GPU run needs."""
    path = write_headers_only_gpt_oss(tmp_path / "gpt-oss-120b")
    monkeypatch.setenv("MOECTL_GPT_OSS_120B_PATH", str(path))
    monkeypatch.setenv("MOECTL_HOME", str(tmp_path / "home"))
    code, out, err = run_cli(["inspect", "--model", "gpt-oss-120b", "--json"], capsys)
    assert code == 0, err
    info = json.loads(out)
    assert (info["layers"], info["experts"], info["top_k"], info["expert_format"]) == (36, 128, 4, "mxfp4")
    assert info["bytes_per_expert"] == MXFP4_EXPERT == 13_236_480
    assert info["expert_bytes"] == 36 * 128 * MXFP4_EXPERT                        # 60.99 GB
    assert 4.25 < info["bits_per_weight"] < 4.26                                  # biases included
    # dense: embeddings + head (untied) + attention, bf16 (the release's dense tensors, ~4.3 GB)
    assert 4.2e9 < info["dense_bytes"] < 4.3e9
    assert info["total_bytes"] == info["dense_bytes"] + info["expert_bytes"]
    assert info["host_ram_bytes"] == info["expert_bytes"]                         # --offload ram: experts pinned
    assert info["device_min_bytes"] == info["dense_bytes"] + info["kv_reserve_bytes"] + 36 * MXFP4_EXPERT
    code, out, _ = run_cli(["inspect", "--model", "gpt-oss-120b"], capsys)
    assert code == 0 and "mxfp4" in out and "60.99 GB" in out


def test_cost_model_prices_released_experts():
    from moectl.core.shapes import expert_bytes, load_shape, shape_from_hf_config

    for name, experts in (("gpt-oss-20b", 24 * 32), ("gpt-oss-120b", 36 * 128)):
        shape = load_shape(name)
        assert expert_bytes(shape) == MXFP4_EXPERT                           # the recipe: as released
        assert expert_bytes(shape, bits=16) == 3 * 2880 * 2880 * 2 + 8640 * 2  # a bf16 copy: 3.8x the bytes
    assert round(36 * 128 * MXFP4_EXPERT / 1e9, 1) == 61.0
    # a checkpoint's config.json says the same (simulate --model-shape DIR, profiled traces)
    cfg = {"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36,
           "num_local_experts": 128, "num_experts_per_tok": 4, "num_attention_heads": 64, "head_dim": 64,
           "vocab_size": 201088, "torch_dtype": "bfloat16", "quantization_config": {"quant_method": "mxfp4"}}
    assert expert_bytes(shape_from_hf_config(cfg)) == MXFP4_EXPERT
    qwen = {"model_type": "qwen3_moe", "hidden_size": 2048, "moe_intermediate_size": 768, "num_hidden_layers": 48,
            "num_experts": 128, "num_experts_per_tok": 8, "num_attention_heads": 32, "head_dim": 128,
            "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    assert expert_bytes(shape_from_hf_config(qwen)) == 3 * 2048 * 768 * (1 + 4 / (128 * 128))
    # the recipe prices exactly what the runtime holds: the packed Fp8BlockFormat of that expert
    fmt = fp8_block.Fp8BlockFormat(ExpertLayout(("gate_up", "down"), ((1536, 2048), (2048, 768))), torch.bfloat16,
                                   (128, 128))
    assert expert_bytes(load_shape("qwen3-moe-fp8")) == fmt.nbytes == 3 * 2048 * 768 + 288 * 4
