"""Model shapes: a model's sizes as plain numbers (a recipe's `shape:` block, or a checkpoint's config.json), and
what they add up to in bytes (one expert, the dense weights, the KV reserve). Torch-free: the simulator, the
planner, the sizing and `make-synthetic` all count with these; a GGUF file's shape is read from its header
(`store/gguf/shape.py`).

A shape is a dict: num_layers, moe_layers, hidden_size, intermediate_size, num_experts, top_k,
num_attention_heads, num_key_value_heads, head_dim, vocab_size, dtype, shared_experts,
shared_expert_intermediate_size, and optionally expert_format (+ weight_block_size), expert_bias, expert_nbytes.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from ..errors import MoectlError

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
DTYPE_BYTES = {"bfloat16": 2.0, "float16": 2.0, "bf16": 2.0, "fp16": 2.0, "float32": 4.0, "fp32": 4.0,
               "int8": 1.0, "float8": 1.0, "fp8": 1.0}
# Bits per weight of experts kept as a checkpoint released them (a shape's `expert_format`): MXFP4 = a 4-bit
# e2m1 code + one 8-bit scale per 32 weights; block FP8 = 8 bits + one fp32 scale per weight_block_size block.
FORMAT_BITS = {"mxfp4": lambda shape: 4 + 8 / 32,
               "fp8": lambda shape: 8 + 32 / math.prod(shape.get("weight_block_size") or (128, 128))}



def _recipe_files() -> list[Path]:
    return sorted(RECIPES_DIR.glob("*.yaml"))


def load_shape(name: str) -> dict:
    """The `shape:` block of recipe `name` (a recipe name or a yaml path), with `name` added; or the shape
    of a Hugging Face checkpoint directory (its config.json)."""
    import yaml                                     # here: a run that reads no recipe imports no yaml

    p = Path(name).expanduser()
    if p.suffix.lower() == ".gguf" and p.is_file():
        raise MoectlError(f"{p} is a GGUF file: its shape is read from its header (store/gguf/shape.py: gguf_shape)")
    if p.is_dir() and (p / "config.json").is_file():
        return shape_from_hf_config(json.loads((p / "config.json").read_text())) | {"name": p.name}
    if not p.is_file():
        p = RECIPES_DIR / f"{name}.yaml"
    if not p.is_file():
        known = [f.stem for f in _recipe_files() if "shape" in (yaml.safe_load(f.read_text()) or {})]
        raise MoectlError(f"unknown model shape {name!r}; recipes with a shape: block: {', '.join(known)}")
    d = yaml.safe_load(p.read_text()) or {}
    if "shape" not in d:
        raise MoectlError(f"recipe {p} has no shape: block (the tiny model's shape comes from its checkpoint)")
    return {"name": d.get("name", p.stem), **d["shape"]}


def shape_for_trace_model(model: str) -> dict | None:
    """The recipe shape whose `trace_names` lists `model` (a moe-routing-v1 header's model)."""
    import yaml

    for f in _recipe_files():
        d = yaml.safe_load(f.read_text()) or {}
        if model in (d.get("trace_names") or []) and "shape" in d:
            return {"name": d.get("name", f.stem), **d["shape"]}
    return None


def shape_from_hf_config(cfg: dict) -> dict:
    """A shape block from a Hugging Face config.json dict (profiled traces of local checkpoints)."""
    g = cfg.get
    hidden = g("hidden_size")
    inter = g("moe_intermediate_size") or g("intermediate_size")
    heads = g("num_attention_heads")
    return {
        "name": g("_name_or_path", "model"), "num_layers": g("num_hidden_layers"),
        "moe_layers": g("num_hidden_layers"), "hidden_size": hidden, "intermediate_size": inter,
        "num_experts": g("num_local_experts") or g("num_experts") or g("n_routed_experts"),
        "top_k": g("num_experts_per_tok"), "num_attention_heads": heads,
        "num_key_value_heads": g("num_key_value_heads", heads),
        "head_dim": g("head_dim") or hidden // heads, "vocab_size": g("vocab_size"),
        "dtype": str(g("torch_dtype") or g("dtype") or "float32"),
        "shared_experts": g("n_shared_experts") or 0,
        "shared_expert_intermediate_size": g("shared_expert_intermediate_size") or 0,
    } | released_format(cfg) | ({"expert_nbytes": g("gguf_expert_nbytes")} if g("gguf_expert_nbytes") else {})


def released_format(cfg: dict) -> dict:
    """`expert_format` (+ `weight_block_size`) of a checkpoint released quantized, `expert_bias` for GPT-OSS."""
    qc = cfg.get("quantization_config") or {}
    out = {"expert_bias": True} if cfg.get("model_type") == "gpt_oss" else {}
    if qc.get("quant_method") in FORMAT_BITS:
        out["expert_format"] = qc["quant_method"]
        if qc.get("weight_block_size"):
            out["weight_block_size"] = list(qc["weight_block_size"])
    return out


def expert_bytes(shape: dict, bits: float | None = None, group_size: int | None = 64) -> float:
    """Bytes of one routed expert (gate, up, down projections; + biases with `expert_bias`, GPT-OSS). `bits`
    None = the checkpoint's own precision: its `expert_format` as released (mxfp4, fp8), else the dtype;
    quantized copies add one scale and one zero point per `group_size` weights, in the model's dtype (HQQ's meta:
    `formats/hqq.py`; 4 bytes a group in bf16, 8 in fp32 as the runtime's copies of an fp32 checkpoint);
    `group_size` None: ggml's blocks, whose scales `bits` counts (`GGML_COPY_BITS`)."""
    n = 3 * shape["hidden_size"] * shape["intermediate_size"]
    dtype_bytes = DTYPE_BYTES.get(str(shape.get("dtype", "bfloat16")), 2.0)
    bias = (2 * shape["intermediate_size"] + shape["hidden_size"]) * dtype_bytes if shape.get("expert_bias") else 0
    if bits is not None and not (0 < bits <= 32):
        raise MoectlError(f"--bits must be a precision between 0 and 32 bits (e.g. 16, 8, 4), not {bits:g}")
    if bits is None and shape.get("expert_nbytes"):        # stated as stored (a GGUF's packed experts)
        return float(shape["expert_nbytes"])
    if bits is None:
        fmt = shape.get("expert_format")
        if fmt is not None and fmt not in FORMAT_BITS:
            raise MoectlError(f"shape {shape.get('name', '?')}: unknown expert_format {fmt!r}; known: "
                              f"{', '.join(FORMAT_BITS)}")
        return n * (FORMAT_BITS[fmt](shape) / 8 if fmt else dtype_bytes) + bias
    if bits >= 16 or group_size is None:               # None: block formats whose `bits` hold their scales
        return n * bits / 8 + bias
    return n * bits / 8 + (n / group_size) * 2 * max(dtype_bytes, 2.0) + bias


# ggml block copies (`moectl quantize --format ggml-q4_0`, formats/ggml_copies.py): bits a weight, the blocks' own
# scales included (Q4_0: 18 bytes per 32 weights; Q8_0: 34 per 32; Q4_K: 144 per 256)
GGML_COPY_BITS = {"ggml-q4_0": 4.5, "ggml-q8_0": 8.5, "ggml-q4_k": 4.5}


def parse_lowbit(spec: str) -> tuple[float, int | None]:
    """`--lowbit q4g64` -> (bits 4, group size 64); `q4` alone means group 64; a ggml block copy set
    (`ggml-q4_0`) -> (its bits a weight with the scales, None: no separate group meta)."""
    if str(spec).strip().lower() in GGML_COPY_BITS:
        return GGML_COPY_BITS[str(spec).strip().lower()], None
    m = re.fullmatch(r"q(\d+)(?:g(\d+))?", str(spec).strip().lower())
    if not m or int(m.group(1)) not in (1, 2, 3, 4, 8) or (m.group(2) and int(m.group(2)) < 1):
        raise MoectlError(f"--lowbit {spec!r} is not a low-bit copy set: write q<bits>g<group size>, "
                          f"bits 8, 4, 3, 2 or 1, e.g. q4g64 or q2g16, or {', '.join(GGML_COPY_BITS)}")
    return int(m.group(1)), int(m.group(2) or 64)


def dense_bytes(shape: dict) -> float:
    """Bytes of the weights that stay on the device besides the expert cache: attention, routers, shared
    experts, norms, embeddings and the output head (untied), in the model's dtype."""
    D, L = shape["hidden_size"], shape["num_layers"]
    H = shape["num_attention_heads"]
    kv, hd = shape.get("num_key_value_heads", H), shape.get("head_dim") or D // H
    shared_i = (shape.get("shared_experts") or 0) and (shape.get("shared_expert_intermediate_size")
                                                       or shape["intermediate_size"] * shape["shared_experts"])
    per_layer = D * H * hd * 2 + D * kv * hd * 2 + D * shape["num_experts"] + 3 * D * shared_i + 2 * D
    params = L * per_layer + 2 * D * (shape.get("vocab_size") or 32000) + D
    return params * DTYPE_BYTES.get(str(shape.get("dtype", "bfloat16")), 2.0)


def kv_reserve_bytes(shape: dict, tokens: int = 4096) -> float:
    """The KV cache `--budget` keeps room for (the runtime's KV_RESERVE_TOKENS, 4096 tokens)."""
    H = shape["num_attention_heads"]
    kv, hd = shape.get("num_key_value_heads", H), shape.get("head_dim") or shape["hidden_size"] // H
    return 2 * shape["num_layers"] * kv * hd * tokens * DTYPE_BYTES.get(str(shape.get("dtype", "bfloat16")), 2.0)
