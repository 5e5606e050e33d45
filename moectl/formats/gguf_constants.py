"""The `gguf` package's constants (its `gguf/constants.py`: the encodings, their block sizes, the value types, the
magic) without the package's `__init__`, for what reads a GGUF's header and sizes it (`gguf_encodings.py`,
`store/gguf/files.py`).

Why: `import gguf` imports its writer, reader, quants, tensor map, vocab (which tries sentencepiece) and metadata
(yaml) besides its constants: ~0.04 s of a torch-free `moectl generate -n 1`'s ~0.5 s (docs/gguf.md, "stop 54"),
for a handful of names. `constants.py` imports nothing but `enum` and `typing`, so it is executed here from the
installed package's own file, as the module `gguf.constants` (registered in `sys.modules` under that name): a later
`import gguf` (the torch path, gguf's own modules, transformers) takes this very module for its
`from .constants import *`, so every enum class and table is gguf's one object, whichever came first. The one
difference, which nothing in moectl or its dependencies reads: the `gguf` package imported after this lacks the
attribute `gguf.constants` (`from gguf.constants import X` and `gguf.X` work). Where the package is imported
already, or cannot be found as files, this is `import gguf.constants`.
"""

from __future__ import annotations

import sys

NAME = "gguf.constants"


def _constants():
    if NAME in sys.modules or "gguf" in sys.modules:
        import gguf.constants

        return sys.modules[NAME]
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("gguf")                  # a top-level name: found, not imported
    locations = list(spec.submodule_search_locations or []) if spec else []
    path = Path(locations[0]) / "constants.py" if locations else None
    if path is None or not path.is_file():
        import gguf.constants

        return sys.modules[NAME]
    own = importlib.util.spec_from_file_location(NAME, path)
    module = importlib.util.module_from_spec(own)
    sys.modules[NAME] = module
    try:
        own.loader.exec_module(module)
    except BaseException:
        del sys.modules[NAME]
        raise
    return module


_c = _constants()
GGML_QUANT_SIZES = _c.GGML_QUANT_SIZES
GGMLQuantizationType = _c.GGMLQuantizationType
GGUFValueType = _c.GGUFValueType
GGUF_MAGIC = _c.GGUF_MAGIC
GGUF_DEFAULT_ALIGNMENT = _c.GGUF_DEFAULT_ALIGNMENT
# gguf's reader's `READER_SUPPORTED_VERSIONS` (gguf/gguf_reader.py; tests/test_cli_start.py checks they are equal)
READER_SUPPORTED_VERSIONS = [2, _c.GGUF_VERSION]
