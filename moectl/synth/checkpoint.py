"""Random-weight checkpoints with a recipe's real tensor shapes: real-size experts without a download.

Legend: H = hidden size, I = expert intermediate size, V = vocab, E = experts, L = layers.

`write_synthetic(shape, out, layers)` writes an ordinary Hugging Face Mixtral checkpoint (config.json, one
safetensors shard per decoder layer plus one for the embeddings / final norm / head, and the index that maps
every key to its shard) whose tensors have the recipe's shapes; `--layers N` keeps only the first N decoder
layers. Weights are N(0, 0.02) (norms 1), generated one tensor at a time and written straight to the shard
after its header, so the most it holds in RAM is one tensor (Mixtral's w1: 4096 x 14336 bf16 = 117 MB), never
a shard or the model. (safetensors' own writer takes a whole dict at once; the file format is one JSON header
and the raw bytes, written here in the same layout.) With `--replay-trace`, real routing runs on it.

Families: `mixtral` (MixtralForCausalLM), `qwen3_moe` (Qwen3MoeForCausalLM: q/k norms, `mlp.experts.E.*_proj`) and
`qwen2_moe` (Qwen2MoeForCausalLM: q/k/v biases, the shared expert and its gate) are written as themselves; `gpt_oss` shapes are written as a Mixtral-family checkpoint with GPT-OSS-20B's
expert shapes, count and top-k ("GPT-OSS-like": SwiGLU experts without biases, MXFP4 or attention sinks), since
the comparison and the cache only see the experts' shapes. Every checkpoint carries a usable tokenizer: a
byte-level BPE (GPT-2's split, `moectl.synth.tiny.train_tokenizer`) trained on the built-in corpus, 1024 tokens or
the shape's vocabulary if smaller (ids above it exist in the embedding but are never produced), so `generate`
works and llama.cpp's converter accepts it when told the pre-tokenizer is "gpt-2" (see `bench/llamacpp.py`).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

from ..errors import MoectlError
from ..progress import ProgressBar

ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss")
TOKENIZER_VOCAB = 1024


def layer_tensors(shape: dict, layer: int, family: str) -> list[tuple[str, tuple[int, ...]]]:
    """(key, shape) of decoder layer `layer` in the family's released names: Mixtral's (`block_sparse_moe`,
    w1/w3/w2), Qwen3-MoE's (`mlp`, gate/up/down_proj, plus per-head q/k norms) or Qwen2-MoE's (`mlp`, q/k/v
    biases, `mlp.shared_expert.*_proj` of the shape's shared_expert_intermediate_size and `mlp.shared_expert_gate`)."""
    H, I, E = shape["hidden_size"], shape["intermediate_size"], shape["num_experts"]
    heads, kv = shape["num_attention_heads"], shape.get("num_key_value_heads", shape["num_attention_heads"])
    hd = shape.get("head_dim") or H // heads
    p = f"model.layers.{layer}"
    out = [(f"{p}.input_layernorm.weight", (H,)), (f"{p}.post_attention_layernorm.weight", (H,)),
           (f"{p}.self_attn.q_proj.weight", (heads * hd, H)), (f"{p}.self_attn.k_proj.weight", (kv * hd, H)),
           (f"{p}.self_attn.v_proj.weight", (kv * hd, H)), (f"{p}.self_attn.o_proj.weight", (H, heads * hd))]
    if family == "qwen3_moe":
        out += [(f"{p}.self_attn.q_norm.weight", (hd,)), (f"{p}.self_attn.k_norm.weight", (hd,))]
        moe, names = f"{p}.mlp", ("gate_proj", "up_proj", "down_proj")
    elif family == "qwen2_moe":
        S = shape["shared_expert_intermediate_size"]
        out += [(f"{p}.self_attn.q_proj.bias", (heads * hd,)), (f"{p}.self_attn.k_proj.bias", (kv * hd,)),
                (f"{p}.self_attn.v_proj.bias", (kv * hd,)),
                (f"{p}.mlp.shared_expert.gate_proj.weight", (S, H)), (f"{p}.mlp.shared_expert.up_proj.weight", (S, H)),
                (f"{p}.mlp.shared_expert.down_proj.weight", (H, S)), (f"{p}.mlp.shared_expert_gate.weight", (1, H))]
        moe, names = f"{p}.mlp", ("gate_proj", "up_proj", "down_proj")
    else:
        moe, names = f"{p}.block_sparse_moe", ("w1", "w3", "w2")
    out.append((f"{moe}.gate.weight", (E, H)))
    for e in range(E):
        q = f"{moe}.experts.{e}"
        out += [(f"{q}.{names[0]}.weight", (I, H)), (f"{q}.{names[1]}.weight", (I, H)),
                (f"{q}.{names[2]}.weight", (H, I))]
    return out


def hf_config(shape: dict, family: str, layers: int, dt: torch.dtype, bos: int, eos: int) -> dict:
    """config.json of the checkpoint (Mixtral's for mixtral and gpt_oss shapes, Qwen3-MoE's / Qwen2-MoE's for
    qwen3_moe / qwen2_moe)."""
    H, heads = shape["hidden_size"], shape["num_attention_heads"]
    common = {"hidden_size": H, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": shape.get("num_key_value_heads", heads),
              "head_dim": shape.get("head_dim") or H // heads, "num_experts_per_tok": shape["top_k"],
              "vocab_size": shape.get("vocab_size") or 32000, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
              "rope_theta": 1e6, "tie_word_embeddings": False, "hidden_act": "silu",
              "torch_dtype": str(dt).replace("torch.", ""), "bos_token_id": bos, "eos_token_id": eos,
              "router_aux_loss_coef": 0.02, "moectl_synthetic": shape.get("name", "")}
    if family == "qwen3_moe":
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **common,
                "moe_intermediate_size": shape["intermediate_size"], "intermediate_size": shape["intermediate_size"],
                "num_experts": shape["num_experts"], "norm_topk_prob": True, "decoder_sparse_step": 1,
                "mlp_only_layers": [], "attention_bias": False, "sliding_window": None, "use_sliding_window": False}
    if family == "qwen2_moe":                   # Qwen1.5-MoE's settings: top-k weights not renormalised, q/k/v biases
        return {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", **common,
                "moe_intermediate_size": shape["intermediate_size"], "intermediate_size": shape["intermediate_size"],
                "shared_expert_intermediate_size": shape["shared_expert_intermediate_size"],
                "num_experts": shape["num_experts"], "norm_topk_prob": False, "decoder_sparse_step": 1,
                "mlp_only_layers": [], "qkv_bias": True, "sliding_window": None, "use_sliding_window": False}
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **common,
            "intermediate_size": shape["intermediate_size"], "num_local_experts": shape["num_experts"],
            "sliding_window": None}


def write_tokenizer(out: Path, vocab: int):
    """A byte-level BPE of `vocab` tokens trained on the built-in corpus, saved beside the weights; returns it."""
    from ..calib.builtin_corpus import builtin_corpus
    from .tiny import train_tokenizer

    tok = train_tokenizer(builtin_corpus("train")[:400], vocab)
    tok.model_max_length = 32768
    tok.save_pretrained(out)
    return tok


def write_shard(path: Path, tensors: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                gen: torch.Generator) -> int:
    """One safetensors file, each tensor made and written in turn; returns its bytes."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    header, pos = {}, 0
    for key, shp in tensors:
        n = math.prod(shp) * itemsize
        header[key] = {"dtype": ST_DTYPES[dtype], "shape": list(shp), "data_offsets": [pos, pos + n]}
        pos += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)                       # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for key, shp in tensors:
            if key.endswith("norm.weight"):
                t = torch.ones(shp, dtype=dtype)
            else:
                t = (torch.randn(shp, generator=gen) * 0.02).to(dtype)
            f.write(t.contiguous().view(torch.uint8).numpy().tobytes())
            del t
    return 8 + len(head) + pos


def write_synthetic(shape: dict, out: str | Path, layers: int | None = None, family: str = "mixtral",
                    dtype: torch.dtype | None = None, seed: int = 0, progress: bool = True) -> dict:
    """Write the checkpoint; returns {"path", "layers", "bytes", "config"}."""
    if family not in FAMILIES:
        raise MoectlError(f"make-synthetic writes {', '.join(FAMILIES)}-family checkpoints; shape "
                          f"{shape.get('name')!r} is {family}")
    if family == "qwen2_moe" and not shape.get("shared_expert_intermediate_size"):
        raise MoectlError(f"shape {shape.get('name')!r} is qwen2_moe but gives no shared_expert_intermediate_size")
    L = shape["num_layers"] if layers is None else int(layers)
    if not 1 <= L <= shape["num_layers"]:
        raise MoectlError(f"--layers must be between 1 and {shape['num_layers']}, not {layers}")
    dt = dtype or {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(str(shape.get("dtype")), torch.float32)
    H, V = shape["hidden_size"], shape.get("vocab_size") or 32000
    if V < 260:
        raise MoectlError(f"vocab_size {V} is too small for a byte-level tokenizer (256 bytes + 4 specials)")
    out = Path(out).expanduser()
    if out.exists() and any(out.iterdir()):
        raise MoectlError(f"{out} exists and is not empty; give a new directory")
    out.mkdir(parents=True, exist_ok=True)
    tok = write_tokenizer(out, min(TOKENIZER_VOCAB, V))
    config = hf_config(shape, family, L, dt, tok.bos_token_id, tok.eos_token_id)
    shards = [[("model.embed_tokens.weight", (V, H)), ("model.norm.weight", (H,)), ("lm_head.weight", (V, H))]]
    shards += [layer_tensors(shape, l, family) for l in range(L)]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    gen = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    with ProgressBar(progress) as bar:
        task = bar.add(f"writing {len(shards)} shards", total=len(shards))
        for name, tensors in zip(names, shards):
            total += write_shard(out / name, tensors, dt, gen)
            weight_map.update({k: name for k, _ in tensors})
            bar.update(task, advance=1)
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return {"path": str(out), "layers": L, "bytes": total, "shards": len(shards), "config": config}
