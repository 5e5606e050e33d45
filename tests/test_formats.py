"""ExpertFormat: byte layout, typed views, pack, and the dense format being the checkpoint's tensors."""

import torch

from moectl.models.base import ExpertLayout
from moectl.formats.expert import DenseFormat, ExpertFormat, Part


def test_dense_format_is_the_layout_without_padding():
    layout = ExpertLayout(("gate_up", "down"), ((6, 4), (4, 3)))
    fmt = DenseFormat(layout, torch.bfloat16)
    assert fmt.name == "bf16" and fmt.nbytes == (24 + 12) * 2
    assert fmt.spans == {"gate_up": (0, 48), "down": (48, 72)}
    w = {"gate_up": torch.randn(6, 4), "down": torch.randn(4, 3)}
    buf = fmt.pack(w)
    assert buf.dtype == torch.uint8 and buf.shape == (72,)
    v = fmt.views(buf)
    assert v["down"].dtype == torch.bfloat16 and v["down"].shape == (4, 3)
    assert torch.equal(v["gate_up"], w["gate_up"].bfloat16())
    assert fmt.weights(v) is v                                  # the trivial case: no dequantisation, no copy
    assert v["down"].data_ptr() == buf.data_ptr() + 48          # views of the buffer itself
    # the bytes are the tensors concatenated, as a checkpoint read writes them
    assert torch.equal(buf, torch.cat([w["gate_up"].bfloat16().reshape(-1), w["down"].bfloat16().reshape(-1)])
                       .view(torch.uint8))


def test_mixed_parts_are_aligned_to_their_dtype():
    fmt = ExpertFormat("x", [Part("q", (3,), torch.uint8), Part("s", (2,), torch.float32), Part("z", (1,), torch.int16)])
    assert fmt.spans == {"q": (0, 3), "s": (4, 12), "z": (12, 14)}
    assert fmt.nbytes == 16
    buf = fmt.pack({"q": torch.tensor([1, 2, 3]), "s": torch.tensor([0.5, -1.0]), "z": torch.tensor([7])})
    v = fmt.views(buf)
    assert v["q"].tolist() == [1, 2, 3] and v["s"].tolist() == [0.5, -1.0] and v["z"].tolist() == [7]
    assert fmt.describe()["parts"][1] == ["s", [2], "float32"]
