"""Family adapters, one file each. `adapter_for(config)` picks one by `config.model_type`; a model's fingerprint
names its family, so it is taken here too (`config_fingerprint`, `checkpoint_fingerprint`)."""

from __future__ import annotations

from ..core.fingerprint import model_fingerprint
from ..errors import MoectlError
from .base import FamilyAdapter
from .deepseek_v2 import DeepseekV2Adapter
from .deepseek_v3 import DeepseekV3Adapter
from .gpt_oss import GptOssAdapter
from .mixtral import MixtralAdapter
from .olmoe import OlmoeAdapter
from .qwen2_moe import Qwen2MoeAdapter
from .qwen3_moe import Qwen3MoeAdapter

ADAPTERS: tuple[type[FamilyAdapter], ...] = (
    MixtralAdapter, Qwen2MoeAdapter, Qwen3MoeAdapter, OlmoeAdapter, DeepseekV2Adapter, DeepseekV3Adapter, GptOssAdapter,
)
FAMILIES = {mt: cls for cls in ADAPTERS for mt in cls.model_types}
# Dense cousins of supported families: a clear "this is not an MoE model" instead of "unsupported".
DENSE_MODEL_TYPES = {"mistral", "llama", "qwen2", "qwen3", "olmo", "olmo2", "gemma", "gemma2", "gemma3", "phi3", "gpt2"}


def adapter_for(config) -> FamilyAdapter:
    mt = getattr(config, "model_type", None)
    if mt in FAMILIES:
        return FAMILIES[mt](config)
    if mt in DENSE_MODEL_TYPES:
        raise MoectlError(f"model type {mt!r} is a dense model (no Mixture-of-Experts layers); moectl offloads "
                          f"experts of MoE models: {', '.join(sorted(FAMILIES))}")
    raise MoectlError(f"unsupported model family {mt!r}; supported: {', '.join(sorted(FAMILIES))}")



def config_fingerprint(config) -> str:
    """The fingerprint of a model from its transformers config (what every artifact records)."""
    return model_fingerprint(config.to_dict(), adapter_for(config).family)


def checkpoint_fingerprint(path) -> str:
    """The fingerprint of the checkpoint directory `path` (reads config.json only)."""
    from transformers import AutoConfig

    return config_fingerprint(AutoConfig.from_pretrained(str(path)))
