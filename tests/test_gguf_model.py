"""GGUF files in llama.cpp's layout (tests/gguf_build.py) read by moectl/gguf: config, tokenizer, experts in place,
dense tensors; lossless against the safetensors original at F32 for every family."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as reference_dequantize
from safetensors.torch import load_file

from gguf_build import model_from_gguf, write_gguf
from model_factory import build_family, save_tokenizer
from moectl.store.gguf.config import gguf_config, gguf_tokenizer
from moectl.store.gguf.experts import ExpertIndex
from moectl.store.gguf.files import GgufFiles
from moectl.formats.gguf import layer_formats


@pytest.fixture(scope="module")
def mixtral_gguf(tiny_small, tmp_path_factory):
    return write_gguf(tiny_small, tmp_path_factory.mktemp("gguf") / "tiny-F32.gguf")


def _logits(model, vocab):
    ids = torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids).logits


def test_mixtral_gguf_is_a_mixtral_not_transformers_llama(mixtral_gguf, tiny_small):
    """transformers' own loader reads llama.cpp's Mixtral (architecture `llama`) as a dense Llama; moectl's config
    is the original's."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    theirs = load_gguf_checkpoint(str(mixtral_gguf))["config"]
    assert theirs["model_type"] == "llama" and "num_local_experts" not in theirs      # the bug, as of 5.2x
    ours = gguf_config(GgufFiles(mixtral_gguf)).to_dict()
    orig = json.loads((tiny_small / "config.json").read_text())
    for key in ("model_type", "num_local_experts", "num_experts_per_tok", "hidden_size", "intermediate_size",
                "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size", "rms_norm_eps",
                "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert ours[key] == orig[key], key
    assert ours["rope_parameters"]["rope_theta"] == orig["rope_parameters"]["rope_theta"]


def test_tokenizer_from_metadata_matches_original(mixtral_gguf, tiny_small):
    from transformers import AutoTokenizer

    ours, orig = gguf_tokenizer(GgufFiles(mixtral_gguf)), AutoTokenizer.from_pretrained(tiny_small)
    text = "The cache holds experts.\n<|im_start|>user\nwhat is 2+2?<|im_end|>\n  spaces  and ünïcode"
    assert ours(text).input_ids == orig(text).input_ids
    assert ours.decode(orig(text).input_ids) == orig.decode(orig(text).input_ids)
    assert (ours.eos_token_id, ours.bos_token_id) == (orig.eos_token_id, orig.bos_token_id)
    assert ours.chat_template == orig.chat_template


def test_tokenizer_metadata_is_transformers_own(mixtral_gguf):
    """The tokenizer is built from the metadata moectl parsed once: the same (architecture, vocabulary, config) that
    transformers' get_gguf_tokenizer reads from the file itself, so the same ids."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    from moectl.store.gguf.config import tokenizer_metadata

    files = GgufFiles(mixtral_gguf)
    theirs = get_gguf_tokenizer(str(mixtral_gguf))
    assert tokenizer_metadata(files) == theirs and len(theirs[1]["tokens"]) == 512
    backend, extra = convert_gguf_tokenizer(theirs[0], theirs[1])
    reference = PreTrainedTokenizerFast(tokenizer_object=backend, **theirs[2], **extra)
    text = "Experts in RAM.\n<|im_start|>user\nwhat is 2+2?<|im_end|>\n  ünïcode"
    assert gguf_tokenizer(files)(text).input_ids == reference(text).input_ids


@pytest.mark.parametrize("per_expert", [False, True], ids=["stacked", "per-expert"])
def test_f32_experts_equal_safetensors(tiny_small, tmp_path, per_expert):
    path = write_gguf(tiny_small, tmp_path / "t.gguf", per_expert=per_expert)
    files = GgufFiles(path)
    assert ("blk.0.ffn_gate.3.weight" in files) == per_expert and ("blk.0.ffn_gate_exps.weight" in files) != per_expert
    index = ExpertIndex(files)
    sd = load_file(tiny_small / "model.safetensors")
    for layer, fmt in layer_formats(index, "mixtral", torch.float32).items():
        for e in range(index.num_experts):
            w = fmt.weights(fmt.views(fmt.packed(e)))
            p = f"model.layers.{layer}.block_sparse_moe.experts.{e}."
            assert torch.equal(w["gate_up"], torch.cat([sd[p + "w1.weight"], sd[p + "w3.weight"]]))
            assert torch.equal(w["down"], sd[p + "w2.weight"])
    assert index.sizes()["bits_per_weight"] == 32.0
    assert index.sizes()["bytes_per_expert"] == 3 * 64 * 128 * 4


def test_mixtral_forward_lossless(mixtral_gguf, tiny_small):
    from transformers import AutoModelForCausalLM

    orig = AutoModelForCausalLM.from_pretrained(tiny_small, dtype=torch.float32).eval()
    ours = model_from_gguf(mixtral_gguf)
    assert torch.equal(_logits(ours, 512), _logits(orig, 512))


# Not the config classes' defaults, so reading them from the metadata is what makes the forward equal.
ROPE = {"gpt_oss": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16.0,
                    "beta_slow": 2.0, "rope_theta": 50000.0, "truncate": False},
        "deepseek_v3": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
                        "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 20000.0},
        "qwen3_moe": {"rope_type": "linear", "factor": 2.0, "rope_theta": 30000.0}}


def build_with_rope(family: str, out):
    """model_factory.build_family with ROPE[family]'s rope parameters."""
    from transformers import AutoModelForCausalLM

    from model_factory import family_configs

    cfg = family_configs()[family]
    if family in ROPE:
        cfg.rope_parameters = dict(ROPE[family])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.eval().save_pretrained(out)
    return model


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss"])
def test_family_forward_lossless(family, tmp_path):
    """Every family's F32 GGUF: the config is the original's where it matters (sizes transformers misreads, rope
    scaling), and the forward with the file's dense tensors and experts equals the original's exactly. DeepSeek-V2
    in the older layout (attn_kv_b), V3 in today's (attn_k_b / attn_v_b, MLA written as MQA)."""
    orig = build_with_rope(family, tmp_path / "ckpt")
    save_tokenizer(tmp_path / "ckpt")
    path = write_gguf(tmp_path / "ckpt", tmp_path / f"{family}.gguf", mla_split=family == "deepseek_v3")
    config = gguf_config(GgufFiles(path))
    assert config.model_type == family
    for attr in ("moe_intermediate_size", "shared_expert_intermediate_size", "head_dim", "sliding_window",
                 "first_k_dense_replace", "n_shared_experts", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                 "v_head_dim", "routed_scaling_factor", "n_group", "topk_group", "intermediate_size"):
        if hasattr(orig.config, attr):
            assert getattr(config, attr) == getattr(orig.config, attr), attr
    assert config.rope_parameters == orig.config.rope_parameters
    assert torch.equal(_logits(model_from_gguf(path), orig.config.vocab_size), _logits(orig, orig.config.vocab_size))


def test_qwen3_moe_expert_size_transformers_misreads(tmp_path):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    build_family("qwen3_moe", tmp_path / "ckpt")
    save_tokenizer(tmp_path / "ckpt")
    path = write_gguf(tmp_path / "ckpt", tmp_path / "q.gguf")
    theirs = load_gguf_checkpoint(str(path))["config"]
    assert theirs.get("moe_intermediate_size") is None          # not read: the config class default (768) applies
    assert gguf_config(GgufFiles(path)).moe_intermediate_size == 32


@pytest.mark.parametrize("encoding", [T.F16, T.BF16, T.Q8_0, T.Q4_0, T.MXFP4])
def test_quantized_experts_equal_reference_dequantisation(tiny_small, tmp_path, encoding):
    """Experts quantised by gguf.quants.quantize: moectl's bytes and dequantisation equal gguf's reference on the
    same tensor, and the header's sizes are the encoding's."""
    path = write_gguf(tiny_small, tmp_path / "q.gguf", expert_encoding=encoding)
    files = GgufFiles(path)
    index = ExpertIndex(files)
    for layer, fmt in layer_formats(index, "mixtral", torch.float32).items():
        for proj in ("gate", "up", "down"):
            t = files.tensors[f"blk.{layer}.ffn_{proj}_exps.weight"]
            assert t.encoding == encoding
            raw = files.bytes_of(t.file, t.offset, t.nbytes).reshape(t.shape[0], -1)
            ref = reference_dequantize(raw, encoding).reshape(t.shape)        # [E, out, in]
            for e in (0, 5):
                m = fmt.matrices(fmt.views(fmt.packed(e)))
                assert torch.equal(m[proj], torch.from_numpy(np.ascontiguousarray(ref[e]))), (layer, proj, e)
    q, b = {T.F16: (1, 2), T.BF16: (1, 2), T.Q8_0: (32, 34), T.Q4_0: (32, 18), T.MXFP4: (32, 17)}[encoding]
    sizes = index.sizes()
    assert sizes["bits_per_weight"] == 8 * b / q
    assert sizes["bytes_per_expert"] == 3 * 64 * 128 * b // q
    assert sizes["expert_bytes"] == 2 * 8 * sizes["bytes_per_expert"]


def test_split_files_read_as_one(mixtral_gguf, tiny_small, tmp_path):
    first = write_gguf(tiny_small, tmp_path / "tiny.gguf", split_max_tensors=8)
    assert first.name == "tiny-00001-of-00003.gguf"
    split, whole = GgufFiles(first), GgufFiles(mixtral_gguf)
    assert len(split.paths) == 3 and set(split.tensors) == set(whole.tensors)
    assert len({t.file for t in split.tensors.values()}) == 3
    assert gguf_config(split).to_dict() == gguf_config(whole).to_dict()
    a, b = ExpertIndex(split), ExpertIndex(whole)
    fa, fb = layer_formats(a, "mixtral", torch.float32), layer_formats(b, "mixtral", torch.float32)
    for layer in a.layers:
        for e in range(8):
            assert torch.equal(fa[layer].packed(e), fb[layer].packed(e))
    assert torch.equal(_logits(model_from_gguf(first), 512), _logits(model_from_gguf(mixtral_gguf), 512))


def test_gpt_oss_mxfp4_experts(tmp_path):
    """GPT-OSS as llama.cpp ships it (MXFP4 experts, F32 biases): weights() is the family's layout (gate_up [H, 2I]
    with gate in the even columns, down [I, H]) of gguf's reference dequantisation, biases the original's."""
    orig = build_with_rope("gpt_oss", tmp_path / "ckpt")
    save_tokenizer(tmp_path / "ckpt")
    path = write_gguf(tmp_path / "ckpt", tmp_path / "oss.gguf", expert_encoding=T.MXFP4)
    files = GgufFiles(path)
    index = ExpertIndex(files)
    assert index.sizes()["encoding_bits"] == {"MXFP4": 4.25}
    ref = {}
    for layer in index.layers:
        for proj in ("gate", "up", "down"):
            t = files.tensors[f"blk.{layer}.ffn_{proj}_exps.weight"]
            assert t.encoding == T.MXFP4
            raw = files.bytes_of(t.file, t.offset, t.nbytes).reshape(t.shape[0], -1)
            ref[layer, proj] = torch.from_numpy(reference_dequantize(raw, T.MXFP4).reshape(t.shape).copy())
    for layer, fmt in layer_formats(index, "gpt_oss", torch.float32).items():
        experts = orig.model.layers[layer].mlp.experts
        for e in range(index.num_experts):
            w = fmt.weights(fmt.views(fmt.packed(e)))
            assert torch.equal(w["gate_up"][:, ::2], ref[layer, "gate"][e].T)
            assert torch.equal(w["gate_up"][:, 1::2], ref[layer, "up"][e].T)
            assert torch.equal(w["down"], ref[layer, "down"][e].T)
            assert torch.equal(w["gate_up_bias"], experts.gate_up_proj_bias[e].detach())
            assert torch.equal(w["down_bias"], experts.down_proj_bias[e].detach())
    err = (w["down"] - experts.down_proj[e].detach()).abs().max() / experts.down_proj[e].abs().max()
    assert 0 < err < 0.3                                                         # quantised, and close


def test_metadata_equals_gguf_reader(mixtral_gguf):
    """The whole-array metadata reads give what gguf's own reader gives (strings, numbers, string and int arrays)."""
    from gguf import GGUFReader

    from moectl.store.gguf.files import field_value

    stock = {k: field_value(f) for k, f in GGUFReader(mixtral_gguf).fields.items() if not k.startswith("GGUF.")}
    ours = GgufFiles(mixtral_gguf).meta
    assert ours == stock and list(ours) == list(stock)                  # the file's order too
    assert len(ours["tokenizer.ggml.tokens"]) == 512 and len(ours["tokenizer.ggml.token_type"]) == 512
    assert isinstance(ours["tokenizer.ggml.merges"][0], str) and ours["llama.expert_count"] == 8


def test_tensor_table_equals_gguf_reader(mixtral_gguf, tiny_small, tmp_path):
    """moectl's header parse finds every tensor where gguf's own reader does (file, offset, bytes, encoding, shape),
    whole and split in parts."""
    from gguf import GGUFReader

    split = write_gguf(tiny_small, tmp_path / "m.gguf", split_max_tensors=7)
    for first in (mixtral_gguf, split):
        files = GgufFiles(first)
        stock = {}
        for path in files.paths:
            for t in GGUFReader(path).tensors:
                stock[t.name] = (path, int(t.data_offset), int(t.n_bytes), int(t.tensor_type),
                                 tuple(int(d) for d in reversed(t.shape.tolist())))
        ours = {n: (e.file, e.offset, e.nbytes, e.encoding, e.shape) for n, e in files.tensors.items()}
        assert ours == stock and len(ours) > 20


def test_opening_reads_no_vocabulary(mixtral_gguf, monkeypatch):
    """The vocabulary's strings are read when a tokenizer is built, not to open the file, size it or make its
    config (its length is counted); then they are gguf's."""
    import moectl.store.gguf.files as files_module
    from moectl.store.gguf.model import GgufModel

    decoded, real = [], files_module._read_array

    def counted(buf, pos, item, count, read=True):
        if read:
            decoded.append(count)
        return real(buf, pos, item, count, read)

    monkeypatch.setattr(files_module, "_read_array", counted)
    g = GgufModel(mixtral_gguf)
    g.sizes(2)
    assert decoded == [] and g.config.vocab_size == 512
    assert len(g.files.meta["tokenizer.ggml.tokens"]) == 512 and decoded == [512]


def test_tokenizer_cache_is_the_same_tokenizer_and_follows_the_file(mixtral_gguf, tmp_path, monkeypatch):
    """GgufModel.tokenizer(cache): built and saved once, read back by later calls (the converter is not called),
    the same ids, special tokens and chat template; a rewritten file (new mtime) or another transformers is built
    again; a cache that cannot be written is no error."""
    import os
    import shutil

    import moectl.store.gguf.model as gm
    from moectl.store.gguf.model import GgufModel

    f = tmp_path / "m.gguf"
    shutil.copy(mixtral_gguf, f)
    built = []
    convert = gm.gguf_tokenizer
    monkeypatch.setattr(gm, "gguf_tokenizer", lambda files: (built.append(1), convert(files))[1])
    cache = tmp_path / "work" / "gguf-tokenizer"
    fresh = GgufModel(f).tokenizer(cache)
    assert len(built) == 1 and (cache / "source.json").exists()
    cached = GgufModel(f).tokenizer(cache)
    assert len(built) == 1                                  # read back, not converted
    texts = ["The cache holds experts.\n<|im_start|>user\nwhat is 2+2?<|im_end|>\n  spaces  and ünïcode", "", " x"]
    for text in texts:
        for special in (True, False):
            assert cached(text, add_special_tokens=special).input_ids == fresh(text, add_special_tokens=special).input_ids
    ids = fresh(texts[0]).input_ids
    assert cached.decode(ids) == fresh.decode(ids) and len(cached) == len(fresh)
    assert cached.special_tokens_map == fresh.special_tokens_map
    assert (cached.eos_token_id, cached.bos_token_id, cached.pad_token_id) == \
        (fresh.eos_token_id, fresh.bos_token_id, fresh.pad_token_id)
    assert cached.chat_template == fresh.chat_template
    chat = [{"role": "user", "content": "hi"}]
    if fresh.chat_template:
        assert cached.apply_chat_template(chat, tokenize=False) == fresh.apply_chat_template(chat, tokenize=False)
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))     # the file rewritten: its cache is stale
    GgufModel(f).tokenizer(cache)
    assert len(built) == 2
    monkeypatch.setattr("transformers.__version__", "0.0-other")
    GgufModel(f).tokenizer(cache)
    assert len(built) == 3
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    assert GgufModel(f).tokenizer(blocked / "gguf-tokenizer")(texts[0]).input_ids == fresh(texts[0]).input_ids
