"""What a device-memory budget holds: dense weights, the KV cache, a workspace, and expert slots.

    budget = dense (everything resident besides the expert cache)
           + KV cache for `kv_tokens` tokens at the model's shapes (K and V, every layer)
           + workspace (activations and logits of one prefill chunk; see WORKSPACE_TOKENS)
           + experts (the cache the plan splits over layers and precisions)

The minimum is dense + KV + workspace + one slot per MoE layer of the smallest precision served; below it
is one clear error that states the minimum. The facts come from the checkpoint (the runtime's own sizing:
`runtime/engine.py` dense_nbytes of the skeleton, kv_reserve_nbytes) or, for a recipe without a
checkpoint, from its `shape:` block (`sim/cost.py: dense_bytes, kv_reserve_bytes`, what `simulate --budget` uses).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import MoectlError
from ..recipes import format_bytes, parse_size
from ..sim.cost import dense_bytes, expert_bytes, kv_reserve_bytes

WORKSPACE_TOKENS = 512          # a prefill chunk's activations and fp32 logits stay allocated while it runs


@dataclass
class ModelFacts:
    """Sizes the budget split and the cost model need. `shape` is a recipe-style shape block."""

    name: str
    shape: dict
    num_layers: int             # MoE layers
    num_experts: int
    top_k: int
    dense_bytes: int
    kv_bytes_per_token: int     # all layers
    fingerprint: str | None = None
    source: str = ""            # "checkpoint <path>" or "recipe <name>"
    full_expert_bytes: int | None = None   # the checkpoint's packed expert (biases included), when known

    def expert_bytes(self, bits: float | None = None, group: int = 64) -> int:
        if bits is None and self.full_expert_bytes:
            return self.full_expert_bytes
        return int(expert_bytes(self.shape, bits, group))


def model_facts(model: str, workdir=None) -> ModelFacts:
    """Facts of a checkpoint (or the built tiny model), else of a recipe's `shape:` block when its checkpoint
    is absent (plans from traces alone)."""
    from ..recipes import load_recipe, recipes_dir, resolve_model

    try:
        ref = resolve_model(model, workdir)
        present = ref.path.is_dir()
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
    from ..runtime.engine import inspect_model, kv_reserve_nbytes, load_config, _dtype
    from ..sim.cost import shape_from_hf_config

    info = inspect_model(model, workdir)
    config, _ = load_config(info["path"])
    kv = kv_reserve_nbytes(config, _dtype(info["dtype"], config), 1)
    shape = shape_from_hf_config(config.to_dict()) | {"name": info["model"], "dtype": info["dtype"],
                                                      "moe_layers": info["moe_layers"]}
    return ModelFacts(info["model"], shape, info["moe_layers"], info["experts"], info["top_k"],
                      int(info["dense_bytes"]), int(kv), info["fingerprint"], f"checkpoint {info['path']}",
                      int(info["bytes_per_expert"]))


def workspace_bytes(shape: dict, tokens: int = WORKSPACE_TOKENS) -> int:
    """fp32 logits of one chunk + a handful of [T, D] / [T, 2I] activations (what a forward holds at its peak)."""
    D, V, inter = shape["hidden_size"], shape.get("vocab_size") or 32000, shape["intermediate_size"]
    return int(tokens * (V + 8 * D + 2 * inter) * 4)


@dataclass
class BudgetSplit:
    total: int
    dense: int
    kv: int
    kv_tokens: int
    workspace: int
    experts: int                # bytes left for expert slots
    staging: int = 0            # prefetch staging buffers (runtime/cache.py), taken from the experts' bytes

    def to_dict(self) -> dict:
        return asdict(self)


def split_budget(size: str | int, facts: ModelFacts, kv_tokens: int = 4096, min_slot_bytes: int | None = None) -> BudgetSplit:
    """The budget's parts; a clear error when it cannot hold one slot per MoE layer (`min_slot_bytes`:
    the smallest slot served, default a full-precision expert)."""
    total = parse_size(size) if isinstance(size, str) else int(size)
    if kv_tokens < 0:
        raise MoectlError(f"--kv-tokens must be >= 0, not {kv_tokens}")
    kv = facts.kv_bytes_per_token * kv_tokens
    ws = workspace_bytes(facts.shape)
    slot = facts.expert_bytes() if min_slot_bytes is None else int(min_slot_bytes)
    minimum = facts.dense_bytes + kv + ws + facts.num_layers * slot
    if total < minimum:
        raise MoectlError(
            f"--budget {format_bytes(total)} is below the minimum {format_bytes(minimum)} for {facts.name}: dense "
            f"weights {format_bytes(facts.dense_bytes)} + KV cache for {kv_tokens} tokens {format_bytes(kv)} + "
            f"workspace {format_bytes(ws)} + one expert slot per MoE layer ({facts.num_layers} x "
            f"{format_bytes(slot)})")
    return BudgetSplit(total, facts.dense_bytes, kv, kv_tokens, ws, total - facts.dense_bytes - kv - ws)
