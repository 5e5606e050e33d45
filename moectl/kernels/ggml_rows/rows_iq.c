// Expert-rows kernels (rows.h) for the IQ types: IQ4_XS, IQ3_XXS, IQ2_XXS (AVX-512BW; VNNI where built).
//
// The weights are signed (IQ4_XS: kvalues_iq4nl, -127..113; IQ3_XXS / IQ2_XXS: an unsigned grid, 4..62 / 8..43, with a
// sign bit per value) and each 32-value sub-block has its own integer scale. Each weight block of a row is decoded
// ONCE for many tokens, and a block's integer sum is vec_dot's own, sum_sub scale_sub * sum(w a), exact in int32; it
// is scaled in fp32 by the block's d (fp16, times IQ3's 1/4 or IQ2's 1/8: exact powers of two) and the token's q8_K d.
// Two kernels, by how many tokens a call has (the activations are put in the kernel's layout once a call, in a
// per-thread scratch, and shared by every row):
//   tokens in lanes (VNNI, groups of 16 tokens; `rows_lanes`): a vector holds 4 activation bytes of each of 16 tokens;
//     one vpdpbusd multiplies them by 4 weight bytes broadcast (u8: w + bias, the bias taken off through the
//     tokens' sums over each sub-block), 64 products; a sub-block's scale is one int32 multiply for 16 tokens. ggml's
//     tiled micro-kernel has this layout too; here the weights go from the GGUF block to the broadcast with no tile
//     repacked in memory.
//   tokens in vectors (`rows_vectors`: fewer than 6 tokens left over, and builds without VNNI): a row's block is
//     unpacked into eight int16 vectors of w * scale (|w * scale| <= 127 * 32), two rows at a time, and each token's
//     activations (int16) meet them by vpdpwssd (or madd + add), 32 products an instruction: no token lane idles.
// Why the scale is folded as it is: a u8 x s8 dot needs one side unsigned and the sub-block's scale must reach each
// sub-block's sum; in lanes the sum of a sub-block is one vector for 16 tokens (one multiply), in vectors it is spread
// over lanes of a token's vector (so the scale goes into the weights, in int16).
//
// Legend: K = input width (nb blocks of 256), m = weight rows of the chunk, n = tokens routed to the expert,
// G = tokens of a group, c = one of a block's eight 32-value vectors.
#include "rows.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)   // every AVX-512BW CPU has VL

#include <immintrin.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define GGML_COMMON_IMPL_C          // the grids and sign tables as static const, as ggml-cpu's quants.c has them
#include "ggml-common.h"

enum { GROUP = 32 };    // tokens a weight block is unpacked for (vectors): scratch GROUP * K * 2 bytes, 256 KB at 4096

// a thread's scratch, grown on demand and kept for the thread's later calls: the activations in a kernel's layout,
// made once a call and shared by every row. Freed when the thread exits (a pthread key's destructor): ggml built
// without OpenMP runs a graph on a threadpool made for it when the caller gives none, whose threads end with it.
typedef struct { void * p; size_t bytes; } scratch;

enum { VECTORS_SCRATCH, LANES_SCRATCH, SCRATCHES };    // rows_vectors: int16 [G][nb][QK_K]; rows_lanes: lanes_block

static pthread_key_t  scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_free(void * arg) {
    scratch * s = arg;
    for (int i = 0; i < SCRATCHES; ++i) {
        free(s[i].p);
    }
    free(s);
}

static int scratch_key_made;

static void scratch_key_make(void) {
    GGML_ASSERT(pthread_key_create(&scratch_key, scratch_free) == 0);
    scratch_key_made = 1;
}

// the library unloaded (dlclose) while threads that called it live: their destructor would point into unmapped code,
// so the key goes first (their scratches are then left, not freed)
static void __attribute__((destructor)) scratch_key_delete(void) {
    if (scratch_key_made) {
        pthread_key_delete(scratch_key);
    }
}

static scratch * thread_scratch(int which) {
    pthread_once(&scratch_once, scratch_key_make);
    scratch * s = pthread_getspecific(scratch_key);
    if (s == NULL) {
        s = calloc(SCRATCHES, sizeof(scratch));
        GGML_ASSERT(s != NULL && pthread_setspecific(scratch_key, s) == 0);
    }
    return s + which;
}

static void * scratch_for(scratch * s, size_t bytes) {
    if (bytes > s->bytes || s->p == NULL) {     // 0 bytes (K = 0) too: a valid pointer
        free(s->p);
        s->p = aligned_alloc(64, (bytes + 64) / 64 * 64);
        s->bytes = s->p != NULL ? bytes : 0;
    }
    GGML_ASSERT(s->p != NULL && "moectl rows: no memory for the activations' scratch");   // as ggml's allocations
    return s->p;
}

// a block's fp16 d (F16C where built, as ggml's own conversion)
static inline __attribute__((always_inline)) float fp16_to_fp32(ggml_fp16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return ggml_fp16_to_fp32(h);
#endif
}

// ---- unpacking one weight block into w[c] = value * scale (int16, 32 per vector) and its fp32 d ----

// a 64-value chunk of signed bytes -> two int16 vectors times the two sub-blocks' scales
static inline __attribute__((always_inline)) void widen_scaled(__m512i v8, int16_t s0, int16_t s1, __m512i * w) {
    w[0] = _mm512_mullo_epi16(_mm512_cvtepi8_epi16(_mm512_castsi512_si256(v8)), _mm512_set1_epi16(s0));
    w[1] = _mm512_mullo_epi16(_mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(v8, 1)), _mm512_set1_epi16(s1));
}

// the sign bits of a block's 32 groups of 8 (IQ3_XXS / IQ2_XXS): `words` holds the 8 sub-blocks' uint32 (4 x 7 bits
// a sub-block, the 8th bit of each group its parity: ksigns_iq2xs[i] = i | parity(i) << 7); mask[h] covers values
// 64h..64h+63 (bit 8g + j: value j of group g), the layout _mm512_mask_sub_epi8 negates by; ls[k] = 2 (word k >> 28)
// + 1, the sub-blocks' scales
static inline __attribute__((always_inline)) void sign_masks(__m256i words, __mmask64 * mask, int16_t * ls) {
    const __m256i scale = _mm256_add_epi32(_mm256_slli_epi32(_mm256_srli_epi32(words, 28), 1), _mm256_set1_epi32(1));
    _mm_storeu_si128((__m128i *) ls, _mm256_cvtepi32_epi16(scale));
    const __m512i shifts = _mm512_set_epi32(21, 14, 7, 0, 21, 14, 7, 0, 21, 14, 7, 0, 21, 14, 7, 0);
    const __m512i lo = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i m7 = _mm512_set1_epi32(127);
    const __m512i one = _mm512_set1_epi32(1);
    const __m512i all = _mm512_castsi256_si512(words);
    uint64_t bytes[4];
#pragma GCC unroll 8
    for (int half = 0; half < 2; ++half) {      // sub-blocks 4 half .. 4 half + 3: 16 groups, a group a lane
        const __m512i idx = _mm512_add_epi32(lo, _mm512_set1_epi32(4 * half));
        __m512i s = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(idx, all), shifts), m7);
        __m512i p = _mm512_xor_si512(s, _mm512_srli_epi32(s, 4));
        p = _mm512_xor_si512(p, _mm512_srli_epi32(p, 2));
        p = _mm512_xor_si512(p, _mm512_srli_epi32(p, 1));
        s = _mm512_or_si512(s, _mm512_slli_epi32(_mm512_and_si512(p, one), 7));
        _mm_storeu_si128((__m128i *) bytes + half, _mm512_cvtepi32_epi8(s));
    }
#pragma GCC unroll 8
    for (int h = 0; h < 4; ++h) {
        mask[h] = (__mmask64) bytes[h];
    }
}

// the 8 sub-blocks' scales, 6 bits - 32: low 4 bits nibble k of scales_l, high 2 bits bits 2k, 2k + 1 of scales_h
static inline __attribute__((always_inline)) void iq4_xs_scales(const block_iq4_xs * x, int16_t * ls) {
    uint32_t low;
    memcpy(&low, x->scales_l, sizeof(low));
#if defined(__BMI2__)
    const uint64_t bytes = _pdep_u64(low, 0x0f0f0f0f0f0f0f0full) | _pdep_u64(x->scales_h, 0x3030303030303030ull);
#else
    uint64_t bytes = 0;
    for (int k = 0; k < 8; ++k) {
        bytes |= (uint64_t) (((low >> 4 * k) & 0xf) | (((x->scales_h >> 2 * k) & 3) << 4)) << 8 * k;
    }
#endif
    _mm_storeu_si128((__m128i *) ls, _mm_sub_epi16(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long) bytes)),
                                                   _mm_set1_epi16(32)));
}

// IQ4_XS: a 64-byte half h of qs is sub-blocks 4h..4h+3 (16 bytes each: byte j's low nibble value j, its high nibble
// value 16 + j). Read as 32 words (word u = bytes 2u, 2u + 1 of sub-block s = u / 8, i = u % 8), its four nibbles are
// values 2i, 2i + 1 (low nibbles) and 16 + 2i, 17 + 2i (high) of sub-block s: four int16 vectors, each looked up in one
// vpermt2w from the four sub-blocks' tables kvalues * scale (64 int16 entries: nibble + 16 s). So the scale costs a
// multiply a table, not a vector, and no byte is widened; the activations are put in the same order once a call
// (`widen_iq4_xs`): w[4h + k], k = 0..3, lane 8s + i <-> value 32 (4h + s) + (2i, 2i + 1, 16 + 2i, 17 + 2i)[k].
static const int16_t iq4_xs_kvalues2[32] __attribute__((aligned(64))) = {
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
};

static inline __attribute__((always_inline)) float unpack_iq4_xs(const block_iq4_xs * x, __m512i * w) {
    const __m512i kv2 = _mm512_load_si512(iq4_xs_kvalues2);                     // kvalues_iq4nl twice, int16
    const __m512i m4 = _mm512_set1_epi16(0x0f);
    const __m512i sub = _mm512_set_epi64(0x0030003000300030ll, 0x0030003000300030ll, 0x0020002000200020ll,
                                         0x0020002000200020ll, 0x0010001000100010ll, 0x0010001000100010ll, 0, 0);
    const __m512i pair = _mm512_set_epi64(0x0001000100010001ll, 0x0001000100010001ll, 0x0001000100010001ll,
                                          0x0001000100010001ll, 0, 0, 0, 0);       // [0 x 16, 1 x 16]
    int16_t scales[8];
    iq4_xs_scales(x, scales);
    const __m512i ls = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *) scales));
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
        // tables of sub-blocks (4h, 4h + 1) and (4h + 2, 4h + 3): kvalues * scale, |.| <= 127 * 32
        const __m512i t01 = _mm512_mullo_epi16(kv2, _mm512_permutexvar_epi16(
            _mm512_add_epi16(pair, _mm512_set1_epi16((short) (4 * h))), ls));
        const __m512i t23 = _mm512_mullo_epi16(kv2, _mm512_permutexvar_epi16(
            _mm512_add_epi16(pair, _mm512_set1_epi16((short) (4 * h + 2))), ls));
        const __m512i q = _mm512_loadu_si512(x->qs + 64 * h);
        // (q & 15) | 16 s: ternary logic (a & b) | c
        w[4 * h + 0] = _mm512_permutex2var_epi16(t01, _mm512_ternarylogic_epi32(q, m4, sub, 0xea), t23);
        w[4 * h + 1] = _mm512_permutex2var_epi16(t01, _mm512_ternarylogic_epi32(_mm512_srli_epi16(q, 8), m4, sub, 0xea),
                                                 t23);
        w[4 * h + 2] = _mm512_permutex2var_epi16(t01, _mm512_ternarylogic_epi32(_mm512_srli_epi16(q, 4), m4, sub, 0xea),
                                                 t23);
        w[4 * h + 3] = _mm512_permutex2var_epi16(t01, _mm512_or_si512(_mm512_srli_epi16(q, 12), sub), t23);
    }
    return fp16_to_fp32(x->d);
}

// a q8_K block's 256 values as int16 in `unpack_iq4_xs`'s order: from the natural sub-block vectors n_t, per pair
// (n_4h, n_4h+1) P = [even of 0..15 of each, odd of 0..15 of each] and Q the same of 16..31, then halves of the two
// pairs' P and Q side by side
static const int16_t iq4_xs_lo_idx[32] __attribute__((aligned(64))) = {
    0, 2, 4, 6, 8, 10, 12, 14, 32, 34, 36, 38, 40, 42, 44, 46,
    1, 3, 5, 7, 9, 11, 13, 15, 33, 35, 37, 39, 41, 43, 45, 47,
};

static inline __attribute__((always_inline)) void widen_iq4_xs(const int8_t * q, __m512i * a) {
    const __m512i lo = _mm512_load_si512(iq4_xs_lo_idx);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    __m512i n[8], p[4], r[4];
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
        n[t] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *) (q + 32 * t)));
    }
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {               // pair k: sub-blocks 2k, 2k + 1
        p[k] = _mm512_permutex2var_epi16(n[2 * k], lo, n[2 * k + 1]);
        r[k] = _mm512_permutex2var_epi16(n[2 * k], hi, n[2 * k + 1]);
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
        a[4 * h + 0] = _mm512_shuffle_i64x2(p[2 * h], p[2 * h + 1], 0x44);
        a[4 * h + 1] = _mm512_shuffle_i64x2(p[2 * h], p[2 * h + 1], 0xee);
        a[4 * h + 2] = _mm512_shuffle_i64x2(r[2 * h], r[2 * h + 1], 0x44);
        a[4 * h + 3] = _mm512_shuffle_i64x2(r[2 * h], r[2 * h + 1], 0xee);
    }
}

// IQ3_XXS / IQ2_XXS decoded: v[h] = values 64h..64h+63 as signed bytes (grid entries, signs applied), ls[k] = 2 s + 1
static inline __attribute__((always_inline)) float decode_iq3_xxs(const block_iq3_xxs * x, __m512i * v, int16_t * ls) {
    const uint8_t * gas = x->qs + QK_K / 4;     // a sub-block's uint32: 4 x 7 sign bits, scale in the top 4
    __mmask64 neg[4];
    sign_masks(_mm256_loadu_si256((const __m256i *) gas), neg, ls);
#pragma GCC unroll 8
    for (int h = 0; h < 4; ++h) {               // 64 values: 16 grid entries of 4 bytes, index i -> values 4i..4i+3
        const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *) (x->qs + 16 * h)));
        const __m512i g = _mm512_i32gather_epi32(idx, (const void *) iq3xxs_grid, 4);
        v[h] = _mm512_mask_sub_epi8(g, neg[h], _mm512_setzero_si512(), g);
    }
    return 0.25f * fp16_to_fp32(x->d);
}

static inline __attribute__((always_inline)) float decode_iq2_xxs(const block_iq2_xxs * x, __m512i * v, int16_t * ls) {
    // per sub-block: 4 grid index bytes, then a uint32 of 4 x 7 sign bits + scale
    const __m512i all = _mm512_loadu_si512(x->qs);
    const __m512i odd = _mm512_set_epi32(15, 13, 11, 9, 7, 5, 3, 1, 15, 13, 11, 9, 7, 5, 3, 1);
    __mmask64 neg[4];
    sign_masks(_mm512_castsi512_si256(_mm512_permutexvar_epi32(odd, all)), neg, ls);
    const __m128i pick = _mm_set_epi8(-1, -1, -1, -1, -1, -1, -1, -1, 11, 10, 9, 8, 3, 2, 1, 0);
#pragma GCC unroll 8
    for (int h = 0; h < 4; ++h) {               // 64 values: 8 grid entries of 8 bytes, sub-blocks 2h and 2h + 1
        const __m128i bytes = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *) (x->qs + 8 * h)), pick);
        const __m512i g = _mm512_i32gather_epi64(_mm256_cvtepu8_epi32(bytes), (const void *) iq2xxs_grid, 8);
        v[h] = _mm512_mask_sub_epi8(g, neg[h], _mm512_setzero_si512(), g);
    }
    return 0.125f * fp16_to_fp32(x->d);
}

// the grid types' block decoded (as decode_iq3_xxs / decode_iq2_xxs)
static inline __attribute__((always_inline)) float decode_grid(enum ggml_type type, const uint8_t * block, __m512i * v,
                                                                int16_t * ls) {
    return type == GGML_TYPE_IQ3_XXS ? decode_iq3_xxs((const block_iq3_xxs *) block, v, ls)
                                     : decode_iq2_xxs((const block_iq2_xxs *) block, v, ls);
}

// IQ3_XXS / IQ2_XXS for the vectors' kernel: each 64-value chunk widened to int16 and multiplied by its scales
static inline __attribute__((always_inline)) float unpack_grid(enum ggml_type type, const uint8_t * block, __m512i * w) {
    __m512i v[4];
    int16_t ls[8];
    const float d = decode_grid(type, block, v, ls);
#pragma GCC unroll 4
    for (int h = 0; h < 4; ++h) {
        widen_scaled(v[h], ls[2 * h], ls[2 * h + 1], w + 2 * h);
    }
    return d;
}

// ---- the products ----

// the weights stream from memory (an expert's rows are read once a call): the block `ahead` rows on is fetched while
// this one is computed (no fault past the chunk's end: a prefetch never faults)
enum { PREFETCH_ROWS_VECTORS = 2, PREFETCH_ROWS_LANES = 4 };

static inline __attribute__((always_inline)) void prefetch_block(const uint8_t * x, size_t bytes) {
    for (size_t o = 0; o < bytes; o += 64) {
        _mm_prefetch((const char *) x + o, _MM_HINT_T0);
    }
    _mm_prefetch((const char *) x + bytes - 1, _MM_HINT_T0);
}

static inline __attribute__((always_inline)) __m512i dot16(__m512i acc, __m512i w, __m512i a) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, w, a);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, a));
#endif
}

static inline __attribute__((always_inline)) float unpack(enum ggml_type type, const uint8_t * block, __m512i * w) {
    switch (type) {
        case GGML_TYPE_IQ4_XS:  return unpack_iq4_xs((const block_iq4_xs *) block, w);
        default:                return unpack_grid(type, block, w);
    }
}

// one group of G <= GROUP tokens: a16 [G][nb][QK_K] int16, acts / out the group's own
static inline __attribute__((always_inline)) void rows_group(enum ggml_type type, size_t block_bytes,
        const uint8_t * w, size_t row_bytes, int64_t m, int64_t nb, const block_q8_K * const * acts, int64_t G,
        const int16_t * a16, float * const * out) {
    __m512 acc[GROUP][2];                       // fp32 per (token, row of the pair), over blocks
    for (int64_t r = 0; r < m; r += 2) {
        const int two = r + 1 < m;
        const uint8_t * row0 = w + r * row_bytes;
        const uint8_t * row1 = two ? row0 + row_bytes : row0;    // an odd last row: computed twice, stored once
        for (int64_t t = 0; t < G; ++t) {
            acc[t][0] = acc[t][1] = _mm512_setzero_ps();
        }
        for (int64_t b = 0; b < nb; ++b) {
            __m512i w0[8], w1[8];
            prefetch_block(row0 + PREFETCH_ROWS_VECTORS * row_bytes + b * block_bytes, block_bytes);
            prefetch_block(row1 + PREFETCH_ROWS_VECTORS * row_bytes + b * block_bytes, block_bytes);
            const float d0 = unpack(type, row0 + b * block_bytes, w0);
            const float d1 = unpack(type, row1 + b * block_bytes, w1);
            for (int64_t t = 0; t < G; ++t) {
                const __m512i * a = (const __m512i *) (a16 + (t * nb + b) * QK_K);
                __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
#pragma GCC unroll 8
                for (int c = 0; c < 8; ++c) {
                    const __m512i ac = _mm512_load_si512(a + c);
                    s0 = dot16(s0, w0[c], ac);
                    s1 = dot16(s1, w1[c], ac);
                }
                const float da = acts[t][b].d;
                acc[t][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_set1_ps(d0 * da), acc[t][0]);
                acc[t][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_set1_ps(d1 * da), acc[t][1]);
            }
        }
        for (int64_t t = 0; t < G; ++t) {
            out[t][r] = _mm512_reduce_add_ps(acc[t][0]);
            if (two) {
                out[t][r + 1] = _mm512_reduce_add_ps(acc[t][1]);
            }
        }
    }
}

// tokens a vector: each token's activations in int16 vectors, a row pair's unpacked weights in registers
static inline __attribute__((always_inline)) void rows_vectors(enum ggml_type type, size_t block_bytes, const void * w,
        size_t row_bytes, int64_t m, int64_t nb, const block_q8_K * const * acts, int64_t n, float * const * out) {
    const int64_t groups = (n + GROUP - 1) / GROUP;
    const int64_t per = (n + groups - 1) / groups;                  // balanced: 33 tokens are 17 + 16, not 32 + 1
    int16_t * a16 = scratch_for(thread_scratch(VECTORS_SCRATCH), (size_t) per * nb * QK_K * sizeof(int16_t));
    for (int64_t j0 = 0; j0 < n; j0 += per) {
        const int64_t G = n - j0 < per ? n - j0 : per;
        for (int64_t t = 0; t < G; ++t) {
            for (int64_t b = 0; b < nb; ++b) {
                const int8_t * q = acts[j0 + t][b].qs;
                __m512i * a = (__m512i *) (a16 + (t * nb + b) * QK_K);
                if (type == GGML_TYPE_IQ4_XS) {
                    widen_iq4_xs(q, a);
                } else {
#pragma GCC unroll 8
                    for (int c = 0; c < 8; ++c) {
                        a[c] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *) (q + 32 * c)));
                    }
                }
            }
        }
        rows_group(type, block_bytes, (const uint8_t *) w, row_bytes, m, nb, acts + j0, G, a16, out + j0);
    }
}

#if defined(__AVX512VNNI__)
// ---- tokens in lanes (VNNI): 16 tokens a vector, a weight's 4 bytes broadcast ----
//
// From 16 tokens on, the tokens go in the lanes (as ggml's tiled micro-kernel has them): one vpdpbusd multiplies 4
// weight bytes (broadcast, biased to u8: w + BIAS) by 4 activation bytes of each of 16 tokens, 64 products, twice
// vpdpwssd's 32, and a sub-block's scale is one int32 multiply for 16 tokens. The activations are packed once a call
// into lanes_block: q[kg][t] = token t's 4 bytes kg (in the weights' decoded order), bias[s][t] = BIAS * the
// token's sum over sub-block s (what w + BIAS adds, taken off before the scale), d[t] = its q8_K d.
// Legend here: kg = a group of 4 values (64 a block), s = sub-block (8 a block), t = a token's lane.
enum { LANES = 16, LANE_ROWS = 4, LANE_GROUPS = 4, LANES_FROM = 6 };

typedef struct {
    uint32_t q[QK_K / 4][LANES];
    int32_t  bias[QK_K / 32][LANES];
    float    d[LANES];
} lanes_block;

static inline __attribute__((always_inline)) int lanes_bias(enum ggml_type type) {
    return type == GGML_TYPE_IQ4_XS ? 128 : 64;     // |kvalues| <= 127; |IQ3 grid| <= 62, |IQ2 grid| <= 43; 2^k
}

// the k-th (of 8) group of 4 of sub-block s in the decoded order: IQ4_XS's half h = s / 4 holds the low nibbles of
// its 4 sub-blocks (16 values each), then their high nibbles; IQ3 / IQ2 decode in the natural order
static inline __attribute__((always_inline)) int lanes_kg(enum ggml_type type, int s, int k) {
    return type == GGML_TYPE_IQ4_XS ? 32 * (s / 4) + 16 * (k / 4) + 4 * (s % 4) + k % 4 : 8 * s + k;
}

// a row's block decoded as u8 w + BIAS into wb[kg] (4 bytes each), its scales ls[s] and d
static inline __attribute__((always_inline)) float lanes_unpack(enum ggml_type type, const uint8_t * block,
                                                                 uint32_t * wb, int16_t * ls) {
    if (type == GGML_TYPE_IQ4_XS) {
        const block_iq4_xs * x = (const block_iq4_xs *) block;
        const __m512i values = _mm512_add_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *) kvalues_iq4nl)),
                                               _mm512_set1_epi8((char) 0x80));
        const __m512i m4 = _mm512_set1_epi8(0x0f);
        iq4_xs_scales(x, ls);
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
            const __m512i q = _mm512_loadu_si512(x->qs + 64 * h);
            _mm512_store_si512(wb + 32 * h, _mm512_shuffle_epi8(values, _mm512_and_si512(q, m4)));
            _mm512_store_si512(wb + 32 * h + 16,
                               _mm512_shuffle_epi8(values, _mm512_and_si512(_mm512_srli_epi16(q, 4), m4)));
        }
        return fp16_to_fp32(x->d);
    }
    __m512i v[4];
    const float d = decode_grid(type, block, v, ls);
#pragma GCC unroll 4
    for (int h = 0; h < 4; ++h) {
        _mm512_store_si512(wb + 16 * h, _mm512_add_epi8(v[h], _mm512_set1_epi8(64)));
    }
    return d;
}

// a 16 x 16 matrix of dwords transposed in registers: r[i] = row i in, column i out
static inline __attribute__((always_inline)) void transpose16(__m512i * r) {
    __m512i t[16];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {               // a 128-bit lane L: [r2i[4L], r2i+1[4L], r2i[4L+1], r2i+1[4L+1]] (+2)
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {               // r[4i + k] lane L: column 4L + k of rows 4i..4i+3
        r[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {               // column 4L + k: lane L of r[k], r[4 + k], r[8 + k], r[12 + k]
        const __m512i a = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x88);          // lanes 0, 2 | 0, 2
        const __m512i b = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xdd);          // lanes 1, 3 | 1, 3
        const __m512i c = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x88);
        const __m512i d = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xdd);
        t[k] = _mm512_shuffle_i32x4(a, c, 0x88);
        t[8 + k] = _mm512_shuffle_i32x4(a, c, 0xdd);
        t[4 + k] = _mm512_shuffle_i32x4(b, d, 0x88);
        t[12 + k] = _mm512_shuffle_i32x4(b, d, 0xdd);
    }
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
        r[i] = t[i];
    }
}

// tokens acts[0..g-1] (g <= LANES; lanes from g on: zeros) packed into p[0..nb-1]: a block's 64 dwords of each token
// (in the decoded order) as four 16 x 16 tiles [token][kg], transposed to [kg][token]
static void lanes_pack(enum ggml_type type, const block_q8_K * const * acts, int64_t g, int64_t nb, lanes_block * p) {
    const __m512i lo = _mm512_setr_epi64(0, 1, 4, 5, 8, 9, 12, 13);       // 16-byte pieces 0, 2 of each source
    const __m512i hi = _mm512_setr_epi64(2, 3, 6, 7, 10, 11, 14, 15);     // pieces 1, 3
    const int bias = lanes_bias(type);
    for (int64_t b = 0; b < nb; ++b) {
        for (int tile = 0; tile < 4; ++tile) {  // kg 16 tile .. 16 tile + 15: bytes 64 tile.. of the decoded order
            __m512i r[LANES];
            for (int t = 0; t < LANES; ++t) {
                if (t >= g) {
                    r[t] = _mm512_setzero_si512();
                } else if (type == GGML_TYPE_IQ4_XS) {  // half h: [low 16 of sub-blocks 4h..4h+3, high 16 of them]
                    const int8_t * q = acts[t][b].qs + 128 * (tile / 2);
                    r[t] = _mm512_permutex2var_epi64(_mm512_loadu_si512(q), tile % 2 ? hi : lo,
                                                     _mm512_loadu_si512(q + 64));
                } else {
                    r[t] = _mm512_loadu_si512(acts[t][b].qs + 64 * tile);
                }
            }
            transpose16(r);
            for (int k = 0; k < 16; ++k) {
                _mm512_store_si512(p[b].q[16 * tile + k], r[k]);
            }
        }
        // bias * each token's sum over sub-block s: the packed bytes summed by vpdpbusd (the same sums as q8_K's
        // bsums, here already in the lanes), times bias = 2^6 or 2^7
        const int shift = bias == 128 ? 7 : 6;
        for (int s = 0; s < QK_K / 32; ++s) {
            __m512i sum = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int k = 0; k < 8; ++k) {
                sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi8(1), _mm512_load_si512(p[b].q[lanes_kg(type, s, k)]));
            }
            _mm512_store_si512(p[b].bias[s], _mm512_slli_epi32(sum, shift));
        }
        for (int t = 0; t < LANES; ++t) {
            p[b].d[t] = t < g ? acts[t][b].d : 0.0f;
        }
    }
}

// G <= LANE_GROUPS groups of 16 tokens (p: [G][nb]; the last holds g_last tokens), every row; LANE_ROWS rows at a time
static inline __attribute__((always_inline)) void rows_lanes_groups(enum ggml_type type, size_t block_bytes,
        const uint8_t * w, size_t row_bytes, int64_t m, int64_t nb, const lanes_block * p, int G, int64_t g_last,
        float * const * out) {
    for (int64_t r = 0; r < m; r += LANE_ROWS) {
        const int here = m - r < LANE_ROWS ? (int) (m - r) : LANE_ROWS;
        const uint8_t * row[LANE_ROWS];
        for (int i = 0; i < LANE_ROWS; ++i) {
            row[i] = w + (r + (i < here ? i : here - 1)) * row_bytes;     // past the last: the last again, not stored
        }
        __m512 acc[LANE_GROUPS][LANE_ROWS];
        for (int g = 0; g < G; ++g) {
            for (int i = 0; i < LANE_ROWS; ++i) {
                acc[g][i] = _mm512_setzero_ps();
            }
        }
        for (int64_t b = 0; b < nb; ++b) {
            uint32_t wb[LANE_ROWS][QK_K / 4] __attribute__((aligned(64)));
            int16_t ls[LANE_ROWS][8];
            float dw[LANE_ROWS];
#pragma GCC unroll 4
            for (int i = 0; i < LANE_ROWS; ++i) {
                prefetch_block(row[i] + PREFETCH_ROWS_LANES * row_bytes + b * block_bytes, block_bytes);
                dw[i] = lanes_unpack(type, row[i] + b * block_bytes, wb[i], ls[i]);
            }
            for (int g = 0; g < G; ++g) {
                const lanes_block * pb = p + g * nb + b;
                __m512i tot[LANE_ROWS];
#pragma GCC unroll 4
                for (int i = 0; i < LANE_ROWS; ++i) {
                    tot[i] = _mm512_setzero_si512();
                }
#pragma GCC unroll 1
                for (int s = 0; s < QK_K / 32; ++s) {
                    __m512i raw[LANE_ROWS];
#pragma GCC unroll 4
                    for (int i = 0; i < LANE_ROWS; ++i) {
                        raw[i] = _mm512_setzero_si512();
                    }
#pragma GCC unroll 8
                    for (int k = 0; k < 8; ++k) {
                        const int kg = lanes_kg(type, s, k);
                        const __m512i a = _mm512_load_si512(pb->q[kg]);
#pragma GCC unroll 4
                        for (int i = 0; i < LANE_ROWS; ++i) {
                            raw[i] = _mm512_dpbusd_epi32(raw[i], _mm512_set1_epi32((int) wb[i][kg]), a);
                        }
                    }
                    const __m512i bias = _mm512_load_si512(pb->bias[s]);
#pragma GCC unroll 4
                    for (int i = 0; i < LANE_ROWS; ++i) {
                        tot[i] = _mm512_add_epi32(tot[i], _mm512_mullo_epi32(_mm512_sub_epi32(raw[i], bias),
                                                                             _mm512_set1_epi32(ls[i][s])));
                    }
                }
                const __m512 da = _mm512_load_ps(pb->d);
#pragma GCC unroll 4
                for (int i = 0; i < LANE_ROWS; ++i) {
                    acc[g][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot[i]), _mm512_mul_ps(da, _mm512_set1_ps(dw[i])),
                                                acc[g][i]);
                }
            }
        }
        for (int g = 0; g < G; ++g) {
            const int64_t tokens = g == G - 1 ? g_last : LANES;
            for (int i = 0; i < here; ++i) {
                float y[LANES] __attribute__((aligned(64)));
                _mm512_store_ps(y, acc[g][i]);
                for (int64_t t = 0; t < tokens; ++t) {
                    out[g * LANES + t][r + i] = y[t];
                }
            }
        }
    }
}

// the tokens from 0 in groups of 16, LANE_GROUPS groups at a time (weights unpacked once for them); returns how many
// it took: every full group, and a last part of LANES_FROM tokens or more (fewer: the vectors' kernel is cheaper)
static inline __attribute__((always_inline)) int64_t rows_lanes(enum ggml_type type, size_t block_bytes,
        const void * w, size_t row_bytes, int64_t m, int64_t nb, const block_q8_K * const * acts, int64_t n,
        float * const * out) {
    const int64_t taken = n % LANES >= LANES_FROM ? n : n / LANES * LANES;
    if (taken == 0) {
        return 0;
    }
    lanes_block * p = scratch_for(thread_scratch(LANES_SCRATCH), (size_t) LANE_GROUPS * nb * sizeof(lanes_block));
    for (int64_t j0 = 0; j0 < taken; j0 += LANE_GROUPS * LANES) {
        const int64_t tokens = taken - j0 < LANE_GROUPS * LANES ? taken - j0 : LANE_GROUPS * LANES;
        const int G = (int) ((tokens + LANES - 1) / LANES);
        for (int g = 0; g < G; ++g) {
            const int64_t count = tokens - g * LANES < LANES ? tokens - g * LANES : LANES;
            lanes_pack(type, acts + j0 + g * LANES, count, nb, p + g * nb);
        }
        rows_lanes_groups(type, block_bytes, (const uint8_t *) w, row_bytes, m, nb, p, G, tokens - (G - 1) * LANES,
                          out + j0);
    }
    return taken;
}
#endif

static inline __attribute__((always_inline)) void rows(enum ggml_type type, size_t block_bytes, const void * w,
        size_t row_bytes, int64_t m, int64_t nb, const block_q8_K * const * acts, int64_t n, float * const * out) {
    if (m <= 0 || n <= 0) {
        return;
    }
#if defined(__AVX512VNNI__)
    const int64_t done = rows_lanes(type, block_bytes, w, row_bytes, m, nb, acts, n, out);
#else
    const int64_t done = 0;
#endif
    if (done < n) {
        rows_vectors(type, block_bytes, w, row_bytes, m, nb, acts + done, n - done, out + done);
    }
}

static void rows_iq4_xs(const void * w, size_t row_bytes, int64_t m, int64_t nb, const block_q8_K * const * acts,
                        int64_t n, float * const * out) {
    rows(GGML_TYPE_IQ4_XS, sizeof(block_iq4_xs), w, row_bytes, m, nb, acts, n, out);
}

static void rows_iq3_xxs(const void * w, size_t row_bytes, int64_t m, int64_t nb, const block_q8_K * const * acts,
                         int64_t n, float * const * out) {
    rows(GGML_TYPE_IQ3_XXS, sizeof(block_iq3_xxs), w, row_bytes, m, nb, acts, n, out);
}

static void rows_iq2_xxs(const void * w, size_t row_bytes, int64_t m, int64_t nb, const block_q8_K * const * acts,
                         int64_t n, float * const * out) {
    rows(GGML_TYPE_IQ2_XXS, sizeof(block_iq2_xxs), w, row_bytes, m, nb, acts, n, out);
}

ggml_moectl_rows_fn ggml_moectl_rows_iq(enum ggml_type type) {
    switch (type) {
        case GGML_TYPE_IQ4_XS:  return rows_iq4_xs;
        case GGML_TYPE_IQ3_XXS: return rows_iq3_xxs;
        case GGML_TYPE_IQ2_XXS: return rows_iq2_xxs;
        default:                return NULL;
    }
}

#else   // no AVX-512BW (and VL) in this build: ggml's own path

ggml_moectl_rows_fn ggml_moectl_rows_iq(enum ggml_type type) {
    (void) type;
    return NULL;
}

#endif
