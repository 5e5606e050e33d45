"""What a device-memory budget holds: dense weights, the KV cache, a workspace, and expert slots.

    budget = dense (everything resident besides the expert cache)
           + KV cache for `kv_tokens` tokens at the model's shapes (K and V, every layer)
           + workspace (activations and logits of one prefill chunk; see WORKSPACE_TOKENS)
           + experts (the cache the plan splits over layers and precisions)

The minimum is dense + KV + workspace + one slot per MoE layer of the smallest precision served; below it
is one clear error that states the minimum. The split itself is `moectl/core/sizing.py` (the runtime's, simulate's and
inspect's too); this file finds the facts: from the checkpoint (`store/facts.py`: dense bytes of the
skeleton, KV bytes per token) or, for a recipe without a checkpoint, from its `shape:` block.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import MoectlError
from ..core.shapes import dense_bytes, expert_bytes, kv_reserve_bytes
from ..core.sizing import ModelSizes


@dataclass
class ModelFacts(ModelSizes):
    """The sizing's facts + what the planner prices: an expert's bytes at any precision (from the shape)."""

    def __post_init__(self):
        if self.full_expert_bytes is None:
            self.full_expert_bytes = int(expert_bytes(self.shape))

    def expert_bytes(self, bits: float | None = None, group: int = 64) -> int:
        return int(self.full_expert_bytes) if bits is None else int(expert_bytes(self.shape, bits, group))


def model_facts(model: str, workdir=None) -> ModelFacts:
    """Facts of a checkpoint (or the built tiny model), else of a recipe's `shape:` block when its checkpoint
    is absent (plans from traces alone)."""
    from ..core.recipes import load_recipe, recipes_dir, resolve_model

    try:
        ref = resolve_model(model, workdir)
        present = ref.path.is_dir() or ref.gguf
    except MoectlError:
        if not (recipes_dir() / f"{model}.yaml").exists():
            raise
        ref, present = None, False
    if present:
        return _checkpoint_facts(model, workdir)
    recipe = load_recipe(model) if ref is None else ref.recipe
    if not recipe or "shape" not in recipe:
        raise MoectlError(f"--model {model}: no checkpoint at {ref.path if ref else '?'} and no recipe shape: block")
    shape = {"name": recipe.get("name", model), **recipe["shape"]}
    return ModelFacts(shape["name"], shape, shape.get("moe_layers", shape["num_layers"]), shape["num_experts"],
                      shape["top_k"], int(dense_bytes(shape)), int(kv_reserve_bytes(shape, 1)), None,
                      f"recipe {shape['name']} (shape: block; no checkpoint)")


def _checkpoint_facts(model: str, workdir) -> ModelFacts:
    from ..store.facts import inspect_model, kv_reserve_nbytes, load_config, parse_dtype
    from ..core.shapes import shape_from_hf_config

    info = inspect_model(model, workdir)
    config, _ = load_config(info["path"])
    kv = kv_reserve_nbytes(config, parse_dtype(info["dtype"], config), 1)
    shape = shape_from_hf_config(config.to_dict()) | {"name": info["model"], "dtype": info["dtype"],
                                                      "moe_layers": info["moe_layers"]}
    return ModelFacts(info["model"], shape, info["moe_layers"], info["experts"], info["top_k"],
                      int(info["dense_bytes"]), int(kv), info["fingerprint"], f"checkpoint {info['path']}",
                      int(info["bytes_per_expert"]))
