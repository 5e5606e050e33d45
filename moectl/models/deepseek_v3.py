"""DeepSeek-V3: sigmoid scores, grouped routing with e_score_correction_bias (choice only),
renormalised, times routed_scaling_factor; shared experts and dense first layers stay resident."""

from .base import FamilyAdapter


class DeepseekV3Adapter(FamilyAdapter):
    family = "deepseek_v3"
    model_types = ("deepseek_v3",)

    @property
    def num_experts(self) -> int:
        return int(self.config.n_routed_experts)
