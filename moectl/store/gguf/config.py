"""A GGUF's transformers config and tokenizer, from its metadata (llama.cpp's key names).

Legend: E = routed experts, I = expert intermediate size, H = hidden size.

transformers already reads GGUF metadata (`transformers.integrations.ggml.GGUF_CONFIG_MAPPING`, used by
`load_gguf_checkpoint`), and its table is used here for the keys every family shares. Its loader is not called,
because for these families it is wrong or missing (tests/test_gguf_config.py shows each):
  - llama.cpp writes Mixtral as architecture `llama` with `llama.expert_count`; transformers 5.2x builds a dense
    LlamaConfig from it (no experts: every expert weight would be dropped). Here: `llama` + expert_count > 0 is
    a MixtralConfig with num_local_experts / num_experts_per_tok.
  - `qwen3moe` / `qwen2moe`: it maps feed_forward_length (the dense width) but not expert_feed_forward_length,
    so moe_intermediate_size stays the config class's default (768 / 1408) whatever the file says; nor
    expert_shared_feed_forward_length (Qwen2-MoE's shared expert). Here: both from the file.
  - `gpt-oss`: llama.cpp writes `attention.sliding_window` and `attention.key_length`; transformers looks for
    `sliding_window` and ignores key_length, so both stay defaults. Here: from the file.
  - `olmoe`, `deepseek2`: not supported by it at all. Here: their keys (DeepSeek's MLA ranks, dense lead
    layers, shared experts, routing scale; V3 when the file has `exp_probs_b` routing biases).
Then every size the config states is checked against the tensor shapes (`check_shapes`), so a file whose
metadata contradicts its tensors is one clear error, not a wrong model.
"""

from __future__ import annotations

from ...errors import MoectlError
from .files import GgufFiles

# GGUF architecture -> the moectl family (transformers model_type) it holds
ARCH_FAMILY = {"llama": "mixtral", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "olmoe": "olmoe",
               "deepseek2": "deepseek_v2", "gpt-oss": "gpt_oss"}
EXPERT_COUNT_ATTR = {"mixtral": "num_local_experts", "qwen2_moe": "num_experts", "qwen3_moe": "num_experts",
                     "olmoe": "num_experts", "deepseek_v2": "n_routed_experts", "deepseek_v3": "n_routed_experts",
                     "gpt_oss": "num_local_experts"}
# metadata key (after '{arch}.') -> config attribute, per family, on top of transformers' shared table
FAMILY_KEYS = {
    "mixtral": {"rope.dimension_count": "head_dim"},
    "qwen2_moe": {"expert_feed_forward_length": "moe_intermediate_size",
                  "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
    "qwen3_moe": {"expert_feed_forward_length": "moe_intermediate_size", "attention.key_length": "head_dim"},
    "olmoe": {},
    "deepseek_v2": {"expert_feed_forward_length": "moe_intermediate_size",
                    "leading_dense_block_count": "first_k_dense_replace", "expert_shared_count": "n_shared_experts",
                    "expert_weights_scale": "routed_scaling_factor", "expert_weights_norm": "norm_topk_prob",
                    "attention.q_lora_rank": "q_lora_rank", "attention.kv_lora_rank": "kv_lora_rank",
                    "rope.dimension_count": "qk_rope_head_dim", "expert_group_count": "n_group",
                    "expert_group_used_count": "topk_group"},
    "gpt_oss": {"expert_feed_forward_length": "intermediate_size", "attention.sliding_window": "sliding_window",
                "attention.key_length": "head_dim"},
}
# without these a config class default would silently stand in for the model's size
REQUIRED = ("block_count", "embedding_length", "attention.head_count", "expert_count", "expert_used_count")
TOKEN_IDS = {"bos_token_id": "tokenizer.ggml.bos_token_id", "eos_token_id": "tokenizer.ggml.eos_token_id",
             "pad_token_id": "tokenizer.ggml.padding_token_id"}


def family_of(files: GgufFiles) -> str:
    """The moectl family of this file, or a MoectlError naming its architecture."""
    arch = files.arch
    if arch not in ARCH_FAMILY or (arch == "llama" and not files.get("llama.expert_count")):
        raise MoectlError(f"{files.paths[0]}: GGUF architecture {arch!r}"
                          + (" without experts (a dense Llama)" if arch == "llama" else "")
                          + " is not a Mixture-of-Experts family moectl runs; supported: "
                          + ", ".join(f"{a} ({f})" for a, f in ARCH_FAMILY.items()))
    family = ARCH_FAMILY[arch]
    if family == "deepseek_v2" and (files.get("deepseek2.expert_gating_func") == 2
                                    or any(n.endswith(".exp_probs_b.bias") for n in files.tensors)):
        family = "deepseek_v3"                      # sigmoid routing with correction biases: V3's router
    return family


def config_dict(files: GgufFiles) -> dict:
    """The transformers config (as a dict with model_type) this file's metadata states."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    family = family_of(files)
    for key in REQUIRED:
        files.get("{arch}." + key, required=True)
    shared = {k: v for k, v in GGUF_CONFIG_MAPPING["qwen3_moe"].items() if v is not None}
    shared["expert_count"] = EXPERT_COUNT_ATTR[family]
    keys = shared | FAMILY_KEYS["deepseek_v2" if family == "deepseek_v3" else family]
    cfg = {"model_type": family, **GGUF_CONFIG_DEFAULTS_MAPPING.get(family, {})}
    for key, attr in keys.items():
        value = files.get("{arch}." + key)
        if value is not None:
            cfg[attr] = value
    for attr, key in TOKEN_IDS.items():
        if files.get(key) is not None:
            cfg[attr] = files.get(key)
    if "vocab_size" not in cfg and "tokenizer.ggml.tokens" in files.meta:
        cfg["vocab_size"] = files.meta.array_len("tokenizer.ggml.tokens")        # counted, not read
    cfg["tie_word_embeddings"] = "output.weight" not in files.tensors  # llama.cpp omits a tied output
    if family.startswith("deepseek"):
        _deepseek(files, cfg)
    _rope(files, cfg)
    return cfg


# rope.scaling.* (what TextModel.set_gguf_parameters writes for YaRN) -> transformers' rope_parameters
YARN_KEYS = {"factor": "factor", "original_context_length": "original_max_position_embeddings",
             "yarn_attn_factor": "attention_factor", "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow"}


def _rope(files: GgufFiles, cfg: dict) -> None:
    """rope_parameters: theta, and linear or YaRN scaling as the file states it (transformers' loader rebuilds
    this for gpt-oss only). GPT-OSS's YaRN does not truncate its correction range (its config says so; llama.cpp
    computes it the same way); DeepSeek's log multiplier is 0.1 x mscale_all_dim."""
    theta = cfg.pop("rope_theta", None)
    kind = files.get("{arch}.rope.scaling.type")
    if kind not in (None, "none", "linear", "yarn"):
        raise MoectlError(f"{files.paths[0]}: rope scaling {kind!r} is not supported (linear, yarn)")
    if theta is None and kind in (None, "none"):
        return                                      # nothing stated: the config class's own rope (as HF's was)
    if theta is None:
        from transformers import AutoConfig

        theta = AutoConfig.for_model(cfg["model_type"]).rope_parameters["rope_theta"]
    params = {"rope_type": "default", "rope_theta": theta}
    if kind in ("linear", "yarn"):
        params["rope_type"] = kind
        params["factor"] = files.get("{arch}.rope.scaling.factor", required=True)
    if kind == "yarn":
        for key, attr in YARN_KEYS.items():
            if (value := files.get("{arch}.rope.scaling." + key)) is not None:
                params[attr] = value
        if (log_mul := files.get("{arch}.rope.scaling.yarn_log_multiplier")) is not None:
            params["mscale_all_dim"] = round(log_mul / 0.1, 6)
            params["mscale"] = params["mscale_all_dim"]
        if cfg["model_type"] == "gpt_oss":
            params["truncate"] = False
    cfg["rope_parameters"] = params


def _deepseek(files: GgufFiles, cfg: dict) -> None:
    """MLA head sizes: key_length = nope + rope, value_length = v (older converters; newer ones also write the
    `_mla` variants, which are the per-head sizes before absorption)."""
    key = files.get("deepseek2.attention.key_length_mla") or files.get("deepseek2.attention.key_length")
    value = files.get("deepseek2.attention.value_length_mla") or files.get("deepseek2.attention.value_length")
    if key is not None and "qk_rope_head_dim" in cfg:
        cfg["qk_nope_head_dim"] = key - cfg["qk_rope_head_dim"]
    if value is not None:
        cfg["v_head_dim"] = value
    if files.get("deepseek2.attention.key_length_mla") is not None:   # MLA written as MQA: one KV "head"
        cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    cfg.pop("head_dim", None)                       # attention.key_length is nope + rope here, not a head_dim
    cfg.setdefault("q_lora_rank", None)             # absent: queries are one projection (V2-Lite)
    if cfg["model_type"] == "deepseek_v2":
        cfg["topk_method"] = "greedy" if not cfg.get("n_group") else "group_limited_greedy"


def gguf_config(files: GgufFiles):
    """The transformers PretrainedConfig, checked against the tensor shapes."""
    from transformers import AutoConfig

    cfg = dict(config_dict(files))
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    check_shapes(files, config)
    return config


def _expect(files: GgufFiles, name: str, want: tuple[int, ...], what: str) -> None:
    if name not in files.tensors:
        return
    got = files.tensors[name].shape
    if got != want:
        raise MoectlError(f"{files.paths[0]}: the metadata says {what}, so tensor {name} should be {list(want)}, "
                          f"but it is {list(got)} in {files.tensors[name].file.name} (metadata contradicts tensors)")


def check_shapes(files: GgufFiles, config) -> None:
    """Every size the metadata states, against the tensors that have it."""
    H, V = config.hidden_size, config.vocab_size
    E = getattr(config, EXPERT_COUNT_ATTR[config.model_type])
    I = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    _expect(files, "token_embd.weight", (V, H), f"vocab {V} x hidden {H}")
    for layer in range(config.num_hidden_layers):
        p = f"blk.{layer}"
        _expect(files, f"{p}.ffn_gate_inp.weight", (E, H), f"{E} experts x hidden {H}")
        for proj, shape in (("gate", (E, I, H)), ("up", (E, I, H)), ("down", (E, H, I))):
            _expect(files, f"{p}.ffn_{proj}_exps.weight", shape, f"{E} experts of [{I} x {H}]")
            for e in range(E):
                _expect(files, f"{p}.ffn_{proj}.{e}.weight", shape[1:], f"experts of [{I} x {H}]")
    if not any(f"blk.{layer}.ffn_gate_inp.weight" in files.tensors for layer in range(config.num_hidden_layers)):
        raise MoectlError(f"{files.paths[0]} has no expert routers (blk.N.ffn_gate_inp.weight) for its "
                          f"{config.num_hidden_layers} layers")


# transformers' names of the special tokens, by the metadata key of their id (`tokenizer.ggml.<key>`)
SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                  "pad_token": "padding_token_id"}


def tokenizer_metadata(files: GgufFiles) -> tuple[str, dict, dict]:
    """(architecture, tokenizer dict, tokenizer config): what transformers' `get_gguf_tokenizer(path)` gives, from
    the metadata moectl already parsed (transformers' own reads the file again: 1-2 s of a 152k-token vocabulary
    on the shared machine). The same grouping by its GGUF_TOKENIZER_MAPPING, its BOS defaults and special tokens;
    tests/test_gguf_model.py compares the two on a file."""
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING

    meta = files.meta
    grouped = {group: {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    kind = tokenizer.get("tokenizer_type")
    if kind == "llama":                 # older files say nothing; llama.cpp adds BOS to a sentencepiece vocabulary
        config.setdefault("add_bos_token", True)
    elif kind == "gemma4":              # its chat template writes <bos> itself
        config["add_bos_token"] = False
    for name, key in SPECIAL_TOKENS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    return files.arch, tokenizer, config


def gguf_tokenizer(files: GgufFiles):
    """The tokenizer the metadata describes, built by transformers' GGUF tokenizer converter."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer

    try:
        arch, tokenizer_dict, tokenizer_config = tokenizer_metadata(files)
        backend, extra = convert_gguf_tokenizer(arch, tokenizer_dict)
    except (KeyError, ValueError, IndexError) as e:
        raise MoectlError(f"{files.paths[0]}: cannot build its tokenizer from the metadata ({e})") from None
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)
