"""moectl's one patch to ggml's CPU backend: software prefetch of the weight rows in the one-token products.

Why (issue 42's decode gap): a one-token product streams its weight matrix from DRAM once, and ggml's loops
(`ggml_compute_forward_mul_mat_one_chunk`'s vec_dot rows, `..._mul_mat_id_one_chunk`'s expert rows, repack.cpp's gemv
over 8-row groups) issue no software prefetch: on an Intel Xeon the hardware prefetchers stop at each 4 KB page, so
each page starts cold and one core reads ~7 GB/s where a kernel prefetching 4 KB ahead reads 11-13 (docs/gguf.md).
The patch prefetches the bytes `ggml_moectl_prefetch_bytes` ahead of the rows about to be read, and (same switch)
runs the repacked experts' product in row tiles with the routed tokens inside (`_EXPERT_TILES`: a prefill no longer
streams an expert once per token); the distance is a
global the shim sets at handle creation (kernels/ggml.py: `MOECTL_GGML_PREFETCH`), 0 (ggml's default) is stock
behaviour. Prefetch changes no arithmetic (tests/test_ggml_prefetch.py: bit-equal products with it on and off).

Only moectl's ggml build is patched (kernels/ggml.py: `build()` configures a private copy of the vendored ggml/ tree,
`overlay()`); llama.cpp's tools in the comparison (bench/llamacpp.py) build from the untouched source. The edits are
exact-anchor text edits (no `patch` binary): an anchor not found exactly once fails the build with a message naming
it. `KEY` (a hash of the edits) is part of the build's directory, so a changed patch builds anew.

A prefill (T > 1 tokens) runs the same patched loops where it takes them: the vec_dot path's 16-token blocks (the
first token of each prefetches) and a repacked expert's gemv per routed token. Not patched: llamafile's sgemm (dense
Q8_0, Q4_0, ... at T > 1) and repack.cpp's gemm (a repacked dense matrix at T >= 4): splitting that gemm into 16-row
groups each prefetched ahead was measured and lost (0.76-0.91 at T = 4 and 16; the split alone 0.97-1.01: the
product is compute-bound there; docs/gguf.md, "A prefill's products"), so it is not an edit.

A prefetch past a matrix's end (its last rows, or a thread's chunk) reads nothing it is not allowed to: a prefetch
never faults (x86 PREFETCHh, ARM PRFM), so the loops need no bound. Distances measured (docs/gguf.md, "Software
prefetch"): 1-16 KB all won on a busy Xeon, 4 KB best or near it; `kernels/ggml.py: PREFETCH_DEFAULT`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

# ggml-cpu.c, before the vec_dot product's chunk: the distance, its setter (the shim's), the prefetch of a byte range.
# Per-row bursts: a vec_dot computes one whole row, so the rows `distance` bytes ahead are asked for as a row starts.
_DEFS_C = """\
// moectl patch (moectl/kernels/ggml_patch.py): software prefetch of the weight rows `ggml_moectl_prefetch_bytes`
// ahead in the one-token products (0: off, stock ggml). Prefetch is a hint: it changes no result.
int ggml_moectl_prefetch_bytes = 0;
__attribute__((visibility("default"))) void ggml_moectl_set_prefetch_bytes(int bytes) {
    ggml_moectl_prefetch_bytes = bytes > 0 ? bytes : 0;
}
static inline void ggml_moectl_prefetch(const char * p, size_t n) {
    for (size_t o = 0; o < n; o += 64) {
        __builtin_prefetch(p + o, 0, 3);
    }
}

"""

# repack.cpp: the same distance and range prefetch.
_DEFS_CPP = """\

// moectl patch (moectl/kernels/ggml_patch.py): see ggml-cpu.c's ggml_moectl_prefetch_bytes.
extern "C" int ggml_moectl_prefetch_bytes;
static inline void ggml_moectl_prefetch(const char * p, size_t n) {
    for (size_t o = 0; o < n; o += 64) {
        __builtin_prefetch(p + o, 0, 3);
    }
}
"""

_GEMV = "gemv<BLOC_TYPE, INTER_SIZE, NB_COLS, PARAM_TYPE>("
_WIDTH = 120                    # the edits' lines wrap as ggml's do; an argument too long for any line stays whole


def _call(pad: int, head: str, args: list[str]) -> str:
    """`head` (a call's name and its open parenthesis) then `args`, `pad` spaces deep, closed with `);`: the arguments
    fill each line greedily up to _WIDTH columns, every further line aligned under the first argument."""
    words = [a + "," for a in args[:-1]] + [args[-1] + ");"]
    line, lines = " " * pad + head + words[0], []
    for word in words[1:]:
        if len(line) + 1 + len(word) <= _WIDTH:
            line += " " + word
        else:
            lines.append(line)
            line = " " * (pad + len(head)) + word
    return "\n".join([*lines, line]) + "\n"


def _group_loop(pad: int, start: str, end: str, x: str, s: str, y: str, prefetch_if: str = "") -> str:
    """The loop both row edits run (`pad` spaces deep): rows [start, end) of the weights at `x` in groups of NB_COLS
    (one interleaved group each; gemv computes each group on its own, so splitting changes no result), each group's
    bytes `distance` ahead prefetched before it (only where `prefetch_if` holds, if given), then its gemv into the
    output at `s` for the activations at `y`."""
    ind = " " * pad
    prefetch = f"ggml_moectl_prefetch({x} + c * nb01 + ggml_moectl_prefetch_bytes, NB_COLS * nb01);\n"
    if prefetch_if:
        prefetch = f"if ({prefetch_if}) {{\n{ind}        {prefetch}{ind}    }}\n"
    return (f"{ind}for (int64_t c = {start}; c < {end}; c += NB_COLS) {{\n"
            f"{ind}    {prefetch}"
            + _call(pad + 4, _GEMV, ["ne00", f"{s} + c", "ne01", f"{x} + c * nb01", y, "1",
                                     f"(int) ({end} - c < NB_COLS ? {end} - c : NB_COLS)"])
            + f"{ind}}}\n")


# repack.cpp's one-token gemv: over [start, start + nc) columns group by group (`_group_loop`). Made with its
# placeholders and filled in by `_gemv_split`: the lines wrap around the placeholders, as the text always has.
_GEMV_SPLIT = ("""\
            if (ggml_moectl_prefetch_bytes > 0) {       // moectl patch: group by group, prefetching ahead
"""
               + _group_loop(16, "0", "@NC@", "@X@", "@S@", "@Y@")
               + """\
                continue;
            }
""")


# repack.cpp's forward_mul_mat_id: stock ggml runs one gemv per routed token over the thread's whole row range of the
# expert, so a prefill that routes n tokens to an expert streams its rows n times (Mixtral's 64-token prefill: ~16
# tokens an expert, a thread's share of a 14336 x 4096 Q4_0 expert 16 MB, far past L2). Here the rows go in tiles of
# ~256 KB (whole NB_COLS groups), each tile's groups prefetched ahead as the first token reaches them, and every routed
# token's gemv runs on the tile while it is cached (`_group_loop`). gemv computes each NB_COLS group on its own, so
# every output is the same gemv on the same bytes as stock: no result changes (tests/test_ggml_prefetch.py).
_EXPERT_TILES = ("""\
            if (ggml_moectl_prefetch_bytes > 0) {       // moectl patch: row tiles outer, routed tokens inner
                int64_t tile = (int64_t) ((256 * 1024) / nb01) / NB_COLS * NB_COLS;
                if (tile < NB_COLS) {
                    tile = NB_COLS;
                }
                for (int64_t t0 = src0_cur_start; t0 < src0_cur_end; t0 += tile) {
                    const int64_t t1 = t0 + tile < src0_cur_end ? t0 + tile : src0_cur_end;
                    for (int ir1 = 0; ir1 < nr1; ir1++) {
                        struct mmid_row_mapping row_mapping = MMID_MATRIX_ROW(cur_a, ir1);
                        const int id = row_mapping.i1;
                        const int64_t i11 = id % ne11;
                        const int64_t i12 = row_mapping.i2;
                        const auto * src1_col = (const char *) wdata + (i11 * nbw1 + i12 * nbw2);
                        float * s_row = (float *) ((char *) dst->data + (id * nb1 + i12 * nb2));
"""
                 + _group_loop(24, "t0", "t1", "src0_cur", "s_row", "src1_col", prefetch_if="ir1 == 0")
                 + """\
                    }
                }
                continue;
            }
""")


def _gemv_split(nc: str, x: str, s: str, y: str) -> str:
    """`_GEMV_SPLIT` for one gemv call: `nc` columns, weights at `x`, output at `s`, activations at `y`; the original
    call after it is skipped (`continue`) when the patch's path ran."""
    return _GEMV_SPLIT.replace("@NC@", nc).replace("@X@", x).replace("@S@", s).replace("@Y@", y)


# (file under ggml/src/ggml-cpu/, anchor that must occur exactly once, text put before it, text put after it)
EDITS: list[tuple[str, str, str, str]] = [
    ("ggml-cpu.c", "static void ggml_compute_forward_mul_mat_one_chunk(\n", _DEFS_C, ""),
    # the vec_dot rows: the first token of a column block asks for the rows ahead (later tokens reread them cached)
    ("ggml-cpu.c",
     "                for (int64_t ir0 = iir0; ir0 < iir0 + blck_0 && ir0 < ir0_end; ir0 += num_rows_per_vec_dot) {\n",
     "", "                    if (ggml_moectl_prefetch_bytes > 0 && ir1 == iir1) {\n"
         "                        ggml_moectl_prefetch(src0_row + ir0 * nb01 + ggml_moectl_prefetch_bytes,"
         " num_rows_per_vec_dot * nb01);\n"
         "                    }\n"),
    # the experts' rows (mul_mat_id by vec_dot)
    ("ggml-cpu.c",
     "                    vec_dot(ne00, &tmp[ir0 - iir0], 0, src0_cur + ir0*nb01, 0, src1_col, 0, 1);\n",
     "                    if (ggml_moectl_prefetch_bytes > 0 && ir1 == iir1) {\n"
     "                        ggml_moectl_prefetch(src0_cur + ir0*nb01 + ggml_moectl_prefetch_bytes, nb01);\n"
     "                    }\n", ""),
    ("repack.cpp", '#include "arch-fallback.h"\n', "", _DEFS_CPP),
    # the repacked one-token product (forward_mul_mat_one_chunk's gemv rows)
    ("repack.cpp",
     "        for (int iter = nrows - (nrows % 4); iter < nrows; iter++) {\n",
     "", _gemv_split(nc="ncols", x="(src0_ptr + src0_start * nb01)",
                     s="(float *) (dst_ptr + (iter * nb1)) + src0_start", y="src1_ptr + (src1_col_stride * iter)")),
    # the repacked experts (forward_mul_mat_id): row tiles outer, routed tokens inner (below)
    ("repack.cpp", "            for (int ir1 = 0; ir1 < nr1; ir1++) {\n", _EXPERT_TILES, ""),
]



def key(edits: list[tuple[str, str, str, str]] | None = None) -> str:
    """The patch's identity: a hash of its edits (`EDITS`), part of the build's directory (kernels/ggml.py)."""
    return hashlib.sha256(repr(EDITS if edits is None else edits).encode()).hexdigest()[:10]


KEY = key()


def build_key() -> str:
    """The patch's name in its build's directories and marker (kernels/ggml.py: `lib-`, `src-`, `build-`, `BUILT-`
    this): `p` and `KEY`, read at each call."""
    return f"p{KEY}"


def apply(ggml_dir: Path) -> None:
    """Apply `EDITS` in place to the ggml/ tree at `ggml_dir` (a private copy: see kernels/ggml.py `overlay()`).
    RuntimeError naming the file and anchor where an anchor is not found exactly once (a new llama.cpp version:
    re-anchor the edits)."""
    files: dict[str, str] = {}
    for name, anchor, before, after in EDITS:
        path = ggml_dir / "src" / "ggml-cpu" / name
        text = files.get(name) or path.read_text()
        n = text.count(anchor)
        if n != 1:
            first = anchor.strip().splitlines()[0][:70]
            raise RuntimeError(f"moectl's ggml patch (kernels/ggml_patch.py) does not apply: {name} has its anchor "
                               f"{first!r} {n} times, not once")
        files[name] = text.replace(anchor, before + anchor + after)
    for name, text in files.items():
        (ggml_dir / "src" / "ggml-cpu" / name).write_text(text)
