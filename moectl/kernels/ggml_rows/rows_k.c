// Expert-rows kernels (rows.h) for the K-quants ggml does not repack on x86: Q5_K, Q6_K, Q3_K.
//
// Why: ggml's vec_dot for these types (AVX2 only) unpacks a weight block for every (row, token) pair. Here a block
// of two weight rows is unpacked once into registers (u8 weights in the activation's order, int16 scale vectors)
// and used for each token of a group: per token and row, four vpmaddubsw (u8 weight x s8 activation -> int16
// pairs) and four vpdpwssd (x the pair's scale -> int32 lanes, VNNI; vpmaddwd + vpaddd on plain AVX-512BW).
//
// The same integer sums per block as ggml's vec_dot (arch/x86/quants.c), only split over int32 lanes:
//   Q6_K: sum_g sc_g * sum_{l in g} q_l a_l - 32 * sum_g sc_g * bsum_g      (q in 0..63, 16 groups of 16, sc int8)
//   Q3_K: sum_g sc_g * sum_{l in g} u_l a_l -  4 * sum_g sc_g * bsum_g      (u = q2 + 4 hbit in 0..7: q3 = u - 4,
//                                                                           sc = 6-bit - 32)
//   Q5_K: sum_s sc_s * sum_{l in s} q_l a_l, and the mins sum_s mn_s * (bsum_2s + bsum_2s+1)  (8 subblocks of 32)
// The offsets ride on the q8_K bsums (vpmaddwd with -32 sc / -4 sc, in the same int32 lanes); Q5_K's mins get their
// own fp32 lanes (their scale is dmin, not d). No int16 saturates: |q a| pairs <= 2 * 63 * 128.
// Then d_x * d_a (fp32, as ggml's d) times the lanes, accumulated over blocks in fp32 lanes and summed per output at
// the end: only that fp32 order differs from vec_dot's.
//
// Legend: K = input width (nb blocks of 256), m = weight rows of the chunk, n = tokens routed to the expert,
// G = tokens of a group (ROWS_G), z = the 4 zmm of a block (64 weights each, z in 0..3), p = an int16 lane (0..31).
#include "rows.h"


#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

#ifdef __AVX512VNNI__
#define ROWS_DPW(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)
#else
#define ROWS_DPW(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
#endif

#define ROWS_INLINE static inline __attribute__((always_inline))

// Tokens whose accumulators a row pair holds at a time (on the stack: G x 3 zmm = 6 KB); more tokens: more groups,
// each unpacking the row pair's blocks again (once a group, not once a token).
#define ROWS_G 32

// One weight row's block, unpacked.
typedef struct {
    __m512i q[4];      // [64] u8: zmm z holds weights 64z .. 64z + 63 (the q8_K row's qs[64z ..] in order)
    __m512i sc[4];     // [32] int16: lane p of zmm z scales the weight pair 64z + 2p, + 1
    __m256i bs;        // [16] int16: lane g multiplies the q8_K bsums[g] (Q6_K, Q3_K: -offset sc_g; Q5_K: mn_{g/2})
    float d, dmin;     // fp16 scales (dmin: Q5_K only)
} rows_block;

// Lane p of zmm z -> group 4z + p / 8 (16-weight groups: Q6_K, Q3_K) or subblock 2z + p / 16 (32-weight: Q5_K)
static const int16_t ROWS_GROUP16[4][32] = {
#define G16(z) { 4*z, 4*z, 4*z, 4*z, 4*z, 4*z, 4*z, 4*z, 4*z+1, 4*z+1, 4*z+1, 4*z+1, 4*z+1, 4*z+1, 4*z+1, 4*z+1,        \
                 4*z+2, 4*z+2, 4*z+2, 4*z+2, 4*z+2, 4*z+2, 4*z+2, 4*z+2, 4*z+3, 4*z+3, 4*z+3, 4*z+3, 4*z+3, 4*z+3,     \
                 4*z+3, 4*z+3 }
    G16(0), G16(1), G16(2), G16(3),
#undef G16
};
static const int16_t ROWS_GROUP32[4][32] = {
#define G32(z) { 2*z, 2*z, 2*z, 2*z, 2*z, 2*z, 2*z, 2*z, 2*z, 2*z, 2*z, 2*z, 2*z, 2*z, 2*z, 2*z,                          \
                 2*z+1, 2*z+1, 2*z+1, 2*z+1, 2*z+1, 2*z+1, 2*z+1, 2*z+1, 2*z+1, 2*z+1, 2*z+1, 2*z+1, 2*z+1, 2*z+1,     \
                 2*z+1, 2*z+1 }
    G32(0), G32(1), G32(2), G32(3),
#undef G32
};

// Lane g (< 16) -> 8 + g / 2: Q5_K's min of subblock g / 2 against bsums[g] (the mins are lanes 8-15 of its scales)
static const int16_t ROWS_MINS[32] = { 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15 };

// The 6-bit scales from their 12 bytes, lane i < 16 = ((v[LO_i] >> LO_SHIFT_i) & low mask) | (high two bits at 4-5
// from v[HI_i]), v the bytes as int16 lanes. Q3_K: scale i's low nibble is byte i & 7's (high nibble from i = 8),
// its high bits byte 8 + i % 4's bits 2 (i / 4) .. + 1 (read from v << 4, shifted right: at bits 4-5).
static const int16_t ROWS_Q3_LO[32] = { 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7 };
static const int16_t ROWS_Q3_LO_SHIFT[32] = { 0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4 };
static const int16_t ROWS_Q3_HI[32] = { 8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11 };
static const int16_t ROWS_Q3_HI_SHIFT[32] = { 0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6 };
// Q5_K: lanes 0-7 the scales, 8-15 the mins. Scale j < 4: byte j & 63; j >= 4: byte j + 4's low nibble, high bits
// byte j - 4's top two. Min j < 4: byte j + 4 & 63; j >= 4: byte j + 4's high nibble, high bits byte j's top two.
static const int16_t ROWS_Q5_LO[32] = { 0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11 };
static const int16_t ROWS_Q5_LO_SHIFT[32] = { 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4 };
static const int16_t ROWS_Q5_LO_MASK[32] = { 63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15 };
static const int16_t ROWS_Q5_HI[32] = { 0, 0, 0, 0, 0, 1, 2, 3, 0, 0, 0, 0, 4, 5, 6, 7 };
static const int16_t ROWS_Q5_HI_MASK[32] = { 0, 0, 0, 0, 0x30, 0x30, 0x30, 0x30, 0, 0, 0, 0, 0x30, 0x30, 0x30, 0x30 };

// A K-quant's 12 scale bytes as int16 lanes 0-11 (a masked load: nothing past them is read)
ROWS_INLINE __m512i rows_scale_bytes(const uint8_t *s) {
    return _mm512_cvtepu8_epi16(_mm512_castsi512_si256(_mm512_maskz_loadu_epi8(0xFFF, s)));
}

// Bit b of each byte of a 64-bit lane to bit t (b, t < 8): a rotate by b - t keeps every byte's bit t its own.
#define ROWS_ROT(b, t) (((b) - (t)) & 63)

// --- Q6_K: ql [128] low nibbles, qh [64] top two bits, scales [16] int8, d --------------------------------------
// Half h (128 weights): ql[64h + l] low nibble is weight 128h + l (l < 64), high nibble 128h + 64 + l; the top bits
// are qh[32h + l % 32] bits 0-1 (l < 32), 2-3 (l >= 32) for the low nibbles, 4-5 and 6-7 for the high ones.
ROWS_INLINE void rows_unpack_q6_K(const void *p, rows_block *b) {
    const block_q6_K *x = (const block_q6_K *)p;
    const __m512i m0f = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i shl = _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4), shr = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0);
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const __m512i ql = _mm512_loadu_si512(x->ql + 64 * h);
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(x->qh + 32 * h)));
        // 0xF8: A | (B & C)
        b->q[2 * h] = _mm512_ternarylogic_epi32(_mm512_and_si512(ql, m0f), _mm512_sllv_epi64(qh, shl), m30, 0xF8);
        b->q[2 * h + 1] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m0f),
                                                    _mm512_srlv_epi64(qh, shr), m30, 0xF8);
    }
    const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x->scales));
#pragma GCC unroll 4
    for (int z = 0; z < 4; z++)
        b->sc[z] = _mm512_permutexvar_epi16(_mm512_loadu_si512(ROWS_GROUP16[z]), _mm512_castsi256_si512(sc));
    b->bs = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(sc, 5));     // -32 sc_g
    b->d = _cvtsh_ss(x->d);
    b->dmin = 0.0f;
}

// --- Q3_K: hmask [32] high bits, qs [64] low two bits, scales [12] 6-bit, d --------------------------------------
// Weight 128h + 32k + l (l < 32): (qs[32h + l] >> 2k) & 3, high bit hmask[l] bit 4h + k; group 8h + 2k + l / 16.
// Zmm z = 2h + c holds k = 2c (low 32 bytes) and 2c + 1 (high 32 bytes).
ROWS_INLINE void rows_unpack_q3_K(const void *p, rows_block *b) {
    const block_q3_K *x = (const block_q3_K *)p;
    const __m512i m03 = _mm512_set1_epi8(0x03), m04 = _mm512_set1_epi8(0x04);
    const __m512i hm = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)x->hmask));
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const __m512i qs = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(x->qs + 32 * h)));
#pragma GCC unroll 2
        for (int c = 0; c < 2; c++) {
            const int k = 2 * c, bit = 4 * h + k;
            const __m512i sh = _mm512_set_epi64(2 * k + 2, 2 * k + 2, 2 * k + 2, 2 * k + 2, 2 * k, 2 * k, 2 * k, 2 * k);
            const __m512i rot = _mm512_set_epi64(ROWS_ROT(bit + 1, 2), ROWS_ROT(bit + 1, 2), ROWS_ROT(bit + 1, 2),
                                                 ROWS_ROT(bit + 1, 2), ROWS_ROT(bit, 2), ROWS_ROT(bit, 2),
                                                 ROWS_ROT(bit, 2), ROWS_ROT(bit, 2));
            b->q[2 * h + c] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srlv_epi64(qs, sh), m03),
                                                        _mm512_rorv_epi64(hm, rot), m04, 0xF8);
        }
    }
    // The 16 6-bit scales, - 32 (quants.c dequantize_row_q3_K's aux[] unpacking, in int16 lanes 0-15)
    const __m512i v = rows_scale_bytes(x->scales);
    const __m512i lo = _mm512_srlv_epi16(_mm512_permutexvar_epi16(_mm512_loadu_si512(ROWS_Q3_LO), v),
                                         _mm512_loadu_si512(ROWS_Q3_LO_SHIFT));
    const __m512i hi = _mm512_and_si512(_mm512_srlv_epi16(_mm512_permutexvar_epi16(_mm512_loadu_si512(ROWS_Q3_HI),
                                                                                   _mm512_slli_epi16(v, 4)),
                                                          _mm512_loadu_si512(ROWS_Q3_HI_SHIFT)),
                                        _mm512_set1_epi16(0x30));
    // 0xEA: (A & B) | C
    const __m256i sc = _mm256_sub_epi16(
        _mm512_castsi512_si256(_mm512_ternarylogic_epi32(lo, _mm512_set1_epi16(0x0F), hi, 0xEA)),
        _mm256_set1_epi16(32));
#pragma GCC unroll 4
    for (int z = 0; z < 4; z++)
        b->sc[z] = _mm512_permutexvar_epi16(_mm512_loadu_si512(ROWS_GROUP16[z]), _mm512_castsi256_si512(sc));
    b->bs = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(sc, 2));      // -4 sc_g
    b->d = _cvtsh_ss(x->d);
    b->dmin = 0.0f;
}

// --- Q5_K: d, dmin, scales [12] (8 6-bit scales, 8 6-bit mins), qh [32] fifth bits, qs [128] nibbles -----------
// Weight 64z + l (l < 32): qs[32z + l] low nibble, fifth bit qh[l] bit 2z; 64z + 32 + l: high nibble, bit 2z + 1.
ROWS_INLINE void rows_unpack_q5_K(const void *p, rows_block *b) {
    const block_q5_K *x = (const block_q5_K *)p;
    const __m512i m0f = _mm512_set1_epi8(0x0F), m10 = _mm512_set1_epi8(0x10);
    const __m512i sh = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)x->qh));
#pragma GCC unroll 4
    for (int z = 0; z < 4; z++) {
        const __m512i qs = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(x->qs + 32 * z)));
        const __m512i rot = _mm512_set_epi64(ROWS_ROT(2 * z + 1, 4), ROWS_ROT(2 * z + 1, 4), ROWS_ROT(2 * z + 1, 4),
                                             ROWS_ROT(2 * z + 1, 4), ROWS_ROT(2 * z, 4), ROWS_ROT(2 * z, 4),
                                             ROWS_ROT(2 * z, 4), ROWS_ROT(2 * z, 4));
        b->q[z] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srlv_epi64(qs, sh), m0f),
                                            _mm512_rorv_epi64(qh, rot), m10, 0xF8);
    }
    // The 8 scales (int16 lanes 0-7) and 8 mins (8-15) (ggml's get_scale_min_k4 / the utmp[] unpacking)
    const __m512i v = rows_scale_bytes(x->scales);
    const __m512i lo = _mm512_srlv_epi16(_mm512_permutexvar_epi16(_mm512_loadu_si512(ROWS_Q5_LO), v),
                                         _mm512_loadu_si512(ROWS_Q5_LO_SHIFT));
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(_mm512_permutexvar_epi16(_mm512_loadu_si512(ROWS_Q5_HI), v),
                                                          2),
                                        _mm512_loadu_si512(ROWS_Q5_HI_MASK));
    const __m256i sm = _mm512_castsi512_si256(                                    // 0xEA: (A & B) | C
        _mm512_ternarylogic_epi32(lo, _mm512_loadu_si512(ROWS_Q5_LO_MASK), hi, 0xEA));
#pragma GCC unroll 4
    for (int z = 0; z < 4; z++)
        b->sc[z] = _mm512_permutexvar_epi16(_mm512_loadu_si512(ROWS_GROUP32[z]), _mm512_castsi256_si512(sm));
    // lane g: mn_{g/2} (8 + g / 2 of sm), against bsums[g]
    b->bs = _mm512_castsi512_si256(_mm512_permutexvar_epi16(_mm512_loadu_si512(ROWS_MINS),
                                                            _mm512_castsi256_si512(sm)));
    b->d = _cvtsh_ss(x->d);
    b->dmin = _cvtsh_ss(x->dmin);
}

// The block's int32 lanes against one q8_K block: the weight sums and (Q6_K, Q3_K) the offset, in the same lanes.
ROWS_INLINE __m512i rows_dot(const rows_block *b, const __m512i a[4], __m512i s) {
#pragma GCC unroll 4
    for (int z = 0; z < 4; z++) s = ROWS_DPW(s, _mm512_maddubs_epi16(b->q[z], a[z]), b->sc[z]);
    return s;
}

// Rows r0 .. r0 + R - 1 (R = 1 or 2) against tokens j0 .. j0 + g - 1: one pass over the rows' blocks.
ROWS_INLINE void rows_pass(const enum ggml_type type, const int R, const uint8_t *w, size_t row_bytes, int64_t nb,
                           const block_q8_K *const *acts, int g, float *const *out, int64_t r0) {
    const size_t bsz = type == GGML_TYPE_Q5_K ? sizeof(block_q5_K)
                       : type == GGML_TYPE_Q6_K ? sizeof(block_q6_K) : sizeof(block_q3_K);
    const int mins = type == GGML_TYPE_Q5_K;
    __m512 acc[ROWS_G][2];      // [G][R] fp32 lanes of each (token, row)
    __m512 accm[ROWS_G];        // Q5_K's mins of each token: lanes 0-7 row 0, 8-15 row 1
    for (int j = 0; j < g; j++) {
        acc[j][0] = acc[j][1] = accm[j] = _mm512_setzero_ps();
    }
    for (int64_t i = 0; i < nb; i++) {
        rows_block b[2];
#pragma GCC unroll 2
        for (int r = 0; r < R; r++) {
            const uint8_t *x = w + r * row_bytes + i * bsz;
            if (type == GGML_TYPE_Q5_K) rows_unpack_q5_K(x, &b[r]);
            else if (type == GGML_TYPE_Q6_K) rows_unpack_q6_K(x, &b[r]);
            else rows_unpack_q3_K(x, &b[r]);
        }
        const __m512 dx[2] = {_mm512_set1_ps(b[0].d), _mm512_set1_ps(R == 2 ? b[1].d : 0.0f)};
        // Q5_K: -dmin_r against the two rows' mins (lanes 0-7: row 0, 8-15: row 1)
        __m512i mn2 = _mm512_setzero_si512();
        __m512 dmin2 = _mm512_setzero_ps();
        if (mins) {
            const __m512i mb0 = _mm512_castsi256_si512(b[0].bs);
            mn2 = R == 2 ? _mm512_inserti64x4(mb0, b[1].bs, 1) : _mm512_zextsi256_si512(b[0].bs);
            dmin2 = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(-b[0].dmin),
                                         _mm512_set1_ps(R == 2 ? -b[1].dmin : 0.0f));
        }
        for (int j = 0; j < g; j++) {
            const block_q8_K *y = acts[j] + i;
            __m512i a[4];
#pragma GCC unroll 4
            for (int z = 0; z < 4; z++) a[z] = _mm512_loadu_si512(y->qs + 64 * z);
            const __m256i bsums = _mm256_loadu_si256((const __m256i *)y->bsums);
            const __m512 dy = _mm512_set1_ps(y->d);        // a broadcast load: no shuffle port
#pragma GCC unroll 2
            for (int r = 0; r < R; r++) {
                // Q6_K, Q3_K: start from the offset (lanes 0-7, as vpmaddwd of the bsums); Q5_K: from 0
                const __m512i s0 = mins ? _mm512_setzero_si512()
                                        : _mm512_zextsi256_si512(_mm256_madd_epi16(bsums, b[r].bs));
                const __m512i s = rows_dot(&b[r], a, s0);
                acc[j][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dx[r], dy), acc[j][r]);
            }
            if (mins) {
                const __m512i m = _mm512_madd_epi16(_mm512_broadcast_i64x4(bsums), mn2);
                accm[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(m), _mm512_mul_ps(dmin2, dy), accm[j]);
            }
        }
    }
    for (int j = 0; j < g; j++) {
        for (int r = 0; r < R; r++) {
            __m512 v = acc[j][r];
            if (mins) {
                v = _mm512_add_ps(v, _mm512_maskz_mov_ps(r ? 0xFF00 : 0x00FF, accm[j]));
            }
            out[j][r0 + r] = _mm512_reduce_add_ps(v);
        }
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
