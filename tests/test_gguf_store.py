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
from moectl.store.gguf.model import GgufModel, is_gguf
from moectl.store.gguf.store import GgufAdapter, GgufCheckpoint
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


@pytest.mark.parametrize("offload", ["ram", "disk"])
def test_mixed_layers_per_layer_formats(tiny_small, tmp_path, offload):
    """Layers of different encodings (Q8_0 then Q4_0, as a Q4_K_M mixes Q4_K and Q6_K): one slot size and the
    same views for every layer (each part padded to the largest layer's), each layer's own `weights`; every
    expert equals gguf's reference dequantisation bit for bit."""
    path = write_gguf(tiny_small, tmp_path / "mix.gguf",
                      expert_encoding=lambda layer, proj: T.Q8_0 if layer % 2 == 0 else T.Q4_0)
    g = GgufModel(path)
    adapter = GgufAdapter(g)
    store = ExpertStore(GgufCheckpoint(g), adapter, g.index.layers, torch.float32, offload=offload, progress=False)
    assert adapter.format_names() == "gguf-Q8_0,gguf-Q4_0"
    assert store.expert_nbytes == g.index.expert_nbytes(0) == g.index.slot_nbytes() > g.index.expert_nbytes(1)
    assert {tuple(store.format_of("full", l).spans.items()) for l in range(store.num_layers)} == \
        {tuple(store.format.spans.items())}
    for pos, layer in enumerate(g.index.layers):
        fmt = store.format_of("full", pos)
        assert fmt.name == ("gguf-Q8_0" if layer % 2 == 0 else "gguf-Q4_0")
        for e in (0, g.index.num_experts - 1):
            buf = torch.zeros(store.expert_nbytes, dtype=torch.uint8)
            store.load_into(pos, e, buf)
            w = fmt.weights(store.format.views(buf))
            ref = {}
            for name, t in g.index.parts(layer, e):
                ref[name] = torch.from_numpy(reference_dequantize(g.files.bytes_of(t.file, t.offset, t.nbytes),
                                                                  t.encoding).reshape(t.shape))
            assert torch.equal(w["gate_up"], torch.cat([ref["gate"], ref["up"]]))
            assert torch.equal(w["down"], ref["down"])
