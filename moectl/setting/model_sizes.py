"""A model's sizes from a shape block (a recipe's `shape:`, a trace's config, a checkpoint's config.json): one of the
two constructors of `core/sizing.py: ModelSizes`, for the models nothing is on disk of. The other reads a
checkpoint directory or GGUF file (`store/facts.py: checkpoint_sizes`). No torch.
"""

from __future__ import annotations

from ..core.shapes import dense_bytes, expert_bytes, kv_reserve_bytes, parse_lowbit, shape_from_hf_config
from ..core.sizing import ModelSizes


def shape_sizes(shape: dict, num_layers: int | None = None, num_experts: int | None = None, top_k: int | None = None,
                *, name: str | None = None, fingerprint: str | None = None, source: str | None = None,
                expert_nbytes: float | None = None) -> ModelSizes:
    """ModelSizes estimated from `shape`: dense weights and KV bytes per token from the shapes (`sim/cost.py`), one
    expert's bytes as the shape stores it (`expert_nbytes`: as the caller prices it, e.g. a cost model's `--bits`).
    Layers, experts and top-k default to the shape's own."""
    return ModelSizes(name or shape.get("name", "model"), shape,
                      num_layers or shape.get("moe_layers", shape.get("num_layers")),
                      num_experts or shape["num_experts"], top_k or shape["top_k"], int(dense_bytes(shape)),
                      int(kv_reserve_bytes(shape, 1)), fingerprint, source or f"shape {shape.get('name')}",
                      int(expert_nbytes or expert_bytes(shape)))


def config_sizes(config: dict, fingerprint: str, dtype: str, num_layers: int, num_experts: int, top_k: int,
                 dense: int, kv_bytes_per_token: int, expert_nbytes: int, source: str = "",
                 name: str | None = None) -> ModelSizes:
    """ModelSizes of a checkpoint or GGUF from its config's dict and the figures its header gives (`store/facts.py:
    checkpoint_sizes`, and the torch-free run's `runtime/graph_engine.py`): the shape at `dtype` (e.g. bfloat16)."""
    shape = shape_from_hf_config(config) | {"dtype": dtype, "moe_layers": num_layers} | ({"name": name} if name else {})
    return ModelSizes(shape.get("name", "model"), shape, num_layers, num_experts, top_k, dense, kv_bytes_per_token,
                      fingerprint, source, expert_nbytes)


def lowbit_nbytes(sizes: ModelSizes, lowbit: str) -> int:
    """Bytes of one expert's low-bit copy `lowbit` (q<bits>g<group>) at the model's shape, as the runtime stores it
    (HQQ's scale and zero per group in the model's dtype)."""
    return int(expert_bytes(sizes.shape, *parse_lowbit(lowbit)))
