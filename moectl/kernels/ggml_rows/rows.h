// moectl's expert-rows products for ggml's CPU backend (issue 42: prefill of the encodings ggml neither repacks nor
// runs through tinyBLAS). Copied into the patched ggml tree (kernels/ggml_patch.py) as ggml/src/ggml-cpu/moectl-rows/
// and compiled into libggml-cpu with the build's own ISA flags (native: -march=native; MOECTL_GGML_ISA=avx2: no
// AVX-512, so the kernels below that need it are absent and ggml's own path runs).
//
// Why: for an expert with a few routed rows, stock mul_mat_id computes each (weight row, token) pair with vec_dot,
// unpacking the weight block again for every token (Q5_K / Q6_K / Q3_K / IQ types: AVX2 only on x86); from 8 rows ggml's
// tiled kernel unpacks a weight tile into memory, repacks it and runs 8 x 16 VNNI micro-tiles (perf: the unpack and
// repack took as long as the products on a Mixtral Q5_K_M prefill). These kernels unpack a weight block once into
// registers and use it for every routed token.
//
// Legend: K = input width (nb blocks of 256), m = weight rows of the chunk, n = tokens routed to the expert.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "ggml.h"

#define GGML_COMMON_DECL_C
#include "ggml-common.h"

#ifdef __cplusplus
extern "C" {
#endif

// out[j][r] = W[r] . act_j for r < m, j < n: W's rows of nb blocks of its type, `row_bytes` apart, from `w` (an
// expert's first row of the chunk); act_j = acts[j], a q8_K row of nb blocks (ggml's own quantize_row_q8_K, as
// vec_dot_type of the K-quants and IQ types); out[j] points at token j's output for the chunk's first row.
// Each block's integer sums are exact (as ggml's vec_dot's), scaled by the block's fp16 scales and the activation's d
// in fp32; only the order of the fp32 sums over blocks differs from vec_dot's.
typedef void (*ggml_moectl_rows_fn)(const void * w, size_t row_bytes, int64_t m, int64_t nb,
                                    const block_q8_K * const * acts, int64_t n, float * const * out);

// The kernel for `type` on this build, or NULL (no kernel for the type, or the build's ISA lacks what it needs):
// the dispatch (rows.c) asks each family's file in turn.
ggml_moectl_rows_fn ggml_moectl_rows_kernel(enum ggml_type type);
ggml_moectl_rows_fn ggml_moectl_rows_k(enum ggml_type type);     // rows_k.c: Q5_K, Q6_K, Q3_K
ggml_moectl_rows_fn ggml_moectl_rows_iq(enum ggml_type type);    // rows_iq.c: IQ4_XS, IQ2_XXS, IQ3_XXS

#ifdef __cplusplus
}
#endif
