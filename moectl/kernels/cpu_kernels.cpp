// moectl's CPU kernels, compiled on first use by moectl/kernels/__init__.py and called through ctypes.
//
// Legend: M = tokens (rows of x), N = output rows of a weight, K = its input columns, G = ceil(K / 64) blocks of
//         64 inputs, NG = ceil(N / 16) groups of 16 output rows (one 512-bit vector of fp32 lanes: lane r = row r).
//
// 1. q4 / q6 / q8 x int8 (what llama.cpp's repacked Q4_0 GEMV does, on moectl's own affine q4g64 / q8g64 copies;
//    q6g64 for a q4 model's lm_head, as llama.cpp's Q4_0 files keep their output tensor at Q6_K).
//    Weights: codes q in [0, 2^bits), w = (q - 2^(bits-1)) * s + m per block of 64 inputs (HQQ's w = (q - z) * s
//    with m = (2^(bits-1) - z) * s; at q4 the values torch's int4 kernel computes with). Packed per 16 rows x 64
//    inputs (512 bytes at q4, 1024 at q8):
//        q4: byte 64 c + 4 r + i  (c < 8, r < 16, i < 4) = q[row r][4 c + i] | q[row r][4 (c + 8) + i] << 4
//        q8: byte 64 c + 4 r + i  (c < 16)                = q[row r][4 c + i]
//        q6: the q4 layout of the low 4 bits (512 bytes), then byte 512 + 64 c + 4 r + i (c < 4) = the high 2 bits of
//            q[row r][4 (c + 4 j) + i] at bits 2j, 2j+1 (j < 4)                                     (768 bytes)
//    so a 64-byte load (and at q4 `& 0x0f`, `& 0xf0`: the high codes x16, undone by one shift of their sum) gives
//    vectors whose 32-bit lane r holds 4 consecutive codes of row r.
//    Scales: per 16 rows x 64 inputs, 16 bf16 s then 16 bf16 m (one part with the codes' grouping, so a copy is
//    two parts per matrix). Activations are quantized per block of 64 to int8 (d = amax / 127; llama.cpp's Q8_0
//    uses blocks of 32).
//    `vpdpbusd` (u8 codes x the block's 4 activations broadcast) adds 4 products into each row's lane, 16 of them
//    make a block's integer dot for 16 rows at once, and two FMAs apply the block: s d dot + (m - 8 s) d sum(a).
//    Rows per lane means no horizontal sums and one float step per 16 rows x 64 inputs.
//    N not a multiple of 16: zero rows pad the last group; K not a multiple of 64: code 0 and activation 0 pad.
// 2. bf16 x bf16 -> fp32 (`vdpbf16ps`): one-row products of dense bf16 matrices (exact products, fp32 sums),
//    8 rows at a time.
// 3. One token through a layer's routed experts (decode), each gate_up -> SiLU(gate) * up -> down with the
//    low-bit product of 1., the weighted sum in the expert order given: one call instead of ~15 torch operations
//    and 4 kernel calls an expert, with every rounding where the composed torch operations round.
// 4. One query token's attention over a KV cache (decode): scores, softmax (with an optional sink logit per head,
//    GPT-OSS's) and the weighted sum of values in fp32, grouped heads reading their key/value head in place.
//
// Threads: at::parallel_for over output row groups (attention: key/value heads), i.e. torch's own OpenMP pool and
// torch.set_num_threads
// (built with -fopenmp against torch's libgomp).

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

extern "C" __m512 Sleef_expf16_u10(__m512);                // torch's vectorized exp (libtorch_cpu exports it)

namespace {

inline float bf16_to_f32(uint16_t h) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {                     // round to nearest even, as torch's .to(bfloat16)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);   // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

// 16 bf16 -> 16 fp32
inline __m512 load_bf16x16(const uint16_t* p) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

constexpr int MT = 8;                                      // tokens per pass over a row group's codes
// q4 / q6 blocks a row group prefetches ahead (non-temporal: the stream stays out of L2/L3). One 14336 x 4096 q4
// matrix not in cache, one token, one thread: 1.65 -> 1.50 ms with it; 2 blocks did no better, 8 and 16 worse; q8,
// twice the bytes per operation, gained nothing.
constexpr int64_t PF = 4;

}  // namespace

// x [M, K] bf16 -> aq [M, 64 G] int8 (input order, zero-padded), d [M, G] fp32 (amax / 127 of each block),
// xs [M, G] fp32 (d * sum(a) of each block). Vectorized (a decode token's 14336 expert inputs are 224 blocks).
extern "C" void moectl_q8_act(const uint16_t* x, int64_t M, int64_t K, int8_t* aq, float* d, float* xs) {
    const int64_t G = (K + 63) / 64;
    at::parallel_for(0, M * G, 1024, [&](int64_t j0, int64_t j1) {      // a decode row runs inline
        for (int64_t j = j0; j < j1; ++j) {
            const int64_t m = j / G, b = j % G, k0 = b * 64, n = std::min<int64_t>(64, K - k0);
            alignas(64) uint16_t raw[64] = {};
            std::memcpy(raw, x + m * K + k0, n * 2);
            __m512 v[4];
            __m512 amax = _mm512_setzero_ps();
            for (int i = 0; i < 4; ++i) {
                v[i] = load_bf16x16(raw + 16 * i);
                amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
            }
            const float dd = _mm512_reduce_max_ps(amax) / 127.f, inv = dd > 0.f ? 1.f / dd : 0.f;
            __m512i sum = _mm512_setzero_si512();
            for (int i = 0; i < 4; ++i) {         // round to nearest even, as std::nearbyint in the default mode
                __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], _mm512_set1_ps(inv)));
                q = _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
                sum = _mm512_add_epi32(sum, q);
                _mm_storeu_si128(reinterpret_cast<__m128i*>(aq + m * G * 64 + k0 + 16 * i), _mm512_cvtepi32_epi8(q));
            }
            d[m * G + b] = dd;
            xs[m * G + b] = dd * static_cast<float>(_mm512_reduce_add_epi32(sum));
        }
    });
}

namespace {

inline int32_t four(const int8_t* p) {                     // 4 activations as one 32-bit word, for a broadcast
    int32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

// A block's 64 codes of 16 rows as 16 vectors of unsigned bytes, vector c holding inputs 4c .. 4c+3 of row r in
// 32-bit lane r. 8 bits: 16 loads. 4 bits: 8 loads, each giving c (low nibbles, & 0x0f) and c + 8 taken in place
// (& 0xf0, i.e. 16 x the code): their products come out x16 and one shift of the summed dot undoes it, where a
// shift per load would cost 8.
template <int BITS>
inline void load_block(const uint8_t* blk, __m512i* q) {
    if constexpr (BITS == 4) {
        const __m512i lo = _mm512_set1_epi8(0x0f), hi = _mm512_set1_epi8(static_cast<char>(0xf0));
        for (int c = 0; c < 8; ++c) {
            const __m512i v = _mm512_loadu_si512(blk + 64 * c);
            q[c] = _mm512_and_si512(v, lo);
            q[c + 8] = _mm512_and_si512(v, hi);
        }
    } else {
        for (int c = 0; c < 16; ++c) q[c] = _mm512_loadu_si512(blk + 64 * c);
    }
}

// 16 rows' integer dot of a q4 block (vectors q from load_block<4>: 8-15 are x16) with its 64 activations a. Four
// independent chains: with two, dpbusd's latency rather than its throughput bounds a decode row (with the in-place
// high nibbles: one 14336 x 4096 q4 matrix not in cache, one token, one thread, 1.83 -> 1.51 ms; 32 tokens 13.5 ->
// 11.1 ms).
inline __m512i q4_dot(const __m512i* q, const int8_t* a) {
    __m512i d0 = _mm512_setzero_si512(), d1 = d0, d2 = d0, d3 = d0;
    for (int c = 0; c < 8; c += 2) {
        d0 = _mm512_dpbusd_epi32(d0, q[c], _mm512_set1_epi32(four(a + 4 * c)));
        d1 = _mm512_dpbusd_epi32(d1, q[c + 1], _mm512_set1_epi32(four(a + 4 * c + 4)));
        d2 = _mm512_dpbusd_epi32(d2, q[c + 8], _mm512_set1_epi32(four(a + 4 * c + 32)));
        d3 = _mm512_dpbusd_epi32(d3, q[c + 9], _mm512_set1_epi32(four(a + 4 * c + 36)));
    }
    return _mm512_add_epi32(_mm512_add_epi32(d0, d1), _mm512_srai_epi32(_mm512_add_epi32(d2, d3), 4));
}

// The dot of a q6 block's high 2 bits (its 256 bytes after the q4 layout of the low nibbles): vectors c, c+4, c+8,
// c+12 in bits 0-1, 2-3, 4-5, 6-7 of 4 vectors, each masked in place (x1, x4, x16, x64) and unscaled by one shift
// of its sum.
inline __m512i q6_high_dot(const uint8_t* hb, const int8_t* a) {
    __m512i e0 = _mm512_setzero_si512(), e1 = e0, e2 = e0, e3 = e0;
    for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(hb + 64 * c);
        e0 = _mm512_dpbusd_epi32(e0, _mm512_and_si512(v, _mm512_set1_epi8(0x03)), _mm512_set1_epi32(four(a + 4 * c)));
        e1 = _mm512_dpbusd_epi32(e1, _mm512_and_si512(v, _mm512_set1_epi8(0x0c)),
                                 _mm512_set1_epi32(four(a + 4 * c + 16)));
        e2 = _mm512_dpbusd_epi32(e2, _mm512_and_si512(v, _mm512_set1_epi8(0x30)),
                                 _mm512_set1_epi32(four(a + 4 * c + 32)));
        e3 = _mm512_dpbusd_epi32(e3, _mm512_and_si512(v, _mm512_set1_epi8(static_cast<char>(0xc0))),
                                 _mm512_set1_epi32(four(a + 4 * c + 48)));
    }
    return _mm512_add_epi32(_mm512_add_epi32(e0, _mm512_srai_epi32(e1, 2)),
                            _mm512_add_epi32(_mm512_srai_epi32(e2, 4), _mm512_srai_epi32(e3, 6)));
}

// A q6 block's integer dot: the low nibbles (a q4 block) read and masked per token too, not held as load_block's
// 16 vectors as q4's are (held, the q6 product of one 14336 x 4096 matrix, one token, one thread, took 2.4 ms
// instead of 1.9), plus the high bits x16.
inline __m512i q6_dot(const uint8_t* blk, const int8_t* a) {
    const __m512i lo = _mm512_set1_epi8(0x0f), hi = _mm512_set1_epi8(static_cast<char>(0xf0));
    __m512i d0 = _mm512_setzero_si512(), d1 = d0, d2 = d0, d3 = d0;
    for (int c = 0; c < 8; c += 2) {
        const __m512i v0 = _mm512_loadu_si512(blk + 64 * c), v1 = _mm512_loadu_si512(blk + 64 * c + 64);
        d0 = _mm512_dpbusd_epi32(d0, _mm512_and_si512(v0, lo), _mm512_set1_epi32(four(a + 4 * c)));
        d1 = _mm512_dpbusd_epi32(d1, _mm512_and_si512(v1, lo), _mm512_set1_epi32(four(a + 4 * c + 4)));
        d2 = _mm512_dpbusd_epi32(d2, _mm512_and_si512(v0, hi), _mm512_set1_epi32(four(a + 4 * c + 32)));
        d3 = _mm512_dpbusd_epi32(d3, _mm512_and_si512(v1, hi), _mm512_set1_epi32(four(a + 4 * c + 36)));
    }
    const __m512i low = _mm512_add_epi32(_mm512_add_epi32(d0, d1), _mm512_srai_epi32(_mm512_add_epi32(d2, d3), 4));
    return _mm512_add_epi32(low, _mm512_slli_epi32(q6_high_dot(blk + 512, a), 4));
}

// One group of 16 rows against T tokens (m0 .. m0+T-1); y[t][16] fp32. T is a template argument so the
// accumulators stay in registers.
template <int BITS, int T>
inline void lowbit_group(const uint8_t* wq, const uint16_t* sm, const int8_t* aq, const float* d,
                         const float* xs, int64_t G, int64_t m0, float* y) {
    constexpr int64_t BLOCK = 8 * BITS * 16;               // bytes of 16 rows x 64 codes
    const __m512 center = _mm512_set1_ps(-static_cast<float>(1 << (BITS - 1)));   // codes stored + 8 / 32 / 128
    __m512 acc[T];
    for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < G; ++b) {
        __m512i q[16];
        if constexpr (BITS != 8)    // the block PF ahead (past a group's end: the next group's, or nothing)
            for (int c = 0; c < BLOCK / 64; ++c)
                _mm_prefetch(reinterpret_cast<const char*>(wq + (b + PF) * BLOCK + 64 * c), _MM_HINT_NTA);
        if constexpr (BITS != 6) load_block<BITS>(wq + b * BLOCK, q);
        const __m512 s = load_bf16x16(sm + b * 32);
        const __m512 off = _mm512_fmadd_ps(s, center, load_bf16x16(sm + b * 32 + 16));   // m - 8 s (m - 128 s)
        for (int t = 0; t < T; ++t) {
            const int8_t* a = aq + ((m0 + t) * G + b) * 64;
            __m512i dot;
            if constexpr (BITS == 6) {
                dot = q6_dot(wq + b * BLOCK, a);
            } else if constexpr (BITS == 4) {
                dot = q4_dot(q, a);
            } else {                                        // q8 reads twice the bytes: two chains keep up
                __m512i d0 = _mm512_setzero_si512(), d1 = d0;
                for (int c = 0; c < 16; c += 2) {
                    d0 = _mm512_dpbusd_epi32(d0, q[c], _mm512_set1_epi32(four(a + 4 * c)));
                    d1 = _mm512_dpbusd_epi32(d1, q[c + 1], _mm512_set1_epi32(four(a + 4 * c + 4)));
                }
                dot = _mm512_add_epi32(d0, d1);
            }
            const int64_t j = (m0 + t) * G + b;
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, _mm512_set1_ps(d[j])), acc[t]);
            acc[t] = _mm512_fmadd_ps(off, _mm512_set1_ps(xs[j]), acc[t]);
        }
    }
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + 16 * t, acc[t]);
}

template <int BITS>
void lowbit_matmul(const int8_t* aq, const float* d, const float* xs, int64_t M, int64_t N, int64_t K,
                   const uint8_t* codes, const uint16_t* sm, uint16_t* y) {
    constexpr int64_t BLOCK = 8 * BITS * 16;
    const int64_t G = (K + 63) / 64, NG = (N + 15) / 16;
    // Chunks of at least ~256 KB of codes x tokens: a small matrix runs inline rather than waking the pool (whose
    // threads then spin on the cores the other side of a GPU run, the copy engine and the CPU worker, needs).
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / (G * BLOCK * std::min<int64_t>(M, MT)));
    at::parallel_for(0, NG, grain, [&](int64_t g0, int64_t g1) {
        alignas(64) float out[MT * 16];
        for (int64_t g = g0; g < g1; ++g) {
            const uint8_t* wq = codes + g * G * BLOCK;
            const uint16_t* smg = sm + g * G * 32;
            for (int64_t m0 = 0; m0 < M; m0 += MT) {
                const int64_t mt = M - m0 < MT ? M - m0 : MT;
                switch (mt) {
                    case 1: lowbit_group<BITS, 1>(wq, smg, aq, d, xs, G, m0, out); break;
                    case 2: lowbit_group<BITS, 2>(wq, smg, aq, d, xs, G, m0, out); break;
                    case 3: lowbit_group<BITS, 3>(wq, smg, aq, d, xs, G, m0, out); break;
                    case 4: lowbit_group<BITS, 4>(wq, smg, aq, d, xs, G, m0, out); break;
                    case 5: lowbit_group<BITS, 5>(wq, smg, aq, d, xs, G, m0, out); break;
                    case 6: lowbit_group<BITS, 6>(wq, smg, aq, d, xs, G, m0, out); break;
                    case 7: lowbit_group<BITS, 7>(wq, smg, aq, d, xs, G, m0, out); break;
                    default: lowbit_group<BITS, MT>(wq, smg, aq, d, xs, G, m0, out);
                }
                const int64_t rows = N - 16 * g < 16 ? N - 16 * g : 16;
                for (int64_t t = 0; t < mt; ++t)
                    for (int64_t r = 0; r < rows; ++r) y[(m0 + t) * N + 16 * g + r] = f32_to_bf16(out[16 * t + r]);
            }
        }
    });
}

}  // namespace

// y [M, N] bf16 = x @ W^T for a low-bit W of `bits` 4, 6 or 8: codes [NG, G, 8 bits 16] u8, sm [NG, G, 2, 16] bf16
// (s, then m, of each row's block); aq / d / xs from moectl_q8_act.
extern "C" void moectl_lowbit_matmul(const int8_t* aq, const float* d, const float* xs, int64_t M, int64_t N,
                                     int64_t K, const uint8_t* codes, const uint16_t* sm, int64_t bits, uint16_t* y) {
    if (bits == 4)
        lowbit_matmul<4>(aq, d, xs, M, N, K, codes, sm, y);
    else if (bits == 6)
        lowbit_matmul<6>(aq, d, xs, M, N, K, codes, sm, y);
    else
        lowbit_matmul<8>(aq, d, xs, M, N, K, codes, sm, y);
}

// y [N] bf16 = W [N, K] bf16 @ x [K] bf16, fp32 sums; K % 32 == 0 (a decode token's dense products).
extern "C" void moectl_bf16_gemv(const uint16_t* x, int64_t N, int64_t K, const uint16_t* w, uint16_t* y) {
    constexpr int R = 8;                                   // rows at once: 8 streams, 8 independent vdpbf16ps chains
    const int64_t grain = std::max<int64_t>(R, (int64_t{1} << 18) / (2 * K));   // >= ~256 KB a chunk
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
        int64_t n = n0;
        for (; n + R <= n1; n += R) {
            __m512 acc[R];
            for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
            for (int64_t k = 0; k < K; k += 32) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
                for (int r = 0; r < R; ++r)
                    acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(w + (n + r) * K + k), xv);
            }
            for (int r = 0; r < R; ++r) y[n + r] = f32_to_bf16(_mm512_reduce_add_ps(acc[r]));
        }
        for (; n < n1; ++n) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t k = 0; k < K; k += 32)
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w + n * K + k),
                                       (__m512bh)_mm512_loadu_si512(x + k));
            y[n] = f32_to_bf16(_mm512_reduce_add_ps(acc));
        }
    });
}

// One query token's attention (decode). q [H, Dk] bf16 (contiguous); k [KV, S, Dk], v [KV, S, Dv] bf16 with head
// stride kh / vh and row stride ks / vs (elements; the last dimension contiguous); H a multiple of KV, query head h
// reads key/value head h / (H / KV). sinks: null, or [H] fp32 logits that join each head's softmax (not its sum).
// out [H, Dv] bf16. Dk % 32 == 0, Dv % 16 == 0, Dv <= 512.
extern "C" void moectl_decode_attention(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t H,
                                        int64_t KV, int64_t S, int64_t Dk, int64_t Dv, int64_t kh, int64_t ks,
                                        int64_t vh, int64_t vs, float scale, const float* sinks, uint16_t* out) {
    const int64_t rep = H / KV;
    // a key/value head's bytes per chunk >= ~256 KB: a short cache runs inline, as the products do
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, S * (Dk + Dv) * 2));
    at::parallel_for(0, KV, grain, [&](int64_t g0, int64_t g1) {
        std::vector<float> p(S);
        __m512 acc[32];                                    // Dv <= 512
        for (int64_t g = g0; g < g1; ++g) {
            for (int64_t r = 0; r < rep; ++r) {
                const int64_t h = g * rep + r;
                const uint16_t* qh = q + h * Dk;
                float mx = sinks ? sinks[h] : -INFINITY;
                for (int64_t s = 0; s < S; ++s) {                                   // scores: q . k_s * scale
                    const uint16_t* ksr = k + g * kh + s * ks;
                    __m512 a = _mm512_setzero_ps();
                    for (int64_t i = 0; i < Dk; i += 32)
                        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(ksr + i),
                                             (__m512bh)_mm512_loadu_si512(qh + i));
                    p[s] = _mm512_reduce_add_ps(a) * scale;
                    mx = std::fmax(mx, p[s]);
                }
                float sum = sinks ? std::exp(sinks[h] - mx) : 0.f;
                for (int64_t s = 0; s < S; ++s) {
                    p[s] = std::exp(p[s] - mx);
                    sum += p[s];
                }
                for (int64_t i = 0; i < Dv / 16; ++i) acc[i] = _mm512_setzero_ps();
                for (int64_t s = 0; s < S; ++s) {                                   // sum_s p_s v_s
                    const uint16_t* vsr = v + g * vh + s * vs;
                    const __m512 ps = _mm512_set1_ps(p[s]);
                    for (int64_t i = 0; i < Dv / 16; ++i)
                        acc[i] = _mm512_fmadd_ps(ps, load_bf16x16(vsr + 16 * i), acc[i]);
                }
                const float inv = 1.f / sum;
                alignas(64) float o[16];
                for (int64_t i = 0; i < Dv / 16; ++i) {
                    _mm512_store_ps(o, _mm512_mul_ps(acc[i], _mm512_set1_ps(inv)));
                    for (int j = 0; j < 16; ++j) out[h * Dv + 16 * i + j] = f32_to_bf16(o[j]);
                }
            }
        }
    });
}

// One token through K experts (decode): for each expert k in the order given,
//     u = bf16(x @ W13_k^T) [2I];  h = bf16(bf16(silu(u[:I])) * u[I:]) [I];  y = bf16(h @ W2_k^T) [H]
//     out = bf16(out + bf16(y * weights[k]))           (out starts at 0)
// i.e. transformers' SiLU gating and moectl's weighted sum, rounded where the torch operations round (silu and the
// products in fp32, each result to bf16). x [H] bf16; W13_k [2I, H] and W2_k [H, I] in the low-bit layout of
// bits13 / bits2 (codes and sm per matrix, as moectl_lowbit_matmul); out [H] bf16.
extern "C" void moectl_experts_decode(const uint16_t* x, int64_t H, int64_t I, int64_t K,
                                      const uint8_t* const* codes13, const uint16_t* const* sm13, int64_t bits13,
                                      const uint8_t* const* codes2, const uint16_t* const* sm2, int64_t bits2,
                                      const float* weights, uint16_t* out) {
    const int64_t GH = (H + 63) / 64, GI = (I + 63) / 64;
    std::vector<int8_t> ax(GH * 64), ah(GI * 64);
    std::vector<float> dx(GH), sx(GH), dh(GI), sh(GI);
    std::vector<uint16_t> u(2 * I), h(I), y(H);
    moectl_q8_act(x, 1, H, ax.data(), dx.data(), sx.data());      // shared by every expert's gate_up
    std::fill(out, out + H, uint16_t{0});
    for (int64_t k = 0; k < K; ++k) {
        moectl_lowbit_matmul(ax.data(), dx.data(), sx.data(), 1, 2 * I, H, codes13[k], sm13[k], bits13, u.data());
        int64_t i = 0;
        for (; i + 16 <= I; i += 16) {            // torch's vectorized silu: x / (1 + Sleef exp(-x)), then * up
            const __m512 g = load_bf16x16(u.data() + i);
            const __m512 act = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f),
                                                              Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), g))));
            alignas(64) float a[16], up[16];
            _mm512_store_ps(a, act);
            _mm512_store_ps(up, load_bf16x16(u.data() + I + i));
            for (int j = 0; j < 16; ++j) h[i + j] = f32_to_bf16(bf16_to_f32(f32_to_bf16(a[j])) * up[j]);
        }
        for (; i < I; ++i) {                      // the tail: torch's scalar path
            const float g = bf16_to_f32(u[i]);
            const float act = bf16_to_f32(f32_to_bf16(g / (1.f + std::exp(-g))));
            h[i] = f32_to_bf16(act * bf16_to_f32(u[I + i]));
        }
        moectl_q8_act(h.data(), 1, I, ah.data(), dh.data(), sh.data());
        moectl_lowbit_matmul(ah.data(), dh.data(), sh.data(), 1, H, I, codes2[k], sm2[k], bits2, y.data());
        for (int64_t j = 0; j < H; ++j) {
            const float wy = bf16_to_f32(f32_to_bf16(bf16_to_f32(y[j]) * weights[k]));
            out[j] = f32_to_bf16(bf16_to_f32(out[j]) + wy);
        }
    }
}
