"""The existing ExpertStore (unchanged) reads a GGUF model's experts through GgufCheckpoint + GgufAdapter: the RAM
tier holds the file's bytes, the disk tier reads the same by positioned reads, and the format's weights are gguf's
reference dequantisation in the family's layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as reference_dequantize

from gguf_build import write_gguf
from moectl.errors import MoectlError
from moectl.gguf.model import GgufModel, is_gguf
from moectl.gguf.store import GgufAdapter, GgufCheckpoint
from moectl.store.expert_store import ExpertStore


@pytest.fixture(scope="module")
def q8(tiny_small, tmp_path_factory):
    return write_gguf(tiny_small, tmp_path_factory.mktemp("store") / "tiny-Q8_0.gguf", expert_encoding=T.Q8_0)


@pytest.mark.parametrize("offload", ["ram", "disk"])
def test_expert_store_reads_gguf(q8, offload):
    g = GgufModel(q8)
    adapter = GgufAdapter(g)
    store = ExpertStore(GgufCheckpoint(g), adapter, g.index.layers, torch.float32, offload=offload, progress=False)
    fmt = store.format
    assert fmt.nbytes == g.index.expert_nbytes(0) == 3 * 64 * 128 // 32 * 34
    for layer_pos, layer in enumerate(g.index.layers):
        ref = {}
        for proj in ("gate", "up", "down"):
            t = g.files.tensors[f"blk.{layer}.ffn_{proj}_exps.weight"]
            ref[proj] = reference_dequantize(g.files.bytes_of(t.file, t.offset, t.nbytes).reshape(t.shape[0], -1),
                                             T.Q8_0).reshape(t.shape)
        for e in range(g.index.num_experts):
            buf = torch.empty(fmt.nbytes, dtype=torch.uint8)
            store.load_into(layer_pos, e, buf)
            want = torch.cat([torch.from_numpy(g.files.bytes_of(t.file, t.offset, t.nbytes).copy())
                              for _, t in g.index.parts(layer, e)])
            assert torch.equal(buf, want)
            if offload == "ram":
                assert torch.equal(store.host(layer_pos, e), want)
            w = fmt.weights(fmt.views(buf))
            assert torch.equal(w["gate_up"], torch.from_numpy(np.concatenate([ref["gate"][e], ref["up"][e]])))
            assert torch.equal(w["down"], torch.from_numpy(np.ascontiguousarray(ref["down"][e])))


def test_per_expert_layout_through_the_store(tiny_small, tmp_path):
    path = write_gguf(tiny_small, tmp_path / "pe.gguf", expert_encoding=T.Q4_0, per_expert=True)
    g = GgufModel(path)
    store = ExpertStore(GgufCheckpoint(g), GgufAdapter(g), g.index.layers, torch.float32, offload="disk",
                        progress=False)
    buf = torch.empty(store.format.nbytes, dtype=torch.uint8)
    store.load_into(1, 6, buf)
    t = g.files.tensors["blk.1.ffn_down.6.weight"]
    assert torch.equal(buf[-t.nbytes:], torch.from_numpy(g.files.bytes_of(t.file, t.offset, t.nbytes).copy()))


def test_mixed_layers_need_per_layer_formats(tiny_small, tmp_path):
    path = write_gguf(tiny_small, tmp_path / "mix.gguf",
                      expert_encoding=lambda layer, proj: T.Q8_0 if layer == 0 else T.Q4_0)
    adapter = GgufAdapter(GgufModel(path))
    with pytest.raises(MoectlError, match=r"mix.gguf: its MoE layers use different encodings \(gguf-Q4_0, "
                                          r"gguf-Q8_0\); the expert store keeps one format"):
        adapter.format(torch.float32)
    assert adapter.format_for(0, torch.float32).name == "gguf-Q8_0"
    assert adapter.format_for(1, torch.float32).nbytes == adapter.format_for(0, torch.float32).nbytes


def test_is_gguf(tmp_path, q8):
    assert is_gguf(q8) and not is_gguf(tmp_path) and not is_gguf(tmp_path / "model.safetensors")


def test_dense_into_meta_skeleton(q8):
    """What Engine.load will do: a skeleton on meta whose experts are stand-ins takes the GGUF's dense tensors
    (assign=True) and nothing is left on meta or unexpected."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    g = GgufModel(q8)
    with init_empty_weights():
        hf = AutoModelForCausalLM.from_config(g.config, dtype=torch.bfloat16)
    for layer in hf.model.layers:
        layer.mlp.experts = torch.nn.Module()                # OffloadedExperts owns no parameters either
    state = g.dense_state_dict(hf, torch.bfloat16)
    missing, unexpected = hf.load_state_dict(state, strict=False, assign=True)
    assert not missing and not unexpected
    assert not any(p.is_meta for p in hf.parameters())
    assert all(v.dtype == torch.bfloat16 for v in state.values())
