"""DeepSeek-V2 (and V2-Lite): softmax routing (greedy or group-limited), weights times
routed_scaling_factor, shared experts (resident), dense MLPs in the first_k_dense_replace layers."""

from .base import FamilyAdapter


class DeepseekV2Adapter(FamilyAdapter):
    family = "deepseek_v2"
    model_types = ("deepseek_v2",)

    @property
    def num_experts(self) -> int:
        return int(self.config.n_routed_experts)
