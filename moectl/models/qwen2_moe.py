"""Qwen2-MoE / Qwen1.5-MoE: softmax top-k (renormalised only with norm_topk_prob), plus an
always-on shared expert scaled by sigmoid(shared_expert_gate(x)). The shared expert and its
gate are ordinary modules: they stay resident with the dense weights."""

from .base import FamilyAdapter


class Qwen2MoeAdapter(FamilyAdapter):
    family = "qwen2_moe"
    model_types = ("qwen2_moe",)
