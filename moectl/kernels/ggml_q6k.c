// A Q6_K matrix-vector product (one token: decode's lm_head and dense Q6_K matrices) faster than ggml's on x86,
// put in ggml's graph as a custom op (the shim's matvec(): ggml_custom_4d). Included by ggml_shim.c.
//
// Why (issue 42, docs/gguf.md "An own Q6_K matvec"): ggml computes Q6_K x q8_K with ggml_vec_dot_q6_K_q8_K, AVX2
// only, one row at a time (no AVX-512 path, no x86 repack), leaving the rows' streaming from DRAM to the hardware
// prefetcher: a core read ~6 GB/s of the matrix where these kernels, asking for the bytes ahead, read ~10 (and
// compute 21 / 28 GB/s from L1 against its 20). The lm_head of every K-quant file is Q6_K, read once a token.
//
// Same numbers as ggml's, but for fp32 summation order: the activation row is quantized by ggml's own
// quantize_row_q8_K (the Q8_K type traits' from_float), and each block's integer sum is ggml's:
//   sum_g scale_g * sum_{l in g} q6_l * q8_l - 32 * sum_g scale_g * bsum_g   (q6_l in 0..63, groups g of 16)
// then d_x * d_w * that sum, accumulated in fp32 lanes and added up at the end of the row.
//
// Legend: K = input width (a multiple of 256), N = output rows, nb = K / 256 blocks a row; a block is 256 weights:
// ql [128] low nibbles, qh [64] high two bits, scales [16] int8 (one a group of 16), d fp16.
//
// Kernels (`q6k_kernel`): AVX-512BW (+VNNI's vpdpwssd where the CPU has it) and AVX2, both prefetching, each
// compiled with its own target attribute and picked at run time, so the shim builds with plain -O2 and runs on any
// x86 host; the AVX-512 ones are picked only where the loaded ggml was built with AVX-512 (ggml_cpu_has_avx512: not
// in MOECTL_GGML_ISA=avx2's build) and not with MOECTL_GGML_OWN_Q6K=avx2 (tests: the AVX2 path on an AVX-512 host).
// Elsewhere (no AVX2, not x86) the graph keeps ggml's mul_mat.

typedef struct {
    uint8_t ql[128];
    uint8_t qh[64];
    int8_t scales[16];
    uint16_t d;                          // fp16
} q6k_block;                             // ggml's block_q6_K (210 bytes)

typedef struct {
    float d;
    int8_t qs[256];
    int16_t bsums[16];                   // sum of qs over each group of 16
} q8k_block;                             // ggml's block_q8_K (292 bytes)

_Static_assert(sizeof(q6k_block) == 210, "block_q6_K");
_Static_assert(sizeof(q8k_block) == 292, "block_q8_K");

// y[r] = row r of W (rows of nb blocks, `row_bytes` apart) . q, for r in [0, n)
typedef void (*q6k_rows_fn)(const uint8_t *w, size_t row_bytes, int64_t n, const q8k_block *q, int64_t nb, float *y);

enum { Q6K_OFF = 0, Q6K_AUTO = 1, Q6K_AVX2 = 2 };     // MOECTL_GGML_OWN_Q6K: 0, unset / 1, avx2

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

// The rows stream from DRAM once a token; the hardware prefetcher alone left a core at ~7 GB/s of the matrix here
// where it computes 25 from L1: asking for the block Q6K_PREFETCH bytes ahead (its 4 lines) gave ~10 (a 255 MB
// matrix, one thread, CPU time on a busy host; 1-16 KB ahead all within 10 %).
#define Q6K_PREFETCH 4096
#define Q6K_PREFETCH_BLOCK(p)                                                                                         \
    do {                                                                                                              \
        const char *pf_ = (const char *)(p) + Q6K_PREFETCH;                                                           \
        _mm_prefetch(pf_, _MM_HINT_T0);                                                                               \
        _mm_prefetch(pf_ + 64, _MM_HINT_T0);                                                                          \
        _mm_prefetch(pf_ + 128, _MM_HINT_T0);                                                                         \
        _mm_prefetch(pf_ + 192, _MM_HINT_T0);                                                                         \
    } while (0)

// --- AVX-512 -------------------------------------------------------------------------------------------------------
// Half j of a block (128 weights) is one 64-byte ql load and one 32-byte qh load broadcast to both 256-bit halves:
// the low nibbles of ql[0..63] are weights 0..63 of the half, whose top two bits are qh[l] bits 0-1 (l < 32) and
// bits 2-3 (l >= 32); the high nibbles are weights 64..127, top bits qh bits 4-5 and 6-7. One 64-bit variable shift
// per half moves each byte's two bits to bits 4-5 (left 4 / 2, right 0 / 2: within the byte for those bits).
// vpmaddubsw (q6 unsigned x q8 signed) gives 32 int16 sums of pairs, lane m of 64 weights in group m / 8 of the
// four the 64 cover; vpmaddwd / vpdpwssd with the scales spread to match (vpermw) gives int32.

#define Q6K_AVX512_ROWS(NAME, TARGET, DPW)                                                                            \
__attribute__((target(TARGET))) static void NAME(const uint8_t *w, size_t row_bytes, int64_t n, const q8k_block *q,  \
                                                 int64_t nb, float *y) {                                              \
    const __m512i m0f = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);                                        \
    const __m512i shl = _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4), shr = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0);   \
    __m512i sidx[4];                     /* chunk c's lane m: group 4c + m / 8 */                                     \
    for (int c = 0; c < 4; c++) {                                                                                     \
        int16_t ix[32];                                                                                               \
        for (int m = 0; m < 32; m++) ix[m] = (int16_t)(4 * c + m / 8);                                                \
        sidx[c] = _mm512_loadu_si512(ix);                                                                             \
    }                                                                                                                 \
    for (int64_t r = 0; r < n; r++) {                                                                                 \
        const q6k_block *x = (const q6k_block *)(w + r * row_bytes);                                                  \
        __m512 acc = _mm512_setzero_ps();                                                                             \
        for (int64_t i = 0; i < nb; i++) {                                                                            \
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x[i].scales));                \
            const __m512i sc = _mm512_castsi256_si512(sc16);                                                          \
            /* the -32 offset of every weight: 32 * sum_g scale_g * bsum_g (8 int32) */                               \
            const __m256i off = _mm256_slli_epi32(                                                                    \
                _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)q[i].bsums), sc16), 5);                         \
            __m512i s0 = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_zextsi256_si512(off));                      \
            __m512i s1 = _mm512_setzero_si512();                                                                      \
            for (int j = 0; j < 2; j++) {                                                                             \
                const __m512i ql = _mm512_loadu_si512(x[i].ql + 64 * j);                                              \
                const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(x[i].qh + 32 * j)));  \
                /* (ql & 0x0F) | (h & 0x30): 0xF8 = A | (B & C) with A = ql & 0x0F */                                 \
                const __m512i lo = _mm512_ternarylogic_epi32(_mm512_and_si512(ql, m0f),                               \
                                                             _mm512_sllv_epi64(qh, shl), m30, 0xF8);                  \
                const __m512i hi = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m0f),         \
                                                             _mm512_srlv_epi64(qh, shr), m30, 0xF8);                  \
                const __m512i p0 = _mm512_maddubs_epi16(lo, _mm512_loadu_si512(q[i].qs + 128 * j));                   \
                const __m512i p1 = _mm512_maddubs_epi16(hi, _mm512_loadu_si512(q[i].qs + 128 * j + 64));              \
                s0 = DPW(s0, p0, _mm512_permutexvar_epi16(sidx[2 * j], sc));                                          \
                s1 = DPW(s1, p1, _mm512_permutexvar_epi16(sidx[2 * j + 1], sc));                                      \
            }                                                                                                         \
            Q6K_PREFETCH_BLOCK(x + i);                                                                                \
            const float d = q[i].d * _cvtsh_ss(x[i].d);                                                               \
            acc = _mm512_fmadd_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), acc);              \
        }                                                                                                             \
        y[r] = _mm512_reduce_add_ps(acc);                                                                             \
    }                                                                                                                 \
}

#define Q6K_DPW_VNNI(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)
#define Q6K_DPW_BW(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
Q6K_AVX512_ROWS(q6k_rows_avx512vnni, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c", Q6K_DPW_VNNI)
Q6K_AVX512_ROWS(q6k_rows_avx512bw, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c", Q6K_DPW_BW)

// --- AVX2 ----------------------------------------------------------------------------------------------------------
// ggml's unpacking (32 weights a register) and its integer sums, one row at a time (two rows sharing the
// activation's loads were slower here: 16.5 GB/s from L1 against 21), the scales spread per 32 weights (two
// groups) by one byte shuffle of the 16 int16 scales held in both 128-bit lanes, and the prefetch above.

__attribute__((target("avx2,fma,f16c"))) static inline __m256i q6k_avx2_block(const q6k_block *x, const q8k_block *q) {
    const __m256i m3 = _mm256_set1_epi8(3), m15 = _mm256_set1_epi8(15);
    Q6K_PREFETCH_BLOCK(x);
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x->scales));
    const __m256i lo2 = _mm256_permute2x128_si256(sc16, sc16, 0x00), hi2 = _mm256_permute2x128_si256(sc16, sc16, 0x11);
    // chunk c of a half (32 weights, groups 2c and 2c + 1 of its 8): int16 lanes 0-7 take scale 2c, lanes 8-15 2c + 1
    const __m256i sh0 = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                         2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    const __m256i next = _mm256_set1_epi8(4);
    const __m256i bs = _mm256_loadu_si256((const __m256i *)q->bsums);
    __m256i s = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(bs, sc16), 5));
    __m256i t = _mm256_setzero_si256();
    for (int j = 0; j < 2; j++) {
        const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * j));
        const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * j + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(x->qh + 32 * j));
        const int8_t *q8 = q->qs + 128 * j;
        const __m256i a0 = _mm256_or_si256(_mm256_and_si256(ql0, m15), _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4));
        const __m256i a1 = _mm256_or_si256(_mm256_and_si256(ql1, m15),
                                           _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(12)), 2));
        const __m256i a2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m15),
                                           _mm256_and_si256(qh, _mm256_set1_epi8(48)));
        const __m256i a3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m15),
                                           _mm256_srli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(-64)), 2));
        const __m256i src = j ? hi2 : lo2;                 // groups 0..7 of the block, or 8..15
        const __m256i sh1 = _mm256_add_epi8(sh0, next), sh2 = _mm256_add_epi8(sh1, next);
        const __m256i sh3 = _mm256_add_epi8(sh2, next);
        const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_loadu_si256((const __m256i *)q8)),
                                             _mm256_shuffle_epi8(src, sh0));
        const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_loadu_si256((const __m256i *)(q8 + 32))),
                                             _mm256_shuffle_epi8(src, sh1));
        const __m256i p2 = _mm256_madd_epi16(_mm256_maddubs_epi16(a2, _mm256_loadu_si256((const __m256i *)(q8 + 64))),
                                             _mm256_shuffle_epi8(src, sh2));
        const __m256i p3 = _mm256_madd_epi16(_mm256_maddubs_epi16(a3, _mm256_loadu_si256((const __m256i *)(q8 + 96))),
                                             _mm256_shuffle_epi8(src, sh3));
        s = _mm256_add_epi32(s, _mm256_add_epi32(p0, p1));
        t = _mm256_add_epi32(t, _mm256_add_epi32(p2, p3));
    }
    return _mm256_add_epi32(s, t);
}

__attribute__((target("avx2,fma,f16c"))) static void q6k_rows_avx2(const uint8_t *w, size_t row_bytes, int64_t n,
                                                                   const q8k_block *q, int64_t nb, float *y) {
    for (int64_t r = 0; r < n; r++) {
        const q6k_block *x = (const q6k_block *)(w + r * row_bytes);
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < nb; i++) {
            const __m256i s = q6k_avx2_block(&x[i], &q[i]);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(q[i].d * _cvtsh_ss(x[i].d)), _mm256_cvtepi32_ps(s), acc);
        }
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        y[r] = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
    }
}
#endif

// The kernel a handle's setting picks on this CPU (mode: Q6K_*), or NULL: ggml's mul_mat stays.
static q6k_rows_fn q6k_kernel(int mode) {
#if defined(__x86_64__) || defined(__i386__)
    if (mode == Q6K_OFF) return NULL;
    __builtin_cpu_init();
    // AVX-512 only where the loaded ggml was built with it: the library says (MOECTL_GGML_ISA=avx2's build has none)
    const int avx512_ok = mode == Q6K_AUTO && ggml_cpu_has_avx512();
    if (avx512_ok && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq"))
        return __builtin_cpu_supports("avx512vnni") ? q6k_rows_avx512vnni : q6k_rows_avx512bw;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return q6k_rows_avx2;
#else
    (void)mode;
#endif
    return NULL;
}

static const char *q6k_kernel_name(q6k_rows_fn fn) {
#if defined(__x86_64__) || defined(__i386__)
    if (fn == q6k_rows_avx512vnni) return "avx512vnni";
    if (fn == q6k_rows_avx512bw) return "avx512bw";
    if (fn == q6k_rows_avx2) return "avx2";
#endif
    return fn ? "?" : "ggml";
}

// MOECTL_GGML_OWN_Q6K: 0 off, avx2 the AVX2 kernel even where AVX-512 is here (tests), else on (the best kernel)
static int q6k_mode_from_env(void) {
    const char *v = getenv("MOECTL_GGML_OWN_Q6K");
    if (v && !strcmp(v, "0")) return Q6K_OFF;
    if (v && !strcasecmp(v, "avx2")) return Q6K_AVX2;
    return Q6K_AUTO;
}

static int64_t q6k_products;              // products this kernel computed (tests: a graph ran it, not ggml)

// The activation's op (one task), before the product's: x [K, 1] F32 (src 0) -> dst I8 [Q6K_HEAD + K / 256 blocks
// of q8_K]: x quantized once by ggml's quantize_row_q8_K (as ggml's mul_mat does into its work buffer), and the
// product's chunk counter, ahead of the blocks on its own cache line, set to 0 (the graph's barrier after this op
// orders it before every thread's first chunk).
#define Q6K_HEAD 64

static size_t q6k_activation_bytes(int64_t K) { return Q6K_HEAD + sizeof(q8k_block) * (size_t)(K / 256); }

static void q6k_quantize_op(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    (void)nth, (void)userdata;
    if (ith) return;
    const struct ggml_tensor *X = dst->src[0];
    __atomic_store_n((int64_t *)dst->data, 0, __ATOMIC_RELAXED);
    ggml_get_type_traits_cpu(GGML_TYPE_Q8_K)->from_float((const float *)X->data, (uint8_t *)dst->data + Q6K_HEAD,
                                                         X->ne[0]);
}

#define Q6K_CHUNK 64                      // rows a thread takes at a time (the counter's step)

// The product's op: dst [N, 1] F32 = W [K, N] Q6_K (src 0) . the quantized activation (src 1, the op above). The
// threads take chunks of Q6K_CHUNK rows from the counter until none is left, as ggml's mul_mat hands out its
// chunks: a thread the machine slows takes fewer.
static void q6k_matvec_op(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    (void)nth;
    const q6k_rows_fn rows = (q6k_rows_fn)userdata;
    const struct ggml_tensor *W = dst->src[0];
    uint8_t *act = (uint8_t *)dst->src[1]->data;
    const q8k_block *q = (const q8k_block *)(act + Q6K_HEAD);
    const int64_t N = W->ne[1], nb = W->ne[0] / 256;
    if (ith == 0) __atomic_add_fetch(&q6k_products, 1, __ATOMIC_RELAXED);
    for (;;) {
        const int64_t r0 = __atomic_fetch_add((int64_t *)act, 1, __ATOMIC_RELAXED) * Q6K_CHUNK;
        if (r0 >= N) break;
        const int64_t n = N - r0 < Q6K_CHUNK ? N - r0 : Q6K_CHUNK;
        rows((const uint8_t *)W->data + r0 * W->nb[1], W->nb[1], n, q, nb, (float *)dst->data + r0);
    }
}
