"""The memory roofline beside issue 42's decode ratios (bench/gguf_vs_llamacpp.py, docs/gguf.md stop 54): the bytes a
decode token reads, from a GGUF's header alone (checked against a hand sum over a tiny file's tensor list), and the
streaming-read bandwidth probe (a figure, never a timing asserted)."""

from __future__ import annotations

import math

import pytest
from gguf import GGMLQuantizationType as T

from gguf_build import k256_mixtral, write_gguf
from moectl.errors import MoectlError
from moectl.kernels import ggml
from moectl.store.gguf.experts import decode_read_bytes
from moectl.store.gguf.files import GgufFiles

# the tiny Mixtral of k256_mixtral: H = hidden, I = expert width, V = vocabulary, E = experts, U = experts used,
# KV = the K/V projections' rows (2 KV heads of 64); 2 layers
H, I, V, E, U, KV, LAYERS = 256, 256, 512, 4, 2, 128, 2


def q8_0(weights: int) -> int:         # 34 bytes a block of 32: an fp16 scale and 32 int8
    return weights // 32 * 34


def q4_k(weights: int) -> int:         # 144 bytes a super-block of 256
    return weights // 256 * 144


def layer_tensors(l: int) -> set[str]:
    return {f"blk.{l}.{n}.weight" for n in ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                                            "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{"untied" | "tied" | "per-expert": file}: the tiny Mixtral, dense tensors Q8_0 (1-D ones F32, as llama.cpp
    keeps them), experts Q4_K; its own lm_head, one tied to the embedding, and the older one-tensor-per-expert
    layout."""
    root = tmp_path_factory.mktemp("roofline")
    untied, tied = k256_mixtral(root / "untied"), k256_mixtral(root / "tied", tied=True)
    return {"untied": write_gguf(untied, root / "untied.gguf", T.Q4_K, T.Q8_0),
            "tied": write_gguf(tied, root / "tied.gguf", T.Q4_K, T.Q8_0),
            "per-expert": write_gguf(untied, root / "per-expert.gguf", T.Q4_K, T.Q8_0, per_expert=True)}


def test_a_decode_token_reads_the_dense_tensors_the_lm_head_one_embedding_row_and_top_k_experts(tiny):
    files = GgufFiles(tiny["untied"])
    # the hand sum covers every tensor of the file
    assert set(files.tensors) == {"token_embd.weight", "output.weight", "output_norm.weight"} | \
        layer_tensors(0) | layer_tensors(1)
    per_layer_dense = (2 * H * 4                                   # attn_norm, ffn_norm: F32
                       + q8_0(H * H) * 2 + q8_0(KV * H) * 2       # attn_q, attn_output; attn_k, attn_v
                       + q8_0(E * H))                              # the router
    expert = 3 * q4_k(I * H)                                       # gate, up, down of one expert
    want = {"dense": LAYERS * per_layer_dense + H * 4,             # + output_norm
            "experts": LAYERS * U * expert,
            "lm_head": q8_0(V * H),
            "embedding_row": q8_0(H),                              # one row, not the V x H matrix
            "top_k": U, "experts_per_layer": E}
    want["total"] = want["dense"] + want["experts"] + want["lm_head"] + want["embedding_row"]
    assert decode_read_bytes(files) == want
    assert want["total"] == 1_006_992                              # the same sum, worked out by hand
    # the older layout (one tensor per expert) reads the same bytes
    assert decode_read_bytes(GgufFiles(tiny["per-expert"])) == want


def test_a_tied_lm_head_reads_the_whole_embedding_matrix(tiny):
    files = GgufFiles(tiny["tied"])
    assert "output.weight" not in files.tensors
    got = decode_read_bytes(files)
    assert got["lm_head"] == files.tensors["token_embd.weight"].nbytes == q8_0(V * H)
    assert got["embedding_row"] == q8_0(H)
    assert got["total"] == 1_006_992                               # as the untied file: the same shapes


@pytest.mark.skipif(ggml.library() is None, reason="ggml cannot run here")
@pytest.mark.parametrize("threads", [1, 2])
def test_the_read_probe_gives_a_positive_finite_bandwidth_for_each_pass(threads):
    res = ggml.read_bandwidth(nbytes=4 << 20, threads=threads, passes=3)
    assert len(res["passes"]) == 3 and all(math.isfinite(x) and x > 0 for x in res["passes"])
    assert res["min"] <= res["gbps"] <= res["max"] and res["gbps"] == sorted(res["passes"])[1]
    assert res["threads"] == threads and res["bytes"] == 4 << 20   # whole pages a thread: nothing rounded off


@pytest.mark.skipif(ggml.library() is None, reason="ggml cannot run here")
def test_the_read_probe_says_what_is_wrong_with_its_arguments():
    with pytest.raises(MoectlError, match="at least 4 KiB a thread"):
        ggml.read_bandwidth(nbytes=4096, threads=2, passes=1)
