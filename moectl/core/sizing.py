"""What a device-memory budget buys: one sizing for the runtime, `plan-cache`, `simulate` and `inspect`.

    budget = dense     everything resident besides the expert cache (attention, routers, shared experts, head)
           + KV        the KV cache for `kv_tokens` tokens (K and V, every layer; default KV_RESERVE_TOKENS)
           + workspace activations and fp32 logits of one prefill chunk of WORKSPACE_TOKENS tokens, and the
                       math libraries' own buffers (DEVICE_LIBRARY_BYTES)
           + staging   buffers predicted / streamed experts are copied into instead of cache slots
           + experts   the cache's slots, split over precisions (`split_pools`) and layers (`split_slots`)

The minimum is dense + KV + workspace + staging + one slot per MoE layer of the smallest precision served; below
it is one clear error that states the minimum. The callers supply the facts (`ModelSizes`), made one of two ways:
from a checkpoint directory or GGUF file (`store/facts.py: checkpoint_sizes`; the runtime, `plan-cache`, `inspect`,
`simulate` when the trace's model is on disk) or estimated from a shape (`setting/model_sizes.py: shape_sizes`; a
recipe without its checkpoint, a trace's shape). The resolver (`setting/resolve.py`, `setting/pools.py`) turns the
options of a run into pools with these functions. No torch, no runtime, no simulator: a pure function of sizes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import MoectlError
from .cache_model import FULL, LOW, split_slots
from .recipes import format_bytes, parse_size

KV_RESERVE_TOKENS = 4096        # --budget keeps room for this many tokens of KV cache
WORKSPACE_TOKENS = 512          # a prefill chunk's activations and fp32 logits stay allocated while it runs
# cuBLAS / cuBLASLt workspaces: torch's CUDA allocator holds them from the first matmul on (measured on an H200 with
# torch 2.11: 52 MB beyond a tiny model's weights, KV and activations; docs/gpu-check.md). Reserved whatever the
# device, so plan-cache, simulate and the runtime keep one sizing.
DEVICE_LIBRARY_BYTES = 64 << 20
# Share of the expert cache's bytes given to low-bit slots under `--precision hobbit` (`--lowbit-fraction`):
# see docs/benchmarks.md (bench/precision.py) for why.
DEFAULT_LOWBIT_FRACTION = 0.25


@dataclass
class ModelSizes:
    """What the sizing needs of a model. `shape` is a recipe-style shape block (the workspace reads it; a low-bit
    copy's bytes are priced from it: `setting/model_sizes.py: lowbit_nbytes`)."""

    name: str
    shape: dict
    num_layers: int             # MoE layers
    num_experts: int
    top_k: int
    dense_bytes: int
    kv_bytes_per_token: int     # all layers
    fingerprint: str | None = None
    source: str = ""            # "checkpoint <path>" or "recipe <name>"
    full_expert_bytes: int | None = None   # one packed expert at full precision (biases included)

    def expert_bytes(self) -> int:
        return int(self.full_expert_bytes)


def workspace_bytes(shape: dict, tokens: int = WORKSPACE_TOKENS) -> int:
    """fp32 logits of one chunk + a handful of [T, D] / [T, 2I] activations (what a forward holds at its peak), and
    the math libraries' workspaces."""
    D, V, inter = shape["hidden_size"], shape.get("vocab_size") or 32000, shape["intermediate_size"]
    return int(tokens * (V + 8 * D + 2 * inter) * 4) + DEVICE_LIBRARY_BYTES


@dataclass
class BudgetSplit:
    total: int
    dense: int
    kv: int
    kv_tokens: int
    workspace: int
    experts: int                # bytes left for expert slots
    staging: int = 0            # prefetch / prefill staging buffers, taken from the experts' bytes

    def to_dict(self) -> dict:
        return asdict(self)


def split_budget(size: str | int, facts: ModelSizes, kv_tokens: int = KV_RESERVE_TOKENS,
                 min_slot_bytes: int | None = None, staging: int = 0, what: str | None = None) -> BudgetSplit:
    """The budget's parts; a clear error when it cannot hold one slot per MoE layer (`min_slot_bytes`:
    the smallest slot served, default a full-precision expert) after `staging` bytes of staging buffers. `what`
    names the budget in that error (default: `--budget N`) and may end with what to do."""
    total = parse_size(size) if isinstance(size, str) else int(size)
    if kv_tokens < 0:
        raise MoectlError(f"--kv-tokens must be >= 0, not {kv_tokens}")
    kv = facts.kv_bytes_per_token * kv_tokens
    ws = workspace_bytes(facts.shape)
    slot = facts.expert_bytes() if min_slot_bytes is None else int(min_slot_bytes)
    minimum = facts.dense_bytes + kv + ws + staging + facts.num_layers * slot
    if total < minimum:
        name, _, todo = (what or f"--budget {format_bytes(total)}").partition("; ")
        raise MoectlError(
            f"{name} is below the minimum {format_bytes(minimum)} for {facts.name}: dense "
            f"weights {format_bytes(facts.dense_bytes)} + KV cache for {kv_tokens} tokens {format_bytes(kv)} + "
            f"workspace {format_bytes(ws)}" + (f" + staging buffers {format_bytes(staging)}" if staging else "")
            + f" + one expert slot per MoE layer ({facts.num_layers} x {format_bytes(slot)})"
            + (f"; {todo}" if todo else ""))
    return BudgetSplit(total, facts.dense_bytes, kv, kv_tokens, ws, total - facts.dense_bytes - kv - ws - staging,
                       staging)


def budget_slots(split: BudgetSplit, expert_nbytes: float, num_layers: int, num_experts: int) -> list[int]:
    """Full-precision slots per layer that the split's expert bytes hold (at most every expert)."""
    total = min(int(split.experts // expert_nbytes), num_layers * num_experts)
    return split_slots(total, num_layers, num_experts, "--budget")


def lowbit_fraction_for(precision: str, uses_lowbit: bool, fraction: float | None) -> float:
    """The low-bit pools' share of the cache bytes: none for full precision, all of it for lowbit-only (no
    full-precision pool at all), `--lowbit-fraction` (default DEFAULT_LOWBIT_FRACTION) for HOBBIT."""
    if not uses_lowbit:
        return 0.0
    if precision == "lowbit-only":
        return 1.0
    return DEFAULT_LOWBIT_FRACTION if fraction is None else fraction


def split_pools(full_slots: list[int], num_experts: int, full_nbytes: float, low_nbytes: float,
                fraction: float) -> tuple[list[int], list[int]]:
    """The bytes of `full_slots` full-precision slots as per-precision pools (`byte_pools`; `--cache-experts N` with
    --lowbit buys N full experts' bytes)."""
    return byte_pools(sum(full_slots) * full_nbytes, len(full_slots), num_experts, full_nbytes, low_nbytes, fraction)


def byte_pools(nbytes: float, num_layers: int, num_experts: int, full_nbytes: float, low_nbytes: float,
               fraction: float) -> tuple[list[int], list[int]]:
    """The expert cache's `nbytes` split: `fraction` to low-bit slots, the rest to full slots, each pool's total
    split evenly over the layers (`split_slots`); at least one slot of each per layer (the only way the split
    exceeds the bytes), at most E. fraction 1 (lowbit-only): every byte low-bit, no full pool (full slots
    [0] * L): the runtime and the simulator hold the same pools, and prefetches, fills and a streamed prefill copy
    low-bit copies (`prefetch_precision`)."""
    L, E = num_layers, num_experts
    n_full = 0 if fraction >= 1 else max(L, min(L * E, int(nbytes * (1 - fraction)) // full_nbytes))
    n_low = max(L, min(L * E, (nbytes - n_full * full_nbytes) // low_nbytes))
    return ([0] * L if n_full == 0 else split_slots(int(n_full), L, E)), split_slots(int(n_low), L, E)


def budget_pools(split: BudgetSplit, num_layers: int, num_experts: int, full_nbytes: float,
                 low_nbytes: float | None = None, fraction: float = 0.0) -> dict[str, list[int]]:
    """{precision: slots per layer} a budget's expert bytes buy, the runtime's, `simulate`'s, `inspect`'s and the
    planner's even split alike: full slots only without low-bit copies, else `byte_pools` of the same bytes (not
    rounded to whole full-size slots first). Pools with no slot are left out (lowbit-only has no full one)."""
    if low_nbytes is None:
        return {FULL: budget_slots(split, full_nbytes, num_layers, num_experts)}
    full, low = byte_pools(split.experts, num_layers, num_experts, full_nbytes, low_nbytes, fraction)
    return {p: c for p, c in ((FULL, full), (LOW, low)) if sum(c) > 0}


def prefetch_precision(pools) -> str:
    """The copy prefetches, staging buffers and a streamed prefill hold: full precision when there is a full pool,
    else (lowbit-only) the low-bit one. One rule for the runtime's cache and the simulator."""
    return FULL if FULL in pools else LOW


def staging_nbytes(buffers: int, full_nbytes: float, low_nbytes: float | None, lowbit_only: bool) -> int:
    """Bytes of `buffers` staging buffers: each holds one copy of the precision prefetches load (`prefetch_precision`:
    low-bit at lowbit-only, else full)."""
    return int(buffers * (low_nbytes if lowbit_only and low_nbytes else full_nbytes))


def cache_slots(num_layers: int, num_experts: int, cache_experts: int | None = None,
                split: BudgetSplit | None = None, expert_nbytes: float = 0,
                slots_per_layer: list[int] | None = None) -> list[int]:
    """Slots per MoE layer from exactly one of --cache-experts, a budget split, a plan (default: every expert)."""
    if sum(x is not None for x in (cache_experts, split, slots_per_layer)) > 1:
        raise MoectlError("give one of --cache-experts, --budget or a plan, not several")
    if slots_per_layer is not None:
        if len(slots_per_layer) != num_layers:
            raise MoectlError(f"cache plan has {len(slots_per_layer)} layers, the model has {num_layers} MoE layers")
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in slots_per_layer):
            raise MoectlError(f"cache plan slots must be integers >= 1, got {slots_per_layer}")
        return [min(s, num_experts) for s in slots_per_layer]
    if split is not None:
        return budget_slots(split, expert_nbytes, num_layers, num_experts)
    return split_slots(num_layers * num_experts if cache_experts is None else int(cache_experts),
                       num_layers, num_experts)
