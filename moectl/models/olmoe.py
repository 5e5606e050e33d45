"""OLMoE: softmax top-8 over 64 experts, renormalised only with norm_topk_prob."""

from .base import FamilyAdapter


class OlmoeAdapter(FamilyAdapter):
    family = "olmoe"
    model_types = ("olmoe",)
