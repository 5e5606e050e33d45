"""A Q4_K_M-like GGUF (gate/up Q4_K; down Q6_K in layer 0, Q4_K in layer 1; dense Q8_0) of a Mixtral whose rows are
whole 256-weight K blocks: header-only sizes, one padded format per layer, every expert's matrices equal gguf's
reference dequantisation, Q4_K experts straight from the file onto the int4 kernel, dense tensors dequantised."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as reference_dequantize

from gguf_build import model_from_gguf, write_gguf
from model_factory import save_tokenizer
from moectl.store.gguf.config import gguf_config
from moectl.store.gguf.experts import ExpertIndex
from moectl.store.gguf.files import GgufFiles
from moectl.formats.gguf import layer_formats
from moectl.formats.gguf_int4_repack import repack_int4

H = I = 256
E = 4


def q4_k_m(layer: int, proj: str) -> T:
    return T.Q6_K if (proj == "down" and layer == 0) else T.Q4_K


@pytest.fixture(scope="module")
def q4km(tmp_path_factory):
    from transformers import AutoModelForCausalLM, MixtralConfig

    root = tmp_path_factory.mktemp("q4km")
    cfg = MixtralConfig(vocab_size=512, hidden_size=H, intermediate_size=I, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, num_local_experts=E, num_experts_per_tok=2, max_position_embeddings=128,
                        bos_token_id=0, eos_token_id=0, pad_token_id=1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(root / "ckpt", save_original_format=True)
    save_tokenizer(root / "ckpt")
    return write_gguf(root / "ckpt", root / "tiny-Q4_K_M.gguf", expert_encoding=q4_k_m, dense_encoding=T.Q8_0)


def test_sizes_from_header(q4km):
    sizes = ExpertIndex(GgufFiles(q4km)).sizes()
    q4k, q6k = I * H // 256 * 144, I * H // 256 * 210                       # bytes of one [I, H] matrix
    assert sizes["bytes_per_expert"] == 2 * q4k + q6k                           # layer 0's, the larger
    assert sizes["expert_bytes"] == E * ((2 * q4k + q6k) + 3 * q4k)
    assert sizes["bits_per_weight"] == pytest.approx(8 * sizes["expert_bytes"] / (2 * E * 3 * I * H))
    assert sizes["encodings"] == {"Q4_K": E * 5 * q4k, "Q6_K": E * q6k}
    assert sizes["encoding_bits"] == {"Q4_K": 4.5, "Q6_K": 6.5625}
    assert sizes["moe_layers"] == 2 and sizes["experts"] == E


def test_one_format_per_layer_one_size(q4km):
    index = ExpertIndex(GgufFiles(q4km))
    formats = layer_formats(index, "mixtral", torch.float32)
    assert formats[0].name == "gguf-Q4_K+Q6_K" and formats[1].name == "gguf-Q4_K"
    assert formats[0].nbytes == formats[1].nbytes == index.expert_nbytes(0) == index.slot_nbytes() > \
        index.expert_nbytes(1)
    q4k, q6k = I * H // 256 * 144, I * H // 256 * 210
    for layer, fmt in formats.items():   # the same spans in every layer: each part as large as the largest layer's
        assert [fmt.spans[n] for n, _ in index.parts(layer, 0)] == [(0, q4k), (q4k, 2 * q4k), (2 * q4k, 2 * q4k + q6k)]
    assert not formats[0].padded and formats[1].padded


def test_experts_equal_reference(q4km):
    files = GgufFiles(q4km)
    index = ExpertIndex(files)
    formats = layer_formats(index, "mixtral", torch.float32)
    for layer in (0, 1):
        for proj in ("gate", "up", "down"):
            t = files.tensors[f"blk.{layer}.ffn_{proj}_exps.weight"]
            assert t.encoding == q4_k_m(layer, proj)
            ref = reference_dequantize(files.bytes_of(t.file, t.offset, t.nbytes).reshape(E, -1), t.encoding)
            for e in range(E):
                m = formats[layer].matrices(formats[layer].views(formats[layer].packed(e)))
                assert torch.equal(m[proj], torch.from_numpy(np.ascontiguousarray(ref.reshape(E, I, H)[e])))


def test_q4_k_experts_onto_int4_kernel(q4km):
    files = GgufFiles(q4km)
    index = ExpertIndex(files)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(0))
    for e in range(E):
        for name, t in index.parts(1, e):
            data = torch.from_numpy(files.bytes_of(t.file, t.offset, t.nbytes))
            w = torch.from_numpy(reference_dequantize(data.numpy().reshape(t.shape[0], -1), t.encoding))
            y, y_ref = repack_int4(data, t.encoding, t.shape)(x), x @ w.T
            assert (y - y_ref).abs().max() <= 1e-5 * y_ref.abs().max(), (e, name)


def test_dense_dequantised_and_model_runs(q4km):
    files = GgufFiles(q4km)
    assert files.tensors["blk.0.attn_v.weight"].encoding == T.Q8_0
    assert files.tensors["blk.0.attn_norm.weight"].encoding == T.F32                 # 1-D stays F32
    model = model_from_gguf(q4km)
    sd = model.state_dict()
    for gguf_name, hf in (("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight"),
                          ("token_embd.weight", "model.embed_tokens.weight"), ("output.weight", "lm_head.weight")):
        t = files.tensors[gguf_name]
        ref = reference_dequantize(files.bytes_of(t.file, t.offset, t.nbytes).reshape(t.shape[0], -1), t.encoding)
        assert torch.equal(sd[hf], torch.from_numpy(np.ascontiguousarray(ref)))
    assert gguf_config(files).intermediate_size == I
    with torch.no_grad():
        logits = model(torch.arange(12)[None]).logits
    assert torch.isfinite(logits).all() and logits.shape == (1, 12, 512)


def test_sizing_modules_import_no_torch():
    """files, encodings and experts (what sizing and `inspect` need) import neither torch nor transformers."""
    code = ("import sys, moectl.store.gguf.files, moectl.formats.gguf_encodings, moectl.store.gguf.experts; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_model_sizes_account_for_every_byte(q4km):
    from moectl.store.gguf.model import GgufModel

    g = GgufModel(q4km)
    s = g.sizes(dense_bytes_per_weight=2)
    tensors = g.files.tensors.values()
    assert s["expert_bytes"] + s["dense_packed_bytes"] == sum(t.nbytes for t in tensors)
    assert s["file_bytes"] - sum(t.nbytes for t in tensors) < 64 * 1024        # the rest is header and padding
    assert s["dense_weights"] == sum(p.numel() for n, p in model_from_gguf(q4km).named_parameters()
                                     if ".experts." not in n)
    assert s["host_bytes_ram_tier"] == s["expert_bytes"] + 2 * s["dense_weights"]
    assert (s["family"], s["architecture"]) == ("mixtral", "llama")


@pytest.mark.parametrize("layer", [0, 1], ids=["gate_up-int4+down-Q6_K-two-planes", "all-int4"])
def test_int4_format_expert_forward(q4km, layer):
    """A Q4_K_M layer repacked (GgufInt4Format): Mixtral's expert_forward on its Int4Linear weights equals the same
    forward on the dequantised GGUF weights (fp32 scales: summation order only); bf16 scales stay within bf16
    rounding."""
    import torch.nn.functional as F

    from moectl.formats.gguf_int4 import GgufInt4Format
    from moectl.models import adapter_for

    g_files = GgufFiles(q4km)
    index = ExpertIndex(g_files)
    src = layer_formats(index, "mixtral", torch.float32)[layer]
    adapter = adapter_for(gguf_config(g_files))

    def gate(h):
        a, b = h.chunk(2, dim=-1)
        return F.silu(a) * b

    x = torch.randn(5, H, generator=torch.Generator().manual_seed(1))
    src_bf16 = layer_formats(index, "mixtral", torch.bfloat16)[layer]              # dequantises to bf16
    exact, fast = GgufInt4Format(src), GgufInt4Format(src_bf16, torch.bfloat16)
    assert "down.int4" in exact.spans and "gate_up.int4" in exact.spans
    assert exact.planes == ({"down"} if layer == 0 else set())
    if layer == 1:                                   # codes 4 bits + (scale, zero') fp32 per 32: 6 bits a weight
        assert exact.nbytes == 3 * I * H * 6 // 8 and fast.nbytes == 3 * I * H * 5 // 8
    else:                                            # Q6_K: two 4-bit planes + (scale, zero') fp32 per 16: 12 bits
        assert exact.nbytes == 2 * I * H * 6 // 8 + I * H * 12 // 8
    for e in range(E):
        buf = src.packed(e)
        want = adapter.expert_forward(src.weights(src.views(buf)), x, gate)
        w = exact.weights(exact.views(exact.repack(buf)))
        assert callable(w["gate_up"]) and not isinstance(w["gate_up"], torch.Tensor)
        got = adapter.expert_forward(w, x, gate)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        w = fast.weights(fast.views(fast.repack(buf)))
        rough = adapter.expert_forward(w, x.bfloat16(), lambda h: gate(h.float()).bfloat16()).float()
        assert (rough - want).abs().max() <= 3e-2 * want.abs().max()
