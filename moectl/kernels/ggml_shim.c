// moectl's bridge to ggml's CPU backend (moectl/kernels/ggml.py): expert products over weights that stay where
// they lie (the memory-mapped GGUF file, or a host buffer holding its bytes), in their own block encoding.
//
// Legend (torch order, row-major): T = tokens, K = input width, N = output rows, A = experts stacked in one tensor,
// U = experts used per token (top-k), H = hidden size, I = expert intermediate size.
//
// Every call builds a small ggml graph over tensors whose `data` points at the caller's memory (weights, x, y):
// nothing is copied or dequantised; ggml's mul_mat quantizes x to its vec_dot type (q8_0 / q8_K / ...) in its work
// buffer, as llama.cpp does. Intermediates live in a per-handle arena; one handle per calling thread (a handle
// holds ggml's threadpool at the caller's thread count, its arena and work buffer: not thread safe).

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml.h"
#include "ggml-cpu.h"

#define MG_ALIGN 64
#define MG_MAX_NODES 4096

typedef struct {
    struct ggml_threadpool *pool;
    int n_threads;
    uint8_t *meta;       // ggml_init's memory: tensor and graph headers only (no_alloc)
    size_t meta_size;
    uint8_t *arena;      // intermediates
    size_t arena_size, arena_used;
    uint8_t *work;       // ggml_graph_plan's work buffer (x quantized to the vec_dot type, ...)
    size_t work_size;
    int failed;          // an arena too small: the call is redone with a larger one
} mg_handle;

int mg_abi(void) { return 2; }

void *mg_new(int n_threads, int poll) {
    ggml_cpu_init();
    mg_handle *h = calloc(1, sizeof(mg_handle));
    if (!h) return NULL;
    struct ggml_threadpool_params p = ggml_threadpool_params_default(n_threads);
    p.poll = poll;                    // 0: workers sleep between graphs (torch's threads share the cores)
    h->pool = ggml_threadpool_new(&p);
    h->n_threads = n_threads;
    h->meta_size = ggml_tensor_overhead() * MG_MAX_NODES + ggml_graph_overhead_custom(MG_MAX_NODES, false) + 4096;
    h->meta = malloc(h->meta_size);
    return h;
}

void mg_free(void *hp) {
    mg_handle *h = hp;
    if (!h) return;
    ggml_threadpool_free(h->pool);
    free(h->meta);
    free(h->arena);
    free(h->work);
    free(h);
}

static struct ggml_context *begin(mg_handle *h) {
    struct ggml_init_params ip = {h->meta_size, h->meta, true};
    h->arena_used = 0;
    h->failed = 0;
    return ggml_init(ip);
}

// an op's result gets arena memory as soon as it is made (views made later see its data)
static struct ggml_tensor *own(mg_handle *h, struct ggml_tensor *t) {
    size_t n = (ggml_nbytes(t) + MG_ALIGN - 1) / MG_ALIGN * MG_ALIGN;
    if (h->arena_used + n > h->arena_size) {
        h->failed = 1;                               // counted; memory found for the retry
        h->arena_used += n;
        t->data = NULL;
        return t;
    }
    t->data = h->arena + h->arena_used;
    h->arena_used += n;
    return t;
}

static struct ggml_tensor *ext(struct ggml_context *ctx, enum ggml_type type, int64_t ne0, int64_t ne1, int64_t ne2,
                               const void *data) {
    struct ggml_tensor *t = ggml_new_tensor_3d(ctx, type, ne0, ne1, ne2);
    t->data = (void *)data;
    return t;
}

// run the graph ending in the n tensors `outs`; returns 0, or 1 when the arena was too small (grown: the caller
// retries)
static int run_all(mg_handle *h, struct ggml_context *ctx, struct ggml_tensor *const *outs, int n) {
    if (h->failed) {
        free(h->arena);
        h->arena_size = h->arena_used * 2;
        h->arena = aligned_alloc(MG_ALIGN, (h->arena_size + MG_ALIGN - 1) / MG_ALIGN * MG_ALIGN);
        ggml_free(ctx);
        return 1;
    }
    struct ggml_cgraph *gf = ggml_new_graph_custom(ctx, MG_MAX_NODES, false);
    for (int i = 0; i < n; i++) ggml_build_forward_expand(gf, outs[i]);
    struct ggml_cplan plan = ggml_graph_plan(gf, h->n_threads, h->pool);
    if (plan.work_size > h->work_size) {
        free(h->work);
        h->work_size = plan.work_size;
        h->work = malloc(h->work_size);
    }
    plan.work_data = h->work;
    ggml_graph_compute(gf, &plan);
    ggml_free(ctx);
    return 0;
}

static int run(mg_handle *h, struct ggml_context *ctx, struct ggml_tensor *out) { return run_all(h, ctx, &out, 1); }

// y [T, N] = x [T, K] @ W^T, W [N, K] in `type` (rows of blocks, the file's layout).
static int mul_mat_once(mg_handle *h, int type, const void *w, int64_t N, int64_t K, const float *x, int64_t T,
                        float *y) {
    struct ggml_context *ctx = begin(h);
    struct ggml_tensor *W = ext(ctx, type, K, N, 1, w);
    struct ggml_tensor *X = ext(ctx, GGML_TYPE_F32, K, T, 1, x);
    struct ggml_tensor *Y = ggml_mul_mat(ctx, W, X);               // [N, T] in ggml's order = y [T, N]
    Y->data = y;
    return run(h, ctx, Y);
}

void mg_mul_mat(void *h, int type, const void *w, int64_t N, int64_t K, const float *x, int64_t T, float *y) {
    while (mul_mat_once(h, type, w, N, K, x, T, y)) {}
}

// Two matrices on the same x in one graph (an expert's gate and up): y1 [T, N1], y2 [T, N2].
static int mul_mat2_once(mg_handle *h, int t1, const void *w1, int64_t N1, int t2, const void *w2, int64_t N2,
                         int64_t K, const float *x, int64_t T, float *y1, float *y2) {
    struct ggml_context *ctx = begin(h);
    struct ggml_tensor *X = ext(ctx, GGML_TYPE_F32, K, T, 1, x);
    struct ggml_tensor *Y1 = ggml_mul_mat(ctx, ext(ctx, t1, K, N1, 1, w1), X);
    Y1->data = y1;
    struct ggml_tensor *Y2 = ggml_mul_mat(ctx, ext(ctx, t2, K, N2, 1, w2), X);
    Y2->data = y2;
    struct ggml_tensor *outs[2] = {Y1, Y2};
    return run_all(h, ctx, outs, 2);
}

void mg_mul_mat2(void *h, int t1, const void *w1, int64_t N1, int t2, const void *w2, int64_t N2, int64_t K,
                 const float *x, int64_t T, float *y1, float *y2) {
    while (mul_mat2_once(h, t1, w1, N1, t2, w2, N2, K, x, T, y1, y2)) {}
}

// ggml_mul_mat_id: A matrices [N, K] stacked (`w`, A * N rows), x [T, XB, K] with XB = 1 (every used expert reads
// the token's row) or U, ids [T, U] int32; y [T, U, N].
static int mul_mat_id_once(mg_handle *h, int type, const void *w, int64_t A, int64_t N, int64_t K, const float *x,
                           int64_t XB, const int32_t *ids, int64_t U, int64_t T, float *y) {
    struct ggml_context *ctx = begin(h);
    struct ggml_tensor *W = ext(ctx, type, K, N, A, w);
    struct ggml_tensor *X = ext(ctx, GGML_TYPE_F32, K, XB, T, x);
    struct ggml_tensor *ID = ext(ctx, GGML_TYPE_I32, U, T, 1, ids);
    struct ggml_tensor *Y = ggml_mul_mat_id(ctx, W, X, ID);        // [N, U, T]
    Y->data = y;
    return run(h, ctx, Y);
}

void mg_mul_mat_id(void *h, int type, const void *w, int64_t A, int64_t N, int64_t K, const float *x, int64_t XB,
                   const int32_t *ids, int64_t U, int64_t T, float *y) {
    while (mul_mat_id_once(h, type, w, A, N, K, x, XB, ids, U, T, y)) {}
}

// The activation between an expert's gate/up products and its down product: SiLU(gate) * up (llama.cpp's
// LLM_FFN_SILU), or with alpha > 0 GPT-OSS's swiglu_oai (LLM_FFN_SWIGLU_OAI_MOE: gate clamped above at limit, up to
// [-limit, limit]; gate * sigmoid(alpha gate) * (up + 1)).
typedef struct { float alpha, limit; } mg_act;

static struct ggml_tensor *activate(mg_handle *h, struct ggml_context *ctx, struct ggml_tensor *G,
                                    struct ggml_tensor *Up, mg_act act) {
    return own(h, act.alpha > 0 ? ggml_swiglu_oai(ctx, G, Up, act.alpha, act.limit) : ggml_swiglu_split(ctx, G, Up));
}

// One MoE layer's routed experts, as llama.cpp's build_moe_ffn: gate/up/down stacked ([A, I, H], [A, I, H],
// [A, H, I]: the GGUF's ffn_*_exps), x [T, H], ids [T, U], weights [T, U]; biases bg/bu [A, I], bd [A, H] (F32:
// GPT-OSS's ffn_*_exps.bias, added per used expert as ggml_add_id does) or NULL;
// y [T, H] = sum_u weights[t, u] * (down_{ids[t,u]}(act(gate x + bg, up x + bu)) + bd).
// stacked experts `A` matrices [N, K] of `type` at `data`, `stride` bytes apart (0: back to back, a GGUF's
// ffn_*_exps; else the rows of a buffer holding one expert per row, moectl's ggml copies)
static struct ggml_tensor *stack(struct ggml_context *ctx, int type, int64_t K, int64_t N, int64_t A, const void *data,
                                 int64_t stride) {
    struct ggml_tensor *t = ext(ctx, type, K, N, A, data);
    if (stride) t->nb[2] = (size_t)stride;
    return t;
}

static int moe_once(mg_handle *h, int tg, const void *wg, int tu, const void *wu, int td, const void *wd,
                    const float *bg, const float *bu, const float *bd, mg_act act, int64_t A, int64_t H, int64_t I,
                    const float *x, const int32_t *ids, const float *wts, int64_t U, int64_t T, float *y,
                    int64_t stride) {
    struct ggml_context *ctx = begin(h);
    struct ggml_tensor *X = ext(ctx, GGML_TYPE_F32, H, 1, T, x);
    struct ggml_tensor *ID = ext(ctx, GGML_TYPE_I32, U, T, 1, ids);
    struct ggml_tensor *WT = ext(ctx, GGML_TYPE_F32, 1, U, T, wts);
    struct ggml_tensor *G = own(h, ggml_mul_mat_id(ctx, stack(ctx, tg, H, I, A, wg, stride), X, ID));   // [I, U, T]
    struct ggml_tensor *Up = own(h, ggml_mul_mat_id(ctx, stack(ctx, tu, H, I, A, wu, stride), X, ID));
    if (bg) G = own(h, ggml_add_id(ctx, G, ext(ctx, GGML_TYPE_F32, I, A, 1, bg), ID));
    if (bu) Up = own(h, ggml_add_id(ctx, Up, ext(ctx, GGML_TYPE_F32, I, A, 1, bu), ID));
    struct ggml_tensor *Act = activate(h, ctx, G, Up, act);
    struct ggml_tensor *D = own(h, ggml_mul_mat_id(ctx, stack(ctx, td, I, H, A, wd, stride), Act, ID));  // [H, U, T]
    if (bd) D = own(h, ggml_add_id(ctx, D, ext(ctx, GGML_TYPE_F32, H, A, 1, bd), ID));
    D = own(h, ggml_mul(ctx, D, WT));
    struct ggml_tensor *acc = NULL;
    for (int64_t u = 0; u < U; u++) {                                                          // sum over U
        struct ggml_tensor *v = ggml_view_2d(ctx, D, H, T, D->nb[2], u * D->nb[1]);
        acc = acc == NULL ? v : own(h, ggml_add(ctx, acc, v));
    }
    if (U == 1) acc = own(h, ggml_cont(ctx, acc));
    acc->data = y;                                   // the last op writes the caller's y [T, H]
    return run(h, ctx, acc);
}

void mg_moe(void *h, int tg, const void *wg, int tu, const void *wu, int td, const void *wd, int64_t A, int64_t H,
            int64_t I, const float *x, const int32_t *ids, const float *wts, int64_t U, int64_t T, float *y) {
    mg_act silu = {0, 0};
    while (moe_once(h, tg, wg, tu, wu, td, wd, NULL, NULL, NULL, silu, A, H, I, x, ids, wts, U, T, y, 0)) {}
}

// mg_moe over experts `stride` bytes apart: each matrix's expert e at its pointer + e * stride
void mg_moe_strided(void *h, int tg, const void *wg, int tu, const void *wu, int td, const void *wd, int64_t stride,
                    int64_t A, int64_t H, int64_t I, const float *x, const int32_t *ids, const float *wts, int64_t U,
                    int64_t T, float *y) {
    mg_act silu = {0, 0};
    while (moe_once(h, tg, wg, tu, wu, td, wd, NULL, NULL, NULL, silu, A, H, I, x, ids, wts, U, T, y, stride)) {}
}

// GPT-OSS's MoE layer (llama.cpp's openai-moe build_moe_ffn): mg_moe with the biases and swiglu_oai(alpha, limit).
void mg_moe_oai(void *h, int tg, const void *wg, int tu, const void *wu, int td, const void *wd, const float *bg,
                const float *bu, const float *bd, float alpha, float limit, int64_t A, int64_t H, int64_t I,
                const float *x, const int32_t *ids, const float *wts, int64_t U, int64_t T, float *y) {
    mg_act oai = {alpha, limit};
    while (moe_once(h, tg, wg, tu, wu, td, wd, bg, bu, bd, oai, A, H, I, x, ids, wts, U, T, y, 0)) {}
}

// n experts, each its own three matrices anywhere (per-expert pointers: the file's stacked tensors or per-expert
// ones, or host buffers), all applied to the same x [T, H] and summed with coef [n, T]: a decode step's layer
// (T = 1) in one graph, one wake of the threadpool.
static int experts_once(mg_handle *h, int64_t n, const int32_t *types, const void *const *ws, int64_t H, int64_t I,
                        const float *x, int64_t T, const float *coef, float *y) {
    struct ggml_context *ctx = begin(h);
    struct ggml_tensor *X = ext(ctx, GGML_TYPE_F32, H, T, 1, x);
    struct ggml_tensor *acc = NULL;
    mg_act silu = {0, 0};
    for (int64_t e = 0; e < n; e++) {
        const int32_t *t = types + 3 * e;
        const void *const *w = ws + 3 * e;
        struct ggml_tensor *G = own(h, ggml_mul_mat(ctx, ext(ctx, t[0], H, I, 1, w[0]), X));      // [I, T]
        struct ggml_tensor *Up = own(h, ggml_mul_mat(ctx, ext(ctx, t[1], H, I, 1, w[1]), X));
        struct ggml_tensor *Act = activate(h, ctx, G, Up, silu);
        struct ggml_tensor *D = own(h, ggml_mul_mat(ctx, ext(ctx, t[2], I, H, 1, w[2]), Act));    // [H, T]
        D = own(h, ggml_mul(ctx, D, ext(ctx, GGML_TYPE_F32, 1, T, 1, coef + e * T)));
        acc = acc == NULL ? D : own(h, ggml_add(ctx, acc, D));
    }
    acc->data = y;
    return run(h, ctx, acc);
}

void mg_experts(void *h, int64_t n, const int32_t *types, const void *const *ws, int64_t H, int64_t I,
                const float *x, int64_t T, const float *coef, float *y) {
    while (experts_once(h, n, types, ws, H, I, x, T, coef, y)) {}
}

// ggml's own quantizer (every type it writes; `imatrix` per column or NULL): bytes written.
size_t mg_quantize(int type, const float *src, void *dst, int64_t nrows, int64_t n_per_row, const float *imatrix) {
    return ggml_quantize_chunk(type, src, dst, 0, nrows, n_per_row, imatrix);
}

int mg_requires_imatrix(int type) { return ggml_quantize_requires_imatrix(type); }

size_t mg_row_size(int type, int64_t n) { return ggml_row_size(type, n); }

// the CPU features ggml was built for and runs with: avx2, avx512, avx512_vnni, f16c, fma
int mg_features(void) {
    return ggml_cpu_has_avx2() | ggml_cpu_has_avx512() << 1 | ggml_cpu_has_avx512_vnni() << 2 |
           ggml_cpu_has_avx_vnni() << 3 | ggml_cpu_has_fma() << 4 | ggml_cpu_has_f16c() << 5;
}

// the type ggml quantizes x to for a weight of `type` (q8_0, q8_1, q8_K, or f16/bf16/f32 for float weights)
int mg_vec_dot_type(int type) { return ggml_get_type_traits_cpu(type)->vec_dot_type; }
