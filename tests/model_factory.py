"""Tiny random models of every supported family, saved with save_pretrained (offline, < 1 s each)."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, bos_token_id=0, eos_token_id=0, pad_token_id=1)


def family_configs() -> dict:
    from transformers import (DeepseekV2Config, DeepseekV3Config, GptOssConfig, MixtralConfig, OlmoeConfig,
                              Qwen2MoeConfig, Qwen3MoeConfig)

    return {
        "mixtral": MixtralConfig(**COMMON, intermediate_size=128, num_local_experts=8, num_experts_per_tok=2),
        "qwen2_moe": Qwen2MoeConfig(**COMMON, intermediate_size=128, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2),
        "qwen3_moe": Qwen3MoeConfig(**COMMON, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                                    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
        "olmoe": OlmoeConfig(**COMMON, intermediate_size=32, num_experts=8, num_experts_per_tok=2),
        "deepseek_v2": DeepseekV2Config(**COMMON, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                                        num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1,
                                        q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                        v_head_dim=16, routed_scaling_factor=1.5, topk_method="greedy"),
        "deepseek_v3": DeepseekV3Config(**COMMON, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                                        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                                        n_shared_experts=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                                        qk_nope_head_dim=8, v_head_dim=16, routed_scaling_factor=2.5),
        "gpt_oss": GptOssConfig(**COMMON, head_dim=16, intermediate_size=32, num_local_experts=8,
                                num_experts_per_tok=2, sliding_window=32),
    }


def build_family(family: str, out: Path, fused: bool = False, seed: int = 0):
    """Save a random tiny model of `family` to `out`; returns the reference model (eager experts)."""
    from transformers import AutoModelForCausalLM

    cfg = family_configs()[family]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():            # random init leaves some tensors (biases, correction bias) at 0: perturb all
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.eval()
    model.save_pretrained(out, save_original_format=not fused)
    return model


def save_tokenizer(out: Path, vocab_size: int = 512) -> None:
    """A byte-level BPE tokenizer trained in ~0.2 s on a few KB of local text, with a chat template."""
    import inspect as _inspect

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    text = _inspect.getsource(torch.nn.modules.linear) + _inspect.getsource(torch.nn.modules.activation)[:20000]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                 pad_token="<|pad|>")
    hf.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    hf.save_pretrained(out)
