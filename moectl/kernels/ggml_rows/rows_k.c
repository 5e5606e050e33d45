// Expert-rows kernels (rows.h) for the K-quants ggml does not repack on x86: Q5_K, Q6_K, Q3_K.
//
// Why: ggml's vec_dot for these types (AVX2 only) unpacks a weight block for every (row, token) pair. Here the
// blocks of two weight rows are unpacked once into registers, side by side: chunk k (weights 32k .. 32k + 31) of
// row 0 in a zmm's low 32 bytes and of row 1 in its high 32, with int16 scale vectors to match. Each token of a
// group then costs, for both rows, eight vpmaddubsw (u8 weight x s8 activation, the activation's 32 bytes broadcast
// to both halves -> int16 pairs) and eight vpdpwssd (x the pair's scale -> int32; vpmaddwd + vpaddd on plain
// AVX-512BW), ending in one zmm whose lanes 0-7 are row 0's and 8-15 row 1's: one conversion and one fma for both.
//
// The same integer sums per block as ggml's vec_dot (arch/x86/quants.c), only split over int32 lanes:
//   Q6_K: sum_g sc_g * sum_{l in g} q_l a_l - 32 * sum_g sc_g * bsum_g      (q in 0..63, 16 groups of 16, sc int8)
//   Q3_K: sum_g sc_g * sum_{l in g} u_l a_l -  4 * sum_g sc_g * bsum_g      (u = q2 + 4 hbit in 0..7: q3 = u - 4,
//                                                                           sc = 6-bit - 32)
//   Q5_K: sum_s sc_s * sum_{l in s} q_l a_l, and the mins sum_s mn_s * (bsum_2s + bsum_2s+1)  (8 subblocks of 32)
// The offsets ride on the q8_K bsums (vpmaddwd with -32 sc / -4 sc, in the same int32 lanes); Q5_K's mins are a
// second vpmaddwd, scaled by -dmin. No int16 saturates: |q a| pairs <= 2 * 63 * 128.
// Then d_x * d_a (fp32, as ggml's d) times the lanes, accumulated over blocks in fp32 lanes and summed per output at
// the end: only that fp32 order differs from vec_dot's.
//
// Legend: K = input width (nb blocks of 256), m = weight rows of the chunk, n = tokens routed to the expert,
// G = tokens of a group (ROWS_G), k = a 32-weight chunk of a block (0..7), p = an int16 lane (0..31: p / 16 the row).
#include "rows.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

#ifdef __AVX512VNNI__
#define ROWS_DPW(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)
#else
#define ROWS_DPW(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
#endif

#define ROWS_INLINE static inline __attribute__((always_inline))

// Tokens whose accumulators a row pair holds at a time (on the stack: G zmm = 4 KB; a block of their q8_K rows, 18 KB,
// stays in L1 across a pair's tokens); more tokens: more groups, each unpacking the row pair's blocks again (once a
// group, not once a token).
#define ROWS_G 64

// The rows ahead whose blocks are asked for as a pair's are unpacked (the next pair's: the weights stream from DRAM
// in a prefill); 0: none
#ifndef ROWS_PREFETCH_ROWS
#define ROWS_PREFETCH_ROWS 2
#endif

// Two weight rows' blocks, unpacked side by side.
typedef struct {
    __m512i q[8];      // [64] u8: chunk k of row 0 in bytes 0-31, of row 1 in bytes 32-63 (the q8_K qs[32k ..] order)
    __m512i sc[8];     // [32] int16: lane p of chunk k scales row p / 16's weight pair 32k + 2 (p % 16), + 1
    __m512i bs;        // [32] int16: lane p multiplies the q8_K bsums[p % 16] for row p / 16 (Q6_K, Q3_K: -offset
                       // sc_g; Q5_K: mn_{g/2})
    __m512 d, dmin;    // lanes 0-7 row 0's fp16 scale, 8-15 row 1's, as fp32 (dmin: Q5_K's, negated)
} rows_pair;

#define R4(v) v, v, v, v
#define R8(v) v, v, v, v, v, v, v, v
#define R16(v) R8(v), R8(v)
// Lane p of chunk k's scale vector -> the int16 lane of the rows' 32 scales: + 2k (16-weight groups: Q6_K, Q3_K), or
// + k (32-weight subblocks: Q5_K)
static const int16_t ROWS_CHUNK16[32] = { R8(0), R8(1), R8(16), R8(17) };
static const int16_t ROWS_CHUNK32[32] = { R16(0), R16(16) };
// Q5_K: lane p -> row p / 16's min of subblock (p % 16) / 2 (lanes 8-15 of each row's scales), against bsums[p % 16]
static const int16_t ROWS_MINS[32] = { 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15,
                                       24, 24, 25, 25, 26, 26, 27, 27, 28, 28, 29, 29, 30, 30, 31, 31 };

// The 6-bit scales from their 12 bytes v (int16 lanes, row 1's from lane 16): lane i of each row = ((v[LO_i] >>
// LO_SHIFT_i) & low mask) | (the high two bits at 4-5, from v[HI_i]).
// Q3_K (v read from 2 bytes before the scales, which end 2 bytes before the block: lane 2 + b is byte b): scale i's
// low nibble is byte i & 7's (high nibble from i = 8), its high bits byte 8 + i % 4's bits 2 (i / 4) and + 1 (read
// from v << 4, shifted right to bits 4-5).
static const int16_t ROWS_Q3_LO[32] = { 2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4, 5, 6, 7, 8, 9,
                                        18, 19, 20, 21, 22, 23, 24, 25, 18, 19, 20, 21, 22, 23, 24, 25 };
static const int16_t ROWS_Q3_LO_SHIFT[32] = { R8(0), R8(4), R8(0), R8(4) };
static const int16_t ROWS_Q3_HI[32] = { 10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13,
                                        26, 27, 28, 29, 26, 27, 28, 29, 26, 27, 28, 29, 26, 27, 28, 29 };
static const int16_t ROWS_Q3_HI_SHIFT[32] = { R4(0), R4(2), R4(4), R4(6), R4(0), R4(2), R4(4), R4(6) };
// Q5_K: lanes 0-7 the scales, 8-15 the mins. Scale j < 4: byte j & 63; j >= 4: byte j + 4's low nibble, high bits
// byte j - 4's top two. Min j < 4: byte j + 4 & 63; j >= 4: byte j + 4's high nibble, high bits byte j's top two.
static const int16_t ROWS_Q5_LO[32] = { 0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11,
                                        16, 17, 18, 19, 24, 25, 26, 27, 20, 21, 22, 23, 24, 25, 26, 27 };
static const int16_t ROWS_Q5_LO_SHIFT[32] = { R8(0), R4(0), R4(4), R8(0), R4(0), R4(4) };
static const int16_t ROWS_Q5_LO_MASK[32] = { R4(63), R4(15), R4(63), R4(15), R4(63), R4(15), R4(63), R4(15) };
static const int16_t ROWS_Q5_HI[32] = { 0, 0, 0, 0, 0, 1, 2, 3, 0, 0, 0, 0, 4, 5, 6, 7,
                                        16, 16, 16, 16, 16, 17, 18, 19, 16, 16, 16, 16, 20, 21, 22, 23 };
static const int16_t ROWS_Q5_HI_MASK[32] = { R4(0), R4(0x30), R4(0), R4(0x30), R4(0), R4(0x30), R4(0), R4(0x30) };
#undef R4
#undef R8
#undef R16

#define ROWS_TABLE(t) _mm512_loadu_si512(t)

// 32 bytes of each row: row 0's at p0 in the low half, row 1's at p1 in the high half
ROWS_INLINE __m512i rows_pair32(const uint8_t *p0, const uint8_t *p1) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p0)),
                              _mm256_loadu_si256((const __m256i *)p1), 1);
}

// 16 bytes of each row as int16 lanes: row 0's in lanes 0-15, row 1's in 16-31 (signed: Q6_K's int8 scales)
ROWS_INLINE __m512i rows_pair16(const void *p0, const void *p1, int is_signed) {
    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p0)),
                                              _mm_loadu_si128((const __m128i *)p1), 1);
    return is_signed ? _mm512_cvtepi8_epi16(v) : _mm512_cvtepu8_epi16(v);
}

// fp16 a in lanes 0-7, b in 8-15, as fp32 (AVX-512F's vcvtph2ps: no F16C flag needed)
ROWS_INLINE __m512 rows_halves(ggml_half a, ggml_half b) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi16((short)a)),
                                                   _mm_set1_epi16((short)b), 1));
}

// u8 lanes shifted by s bits (s > 0: left, < 0: right) in 16-bit lanes: bits crossing into the neighbouring byte are
// masked away by the caller
#define ROWS_SHIFT(v, s) ((s) > 0 ? _mm512_slli_epi16(v, (s) > 0 ? (s) : 0)                                        \
                                  : (s) < 0 ? _mm512_srli_epi16(v, (s) < 0 ? -(s) : 0) : (v))

// The chunks' scale vectors from the rows' 32 scales (int16 lanes 0-15 row 0, 16-31 row 1): step 2 a chunk for
// 16-weight groups, 1 for 32-weight subblocks
ROWS_INLINE void rows_spread(rows_pair *b, __m512i sc, const int16_t *table, int step) {
    const __m512i base = ROWS_TABLE(table);
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++)
        b->sc[k] = _mm512_permutexvar_epi16(_mm512_add_epi16(base, _mm512_set1_epi16((int16_t)(step * k))), sc);
}

// --- Q6_K: ql [128] low nibbles, qh [64] top two bits, scales [16] int8, d --------------------------------------
// Chunk k = 4h + c: weight 128h + 32c + l (l < 32) is ql[64h + 32 (c % 2) + l]'s low (c < 2) or high nibble, its top
// bits qh[32h + l] bits 2c, 2c + 1.
ROWS_INLINE void rows_unpack_q6_K(const void *p0, const void *p1, rows_pair *b) {
    const block_q6_K *x0 = (const block_q6_K *)p0, *x1 = (const block_q6_K *)p1;
    const __m512i m0f = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const __m512i qh = rows_pair32(x0->qh + 32 * h, x1->qh + 32 * h);
#pragma GCC unroll 2
        for (int c = 0; c < 2; c++) {
            const __m512i ql = rows_pair32(x0->ql + 64 * h + 32 * c, x1->ql + 64 * h + 32 * c);
            // 0xF8: A | (B & C)
            b->q[4 * h + c] = _mm512_ternarylogic_epi32(_mm512_and_si512(ql, m0f), ROWS_SHIFT(qh, 4 - 2 * c), m30,
                                                        0xF8);
            b->q[4 * h + c + 2] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m0f),
                                                            ROWS_SHIFT(qh, -2 * c), m30, 0xF8);
        }
    }
    const __m512i sc = rows_pair16(x0->scales, x1->scales, 1);
    rows_spread(b, sc, ROWS_CHUNK16, 2);
    b->bs = _mm512_sub_epi16(_mm512_setzero_si512(), _mm512_slli_epi16(sc, 5));       // -32 sc_g
    b->d = rows_halves(x0->d, x1->d);
    b->dmin = _mm512_setzero_ps();
}

// --- Q3_K: hmask [32] high bits, qs [64] low two bits, scales [12] 6-bit, d --------------------------------------
// Chunk k = 4h + c: weight 128h + 32c + l (l < 32) is (qs[32h + l] >> 2c) & 3, high bit hmask[l] bit k.
ROWS_INLINE void rows_unpack_q3_K(const void *p0, const void *p1, rows_pair *b) {
    const block_q3_K *x0 = (const block_q3_K *)p0, *x1 = (const block_q3_K *)p1;
    const __m512i m03 = _mm512_set1_epi8(0x03), m04 = _mm512_set1_epi8(0x04);
    const __m512i hm = rows_pair32(x0->hmask, x1->hmask);
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const __m512i qs = rows_pair32(x0->qs + 32 * h, x1->qs + 32 * h);
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const int k = 4 * h + c;
            b->q[k] = _mm512_ternarylogic_epi32(_mm512_and_si512(ROWS_SHIFT(qs, -2 * c), m03), ROWS_SHIFT(hm, 2 - k),
                                                m04, 0xF8);
        }
    }
    // The 16 6-bit scales - 32 (quants.c dequantize_row_q3_K's aux[] unpacking), from the 16 bytes ending with them
    const __m512i v = rows_pair16(x0->scales - 2, x1->scales - 2, 0);
    const __m512i lo = _mm512_srlv_epi16(_mm512_permutexvar_epi16(ROWS_TABLE(ROWS_Q3_LO), v),
                                         ROWS_TABLE(ROWS_Q3_LO_SHIFT));
    const __m512i hi = _mm512_and_si512(_mm512_srlv_epi16(_mm512_permutexvar_epi16(ROWS_TABLE(ROWS_Q3_HI),
                                                                                   _mm512_slli_epi16(v, 4)),
                                                          ROWS_TABLE(ROWS_Q3_HI_SHIFT)),
                                        _mm512_set1_epi16(0x30));
    const __m512i sc = _mm512_sub_epi16(_mm512_ternarylogic_epi32(lo, _mm512_set1_epi16(0x0F), hi, 0xEA),  // (A&B)|C
                                        _mm512_set1_epi16(32));
    rows_spread(b, sc, ROWS_CHUNK16, 2);
    b->bs = _mm512_sub_epi16(_mm512_setzero_si512(), _mm512_slli_epi16(sc, 2));       // -4 sc_g
    b->d = rows_halves(x0->d, x1->d);
    b->dmin = _mm512_setzero_ps();
}

// --- Q5_K: d, dmin, scales [12] (8 6-bit scales, 8 6-bit mins), qh [32] fifth bits, qs [128] nibbles -----------
// Chunk k = 2z + c (subblock k): weight 32k + l (l < 32) is qs[32z + l]'s low (c = 0) or high nibble, fifth bit qh[l]
// bit k.
ROWS_INLINE void rows_unpack_q5_K(const void *p0, const void *p1, rows_pair *b) {
    const block_q5_K *x0 = (const block_q5_K *)p0, *x1 = (const block_q5_K *)p1;
    const __m512i m0f = _mm512_set1_epi8(0x0F), m10 = _mm512_set1_epi8(0x10);
    const __m512i qh = rows_pair32(x0->qh, x1->qh);
#pragma GCC unroll 4
    for (int z = 0; z < 4; z++) {
        const __m512i qs = rows_pair32(x0->qs + 32 * z, x1->qs + 32 * z);
        b->q[2 * z] = _mm512_ternarylogic_epi32(_mm512_and_si512(qs, m0f), ROWS_SHIFT(qh, 4 - 2 * z), m10, 0xF8);
        b->q[2 * z + 1] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(qs, 4), m0f),
                                                    ROWS_SHIFT(qh, 3 - 2 * z), m10, 0xF8);
    }
    // The 8 scales (int16 lanes 0-7) and 8 mins (8-15) of each row (ggml's get_scale_min_k4 / utmp[] unpacking), from
    // 16 bytes (the 12 and 4 of qh)
    const __m512i v = rows_pair16(x0->scales, x1->scales, 0);
    const __m512i lo = _mm512_srlv_epi16(_mm512_permutexvar_epi16(ROWS_TABLE(ROWS_Q5_LO), v),
                                         ROWS_TABLE(ROWS_Q5_LO_SHIFT));
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(_mm512_permutexvar_epi16(ROWS_TABLE(ROWS_Q5_HI), v), 2),
                                        ROWS_TABLE(ROWS_Q5_HI_MASK));
    const __m512i sm = _mm512_ternarylogic_epi32(lo, ROWS_TABLE(ROWS_Q5_LO_MASK), hi, 0xEA);  // (A & B) | C
    rows_spread(b, sm, ROWS_CHUNK32, 1);
    b->bs = _mm512_permutexvar_epi16(ROWS_TABLE(ROWS_MINS), sm);
    b->d = rows_halves(x0->d, x1->d);
    b->dmin = _mm512_sub_ps(_mm512_setzero_ps(), rows_halves(x0->dmin, x1->dmin));
}

// Asks for a block of each row of the next pair (its lines: a block straddles up to four)
ROWS_INLINE void rows_prefetch(const uint8_t *x, size_t bsz) {
    _mm_prefetch((const char *)x, _MM_HINT_T0);
    _mm_prefetch((const char *)x + 64, _MM_HINT_T0);
    _mm_prefetch((const char *)x + 128, _MM_HINT_T0);
    _mm_prefetch((const char *)x + bsz - 1, _MM_HINT_T0);
}

// Rows r0 and r0 + 1 (R = 2), or r0 alone (R = 1: its blocks in both halves, the high lanes unused), against tokens
// 0 .. g - 1 of acts / out: one pass over the rows' blocks.
ROWS_INLINE void rows_pass(const enum ggml_type type, const int R, const uint8_t *w, size_t row_bytes, int64_t nb,
                           const block_q8_K *const *acts, int g, float *const *out, int64_t r0) {
    const size_t bsz = type == GGML_TYPE_Q5_K ? sizeof(block_q5_K)
                       : type == GGML_TYPE_Q6_K ? sizeof(block_q6_K) : sizeof(block_q3_K);
    const uint8_t *w1 = R == 2 ? w + row_bytes : w;
    __m512 acc[ROWS_G];         // [G] fp32 lanes of each token: 0-7 row 0, 8-15 row 1
    for (int j = 0; j < g; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        rows_pair b;
        const uint8_t *x0 = w + i * bsz, *x1 = w1 + i * bsz;
        if (type == GGML_TYPE_Q5_K) rows_unpack_q5_K(x0, x1, &b);
        else if (type == GGML_TYPE_Q6_K) rows_unpack_q6_K(x0, x1, &b);
        else rows_unpack_q3_K(x0, x1, &b);
        if (ROWS_PREFETCH_ROWS) {
            rows_prefetch(x0 + ROWS_PREFETCH_ROWS * row_bytes, bsz);
            rows_prefetch(x1 + ROWS_PREFETCH_ROWS * row_bytes, bsz);
        }
        for (int j = 0; j < g; j++) {
            const block_q8_K *y = acts[j] + i;
            const __m512i bsums = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)y->bsums));
            const __m512 dy = _mm512_set1_ps(y->d);        // a broadcast load: no shuffle port
            // Q6_K, Q3_K: start from the offset (vpmaddwd of the bsums, the same int32 lanes); Q5_K: from 0
            __m512i s = type == GGML_TYPE_Q5_K ? _mm512_setzero_si512() : _mm512_madd_epi16(bsums, b.bs);
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) {
                const __m512i a = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(y->qs + 32 * k)));
                s = ROWS_DPW(s, _mm512_maddubs_epi16(b.q[k], a), b.sc[k]);
            }
            if (type == GGML_TYPE_Q5_K) {       // (d s - dmin mins) d_a: one multiply fewer than each by d_a
                const __m512i mn = _mm512_madd_epi16(bsums, b.bs);
                const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mn), b.dmin,
                                                 _mm512_mul_ps(_mm512_cvtepi32_ps(s), b.d));
                acc[j] = _mm512_fmadd_ps(v, dy, acc[j]);
            } else {
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(b.d, dy), acc[j]);
            }
        }
    }
    for (int j = 0; j < g; j++) {
        out[j][r0] = _mm512_mask_reduce_add_ps(0x00FF, acc[j]);
        if (R == 2) out[j][r0 + 1] = _mm512_mask_reduce_add_ps(0xFF00, acc[j]);
    }
}

ROWS_INLINE void rows_kernel(const enum ggml_type type, const void *w, size_t row_bytes, int64_t m, int64_t nb,
                             const block_q8_K *const *acts, int64_t n, float *const *out) {
    const uint8_t *x = (const uint8_t *)w;
    for (int64_t j0 = 0; j0 < n; j0 += ROWS_G) {
        const int g = n - j0 < ROWS_G ? (int)(n - j0) : ROWS_G;
        int64_t r = 0;
        for (; r + 2 <= m; r += 2) rows_pass(type, 2, x + r * row_bytes, row_bytes, nb, acts + j0, g, out + j0, r);
        if (r < m) rows_pass(type, 1, x + r * row_bytes, row_bytes, nb, acts + j0, g, out + j0, r);
    }
}

static void rows_q5_K(const void *w, size_t row_bytes, int64_t m, int64_t nb, const block_q8_K *const *acts,
                      int64_t n, float *const *out) {
    rows_kernel(GGML_TYPE_Q5_K, w, row_bytes, m, nb, acts, n, out);
}

static void rows_q6_K(const void *w, size_t row_bytes, int64_t m, int64_t nb, const block_q8_K *const *acts,
                      int64_t n, float *const *out) {
    rows_kernel(GGML_TYPE_Q6_K, w, row_bytes, m, nb, acts, n, out);
}

static void rows_q3_K(const void *w, size_t row_bytes, int64_t m, int64_t nb, const block_q8_K *const *acts,
                      int64_t n, float *const *out) {
    rows_kernel(GGML_TYPE_Q3_K, w, row_bytes, m, nb, acts, n, out);
}
#endif

ggml_moectl_rows_fn ggml_moectl_rows_k(enum ggml_type type) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    switch (type) {
        case GGML_TYPE_Q5_K: return rows_q5_K;
        case GGML_TYPE_Q6_K: return rows_q6_K;
        case GGML_TYPE_Q3_K: return rows_q3_K;
        default: return NULL;
    }
#else
    (void) type;
    return NULL;
#endif
}
