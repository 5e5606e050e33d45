"""transformers' model code, imported without hqq (whose import compiles: seconds of every load).

transformers' `cache_utils` (imported by every model's code) imports `hqq.core.quantize` when hqq is installed,
for its HQQ-quantized KV cache, which moectl never uses. That module's `HQQLinear` class body applies
`@torch.compile()` decorators, and each one imports torch's compiler (torch._dynamo's frame conversion,
torch._inductor.compile_fx): 3-7 s of a 2-layer GGUF's 15 s load on the shared 2-core machine, under load
(`bench/gguf_load_time.py`). moectl depends on hqq for its own low-bit copies (`quantize`, `--lowbit`), which
import `hqq.core.quantize` themselves when they run, so only the load of a model that needs none of it is cut.

`import_model_code()` does the process's first import of `transformers.cache_utils` with `sys.modules["hqq"]`
set to None: the import system's own marker for a module that is not there (`importlib.util.find_spec` answers
None, which is what transformers' `is_hqq_available()` asks; `import hqq` fails). The marker is removed right
after, so `import hqq` works again for moectl's quantizer. Nothing of transformers is patched. In this process
transformers then behaves as if hqq were not installed (its answer is cached): its HQQ KV cache and HqqConfig
loading say so; moectl uses neither. Where a transformers version decides differently, hqq is simply imported as
before (slower, never wrong). Nothing is done when hqq or the model code is already imported.
Callers: every moectl function that builds or imports a transformers model (`store/facts.py: skeleton` for each
load and `inspect`; the tiny model's builders), before the import.

Triton is hidden the same way for the same import where torch is a build for no GPU (its `+cpu` wheels: no CUDA,
ROCm or XPU): transformers' model code imports torch._dynamo, whose `utils` imports triton whenever the package is
installed (`torch.utils._triton.has_triton_package`), ~0.25 s of every load, for a compiler backend a CPU-only torch
cannot run (its CPU code is C++). torch then caches "no triton package" for the process, which on such a build
changes nothing it can do; moectl's own Triton kernels import triton themselves (`kernels/triton_lowbit_jit.py`:
on a GPU, or under TRITON_INTERPRET in the tests), which works as before once the marker is gone. Not done when
torch has already asked, or triton is already imported.
"""

from __future__ import annotations

import importlib.util
import sys

MODEL_CODE = "transformers.cache_utils"         # the module every model imports that imports hqq


def import_model_code() -> None:
    """Import transformers' model code (its cache module) for the first time with hqq hidden, and triton on a
    CPU-only torch (see above)."""
    if MODEL_CODE in sys.modules:
        return
    hidden = [name for name, hide in (("hqq", True), ("triton", _triton_unusable()))
              if hide and name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None                # "not installed", for exactly this import
    try:
        import transformers.cache_utils  # noqa: F401
        if importlib.util.find_spec("transformers.masking_utils") is not None:   # 4.53+: imports torch._dynamo
            import transformers.masking_utils  # noqa: F401
    finally:
        for name in hidden:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]


def _triton_unusable() -> bool:
    """torch is a build for no GPU and has not yet asked whether triton is installed."""
    import torch
    from torch.utils._triton import has_triton_package

    gpu = torch.version.cuda or torch.version.hip or getattr(torch.version, "xpu", None)
    asked = getattr(has_triton_package, "cache_info", None) is None or has_triton_package.cache_info().currsize
    return not gpu and not asked
