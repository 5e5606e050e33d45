"""Expert precisions besides the checkpoint's float tensors: checkpoints released quantized (`released.py`:
MXFP4 `mxfp4.py`, block-scaled FP8 `fp8_block.py`), each an `ExpertFormat` (`moectl/formats/expert.py`)."""
