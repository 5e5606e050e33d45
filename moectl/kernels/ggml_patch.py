"""moectl's one patch to ggml's CPU backend: software prefetch of the weight rows in the one-token products.

Why (issue 42's decode gap): a one-token product streams its weight matrix from DRAM once, and ggml's loops
(`ggml_compute_forward_mul_mat_one_chunk`'s vec_dot rows, `..._mul_mat_id_one_chunk`'s expert rows, repack.cpp's gemv
over 8-row groups) issue no software prefetch: on an Intel Xeon the hardware prefetchers stop at each 4 KB page, so each
page starts cold and one core reads ~7 GB/s where a kernel prefetching 4 KB ahead reads 11-13 (docs/gguf.md). The patch
prefetches the bytes `ggml_moectl_prefetch_bytes` ahead of the rows about to be read, and (same switch) runs the
repacked experts' product in row tiles with the routed tokens inside (`_EXPERT_TILES`: a prefill no longer streams an
expert once per token), an expert's routed rows 4 at a time by gemm there (`_EXPERT_GEMM_ROWS`; the global
`ggml_moectl_expert_gemm`, kernels/ggml.py `MOECTL_GGML_EXPERT_GEMM`, 0: every row by gemv), and (same two switches) the
experts ggml does not repack whose product takes q8_0 activations (Q8_0; Q4_0, Q5_0, IQ4_NL where not repacked) through
llamafile's tinyBLAS on each expert's gathered routed rows (`_SGEMM_EXPERT`; stock: vec_dot one (row, token) pair at a
time), and (same two switches, and `ggml_moectl_rows_max`: kernels/ggml.py `MOECTL_GGML_EXPERT_ROWS`) the experts whose
type has one of moectl's own expert-rows kernels (kernels/ggml_rows/: Q5_K, Q6_K, Q3_K, IQ4_XS, IQ3_XXS, IQ2_XXS on
AVX-512; `_ROWS_EXPERT`; stock: vec_dot below 8 routed rows, ggml's tiled kernel from 8); the distance is a global the shim sets at handle creation (kernels/ggml.py: `MOECTL_GGML_PREFETCH`), 0 (ggml's
default) is stock behaviour. The experts' path is decided once an op, by thread 0 into the workspace before the row
mapping's barrier (`_EXPERT_MODE`, `_SGEMM_MODE`): a switch set from another thread while a graph computes cannot make
the op's threads disagree. Prefetch changes no arithmetic (tests/test_ggml_prefetch.py: bit-equal products with it on
and off, the experts' gemm off); the experts' gemm sums in gemm's order, as ggml's dense product does for 4 rows
(tests/test_ggml_expert_gemm.py), tinyBLAS in its own (tests/test_ggml_expert_sgemm.py), the rows kernels each block's
exact integer sums in their own fp32 order (tests/test_ggml_expert_rows.py).

Only moectl's ggml build is patched (kernels/ggml.py: `build()` configures a private copy of the vendored ggml/ tree,
`overlay()`); llama.cpp's tools in the comparison (bench/llamacpp.py) build from the untouched source. The edits are
exact-anchor text edits (no `patch` binary): an anchor not found exactly once fails the build with a message naming
it. `KEY` (a hash of the edits) is part of the build's directory, so a changed patch builds anew.

A prefill (T > 1 tokens) runs the same patched loops where it takes them: the vec_dot path's 16-token blocks (the first
token of each prefetches) and a repacked expert's row tiles (gemm for groups of 4 routed rows, gemv for the rest), and
the tinyBLAS experts' chunks (32 weight rows, every routed token inside). Not patched: llamafile's sgemm itself (dense
Q8_0, Q4_0, ... at T > 1; the experts' path above calls it unchanged) and repack.cpp's gemm (a repacked dense matrix at
T >= 4): splitting that gemm into 16-row groups each prefetched ahead was measured and lost (0.76-0.91 at T = 4 and 16;
the split alone 0.97-1.01: the product is compute-bound there; docs/gguf.md, "A prefill's products"), so it is not an
edit.

A prefetch past a matrix's end (its last rows, or a thread's chunk) reads nothing it is not allowed to: a prefetch
never faults (x86 PREFETCHh, ARM PRFM), so the loops need no bound. Distances measured (docs/gguf.md, "Software
prefetch"): 1-16 KB all won on a busy Xeon, 4 KB best or near it; `kernels/ggml.py: PREFETCH_DEFAULT`.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

# moectl's expert-rows kernels (`_ROWS_EXPERT`): their C sources, copied into the patched tree's ggml-cpu/moectl-rows/
# and added to libggml-cpu's sources; part of `KEY`.
ROWS_DIR = Path(__file__).parent / "ggml_rows"
ROWS_SOURCES = ("rows.c", "rows_k.c", "rows_iq.c")
ROWS_MAX_DEFAULT = 1 << 20      # the most routed rows an expert for which the rows kernels run (kernels/ggml.py)
ROWS_MIN_DEFAULT = 1            # the least: a decode's experts (one row each) too; measured: a Mixtral-shaped
                                # Q5_K_M / Q6_K / IQ4_XS one-token forward 1.19-1.42x vec_dot's, Qwen3's 0.99-1.03

# ggml-cpu.c, before the vec_dot product's chunk: the distance, its setter (the shim's), the prefetch of a byte range.
# Per-row bursts: a vec_dot computes one whole row, so the rows `distance` bytes ahead are asked for as a row starts.
_DEFS_C = """\
// moectl patch (moectl/kernels/ggml_patch.py): software prefetch of the weight rows `ggml_moectl_prefetch_bytes`
// ahead in the one-token products (0: off, stock ggml). Prefetch is a hint: it changes no result.
#include "moectl-rows/rows.h"
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
// The experts (not repacked) whose product takes q8_0 activations and llamafile's tinyBLAS computes: each expert's
// routed rows gathered, then tinyBLAS on MOECTL_SGEMM_ROWS weight rows at a time (mul_mat_id; the switch of
// repack.cpp's gemm: the prefetch on and ggml_moectl_expert_gemm).
#define MOECTL_SGEMM_ROWS 32
// the chunks tinyBLAS computed there (a count the tests read: the path ran), added once per expert and thread
__attribute__((visibility("default"))) int64_t ggml_moectl_sgemm_chunks = 0;
static inline bool ggml_moectl_expert_sgemm_on(void) {
    return ggml_moectl_prefetch_bytes > 0 && ggml_moectl_expert_gemm;
}
// The experts whose type has one of moectl's expert-rows kernels (moectl-rows/rows.h: Q5_K, Q6_K, Q3_K, IQ4_XS,
// IQ3_XXS, IQ2_XXS on AVX-512): an expert with ggml_moectl_rows_min..max routed rows runs it on chunks of
// MOECTL_ROWS_CHUNK weight rows, MOECTL_ROWS_TOKENS routed tokens a call (0: never; same switch as the sgemm's).
#define MOECTL_ROWS_CHUNK 32
#define MOECTL_ROWS_TOKENS 64
int ggml_moectl_rows_max = """ + str(ROWS_MAX_DEFAULT) + """;
int ggml_moectl_rows_min = """ + str(ROWS_MIN_DEFAULT) + """;
__attribute__((visibility("default"))) void ggml_moectl_set_rows_max(int rows) {
    ggml_moectl_rows_max = rows > 0 ? rows : 0;
}
__attribute__((visibility("default"))) void ggml_moectl_set_rows_min(int rows) {
    ggml_moectl_rows_min = rows > 1 ? rows : 1;
}
// the chunks the rows kernels computed there (a count the tests read), added once per expert and thread
__attribute__((visibility("default"))) int64_t ggml_moectl_rows_chunks = 0;
static inline bool ggml_moectl_sgemm_type(enum ggml_type type) {
    return type == GGML_TYPE_Q8_0 || type == GGML_TYPE_Q4_0 || type == GGML_TYPE_Q5_0 || type == GGML_TYPE_IQ4_NL;
}
// mul_mat_id's room after stock's workspace, each piece 64-byte aligned (64 bytes slack each): the op's decision slot
// (always), then where the sgemm is on the gathered rows [n_routed, row_size bytes] and each thread's C scratch
// [n_routed tokens][MOECTL_SGEMM_ROWS] floats.
static inline size_t ggml_moectl_sgemm_room(bool on, int64_t n_routed, size_t row_size, int n_threads) {
    return 64 + 64 + (on ? 64 + (size_t) n_routed * row_size +
                           64 + (size_t) n_threads * MOECTL_SGEMM_ROWS * n_routed * sizeof(float) : 0);
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

// The experts' workspace, after stock mul_mat_id's (src1 quantized, the row mapping: `stock` bytes), offsets 64-byte
// padded: the op's decision slot (always: `ggml_moectl_expert_mode`), then where the gemm is on the groups' quantized
// rows (at most every routed row: `n_routed` rows of `nbw1` bytes), then one float scratch a thread: a group's
// [4, ne10] activations gathered, later a tile's [4, tile] gemm output.
static inline size_t ggml_moectl_mode_offset(size_t stock) {
    return GGML_PAD(stock, 64);
}
static inline size_t ggml_moectl_gemm_groups_offset(size_t stock) {
    return ggml_moectl_mode_offset(stock) + 64;
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

// The experts' path, decided once an op by thread 0 (every thread reads it past the row mapping's barrier: a setter
// called from another thread while a graph computes must not make threads disagree, one skipping the gemm's gather
// barrier the others wait at, or splitting rows differently): 0 stock, 1 the row tiles by gemv, 2 the row tiles with
// the gemm (its room in the workspace: `wsize`).
static inline int ggml_moectl_expert_mode(size_t wsize, size_t stock, int64_t n_routed, size_t nbw1, int64_t ne10,
                                          int64_t tile, int n_threads) {
    if (ggml_moectl_prefetch_bytes <= 0) {
        return 0;
    }
    return ggml_moectl_expert_gemm &&
           ggml_moectl_gemm_size(stock, n_routed, nbw1, ne10, tile, n_threads) <= wsize ? 2 : 1;
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
            if (moectl_mode > 0) {       // moectl patch: row tiles outer, routed tokens inner
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
# (`_EXPERT_GEMM_SIZE`); a barrier, then the tiles read them. Whether it runs is thread 0's decision (`_EXPERT_MODE`,
# read here past the row mapping's barrier); a workspace planned without that room (the switch flipped between plan
# and compute) decides mode 1: `moectl_groups` null, every row by gemv, as with the gemm off.
_EXPERT_GEMM_ROWS = """\
        // moectl patch (moectl/kernels/ggml_patch.py): the op's path (thread 0's, before the barrier above), then
        // the routed rows' groups of 4 for the experts' gemm
        const int moectl_mode = moectl_mode_slot != nullptr ? *moectl_mode_slot : 0;
        char *  moectl_groups  = nullptr;       // [groups][4 rows interleaved, nbw1 bytes each]; null: no gemm
        float * moectl_scratch = nullptr;       // this thread's [4, ne10] gather, later its [4, tile] gemm output
        {
            const int64_t n_routed = ids->ne[0] * ids->ne[1];
            const int64_t tile     = ggml_moectl_expert_tile(nb01, NB_COLS);
            if (moectl_mode == 2) {
                moectl_groups  = wdata + ggml_moectl_gemm_groups_offset(moectl_stock);
                moectl_scratch = (float *) (wdata + ggml_moectl_gemm_scratch_offset(moectl_stock, n_routed, nbw1)) +
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

# forward_mul_mat_id, ahead of thread 0's row mapping: the op's path decided once (`ggml_moectl_expert_mode`) into
# the workspace's slot, which work_size always reserves (`_EXPERT_GEMM_SIZE`); a workspace without it: stock.
_EXPERT_MODE = """\
        // moectl patch (moectl/kernels/ggml_patch.py): the experts' path, thread 0's, read past the barrier
        const size_t moectl_stock = GGML_PAD(nbw3, sizeof(int64_t)) +
                                    n_as * (ne12 + 1) * sizeof(mmid_row_mapping);         // stock's workspace
        int * moectl_mode_slot = params->wsize >= ggml_moectl_gemm_groups_offset(moectl_stock) ?
                                 (int *) (wdata + ggml_moectl_mode_offset(moectl_stock)) : nullptr;
        if (ith == 0 && moectl_mode_slot != nullptr) {
            *moectl_mode_slot = ggml_moectl_expert_mode(params->wsize, moectl_stock, ids->ne[0] * ids->ne[1], nbw1,
                                                        ne10, ggml_moectl_expert_tile(nb01, NB_COLS), nth);
        }

"""

# repack tensor_traits' work_size for MUL_MAT_ID: the room `_EXPERT_GEMM_ROWS` uses, where the gemm is on.
_EXPERT_GEMM_SIZE = """\
                    // moectl patch (moectl/kernels/ggml_patch.py): the op's decision slot (always), the experts' gemm
                    // groups and threads' scratch (where on)
                    if (ggml_moectl_expert_gemm_on()) {
                        const int64_t ne10 = op->src[1]->ne[0];
                        size = ggml_moectl_gemm_size(size, op->src[2]->ne[0] * op->src[2]->ne[1],
                                                     ggml_row_size(PARAM_TYPE, ne10), ne10,
                                                     ggml_moectl_expert_tile(op->src[0]->nb[1], NB_COLS),
                                                     moectl_n_threads);
                    } else {
                        size = ggml_moectl_gemm_groups_offset(size);
                    }
"""


# ggml-cpu.c's forward_mul_mat_id for the experts not repacked whose product takes q8_0 activations and tinyBLAS
# computes (`ggml_moectl_sgemm_type`: Q8_0, and Q4_0 / Q5_0 / IQ4_NL where not repacked): stock ggml computes each
# (weight row, routed token) pair by vec_dot, 16 x 16 at a time, where its dense product (forward_mul_mat) runs the same
# types through llamafile's tinyBLAS (4 x 4 register tiles: a weight block loaded once for 4 tokens). Here each expert
# with >= 2 routed rows gets tinyBLAS too: the routed rows' q8_0 activations gathered once an op, expert after expert
# (all threads, a range each, then a barrier), then the expert's weight rows in chunks of MOECTL_SGEMM_ROWS (every
# routed token inside: a chunk's weights read once), taken from stock's per-expert chunk counter (no barrier between
# experts), tinyBLAS as one thread of one (the thread owns its chunk) into the thread's C scratch [tokens][rows], whose
# columns go to their dst rows. tinyBLAS sums in its own order (tests/test_ggml_expert_sgemm.py). The path is decided
# once an op by thread 0 into the workspace's slot (as repack.cpp's `_EXPERT_MODE`); a workspace without the room
# (`ggml_moectl_sgemm_room`, planned with the switch off) or tinyBLAS refusing a chunk: stock's vec_dot.
_SGEMM_ROOM = """\
    // moectl patch (moectl/kernels/ggml_patch.py): the op's decision slot, then the experts' sgemm room
    // (ggml_moectl_sgemm_room): the gathered rows, the threads' C scratch; a workspace without them decides stock
    const int64_t moectl_n_routed = ids->ne[0]*ids->ne[1];
    const size_t  moectl_row_size = ggml_row_size(vec_dot_type, ne10);
    int * moectl_mode = incr_ptr_aligned(&wdata_cur, 3*sizeof(int), 64);     // [path, rows' most, rows' least]
    const bool moectl_slot = params->wsize >= (size_t)((char *) wdata_cur - (char *) params->wdata);
    char * moectl_rows = incr_ptr_aligned(&wdata_cur, moectl_n_routed*moectl_row_size, 64);  // [n_routed, row_size]
    float * moectl_c = incr_ptr_aligned(&wdata_cur, nth*MOECTL_SGEMM_ROWS*moectl_n_routed*sizeof(float), 64);
    const bool moectl_room = params->wsize >= (size_t)((char *) wdata_cur - (char *) params->wdata);
"""

_SGEMM_MODE = """\
    // moectl patch: the experts' path decided once, by thread 0, read by every thread past the barrier below
    // (0 stock, 1 the sgemm, 2 the rows kernels with their threshold)
    if (ith == 0 && moectl_slot) {
        const bool on = ggml_moectl_expert_sgemm_on() && src1->type != vec_dot_type && !params->use_ref;
        moectl_mode[1] = ggml_moectl_rows_max;
        moectl_mode[2] = ggml_moectl_rows_min;
        moectl_mode[0] = on && moectl_room && ggml_moectl_sgemm_type(type) ? 1 :
                         on && moectl_mode[1] >= moectl_mode[2] && ggml_moectl_rows_kernel(type) != NULL ? 2 : 0;
    }

"""

_SGEMM_GATHER = """\
    // moectl patch: with the sgemm on, the routed rows of each expert with >= 2 of them gathered in the row mapping's
    // order, expert after expert (expert a's from the sum of the counts before it), a range of rows a thread
    const bool moectl_sgemm = moectl_slot && moectl_mode[0] == 1;
    const ggml_moectl_rows_fn moectl_rows_fn = moectl_slot && moectl_mode[0] == 2 ? ggml_moectl_rows_kernel(type) : NULL;
    const int64_t moectl_rows_max = moectl_slot ? moectl_mode[1] : 0;
    const int64_t moectl_rows_min = moectl_slot ? moectl_mode[2] : 0;
    if (moectl_sgemm) {
        const int64_t r_start = (ith*moectl_n_routed)/nth;
        const int64_t r_end   = ((ith + 1)*moectl_n_routed)/nth;
        int64_t r = 0;
        for (int a = 0; a < n_as && r < r_end; r += matrix_row_counts[a], a++) {
            if (matrix_row_counts[a] < 2) {
                continue;
            }
            for (int64_t k = MAX(r_start - r, 0); k < matrix_row_counts[a] && r + k < r_end; k++) {
                const struct mmid_row_mapping rm = MMID_MATRIX_ROW(a, k);
                memcpy(moectl_rows + (r + k)*moectl_row_size,
                       (const char *) params->wdata + (rm.i1 % ne11 + rm.i2*ne11)*moectl_row_size, moectl_row_size);
            }
        }
        ggml_barrier(params->threadpool);
    }

"""

_SGEMM_EXPERT = """\
#if GGML_USE_LLAMAFILE
        if (moectl_sgemm && cne1 >= 2) {       // moectl patch: tinyBLAS on the expert's gathered rows
            int64_t r0 = 0;                                     // the expert's first gathered row
            for (int a = 0; a < cur_a; a++) {
                r0 += matrix_row_counts[a];
            }
            const char * b = moectl_rows + r0*row_size;                           // [cne1, row_size bytes]
            float * c = moectl_c + (size_t) ith*MOECTL_SGEMM_ROWS*moectl_n_routed;   // [cne1][chunk rows]
            // the thread owns its chunk: tinyBLAS as thread 0 of 1 (the op's other threads are elsewhere)
            struct ggml_compute_params one = *params;
            one.ith = 0;
            one.nth = 1;
            const int64_t nchunk = (nr0 + MOECTL_SGEMM_ROWS - 1)/MOECTL_SGEMM_ROWS;
            int current_chunk = ith;
            atomic_int * current_chunk_ctr = (atomic_int *)(atomic_current_chunk + cur_a);
            int64_t done = 0;
            while (current_chunk < nchunk) {
                const int64_t ir0_start = current_chunk*MOECTL_SGEMM_ROWS;
                const int64_t ir0_end   = MIN(ir0_start + MOECTL_SGEMM_ROWS, nr0);
                const int64_t m         = ir0_end - ir0_start;
                if (llamafile_sgemm(&one, m, cne1, ne00/ggml_blck_size(type),
                                    src0_cur + ir0_start*nb01, nb01/ggml_type_size(type),
                                    b, row_size/ggml_type_size(vec_dot_type),
                                    c, m, type, vec_dot_type, GGML_TYPE_F32)) {
                    for (int64_t j = 0; j < cne1; j++) {                // C [cne1][m] -> each token's dst row
                        const struct mmid_row_mapping rm = MMID_MATRIX_ROW(cur_a, j);
                        memcpy((float *) ((char *) dst->data + rm.i1*nb1 + rm.i2*nb2) + ir0_start, c + j*m,
                               m*sizeof(float));
                    }
                    done++;
                } else {
                    ggml_compute_forward_mul_mat_id_one_chunk(dst, src0, src1, ids, cur_a, ir0_start, ir0_end, 0, cne1,
                                                              src0_cur, matrix_rows, row_size, src1_cont, wdata);
                }
                if (nth >= nchunk) {
                    break;
                }
                current_chunk = atomic_fetch_add_explicit(current_chunk_ctr, 1, memory_order_relaxed);
            }
            __atomic_fetch_add(&ggml_moectl_sgemm_chunks, done, __ATOMIC_RELAXED);
            continue;
        }
#endif

"""

# ggml-cpu.c's forward_mul_mat_id for the experts whose type has one of moectl's expert-rows kernels
# (kernels/ggml_rows/rows.h; copied in as ggml-cpu/moectl-rows/): stock ggml computes an expert's rows by vec_dot one
# (weight row, token) pair at a time below 8 routed rows (each pair unpacks the weight block again), and from 8 by its
# tiled kernel (a weight tile unpacked and repacked in memory, then 8 x 16 VNNI micro-tiles); a decode's one row an
# expert by vec_dot (AVX2 for these types). Here an expert with `ggml_moectl_rows_min`..`ggml_moectl_rows_max` routed
# rows (thread 0's per op; by default every one with a row) runs the kernel on chunks of MOECTL_ROWS_CHUNK
# weight rows taken from stock's per-expert chunk counter, every routed token inside (MOECTL_ROWS_TOKENS a call): the
# kernel unpacks each weight block once into registers for all of them. Its activations are the q8_K rows stock
# quantized above (vec_dot's), read in place; each block's integer sums are exact, only the fp32 order over blocks
# differs from vec_dot's (tests/test_ggml_expert_rows.py).
_ROWS_EXPERT = """\
        if (moectl_rows_fn != NULL && cne1 >= moectl_rows_min && cne1 <= moectl_rows_max) {   // moectl patch
            const char *   w0    = (const char *) src0->data + cur_a*nb02;
            const char *   q8    = (const char *) params->wdata;                 // src1 as q8_K rows (above)
            const size_t   q_row = ggml_row_size(vec_dot_type, ne10);
            const int64_t  nchunk = (ne01 + MOECTL_ROWS_CHUNK - 1)/MOECTL_ROWS_CHUNK;
            const block_q8_K * acts[MOECTL_ROWS_TOKENS];
            float *            outs[MOECTL_ROWS_TOKENS];
            int current_chunk = ith;
            atomic_int * current_chunk_ctr = (atomic_int *)(atomic_current_chunk + cur_a);
            int64_t done = 0;
            while (current_chunk < nchunk) {
                const int64_t r0 = (int64_t) current_chunk*MOECTL_ROWS_CHUNK;
                const int64_t m  = MIN(r0 + MOECTL_ROWS_CHUNK, ne01) - r0;
                for (int64_t j0 = 0; j0 < cne1; j0 += MOECTL_ROWS_TOKENS) {
                    const int64_t n = MIN(cne1 - j0, MOECTL_ROWS_TOKENS);
                    for (int64_t j = 0; j < n; j++) {
                        const struct mmid_row_mapping rm = MMID_MATRIX_ROW(cur_a, j0 + j);
                        acts[j] = (const block_q8_K *) (q8 + (rm.i1 % ne11 + rm.i2*ne11)*q_row);
                        outs[j] = (float *) ((char *) dst->data + rm.i1*nb1 + rm.i2*nb2) + r0;
                    }
                    moectl_rows_fn(w0 + r0*nb01, nb01, m, ne00/QK_K, acts, n, outs);
                }
                done++;
                if (nth >= nchunk) {
                    break;
                }
                current_chunk = atomic_fetch_add_explicit(current_chunk_ctr, 1, memory_order_relaxed);
            }
            __atomic_fetch_add(&ggml_moectl_rows_chunks, done, __ATOMIC_RELAXED);
            continue;
        }

"""

# ggml_graph_plan's MUL_MAT_ID work size: the slot always, the sgemm's room where it is on for the op's type.
_SGEMM_PLAN = """\
                        // moectl patch (moectl/kernels/ggml_patch.py): the decision slot, the experts' sgemm room
                        cur += ggml_moectl_sgemm_room(ggml_moectl_expert_sgemm_on() &&
                                                      ggml_moectl_sgemm_type(src0->type) && src1->type != vec_dot_type,
                                                      ids->ne[0]*ids->ne[1], ggml_row_size(vec_dot_type, src1->ne[0]),
                                                      n_tasks);
"""


def _gemv_split(nc: str, x: str, s: str, y: str) -> str:
    """repack.cpp's one-token gemv of `nc` columns (weights at `x`, output at `s`, activations at `y`) group by group
    (`_group_loop`), prefetching ahead; the original call after it is skipped (`continue`) when the patch's path
    ran."""
    return ("            if (ggml_moectl_prefetch_bytes > 0) {"
            "       // moectl patch: group by group, prefetching ahead\n"
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
    # the experts' path decided once an op, by thread 0 before the row mapping's barrier
    ("repack.cpp", "        if (ith == 0) {\n            // initialize matrix_row_counts\n", _EXPERT_MODE, ""),
    # the experts not repacked by tinyBLAS (forward_mul_mat_id): room, decision, gather, chunks; the plan's room
    ("ggml-cpu.c", "    GGML_ASSERT(params->wsize >= (size_t)((char *) wdata_cur - (char *) params->wdata));\n", "",
     _SGEMM_ROOM),
    ("ggml-cpu.c", "    // reset current_chunk\n", _SGEMM_MODE, ""),
    ("ggml-cpu.c", "    for (int cur_a = 0; cur_a < n_as; ++cur_a) {\n", _SGEMM_GATHER, ""),
    ("ggml-cpu.c", "        int chunk_size = 16;\n        if (nr0 == 1 || nr1 == 1) {\n", _SGEMM_EXPERT, ""),
    ("ggml-cpu.c", "                    } break;\n                case GGML_OP_OUT_PROD:\n", _SGEMM_PLAN, ""),
    # the experts with an expert-rows kernel (forward_mul_mat_id, ahead of ggml's tiled kernel); its sources built
    ("ggml-cpu.c", "        // tiled takes over if profitable for this expert (see tiled.h)\n", _ROWS_EXPERT, ""),
    ("CMakeLists.txt", "        ggml-cpu/ops.cpp\n", "",
     "".join(f"        ggml-cpu/moectl-rows/{name}\n" for name in ROWS_SOURCES)),
]



def _rows_files() -> list[Path]:
    """The expert-rows kernels' files copied into the tree: the sources and their header."""
    return [ROWS_DIR / name for name in ("rows.h", *ROWS_SOURCES)]


def key(edits: list[tuple[str, str, str, str]] | None = None) -> str:
    """The patch's identity: a hash of its edits (`EDITS`) and of the expert-rows kernels' files, part of the build's
    directory (kernels/ggml.py)."""
    h = hashlib.sha256(repr(EDITS if edits is None else edits).encode())
    for f in _rows_files():
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:10]


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
    rows = ggml_dir / "src" / "ggml-cpu" / "moectl-rows"
    rows.mkdir(exist_ok=True)
    for f in _rows_files():
        shutil.copyfile(f, rows / f.name)
