"""Qwen3-MoE (Qwen3-30B-A3B): softmax top-8, norm_topk_prob; dense layers via mlp_only_layers."""

from .base import FamilyAdapter


class Qwen3MoeAdapter(FamilyAdapter):
    family = "qwen3_moe"
    model_types = ("qwen3_moe",)
