"""Bad GGUF input: one MoectlError each, naming what is wrong and where."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter

from gguf_build import write_gguf
from moectl.errors import MoectlError
from moectl.store.gguf.config import gguf_config
from moectl.store.gguf.experts import ExpertIndex
from moectl.store.gguf.files import GgufFiles


@pytest.fixture(scope="module")
def good(tiny_small, tmp_path_factory):
    return write_gguf(tiny_small, tmp_path_factory.mktemp("gguf") / "good.gguf", expert_encoding=T.Q8_0)


def minimal_gguf(path, arch: str):
    """A one-tensor GGUF of architecture `arch` (no experts)."""
    w = GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def test_unsupported_architecture(tmp_path):
    with pytest.raises(MoectlError, match=r"phi.gguf: GGUF architecture 'phi3' is not a Mixture-of-Experts family"):
        gguf_config(GgufFiles(minimal_gguf(tmp_path / "phi.gguf", "phi3")))


def test_dense_llama_is_not_moe(tmp_path):
    with pytest.raises(MoectlError, match=r"'llama' without experts \(a dense Llama\)"):
        gguf_config(GgufFiles(minimal_gguf(tmp_path / "llama.gguf", "llama")))


def test_unsupported_encoding(tiny_small, tmp_path):
    # Q8_1 is an activation encoding (ggml's x against Q4_1 weights): no kernel reads it as a weight
    path = write_gguf(tiny_small, tmp_path / "q8_1.gguf", expert_encoding=T.Q8_1)
    with pytest.raises(MoectlError, match=r"q8_1.gguf: tensor blk.\d.ffn_\w+_exps.weight is encoded as Q8_1, which "
                                          r"moectl does not read; supported: F32, F16, BF16, Q8_0, Q4_0"):
        GgufFiles(path)


def test_truncated_data(good, tmp_path):
    path = tmp_path / "cut.gguf"
    shutil.copy(good, path)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 1000)
    with pytest.raises(MoectlError, match=rf"cut.gguf is truncated: tensor blk.1.ffn_\w+_exps.weight ends at byte "
                                          rf"{size:,} but the file has {size - 1000:,} bytes"):
        GgufFiles(path)


def test_truncated_header(good, tmp_path):
    path = tmp_path / "head.gguf"
    path.write_bytes(good.read_bytes()[:300])
    with pytest.raises(MoectlError, match=r"head.gguf is not a readable GGUF file \(truncated or corrupt header"):
        GgufFiles(path)


def test_not_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(MoectlError, match=r"model.gguf is not a readable GGUF file"):
        GgufFiles(path)


def test_missing_split_part(tiny_small, tmp_path):
    first = write_gguf(tiny_small, tmp_path / "m.gguf", split_max_tensors=8)
    (tmp_path / "m-00002-of-00003.gguf").unlink()
    with pytest.raises(MoectlError, match=r"m-00001-of-00003.gguf is part of a model split in 3 files; missing next "
                                          r"to it in .*: m-00002-of-00003.gguf"):
        GgufFiles(first)


def test_split_part_out_of_place(tiny_small, tmp_path):
    write_gguf(tiny_small, tmp_path / "m.gguf", split_max_tensors=8)
    a, b = tmp_path / "m-00002-of-00003.gguf", tmp_path / "m-00003-of-00003.gguf"
    a.rename(tmp_path / "x"), b.rename(a), (tmp_path / "x").rename(b)
    with pytest.raises(MoectlError, match=r"m-00002-of-00003.gguf says it is split part 3 of 3, but its name says "
                                          r"part 2 of 3"):
        GgufFiles(tmp_path / "m-00001-of-00003.gguf")


def test_metadata_contradicts_expert_shapes(tiny_small, tmp_path):
    path = write_gguf(tiny_small, tmp_path / "bad.gguf", meta={"{arch}.feed_forward_length": 96})
    with pytest.raises(MoectlError, match=r"bad.gguf: the metadata says 8 experts of \[96 x 64\], so tensor "
                                          r"blk.0.ffn_gate_exps.weight should be \[8, 96, 64\], but it is "
                                          r"\[8, 128, 64\] in bad.gguf \(metadata contradicts tensors\)"):
        gguf_config(GgufFiles(path))


def test_metadata_contradicts_expert_count(tiny_small, tmp_path):
    path = write_gguf(tiny_small, tmp_path / "bad.gguf", meta={"{arch}.expert_count": 4})
    with pytest.raises(MoectlError, match=r"tensor blk.0.ffn_gate_exps.weight stacks 8 experts, the metadata says 4 "
                                          r"\(llama.expert_count\)"):
        ExpertIndex(GgufFiles(path))
    with pytest.raises(MoectlError, match=r"the metadata says 4 experts x hidden 64, so tensor "
                                          r"blk.0.ffn_gate_inp.weight should be \[4, 64\], but it is \[8, 64\]"):
        gguf_config(GgufFiles(path))


def test_missing_file(tmp_path):
    with pytest.raises(MoectlError, match=r"GGUF file .*nope.gguf does not exist"):
        GgufFiles(tmp_path / "nope.gguf")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(MoectlError, match=r"empty.gguf is not a readable GGUF file"):
        GgufFiles(path)


def test_missing_metadata_key(tmp_path):
    path = tmp_path / "olmoe.gguf"
    w = GGUFWriter(path, "olmoe")
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_head_count(2)
    w.add_expert_count(4)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(MoectlError, match=r"olmoe.gguf has no metadata key olmoe.expert_used_count \(needed for a "
                                          r"olmoe model\)"):
        gguf_config(GgufFiles(path))


def test_per_expert_encodings_differ_in_a_layer(tiny_small, tmp_path, monkeypatch):
    """Old per-expert files are quantised tensor by tensor; a layer whose experts differ cannot share one format."""
    import gguf_build

    path = write_gguf(tiny_small, tmp_path / "pe.gguf", per_expert=True,
                      expert_encoding=lambda layer, proj: T.Q8_0 if layer == 0 else T.F32)
    assert ExpertIndex(GgufFiles(path)).layers == [0, 1]                           # alike within each layer: fine
    real = gguf_build.encode                                                        # layer 1's expert 3 in Q4_0
    monkeypatch.setattr(gguf_build, "encode", lambda x, q, seed=0: real(x, T.Q4_0 if seed == 1003 else q, seed))
    bad = write_gguf(tiny_small, tmp_path / "bad.gguf", per_expert=True, expert_encoding=T.Q8_0)
    with pytest.raises(MoectlError, match=r"bad.gguf: blk.1.ffn_gate.3.weight is Q4_0 \[128, 64\], "
                                          r"blk.1.ffn_gate.0.weight is Q8_0 \[128, 64\]: moectl needs a layer's "
                                          r"experts stored alike"):
        ExpertIndex(GgufFiles(bad))
