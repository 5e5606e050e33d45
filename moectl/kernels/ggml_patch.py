"""moectl's one patch to ggml's CPU backend: software prefetch of the weight rows in the one-token products.

Why (issue 42's decode gap): a one-token product streams its weight matrix from DRAM once, and ggml's loops
(`ggml_compute_forward_mul_mat_one_chunk`'s vec_dot rows, `..._mul_mat_id_one_chunk`'s expert rows, repack.cpp's gemv
over 8-row groups) issue no software prefetch: on an Intel Xeon the hardware prefetchers stop at each 4 KB page, so
each page starts cold and one core reads ~7 GB/s where a kernel prefetching 4 KB ahead reads 11-13 (docs/gguf.md).
The patch prefetches the bytes `ggml_moectl_prefetch_bytes` ahead of the rows about to be read, and (same switch)
runs the repacked experts' product in row tiles with the routed tokens inside (`_EXPERT_TILES`: a prefill no longer
streams an expert once per token), an expert's routed rows 4 at a time by gemm there (`_EXPERT_GEMM_ROWS`; the global
`ggml_moectl_expert_gemm`, kernels/ggml.py `MOECTL_GGML_EXPERT_GEMM`, 0: every row by gemv); the distance is a
global the shim sets at handle creation (kernels/ggml.py: `MOECTL_GGML_PREFETCH`), 0 (ggml's default) is stock
behaviour. Prefetch changes no arithmetic (tests/test_ggml_prefetch.py: bit-equal products with it on and off, the
experts' gemm off); the experts' gemm sums in gemm's order, as ggml's dense product does for 4 rows
(tests/test_ggml_expert_gemm.py).

Only moectl's ggml build is patched (kernels/ggml.py: `build()` configures a private copy of the vendored ggml/ tree,
`overlay()`); llama.cpp's tools in the comparison (bench/llamacpp.py) build from the untouched source. The edits are
exact-anchor text edits (no `patch` binary): an anchor not found exactly once fails the build with a message naming
it. `KEY` (a hash of the edits) is part of the build's directory, so a changed patch builds anew.

A prefill (T > 1 tokens) runs the same patched loops where it takes them: the vec_dot path's 16-token blocks (the
first token of each prefetches) and a repacked expert's row tiles (gemm for groups of 4 routed rows, gemv for the
rest). Not patched: llamafile's sgemm (dense
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
// the repacked experts' routed rows in groups of 4 by gemm inside the row tiles (repack.cpp; 0: gemv per row)
int ggml_moectl_expert_gemm = 1;
__attribute__((visibility("default"))) void ggml_moectl_set_expert_gemm(int on) {
    ggml_moectl_expert_gemm = on != 0;
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
extern "C" int ggml_moectl_expert_gemm;
static inline void ggml_moectl_prefetch(const char * p, size_t n) {
    for (size_t o = 0; o < n; o += 64) {
        __builtin_prefetch(p + o, 0, 3);
    }
}

// Whether the repacked experts' product runs its row tiles (the prefetch on) with their routed rows by gemm: the
// plan (work_size: the gemm's room) and the product (forward_mul_mat_id) ask the same question.
static inline bool ggml_moectl_expert_gemm_on(void) {
    return ggml_moectl_prefetch_bytes > 0 && ggml_moectl_expert_gemm;
}

// The experts' row tile: whole groups of `nb_cols` rows, ~256 KB of an expert's `nb01`-byte rows (at least one group).
static inline int64_t ggml_moectl_expert_tile(size_t nb01, int64_t nb_cols) {
    const int64_t tile = (int64_t) ((256 * 1024) / nb01) / nb_cols * nb_cols;
    return tile < nb_cols ? nb_cols : tile;
}

// The experts' gemm workspace, after stock mul_mat_id's (src1 quantized, the row mapping: `stock` bytes), offsets
// 64-byte padded: the groups' quantized rows (at most every routed row: `n_routed` rows of `nbw1` bytes), then one
// float scratch a thread: a group's [4, ne10] activations gathered, later a tile's [4, tile] gemm output.
static inline size_t ggml_moectl_gemm_groups_offset(size_t stock) {
    return GGML_PAD(stock, 64);
}
static inline size_t ggml_moectl_gemm_scratch_offset(size_t stock, int64_t n_routed, size_t nbw1) {
    return ggml_moectl_gemm_groups_offset(stock) + GGML_PAD((size_t) n_routed * nbw1, 64);
}
static inline size_t ggml_moectl_gemm_scratch_floats(int64_t ne10, int64_t tile) {
    return GGML_PAD(4 * (size_t) (ne10 > tile ? ne10 : tile), 16);
}
static inline size_t ggml_moectl_gemm_size(size_t stock, int64_t n_routed, size_t nbw1, int64_t ne10, int64_t tile,
                                           int n_threads) {
    return ggml_moectl_gemm_scratch_offset(stock, n_routed, nbw1) +
           (size_t) n_threads * ggml_moectl_gemm_scratch_floats(ne10, tile) * sizeof(float);
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


# repack.cpp's forward_mul_mat_id: stock ggml runs one gemv per routed token over the thread's whole row range of the
# expert, so a prefill that routes n tokens to an expert streams its rows n times (Mixtral's 64-token prefill: ~16
# tokens an expert, a thread's share of a 14336 x 4096 Q4_0 expert 16 MB, far past L2). Here the rows go in tiles of
# ~256 KB (whole NB_COLS groups) and every routed token runs on the tile while it is cached: the expert's routed rows
# in groups of 4 by gemm (as the dense forward_mul_mat runs 4 activation rows, quantized once above:
# `_EXPERT_GEMM_ROWS`) into the thread's [4, tile] scratch, scattered to their dst rows, the remaining nr1 % 4 rows by
# gemv (`_group_loop`); the first pass over a tile prefetches its groups ahead. gemv computes each NB_COLS group on its
# own, so with the gemm off (`ggml_moectl_expert_gemm` 0) or fewer than 4 rows an expert every output is the same gemv
# on the same bytes as stock (tests/test_ggml_prefetch.py: bit-equal); gemm's rows are ggml's gemm
# (tests/test_ggml_expert_gemm.py: within gemm's own difference from gemv). The first gemm over a tile runs in
# 2 * NB_COLS column steps, each prefetched ahead: gemm's widest column step (x86's AVX-512 pairs two groups), so its
# sums are a whole call's.
_GEMM = "gemm<BLOC_TYPE, INTER_SIZE, NB_COLS, PARAM_TYPE>("
_EXPERT_TILES = ("""\
            if (ggml_moectl_prefetch_bytes > 0) {       // moectl patch: row tiles outer, routed tokens inner
                const int64_t tile = ggml_moectl_expert_tile(nb01, NB_COLS);
                // gemm's groups: this expert's first 4 * groups routed rows, quantized above from group g0 on
                int64_t g0 = 0;
                for (int a = 0; a < cur_a; a++) {
                    g0 += matrix_row_counts[a] / 4;
                }
                const int64_t groups = moectl_groups != nullptr ? nr1 / 4 : 0;
                for (int64_t t0 = src0_cur_start; t0 < src0_cur_end; t0 += tile) {
                    const int64_t t1 = t0 + tile < src0_cur_end ? t0 + tile : src0_cur_end;
                    const int64_t w = t1 - t0;                  // whole NB_COLS groups: gemm's nc % NB_COLS == 0
                    for (int64_t g = 0; g < groups; g++) {
                        const char * group_q = moectl_groups + (g0 + g) * 4 * nbw1;     // [4 rows interleaved]
                        if (g == 0) {
                            for (int64_t c = 0; c < w; c += 2 * NB_COLS) {
                                const int64_t nc = w - c < 2 * NB_COLS ? w - c : 2 * NB_COLS;
                                ggml_moectl_prefetch(src0_cur + (t0 + c) * nb01 + ggml_moectl_prefetch_bytes,
                                                     nc * nb01);
"""
                 + _call(32, _GEMM, ["ne00", "moectl_scratch + c", "w", "src0_cur + (t0 + c) * nb01", "group_q", "4",
                                     "(int) nc"])
                 + """\
                            }
                        } else {
"""
                 + _call(28, _GEMM, ["ne00", "moectl_scratch", "w", "src0_cur + t0 * nb01", "group_q", "4", "(int) w"])
                 + """\
                        }
                        for (int r = 0; r < 4; r++) {           // scratch [4, w] -> the 4 rows' dst
                            struct mmid_row_mapping row_mapping = MMID_MATRIX_ROW(cur_a, 4 * g + r);
                            float * s_row = (float *) ((char *) dst->data +
                                                       (row_mapping.i1 * nb1 + row_mapping.i2 * nb2));
                            memcpy(s_row + t0, moectl_scratch + r * w, w * sizeof(float));
                        }
                    }
                    for (int ir1 = (int) (4 * groups); ir1 < nr1; ir1++) {
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

# forward_mul_mat_id, after its row mapping (every thread past the barrier): with the row tiles and the gemm on, each
# expert's routed rows in groups of 4 (its first 4 * (count / 4), in the mapping's order), over all experts group g
# thread g % nth's: the 4 rows' float activations gathered into the thread's scratch and quantized once, 4-interleaved
# (`ggml_quantize_mat_t`, as forward_mul_mat quantizes its rows for gemm), into the workspace `work_size` grew
# (`_EXPERT_GEMM_SIZE`); a barrier, then the tiles read them. A workspace planned without that room (the switch
# flipped between plan and compute) leaves `moectl_groups` null: every row by gemv, as with the gemm off.
_EXPERT_GEMM_ROWS = """\
        // moectl patch (moectl/kernels/ggml_patch.py): the routed rows' groups of 4 for the experts' gemm
        char *  moectl_groups  = nullptr;       // [groups][4 rows interleaved, nbw1 bytes each]; null: no gemm
        float * moectl_scratch = nullptr;       // this thread's [4, ne10] gather, later its [4, tile] gemm output
        if (ggml_moectl_expert_gemm_on()) {
            const size_t  stock    = GGML_PAD(nbw3, sizeof(int64_t)) +
                                     n_as * (ne12 + 1) * sizeof(mmid_row_mapping);        // stock's workspace
            const int64_t n_routed = ids->ne[0] * ids->ne[1];
            const int64_t tile     = ggml_moectl_expert_tile(nb01, NB_COLS);
            if (ggml_moectl_gemm_size(stock, n_routed, nbw1, ne10, tile, nth) <= params->wsize) {
                moectl_groups  = wdata + ggml_moectl_gemm_groups_offset(stock);
                moectl_scratch = (float *) (wdata + ggml_moectl_gemm_scratch_offset(stock, n_routed, nbw1)) +
                                 ith * ggml_moectl_gemm_scratch_floats(ne10, tile);
                int64_t g = 0;
                for (int a = 0; a < n_as; a++) {
                    for (int64_t k = 0; k < matrix_row_counts[a] / 4; k++, g++) {
                        if (g % nth != ith) {
                            continue;
                        }
                        for (int r = 0; r < 4; r++) {
                            const struct mmid_row_mapping m = MMID_MATRIX_ROW(a, 4 * k + r);
                            memcpy(moectl_scratch + r * ne10,
                                   (const char *) src1->data + (m.i1 % ne11) * nb11 + m.i2 * nb12,
                                   ne10 * sizeof(float));
                        }
                        ggml_quantize_mat_t<INTER_SIZE, PARAM_TYPE>(moectl_scratch, moectl_groups + g * 4 * nbw1,
                                                                    4, ne10);
                    }
                }
                ggml_barrier(params->threadpool);
            }
        }

"""

# repack tensor_traits' work_size for MUL_MAT_ID: the room `_EXPERT_GEMM_ROWS` uses, where the gemm is on.
_EXPERT_GEMM_SIZE = """\
                    // moectl patch (moectl/kernels/ggml_patch.py): the experts' gemm groups and threads' scratch
                    if (ggml_moectl_expert_gemm_on()) {
                        const int64_t ne10 = op->src[1]->ne[0];
                        size = ggml_moectl_gemm_size(size, op->src[2]->ne[0] * op->src[2]->ne[1],
                                                     ggml_row_size(PARAM_TYPE, ne10), ne10,
                                                     ggml_moectl_expert_tile(op->src[0]->nb[1], NB_COLS),
                                                     moectl_n_threads);
                    }
"""


def _gemv_split(nc: str, x: str, s: str, y: str) -> str:
    """repack.cpp's one-token gemv of `nc` columns (weights at `x`, output at `s`, activations at `y`) group by group
    (`_group_loop`), prefetching ahead; the original call after it is skipped (`continue`) when the patch's path
    ran."""
    return ("            if (ggml_moectl_prefetch_bytes > 0) {       // moectl patch: group by group, prefetching ahead\n"
            + _group_loop(16, "0", nc, x, s, y)
            + "                continue;\n"
            + "            }\n")


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
    # the experts' gemm: the groups quantized once (forward_mul_mat_id), their room (work_size, which names its
    # thread count for it: a name put into the parameter list, ahead of the anchor's comment)
    ("repack.cpp", "        // compute each matrix multiplication in sequence\n", _EXPERT_GEMM_ROWS, ""),
    ("repack.cpp", "                    size += sizeof_mmid_row_mapping*ne02*(ne12 + 1);\n", "", _EXPERT_GEMM_SIZE),
    ("repack.cpp", "/* n_threads */, const struct ggml_tensor * op, size_t & size) override {\n",
     "moectl_n_threads ", ""),
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
