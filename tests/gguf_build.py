"""Write GGUF files the way llama.cpp's converter does, from a tiny safetensors checkpoint (test helper).

Legend: E = experts, I = expert intermediate size, H = hidden size.

What llama.cpp's `convert_hf_to_gguf.py` does for the families moectl runs, reproduced with the `gguf` package:
tensor names from `gguf.get_tensor_name_map` (the converter's `map_tensor_name`), Q/K rows permuted for the
`llama` architecture (`LlamaModel.permute`), experts stacked into `blk.N.ffn_{gate,up,down}_exps.weight` [E, I, H]
/ [E, H, I] (or, like older converters, one `blk.N.ffn_gate.E.weight` per expert), GPT-OSS gate/up split out of
the interleaved `gate_up_proj` and transposed, the metadata keys `TextModel.set_gguf_parameters` and the family
classes write, the tokenizer as `_set_vocab_gpt2` + `gguf.SpecialVocab` store it. Quantised with
`gguf.quants.quantize` where it can (Q8_0, Q4_0, BF16, MXFP4); K-quants and IQ4_XS are valid blocks built here
(random codes with sane scales) since the package cannot quantise them. Like llama.cpp, 1-D tensors stay F32 and a tensor whose
rows are not whole blocks falls back to F32.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import (GGML_QUANT_SIZES, MODEL_ARCH, MODEL_ARCH_NAMES, ExpertGatingFuncType, GGUFWriter,
                  RopeScalingType, SpecialVocab, TokenType)
from gguf import GGMLQuantizationType as T
from gguf import get_tensor_name_map
from gguf.quants import quantize
from safetensors.torch import load_file

ARCH = {"mixtral": MODEL_ARCH.LLAMA, "qwen2_moe": MODEL_ARCH.QWEN2MOE, "qwen3_moe": MODEL_ARCH.QWEN3MOE,
        "olmoe": MODEL_ARCH.OLMOE, "deepseek_v2": MODEL_ARCH.DEEPSEEK2, "deepseek_v3": MODEL_ARCH.DEEPSEEK2,
        "gpt_oss": MODEL_ARCH.GPT_OSS}
# HF per-expert projection names -> llama.cpp's
PROJ = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def k_blocks(rows: int, cols: int, qtype: T, seed: int = 0) -> np.ndarray:
    """Valid K-quant blocks [rows, cols/256*B]: random codes and sub-scales, small positive fp16 super-scales."""
    q, b = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * cols // q, b), dtype=np.uint8)
    if qtype == T.Q6_K:
        raw[:, 208:210] = np.full(1, 0.002, np.float16).view(np.uint8)
    else:
        raw[:, 0:2] = np.full(1, 0.001, np.float16).view(np.uint8)
        raw[:, 2:4] = np.full(1, 0.0005, np.float16).view(np.uint8)
    return raw.reshape(rows, cols // q * b)


def encode(x: torch.Tensor, qtype: T, seed: int = 0) -> tuple[np.ndarray, T]:
    """(array to write, its encoding): 1-D and non-blocked tensors stay F32, as llama.cpp keeps them."""
    a = x.detach().float().contiguous().numpy()
    if qtype == T.F32 or a.ndim < 2 or a.shape[-1] % GGML_QUANT_SIZES[qtype][0]:
        return a, T.F32
    if qtype == T.F16:
        return a.astype(np.float16), T.F16
    if qtype in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS, T.Q8_1):   # valid sizes, random codes
        rows = int(np.prod(a.shape[:-1]))
        return k_blocks(rows, a.shape[-1], qtype, seed).reshape(*a.shape[:-1], -1), qtype
    return quantize(a, qtype), qtype


def llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's `LlamaModel.permute` (rotary halves -> interleaved pairs) of Q/K rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_metadata(w: GGUFWriter, family: str, c: dict, moe_encoding: T, mla_split: bool = False) -> None:
    w.add_name(f"tiny {family}")
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(1 if mla_split else c["num_key_value_heads"])
    w.add_rope_freq_base(float((c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    rope = c.get("rope_parameters") or {}
    if rope.get("rope_type") == "linear":                         # TextModel.set_gguf_parameters
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("attention_factor") is not None:
            w.add_rope_scaling_yarn_attn_factor(rope["attention_factor"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        if family.startswith("deepseek") and rope.get("mscale_all_dim") is not None:   # DeepseekV2Model
            w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    w.add_expert_count(c.get("num_local_experts") or c.get("num_experts") or c["n_routed_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    if c.get("head_dim") is not None and family != "mixtral" and not family.startswith("deepseek"):
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
    w.add_file_type(int(moe_encoding))
    if family == "mixtral":                                       # LlamaModel
        w.add_vocab_size(c["vocab_size"])
        w.add_rope_dimension_count(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    if family in ("qwen2_moe", "qwen3_moe"):                      # Qwen2MoeModel
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
        if c.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    if family.startswith("deepseek"):                             # DeepseekV2Model (before the MLA->MQA rewrite)
        w.add_vocab_size(c["vocab_size"])
        w.add_leading_dense_block_count(c["first_k_dense_replace"])
        if c.get("q_lora_rank"):
            w.add_q_lora_rank(c["q_lora_rank"])
        w.add_kv_lora_rank(c["kv_lora_rank"])
        if mla_split:                                             # today's converter: MLA written as MQA
            w.add_key_length(c["kv_lora_rank"] + c["qk_rope_head_dim"])
            w.add_value_length(c["kv_lora_rank"])
            w.add_key_length_mla(c["qk_nope_head_dim"] + c["qk_rope_head_dim"])
            w.add_value_length_mla(c["v_head_dim"])
        else:                                                     # converters before the k_b/v_b split
            w.add_key_length(c["qk_nope_head_dim"] + c["qk_rope_head_dim"])
            w.add_value_length(c["v_head_dim"])
        w.add_rope_dimension_count(c["qk_rope_head_dim"])
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
        w.add_expert_shared_count(c["n_shared_experts"])
        w.add_expert_weights_scale(c["routed_scaling_factor"])
        w.add_expert_weights_norm(c["norm_topk_prob"])
        if family == "deepseek_v3":
            w.add_expert_group_count(c["n_group"])
            w.add_expert_group_used_count(c["topk_group"])
            w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    if family == "gpt_oss":                                       # GptOssModel
        w.add_sliding_window(c["sliding_window"])
        w.add_expert_feed_forward_length(c["intermediate_size"])


def write_vocab(w: GGUFWriter, ckpt: Path, vocab_size: int) -> None:
    """`_set_vocab_gpt2`: tokens by id, CONTROL for added special tokens, merges and ids via SpecialVocab."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    by_id = {i: t for t, i in tok.get_vocab().items()}
    added = {t.content: t.special for t in tok.added_tokens_decoder.values()}
    tokens, types = [], []
    for i in range(vocab_size):
        t = by_id.get(i, f"[PAD{i}]")
        tokens.append(t)
        types.append(TokenType.USER_DEFINED if t.startswith("[PAD") else
                     TokenType.CONTROL if added.get(t) else TokenType.USER_DEFINED if t in added else TokenType.NORMAL)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    SpecialVocab(ckpt, load_merges=True, n_vocab=vocab_size).add_to_gguf(w, quiet=True)


def write_spm_vocab(w: GGUFWriter, vocab_size: int, chat_template: str | None = None) -> None:
    """A sentencepiece-style vocabulary as llama.cpp's `_set_vocab_sentencepiece` stores it (tokenizer model
    `llama`): <unk> <s> </s>, the 256 byte tokens <0xNN>, then "\u2581"-spelled pieces with their scores (no merges:
    readers rebuild them from the scores), the rest USER_DEFINED fillers; BOS 1, EOS 2, UNK 0, no PAD.
    The pieces are a BPE learned in ~0.1 s on a few KB of local text (deterministic)."""
    import inspect as _inspect

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    text = _inspect.getsource(torch.nn.modules.linear)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    bpe.train_from_iterator([text], trainers.BpeTrainer(vocab_size=vocab_size - 259, min_frequency=2,
                                                        show_progress=False))
    pieces = [t for t, _ in sorted(bpe.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = ([TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
             + [TokenType.NORMAL] * len(pieces))
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    for i in range(len(tokens), vocab_size):
        tokens.append(f"<unused{i}>")
        types.append(TokenType.USER_DEFINED)
        scores.append(-1e4)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)


def k256_mixtral(root: Path, layers: int = 2, tied: bool = False) -> Path:
    """A tiny Mixtral checkpoint (seed 0, with a tokenizer) whose rows are whole 256-weight K blocks, written to
    root / "ckpt" in the released on-disk layout: the model the Q4_K_M-like GGUF fixtures quantize."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    from model_factory import save_tokenizer

    cfg = MixtralConfig(vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=128, bos_token_id=0, eos_token_id=0, pad_token_id=1,
                        tie_word_embeddings=tied)
    torch.manual_seed(0)
    ckpt = root / "ckpt"
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(ckpt, save_original_format=True)
    save_tokenizer(ckpt)
    return ckpt


def write_gguf(ckpt: Path, out: Path, expert_encoding=T.F32, dense_encoding: T = T.F32,
               per_expert: bool = False, split_max_tensors: int = 0, meta: dict | None = None,
               mla_split: bool = False, spm_vocab: bool = False, chat_template: str | None = None) -> Path:
    """Write `ckpt` (a tiny HF checkpoint) as GGUF `out` in llama.cpp's layout; returns the (first) file.
    `spm_vocab`: a sentencepiece-style vocabulary (`write_spm_vocab`, with `chat_template`) instead of the
    checkpoint's byte-level BPE.
    `expert_encoding`: one encoding, or (layer, proj) -> encoding (a Q4_K_M-like mix).
    `mla_split` (DeepSeek): today's converter, kv_b_proj split into attn_k_b (transposed) and attn_v_b and the
    attention written as MQA; else the older single attn_kv_b."""
    c = json.loads((ckpt / "config.json").read_text())
    family = c["model_type"]
    arch = ARCH[family]
    n_layers = c["num_hidden_layers"]
    names = get_tensor_name_map(arch, n_layers)
    sd = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        sd.update(load_file(f))
    w = GGUFWriter(out, MODEL_ARCH_NAMES[arch], split_max_tensors=split_max_tensors)
    write_metadata(w, family, c, expert_encoding(0, "gate") if callable(expert_encoding) else expert_encoding,
                   mla_split)
    if spm_vocab:
        write_spm_vocab(w, c["vocab_size"], chat_template)
    else:
        write_vocab(w, ckpt, c["vocab_size"])
    for key, value in (meta or {}).items():                       # overrides (bad-input tests)
        w.add_uint32(key.replace("{arch}", MODEL_ARCH_NAMES[arch]), value)

    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for key, x in sd.items():
        parts = key.split(".")
        if ".experts." in key and ".shared_experts." not in key and family != "gpt_oss":
            layer, e, proj = int(parts[2]), int(parts[parts.index("experts") + 1]), parts[-2]
            experts.setdefault((layer, PROJ[proj]), {})[e] = x
            continue
        if family == "gpt_oss" and ".experts." in key:
            write_gpt_oss_experts(w, key, x, expert_encoding)
            continue
        if mla_split and key.endswith("kv_b_proj.weight"):         # DeepseekV2Model.modify_tensors
            heads, nope, v = c["num_attention_heads"], c["qk_nope_head_dim"], c["v_head_dim"]
            k_b, v_b = x.view(heads, nope + v, -1).split([nope, v], dim=1)
            layer = int(parts[2])
            for name, t in ((f"blk.{layer}.attn_k_b.weight", k_b.transpose(1, 2)), (f"blk.{layer}.attn_v_b.weight", v_b)):
                a, qt = encode(t, dense_encoding)
                w.add_tensor(name, a, raw_dtype=qt if qt not in (T.F32, T.F16) else None)
            continue
        if family == "mixtral" and key.endswith(("q_proj.weight", "k_proj.weight")):
            heads = c["num_attention_heads"] if "q_proj" in key else c["num_key_value_heads"]
            x = llama_permute(x, heads)
        if family == "gpt_oss" and key.endswith(".sinks"):
            key += ".weight"
        if key.endswith("e_score_correction_bias"):               # DeepseekV2Model.modify_tensors
            key = key.replace("e_score_correction_bias", "e_score_correction.bias")
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert name is not None, key
        a, qt = encode(x, dense_encoding)
        w.add_tensor(name, a, raw_dtype=qt if qt not in (T.F32, T.F16) else None)

    for (layer, proj), by_e in sorted(experts.items()):
        enc = expert_encoding(layer, proj) if callable(expert_encoding) else expert_encoding
        stacked = torch.stack([by_e[e] for e in sorted(by_e)])                    # [E, I, H] or [E, H, I]
        if per_expert:
            for e in sorted(by_e):
                a, qt = encode(stacked[e], enc, seed=layer * 1000 + e)
                w.add_tensor(f"blk.{layer}.ffn_{proj}.{e}.weight", a, raw_dtype=qt if qt != T.F32 else None)
        else:
            a, qt = encode(stacked, enc, seed=layer)
            w.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", a, raw_dtype=qt if qt not in (T.F32, T.F16) else None)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if split_max_tensors:
        first = sorted(out.parent.glob(out.stem + "-00001-of-*.gguf"))
        return first[0]
    return out


def write_gpt_oss_experts(w: GGUFWriter, key: str, x: torch.Tensor, enc: T) -> None:
    """GptOssModel.modify_tensors for unquantised (bf16) experts: gate = gate_up[..., ::2], up = [..., 1::2],
    transposed to [E, I, H]; down transposed to [E, H, I]; biases split the same way."""
    layer = int(key.split(".")[2])
    p = f"blk.{layer}"
    if key.endswith("gate_up_proj"):
        t = x.transpose(-1, -2)                                   # [E, 2I, H]
        for proj, rows in (("gate", t[:, ::2, :]), ("up", t[:, 1::2, :])):
            a, qt = encode(rows, enc, seed=layer)
            w.add_tensor(f"{p}.ffn_{proj}_exps.weight", a, raw_dtype=qt if qt not in (T.F32, T.F16) else None)
    elif key.endswith("gate_up_proj_bias"):
        w.add_tensor(f"{p}.ffn_gate_exps.bias", x[..., ::2].float().contiguous().numpy())
        w.add_tensor(f"{p}.ffn_up_exps.bias", x[..., 1::2].float().contiguous().numpy())
    elif key.endswith("down_proj"):
        a, qt = encode(x.transpose(-1, -2), enc, seed=layer)
        w.add_tensor(f"{p}.ffn_down_exps.weight", a, raw_dtype=qt if qt not in (T.F32, T.F16) else None)
    elif key.endswith("down_proj_bias"):
        w.add_tensor(f"{p}.ffn_down_exps.bias", x.float().contiguous().numpy())
    else:
        raise AssertionError(key)


def model_from_gguf(path: Path):
    """A transformers model of the GGUF's config with its dense tensors and every expert dequantised (fp32): the
    plain reference forward of what moectl reads from the file."""
    from transformers import AutoModelForCausalLM

    from moectl.store.gguf.model import GgufModel

    g = GgufModel(path)
    model = AutoModelForCausalLM.from_config(g.config, dtype=torch.float32).eval()
    sd = g.dense_state_dict(model)
    names = {"gate_up": "gate_up_proj", "down": "down_proj", "gate_up_bias": "gate_up_proj_bias",
             "down_bias": "down_proj_bias"}
    for layer, fmt in g.expert_formats(torch.float32).items():
        ws = [fmt.weights(fmt.views(fmt.packed(e))) for e in range(g.index.num_experts)]
        for k, hf in names.items():
            if k in ws[0]:
                sd[f"model.layers.{layer}.mlp.experts.{hf}"] = torch.stack([w[k] for w in ws])
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return model
