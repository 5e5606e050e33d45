"""Model fingerprints: every artifact records the model it was made from.

A fingerprint is `<family>:<12 hex chars>`, a hash of the model's config with the keys that do
not change the computation (paths, versions, dtype) left out, so the same checkpoint in bf16 or
fp32, or copied elsewhere, keeps its fingerprint. The fingerprint of a transformers config needs its family:
`models.config_fingerprint`.
"""

from __future__ import annotations

import hashlib
import json

from ..errors import MoectlError

# Keys that do not change which experts a token routes to or what they compute.
_VOLATILE = {
    "_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures",
    "_commit_hash", "_attn_implementation_autoset", "_experts_implementation",
    "use_cache", "output_router_logits", "return_dict", "auto_map", "quantization_config",
}


def model_fingerprint(config: dict, family: str) -> str:
    clean = {k: v for k, v in sorted(config.items()) if k not in _VOLATILE}
    digest = hashlib.sha256(json.dumps(clean, sort_keys=True, default=str).encode()).hexdigest()
    return f"{family}:{digest[:12]}"


def check_fingerprint(artifact_fp: str | None, model_fp: str, what: str, path: object = "") -> None:
    """Raise a clear error when an artifact was made for another model."""
    if artifact_fp is None:
        return
    if artifact_fp != model_fp:
        where = f" ({path})" if path else ""
        raise MoectlError(
            f"{what}{where} was made for model {artifact_fp}, but the model loaded is {model_fp}. "
            f"Re-create it for this model (or point --model at the model it was made for)."
        )


def shape_text(layers: int, experts: int, top_k: int | None = None) -> str:
    """`16 MoE layers x 64 experts, top-8`: a model's or an artifact's routing shape, as errors say it."""
    s = lambda n: "" if n == 1 else "s"           # noqa: E731
    return f"{layers} MoE layer{s(layers)} x {experts} expert{s(experts)}" + ("" if top_k is None else f", top-{top_k}")
