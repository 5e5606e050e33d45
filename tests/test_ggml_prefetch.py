"""moectl's software-prefetch patch to ggml (moectl/kernels/ggml_patch.py, issue 42): it applies to the pinned
llama.cpp source (every anchor found once), a missing anchor fails clearly, the build's identity follows the patch
text, `MOECTL_GGML_PREFETCH` is read as a handle is made, and prefetch changes no arithmetic: every product with it
on is bit-equal to the same product with it off (stock ggml), for the vec_dot path (Q8_0, Q5_K, Q6_K, IQ4_XS, BF16),
the repacked one (Q4_0, Q4_K, IQ4_NL, MXFP4: the patched gemv at T < 4, stock gemm at T >= 4) and the experts'
(mul_mat_id: a repacked expert's gemv per routed token, the row tiles' gemm of 4 rows switched off; that gemm sums
in gemm's order and is checked in tests/test_ggml_expert_gemm.py), at T = 1 to 64 and 1 and 2 threads.

Legend: T = tokens, K = input width, N = output rows, A = stacked experts, U = experts used per token.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from moectl.errors import MoectlError
from moectl.kernels import ggml, ggml_patch
from test_ggml_kernels import lib, weights  # noqa: F401  (autouse: ggml built here, or skip / fail as there)

torch.set_num_threads(1)

VEC_DOT = (Q.Q8_0, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.BF16)
REPACKED = (Q.Q4_0, Q.Q4_K, Q.IQ4_NL, Q.MXFP4)
N, K = 256, 1024                 # 256 rows of 1024: rows several KB ahead exist, so the prefetch runs over real rows
DISTANCE = 4096


def _patched_files(tmp_path):
    src = ggml.source_dir() / "ggml" / "src" / "ggml-cpu"
    if not (src / "ggml-cpu.c").exists():
        pytest.skip(f"the pinned llama.cpp source is not here ({src})")
    dst = tmp_path / "ggml" / "src" / "ggml-cpu"
    dst.mkdir(parents=True)
    for name in {e[0] for e in ggml_patch.EDITS}:
        shutil.copy(src / name, dst / name)
    return tmp_path / "ggml", dst


def test_the_patch_applies_to_the_pinned_source(tmp_path):
    """Every edit's anchor is found once in the pinned source; the patched files hold every edit's text."""
    root, files = _patched_files(tmp_path)
    ggml_patch.apply(root)
    for name, anchor, before, after in ggml_patch.EDITS:
        assert before + anchor + after in (files / name).read_text()


def test_a_missing_anchor_fails_with_a_message(tmp_path):
    root, files = _patched_files(tmp_path)
    (files / "repack.cpp").write_text("// not llama.cpp's repack.cpp\n")
    with pytest.raises(RuntimeError, match="repack.cpp has its anchor .* 0 times"):
        ggml_patch.apply(root)


def test_the_build_identity_follows_the_patch_text(tmp_path, monkeypatch):
    """A changed edit changes the key, and the key names the libraries' directory: a changed patch builds anew."""
    changed = [(f, a, b.replace("0, 3)", "0, 2)"), c.replace("0, 3)", "0, 2)")) for f, a, b, c in ggml_patch.EDITS]
    assert ggml_patch.key(changed) != ggml_patch.KEY == ggml_patch.key()
    assert ggml_patch.KEY in ggml.lib_dir(tmp_path, "native").name
    assert ggml.shim_path(tmp_path, "avx2").parent == ggml.lib_dir(tmp_path, "avx2")
    monkeypatch.setattr(ggml_patch, "KEY", ggml_patch.key(changed))
    assert ggml.lib_dir(tmp_path, "native").name == f"lib-p{ggml_patch.key(changed)}"


def test_the_knob_is_read_as_a_handle_is_made(monkeypatch):
    monkeypatch.delenv(ggml.PREFETCH_ENV, raising=False)
    assert ggml.prefetch_bytes() == ggml.PREFETCH_DEFAULT
    monkeypatch.setenv(ggml.PREFETCH_ENV, "0")
    assert ggml.prefetch_bytes() == 0
    monkeypatch.setenv(ggml.PREFETCH_ENV, "-4k")
    with pytest.raises(MoectlError, match="MOECTL_GGML_PREFETCH='-4k'"):
        ggml.prefetch_bytes()
    monkeypatch.setenv(ggml.PREFETCH_ENV, "8192")
    assert ggml.describe()["prefetch_bytes"] == 8192                    # inspect --json, the bench's kernels
    seen = []
    monkeypatch.setattr(ggml, "set_prefetch", seen.append)
    monkeypatch.setattr(ggml._handles, "by_threads", {})
    h = ggml.handle(3)
    try:
        assert seen == [8192]
    finally:
        ggml.require().mg_free(h)


def _on_off(fn):
    """(fn() with prefetch on, fn() with it off). The experts' row tiles run every routed row by gemv here (the
    gemm of 4 rows, on by default, sums in gemm's order: tests/test_ggml_expert_gemm.py)."""
    try:
        ggml.set_prefetch(DISTANCE)
        ggml.set_expert_gemm(False)
        on = fn()
    finally:
        ggml.set_prefetch(0)
        ggml.set_expert_gemm(ggml.expert_gemm())
    return on, fn()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("enc", VEC_DOT + REPACKED, ids=lambda t: t.name)
def test_prefetch_changes_no_product(enc, threads, monkeypatch):
    """y = x W^T at T = 1, 3 (the vec_dot rows; the repacked gemv) and 4, 16, 64 (the vec_dot path's 16-token blocks,
    the first token of each prefetching; the repacked gemm plus gemv for T % 4) and the experts' product (mul_mat_id,
    A = 4, U = 2) at T = 3 and 64: bit-equal with prefetch on and off."""
    monkeypatch.setenv("MOECTL_GGML_REPACK", "all")
    A = 4
    raw, _ = weights(enc, A * N, K)                                     # [A * N, row bytes]
    if enc in REPACKED:
        if not ggml.repacks(enc, (N, K)):
            pytest.skip(f"this CPU's ggml does not repack {enc.name}")
        ggml.register_stable(raw)
    x = torch.randn(64, K, generator=torch.Generator().manual_seed(1))  # [T, K]
    for tokens in (1, 3, 4, 16, 64):
        on, off = _on_off(lambda: ggml.mul_mat(enc, raw, (A * N, K), x[:tokens], threads))
        assert torch.equal(on, off), (enc.name, tokens)
    ids3 = torch.tensor([[0, 2], [3, 0], [2, 1]], dtype=torch.int32)     # [T, U]
    ids64 = torch.stack([torch.randperm(A, generator=torch.Generator().manual_seed(t))[:2] for t in range(64)])
    for ids in (ids3, ids64.to(torch.int32)):
        on, off = _on_off(lambda: ggml.mul_mat_id(enc, raw, (A, N, K), x[:len(ids)], ids, threads))
        assert torch.equal(on, off), (enc.name, len(ids))
    if enc in REPACKED:
        assert ggml.repack_stats()["repacked"] > 0                      # the repacked path is what ran


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("enc", REPACKED, ids=lambda t: t.name)
def test_the_experts_row_tiles_change_no_product(enc, threads, monkeypatch):
    """The repacked experts' product with prefetch on runs row tiles of ~256 KB outer and the routed tokens inner
    (ggml_patch.py `_EXPERT_TILES`): experts of 2048 rows give a thread several tiles and a last partial one; each
    expert gets ~16-48 of 64 tokens (a prefill's) or one (a decode's). With the tiles' gemm off (every routed row by
    gemv), bit-equal with prefetch off (stock ggml)."""
    monkeypatch.setenv("MOECTL_GGML_REPACK", "all")
    A, rows = 4, 2048 + 8 * 3                                            # not a whole number of tiles
    raw, _ = weights(enc, A * rows, K)                                  # [A * rows, row bytes]
    if not ggml.repacks(enc, (rows, K)):
        pytest.skip(f"this CPU's ggml does not repack {enc.name}")
    ggml.register_stable(raw)
    x = torch.randn(64, K, generator=torch.Generator().manual_seed(2))  # [T, K]
    ids64 = torch.stack([torch.randperm(A, generator=torch.Generator().manual_seed(t))[:2] for t in range(64)])
    ids1 = torch.tensor([[1, 3]], dtype=torch.int32)
    for ids in (ids64.to(torch.int32), ids1):
        on, off = _on_off(lambda: ggml.mul_mat_id(enc, raw, (A, rows, K), x[:len(ids)], ids, threads))
        assert torch.equal(on, off), (enc.name, len(ids))
    assert ggml.repack_stats()["repacked"] > 0
