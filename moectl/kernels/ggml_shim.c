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

#define _DEFAULT_SOURCE                  // madvise
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <strings.h>
#include <sys/mman.h>
#include <unistd.h>

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#define MG_ALIGN 64
#define MG_MAX_NODES 4096

#include "ggml_q6k.c"                    // an own Q6_K matvec for one-token products (its ops; matvec() below)

typedef struct {
    struct ggml_threadpool *pool;
    int n_threads;
    uint8_t *meta;       // ggml_init's memory: tensor and graph headers only (no_alloc)
    size_t meta_size;
    uint8_t *arena;      // intermediates
    size_t arena_size, arena_used;
    uint8_t *work;       // ggml_graph_plan's work buffer (x quantized to the vec_dot type, ...)
    size_t work_size;
    int failed;
    q6k_rows_fn q6k;     // the own Q6_K matvec's kernel (MOECTL_GGML_OWN_Q6K, read here once), or NULL: ggml's
    uint8_t *model_meta; // mg_model_eval's graph: tensor and graph headers (sized to the model), and ggml-alloc's
    size_t model_meta_size;
    ggml_gallocr_t galloc;  // intermediates, memory reused along the graph          // an arena too small: the call is redone with a larger one
    // mg_model_eval's decode-step graph (T = 1), kept between steps (decode_step): its own headers and ggml-alloc,
    // since a prefill's graph reuses model_meta and galloc meanwhile
    uint8_t *dec_meta;
    size_t dec_meta_size;
    ggml_gallocr_t dec_galloc;
    struct ggml_context *dec_ctx;
    struct ggml_cgraph *dec_gf;        // NULL: none kept
    struct ggml_tensor *dec_y;         // its logits (data: the caller's buffer, set each step)
    void *dec_key;                     // the mg_model_desc it was built for (a copy)
    int64_t dec_P, dec_s0;             // positions its attention views; first of a sliding-window layer's view
    int dec_has_ids, dec_used;         // built with the routed ids copied out; read a repacked copy (rp_graph)
    char dec_repack[64];               // MOECTL_GGML_REPACK when built
    int32_t dec_tok, dec_pos;          // the step's data the graph reads: token, position, cache row, masks
    int64_t dec_row;
    uint16_t *dec_mask, *dec_mask_swa; // ggml_fp16_t [P], [P - s0]
    int32_t *dec_ids;                  // [n_layer, 1, U]
} mg_handle;

int mg_abi(void) { return 3; }

void *mg_new(int n_threads, int poll) {
    ggml_cpu_init();
    mg_handle *h = calloc(1, sizeof(mg_handle));
    if (!h) return NULL;
    struct ggml_threadpool_params p = ggml_threadpool_params_default(n_threads);
    p.poll = poll;                    // 0: workers sleep between graphs (torch's threads share the cores)
    h->pool = ggml_threadpool_new(&p);
    h->n_threads = n_threads;
    h->q6k = q6k_kernel(q6k_mode_from_env());   // fixed for the handle: its kept decode graph holds the choice
    h->meta_size = ggml_tensor_overhead() * MG_MAX_NODES + ggml_graph_overhead_custom(MG_MAX_NODES, false) + 4096;
    h->meta = malloc(h->meta_size);
    return h;
}

// the kernel a handle's one-token Q6_K products run (ggml_q6k.c): "avx512vnni", "avx512bw", "avx2" or "ggml"
const char *mg_q6k_kernel(void *hp) { return q6k_kernel_name(((mg_handle *)hp)->q6k); }

// the products it has computed so far, every handle's (tests: a graph ran it)
int64_t mg_q6k_products(void) { return __atomic_load_n(&q6k_products, __ATOMIC_RELAXED); }

void mg_free(void *hp) {
    mg_handle *h = hp;
    if (!h) return;
    ggml_threadpool_free(h->pool);
    if (h->galloc) ggml_gallocr_free(h->galloc);
    if (h->dec_ctx) ggml_free(h->dec_ctx);
    if (h->dec_galloc) ggml_gallocr_free(h->dec_galloc);
    free(h->dec_meta);
    free(h->dec_key);
    free(h->dec_mask);
    free(h->dec_mask_swa);
    free(h->dec_ids);
    free(h->model_meta);
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
    if (!h) return t;                                // no arena: ggml-alloc places it (mg_model_eval's graph)
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

// y [N, 1] = W x as ggml_mul_mat(W, x) computes it: through the own Q6_K matvec (ggml_q6k.c: two custom ops, x
// quantized once, then the rows) where `rows` is a kernel and W a 2-d Q6_K matrix against one F32 column (a decode
// step's product, or a prefill's lm_head on its last row); else ggml's. h: the arena the activation's buffer takes
// (NULL: ggml-alloc places it, a model graph).
static struct ggml_tensor *matvec(mg_handle *h, struct ggml_context *ctx, struct ggml_tensor *W, struct ggml_tensor *x,
                                  q6k_rows_fn rows) {
    if (!rows || W->type != GGML_TYPE_Q6_K || W->ne[2] != 1 || W->ne[3] != 1 || W->ne[0] % 256 ||
        W->nb[1] != ggml_row_size(W->type, W->ne[0]) || x->type != GGML_TYPE_F32 || ggml_nelements(x) != W->ne[0] ||
        !ggml_is_contiguous(x))
        return ggml_mul_mat(ctx, W, x);
    struct ggml_tensor *act = own(h, ggml_custom_4d(ctx, GGML_TYPE_I8, (int64_t)q6k_activation_bytes(W->ne[0]), 1, 1, 1,
                                                    &x, 1, q6k_quantize_op, 1, NULL));
    struct ggml_tensor *args[2] = {W, act};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, W->ne[1], 1, 1, 1, args, 2, q6k_matvec_op, GGML_N_TASKS_MAX,
                          (void *)rows);
}

// --- llama.cpp's CPU repack ------------------------------------------------------------------------------------------
// ggml's CPU backend has an extra buffer type, CPU_REPACK (ggml-cpu/repack.cpp): a weight put there is interleaved
// 8 rows at a time (on AVX2: Q4_0, Q4_K, IQ4_NL, MXFP4; `ggml_repack_get_optimal_repack_type`) and MUL_MAT /
// MUL_MAT_ID on it run its GEMV/GEMM kernels, as llama.cpp's model loader arranges for every weight it can.
// Here a graph's weight (the src0 of a MUL_MAT or MUL_MAT_ID, a leaf, contiguous) whose bytes lie in a range
// registered as stable (`mg_repack_register`: a mapped GGUF, whose addresses live until it is unregistered; never a
// transient host buffer, whose addresses get reused) and that ggml accepts is swapped for a copy in a CPU_REPACK
// buffer, made on first use and kept (one entry per (address, type, shape)). A stacked tensor of A experts
// (MUL_MAT_ID) is allocated whole but repacked an expert at a time, those its ids name: before the graph runs when
// the ids are known then, else (a whole forward's graph routes inside) by an op the graph runs between its routing
// and its experts (rp_lazy), so no pass over every expert comes before the first token; a 2-d matrix inside such a
// stack uses that stack's copy.
// A strided stack (moectl's ggml copies: one expert a row of a layer's buffer, gate|up|down, so nb[2] is the row's
// bytes) is taken too, each matrix's rows being contiguous: the copy is a contiguous [A, N, K], expert a repacked
// from src + a * nb[2] of the original. Whatever ggml does not repack is left as it is. The copy takes the bytes of
// the original (the buffer type sizes a tensor at ggml_nbytes), and where the range is a file's private mapping
// that nothing writes (`drop_pages`), the original's whole pages leave the process once copied (madvise DONTNEED:
// the page cache keeps them, a later read faults them back unchanged), so the copy stands in for them instead of
// beside them.
// MOECTL_GGML_REPACK picks the types (`rp_type_on`; 0: none).

typedef struct rp_entry {
    const uint8_t *src;                  // the registered bytes it copies
    int drop_pages;                      // its range is a file's unwritten private mapping: pages copied are dropped
    enum ggml_type type;
    int64_t ne0, ne1, ne2;               // K, N, A
    size_t src_nb2;                      // bytes from one expert's matrix to the next in the original (strided)
    struct ggml_context *ctx;            // its tensor headers: the whole and a slice header per expert
    struct ggml_tensor *t;               // [A, N, K] in the CPU_REPACK buffer
    struct ggml_tensor **slice;          // [A] 2-d headers of expert e's matrix in that buffer
    ggml_backend_buffer_t buf;
    uint8_t *done;                       // [A] RP_TODO, RP_BUSY (a thread is repacking it) or RP_DONE; atomic
    struct rp_group *group;              // the rp_lazy group whose first copy this is (NULL: none yet)
    struct rp_entry *next;               // hash chain
} rp_entry;

#define RP_BUCKETS 4096
enum { RP_TODO = 0, RP_BUSY = 1, RP_DONE = 2 };

// The experts a graph's in-graph routing picks are repacked by the graph itself, an op before their MUL_MAT_IDs
// (rp_lazy): one group per layer's stacks, kept while its entries live, found from its first copy (rp_entry.group),
// so a graph's build finds each layer's in O(1), not by a walk over every layer's.
typedef struct rp_group {
    int n;
    struct rp_entry *e[3];               // the layer's gate, up, down copies (those ggml repacks)
    struct rp_group *next;
} rp_group;

static pthread_mutex_t rp_lock = PTHREAD_MUTEX_INITIALIZER;
static struct { uintptr_t lo, hi; int drop_pages; } *rp_ranges;
static int rp_nranges;
static rp_entry *rp_table[RP_BUCKETS];
static rp_entry **rp_stacks;             // the entries with A > 1 (a 2-d matrix may lie inside one)
static int rp_nstacks;
static rp_group *rp_groups;
static int64_t rp_stat[4];               // entries held, matrices repacked, bytes allocated, graphs that used one
static ggml_backend_buffer_type_t rp_buft;
static ggml_backend_buffer_t rp_probe;   // a tiny CPU_REPACK buffer: its init_tensor says what ggml would repack
static int rp_ready;                     // 0 not looked up, 1 found, -1 none on this build

// ggml's log without its debug lines (CPU_REPACK says each tensor it repacks at that level)
static void rp_log(enum ggml_log_level level, const char *text, void *user) {
    (void)user;
    if (level != GGML_LOG_LEVEL_DEBUG) fputs(text, stderr);
}

static int rp_setup(void) {               // under rp_lock
    if (rp_ready) return rp_ready > 0;
    rp_ready = -1;
    ggml_log_set(rp_log, NULL);
    ggml_backend_reg_t reg = ggml_backend_cpu_reg();
    ggml_backend_dev_get_extra_bufts_t get =
        (ggml_backend_dev_get_extra_bufts_t)ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    if (!get) return 0;
    for (ggml_backend_buffer_type_t *b = get(ggml_backend_reg_dev_get(reg, 0)); b && *b; b++)
        if (strcmp(ggml_backend_buft_name(*b), "CPU_REPACK") == 0) rp_buft = *b;
    if (!rp_buft || !(rp_probe = ggml_backend_buft_alloc_buffer(rp_buft, 256))) return 0;
    rp_ready = 1;
    return 1;
}

// MOECTL_GGML_REPACK: unset, "", "1" or "all": every type ggml repacks here, as llama.cpp (Q4_K too: on a quiet AVX2
// host it took a Qwen3-shaped Q4_K_M decode from 1.19x to 1.08x llama.cpp's at 1 thread, docs/gguf.md; an earlier
// measurement under load had found its T = 64 product slower); "0": none; else a comma list of ggml's type names
// (q4_0,q4_K,iq4_nl,mxfp4; any case). Read per graph: a run or a test may switch it.
static int rp_type_on(const char *v, int type) {
    if (!v || !*v || strcmp(v, "1") == 0) return 1;
    if (strcmp(v, "0") == 0) return 0;
    if (strcmp(v, "all") == 0) return 1;
    const char *name = ggml_type_name(type);
    size_t n = strlen(name);
    for (const char *p = v; *p;) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        if (len == n && strncasecmp(p, name, n) == 0) return 1;
        p += len + (end != NULL);
    }
    return 0;
}

static int rp_enabled(void) {
    const char *v = getenv("MOECTL_GGML_REPACK");
    return !(v && strcmp(v, "0") == 0);
}

// whether ggml's repack takes a [N, K] matrix (ne0 = K, ne1 = N) of `type` on this CPU: its init_tensor picks an
// interleaving (tensor->extra) and its repack() accepts the shape (8 rows at a time, K a multiple of 8)
static int rp_accepts_uncached(int type, int64_t ne0, int64_t ne1) {
    if (!rp_setup() || type < 0 || type >= GGML_TYPE_COUNT || ne1 % 8 || ne0 % 8) return 0;
    uint8_t mem[1024] __attribute__((aligned(64)));
    if (ggml_tensor_overhead() > sizeof(mem)) return 0;
    struct ggml_init_params ip = {sizeof(mem), mem, true};
    struct ggml_context *ctx = ggml_init(ip);
    struct ggml_tensor *t = ggml_new_tensor_2d(ctx, type, ne0, ne1);
    t->buffer = rp_probe;
    int ok = ggml_backend_buffer_init_tensor(rp_probe, t) == GGML_STATUS_SUCCESS && t->extra != NULL;
    ggml_free(ctx);
    return ok;
}

// rp_accepts_uncached, remembered for the last RP_SEEN shapes asked (a graph asks for every weight it has)
#define RP_SEEN 64
static struct { int type; int64_t ne0, ne1; int ok; } rp_seen[RP_SEEN];
static int rp_nseen;

static int rp_accepts(int type, int64_t ne0, int64_t ne1) {   // under rp_lock
    int n = rp_nseen < RP_SEEN ? rp_nseen : RP_SEEN;
    for (int i = 0; i < n; i++)
        if (rp_seen[i].type == type && rp_seen[i].ne0 == ne0 && rp_seen[i].ne1 == ne1) return rp_seen[i].ok;
    int ok = rp_accepts_uncached(type, ne0, ne1), k = rp_nseen++ % RP_SEEN;
    rp_seen[k].type = type, rp_seen[k].ne0 = ne0, rp_seen[k].ne1 = ne1, rp_seen[k].ok = ok;
    return ok;
}

// whether a registered [N, K] matrix (ne0 = K, ne1 = N) of `type` gets a copy (ggml takes it, MOECTL_GGML_REPACK
// asks for its type); nothing is allocated
int mg_repacks(int type, int64_t ne0, int64_t ne1) {
    if (!rp_type_on(getenv("MOECTL_GGML_REPACK"), type)) return 0;
    pthread_mutex_lock(&rp_lock);
    int ok = rp_accepts(type, ne0, ne1);
    pthread_mutex_unlock(&rp_lock);
    return ok;
}

static size_t rp_hash(const void *p) { return ((uintptr_t)p >> 6) * 11400714819323198485ull >> 52 & (RP_BUCKETS - 1); }

// 0: [p, p + n) is in no registered range; else 1 + its drop_pages
static int rp_registered(const void *p, size_t n) {
    for (int i = 0; i < rp_nranges; i++)
        if ((uintptr_t)p >= rp_ranges[i].lo && (uintptr_t)p + n <= rp_ranges[i].hi) return 1 + rp_ranges[i].drop_pages;
    return 0;
}

// bytes [lo, lo + size) stay mapped and unchanged until unregistered; `drop_pages`: they are a file's private
// mapping nothing writes (a copied matrix's pages may leave the process: never for anonymous memory, they would read
// back as zeros)
void mg_repack_register(const void *lo, int64_t size, int drop_pages) {
    pthread_mutex_lock(&rp_lock);
    if (!rp_registered(lo, (size_t)size)) {
        rp_ranges = realloc(rp_ranges, (rp_nranges + 1) * sizeof(*rp_ranges));
        rp_ranges[rp_nranges].lo = (uintptr_t)lo;
        rp_ranges[rp_nranges].hi = (uintptr_t)lo + (uintptr_t)size;
        rp_ranges[rp_nranges++].drop_pages = drop_pages;
    }
    pthread_mutex_unlock(&rp_lock);
}

static void rp_drop(rp_entry *e) {
    for (rp_group **pg = &rp_groups; *pg;) {
        rp_group *g = *pg;
        int uses = 0;
        for (int i = 0; i < g->n; i++) uses |= g->e[i] == e;
        if (uses) {
            for (int i = 0; i < g->n; i++)
                if (g->e[i]->group == g) g->e[i]->group = NULL;         // a copy that stays finds no freed group
            *pg = g->next;
            free(g);
        } else {
            pg = &g->next;
        }
    }
    for (int i = 0; i < rp_nstacks; i++)
        if (rp_stacks[i] == e) rp_stacks[i--] = rp_stacks[--rp_nstacks];
    rp_stat[0]--;
    rp_stat[2] -= (int64_t)ggml_nbytes(e->t);
    ggml_backend_buffer_free(e->buf);
    ggml_free(e->ctx);
    free(e->slice);
    free(e->done);
    free(e);
}

// the range [lo, lo + size) is going (unmapped): its ranges and every copy of its bytes are dropped
void mg_repack_unregister(const void *lo, int64_t size) {
    uintptr_t a = (uintptr_t)lo, b = a + (uintptr_t)size;
    pthread_mutex_lock(&rp_lock);
    for (int i = 0; i < rp_nranges; i++)
        if (rp_ranges[i].lo < b && rp_ranges[i].hi > a) rp_ranges[i--] = rp_ranges[--rp_nranges];
    for (int k = 0; k < RP_BUCKETS; k++)
        for (rp_entry **pe = &rp_table[k]; *pe;) {
            rp_entry *e = *pe;
            if ((uintptr_t)e->src >= a && (uintptr_t)e->src < b) {
                *pe = e->next;
                rp_drop(e);
            } else {
                pe = &e->next;
            }
        }
    pthread_mutex_unlock(&rp_lock);
}

// out[4]: copies held, matrices repacked (an expert of a stack counts one), bytes allocated for copies, graphs that
// used a copy
void mg_repack_stats(int64_t *out) {
    pthread_mutex_lock(&rp_lock);
    memcpy(out, rp_stat, sizeof(rp_stat));
    pthread_mutex_unlock(&rp_lock);
}

static rp_entry *rp_new(const struct ggml_tensor *w, int drop_pages) {      // under rp_lock
    int64_t A = w->ne[2];
    rp_entry *e = calloc(1, sizeof(rp_entry));
    struct ggml_init_params ip = {ggml_tensor_overhead() * (size_t)(A + 1), NULL, true};
    e->ctx = ggml_init(ip);
    e->t = ggml_new_tensor_3d(e->ctx, w->type, w->ne[0], w->ne[1], A);
    e->buf = ggml_backend_buft_alloc_buffer(rp_buft, ggml_nbytes(e->t));    // pages untouched until repacked
    if (!e->ctx || !e->buf || ggml_backend_tensor_alloc(e->buf, e->t, ggml_backend_buffer_get_base(e->buf)) !=
        GGML_STATUS_SUCCESS || !e->t->extra) {
        if (e->buf) ggml_backend_buffer_free(e->buf);
        if (e->ctx) ggml_free(e->ctx);
        free(e);
        return NULL;
    }
    e->src = w->data;
    e->drop_pages = drop_pages;
    e->type = w->type;
    e->ne0 = w->ne[0], e->ne1 = w->ne[1], e->ne2 = A;
    e->src_nb2 = w->nb[2];
    e->slice = calloc((size_t)A, sizeof(*e->slice));
    e->done = calloc((size_t)A, 1);
    for (int64_t a = 0; a < A; a++) {    // every expert's header now: the graph's threads repack with them (rp_lazy)
        struct ggml_tensor *sl = e->slice[a] = ggml_new_tensor_2d(e->ctx, e->type, e->ne0, e->ne1);
        sl->buffer = e->buf;
        sl->data = (uint8_t *)e->t->data + a * e->t->nb[2];
        sl->extra = e->t->extra;                 // the same interleaving: it depends on the type and N only
    }
    size_t k = rp_hash(e->src);
    e->next = rp_table[k];
    rp_table[k] = e;
    if (A > 1) {
        rp_stacks = realloc(rp_stacks, (rp_nstacks + 1) * sizeof(*rp_stacks));
        rp_stacks[rp_nstacks++] = e;
    }
    rp_stat[0]++;
    rp_stat[2] += (int64_t)ggml_nbytes(e->t);
    return e;
}

// expert a of entry e repacked from the registered bytes, once: whoever moves it from RP_TODO to RP_BUSY repacks
// it (a graph's thread, rp_lazy_op, or a graph's build under rp_lock), whoever finds it RP_BUSY waits for RP_DONE.
// Thread safe: experts are disjoint bytes of the copy, their headers made at rp_new.
static void rp_repack(rp_entry *e, int64_t a) {
    uint8_t state = __atomic_load_n(&e->done[a], __ATOMIC_ACQUIRE), todo = RP_TODO;
    if (state == RP_DONE) return;
    if (state == RP_TODO && __atomic_compare_exchange_n(&e->done[a], &todo, RP_BUSY, 0, __ATOMIC_ACQ_REL,
                                                        __ATOMIC_ACQUIRE)) {
        struct ggml_tensor *sl = e->slice[a];
        const uint8_t *from = e->src + a * e->src_nb2;
        ggml_backend_tensor_set(sl, from, 0, ggml_nbytes(sl));                        // CPU_REPACK's set: repacks
        if (e->drop_pages) {             // the whole pages of the original: the page cache's again, not the process's
            uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), lo = ((uintptr_t)from + page - 1) / page * page,
                      hi = ((uintptr_t)from + ggml_nbytes(sl)) / page * page;
            if (hi > lo) madvise((void *)lo, hi - lo, MADV_DONTNEED);
        }
        __atomic_fetch_add(&rp_stat[1], 1, __ATOMIC_RELAXED);
        __atomic_store_n(&e->done[a], RP_DONE, __ATOMIC_RELEASE);
        return;
    }
    while (__atomic_load_n(&e->done[a], __ATOMIC_ACQUIRE) != RP_DONE) sched_yield();   // another thread's, soon
}

// experts of the copies held that are not repacked yet, repacked now (the first-use work left: what llama.cpp's
// loader does for every expert at load): all of them when max_bytes <= 0, else until at least max_bytes of copies
// are written (one matrix at least; an idle server's bounded piece, so a request arriving waits for one piece, not
// the whole remainder); returns how many matrices were
int64_t mg_repack_finish(int64_t max_bytes) {
    int64_t done = 0, bytes = 0;
    pthread_mutex_lock(&rp_lock);
    for (int k = 0; k < RP_BUCKETS && (max_bytes <= 0 || bytes < max_bytes); k++)
        for (rp_entry *e = rp_table[k]; e && (max_bytes <= 0 || bytes < max_bytes); e = e->next)
            for (int64_t a = 0; a < e->ne2 && (max_bytes <= 0 || bytes < max_bytes); a++)
                if (__atomic_load_n(&e->done[a], __ATOMIC_ACQUIRE) != RP_DONE) {
                    rp_repack(e, a);
                    done++;
                    bytes += (int64_t)ggml_nbytes(e->slice[a]);
                }
    pthread_mutex_unlock(&rp_lock);
    return done;
}

// out[2]: of the matrices in the copies held (an expert of a stack counts one), how many are repacked, and all
void mg_repack_progress(int64_t *out) {
    out[0] = out[1] = 0;
    pthread_mutex_lock(&rp_lock);
    for (int k = 0; k < RP_BUCKETS; k++)
        for (rp_entry *e = rp_table[k]; e; e = e->next) {
            for (int64_t a = 0; a < e->ne2; a++) out[0] += __atomic_load_n(&e->done[a], __ATOMIC_ACQUIRE) == RP_DONE;
            out[1] += e->ne2;
        }
    pthread_mutex_unlock(&rp_lock);
}

// expert a's matrix of entry e: its 2-d header in e's buffer, repacked on first use
static struct ggml_tensor *rp_slice(rp_entry *e, int64_t a) {
    rp_repack(e, a);
    return e->slice[a];
}

// each matrix of w is contiguous rows, its matrices nb[2] >= their bytes apart (a contiguous stack, or a strided one)
static int rp_rows_contiguous(const struct ggml_tensor *w) {
    return w->nb[0] == ggml_type_size(w->type) && w->nb[1] == ggml_row_size(w->type, w->ne[0]) &&
           (w->ne[2] == 1 || w->nb[2] >= w->nb[1] * (size_t)w->ne[1]) && w->ne[3] == 1;
}

// whether weight w can have a copy: a leaf of registered bytes, rows contiguous, a type asked for and ggml repacks
// (returns 1 + the range's drop_pages, or 0)
static int rp_eligible(const struct ggml_tensor *w, const char *types) {                           // under rp_lock
    int reg;
    if (!rp_type_on(types, w->type) || w->buffer || w->view_src || w->op != GGML_OP_NONE || !w->data ||
        !rp_rows_contiguous(w) || !(reg = rp_registered(w->data, ggml_nbytes(w))) ||
        !rp_accepts(w->type, w->ne[0], w->ne[1]))
        return 0;
    return reg;
}

// w's entry (NULL: none yet)
static rp_entry *rp_find(const struct ggml_tensor *w) {                                              // under rp_lock
    rp_entry *e = rp_table[rp_hash(w->data)];
    while (e && !(e->src == w->data && e->type == w->type && e->ne0 == w->ne[0] && e->ne1 == w->ne[1] &&
                  e->ne2 == w->ne[2] && (e->ne2 == 1 || e->src_nb2 == w->nb[2])))
        e = e->next;
    return e;
}

// the copy to use for weight w (NULL: w as it is); `ids` (MUL_MAT_ID): the experts to have repacked before the graph
// (ids known now), or else (ids computed in the graph, by a routing rp_lazy did not wrap) every expert
static struct ggml_tensor *rp_get(const struct ggml_tensor *w, const struct ggml_tensor *ids, const char *types) {
    int reg;                                                                                       // under rp_lock
    if (!(reg = rp_eligible(w, types))) return NULL;
    rp_entry *e = rp_find(w);
    if (!e && w->ne[2] == 1) {                          // a matrix of a stack already copied: that stack's slice
        for (int i = 0; i < rp_nstacks; i++) {
            rp_entry *s = rp_stacks[i];
            size_t nb2 = s->src_nb2;
            const uint8_t *p = w->data;
            if (s->type == w->type && s->ne0 == w->ne[0] && s->ne1 == w->ne[1] && p >= s->src &&
                p < s->src + nb2 * s->ne2 && (size_t)(p - s->src) % nb2 == 0)
                return rp_slice(s, (p - s->src) / nb2);
        }
    }
    if (!e && !(e = rp_new(w, reg - 1))) return NULL;
    if (e->ne2 == 1) return rp_slice(e, 0) ? e->t : NULL;
    if (ids && ids->op == GGML_OP_NONE && ids->data && ids->type == GGML_TYPE_I32) {    // the ids are known now
        for (int64_t j = 0; j < ids->ne[1]; j++)
            for (int64_t i = 0; i < ids->ne[0]; i++) {
                int32_t a = *(const int32_t *)((const char *)ids->data + j * ids->nb[1] + i * ids->nb[0]);
                if (a >= 0 && a < e->ne2) rp_slice(e, a);
            }
    } else {
        for (int64_t a = 0; a < e->ne2; a++) rp_slice(e, a);
    }
    return e->t;
}

// whether t is a repacked copy (or an expert's slice of one): rp_lazy put it in the graph already
static int rp_is_copy(const struct ggml_tensor *t) {
    return t->buffer && rp_buft && ggml_backend_buffer_get_type(t->buffer) == rp_buft;
}

// every MUL_MAT / MUL_MAT_ID of the graph whose weight has (or gets) a repacked copy reads that copy; returns whether
// any does (the graph counted as one that used a copy), rp_lazy's included
static int rp_graph(struct ggml_cgraph *gf) {
    if (!rp_enabled()) return 0;
    const char *types = getenv("MOECTL_GGML_REPACK");
    int used = 0;
    pthread_mutex_lock(&rp_lock);
    if (rp_nranges) {
        for (int i = 0; i < ggml_graph_n_nodes(gf); i++) {
            struct ggml_tensor *n = ggml_graph_node(gf, i);
            int id = n->op == GGML_OP_MUL_MAT_ID;
            if (n->op != GGML_OP_MUL_MAT && !id) continue;
            if (rp_is_copy(n->src[0])) {
                used = 1;
                continue;
            }
            if (n->src[1]->type != GGML_TYPE_F32 || (!id && n->src[0]->ne[2] != 1)) continue;
            struct ggml_tensor *r = rp_get(n->src[0], id ? n->src[2] : NULL, types);
            if (r) {
                n->src[0] = r;
                used = 1;
            }
        }
    }
    rp_stat[3] += used;
    pthread_mutex_unlock(&rp_lock);
    return used;
}

// The op rp_lazy puts between a layer's routing and its experts: ids [U, T] pass through unchanged (a view), and
// the experts they name that are not yet repacked are, shared among the graph's threads. Every thread walks the
// same (copy, expert) pairs in the same order, each first sighting of a pair a work item, item w thread w % nth's;
// ggml's barrier after the op has them all done before the MUL_MAT_IDs read the copies.
static void rp_lazy_op(struct ggml_tensor *dst, const struct ggml_tensor *ids, int ith, int nth, void *userdata) {
    (void)dst;
    const rp_group *g = userdata;
    int64_t item = 0;
    for (int k = 0; k < g->n; k++) {
        rp_entry *e = g->e[k];
        uint8_t seen_small[512], *seen = e->ne2 <= 512 ? seen_small : calloc((size_t)e->ne2, 1);
        if (e->ne2 <= 512) memset(seen, 0, (size_t)e->ne2);
        for (int64_t j = 0; j < ids->ne[1]; j++)
            for (int64_t i = 0; i < ids->ne[0]; i++) {
                int32_t a = *(const int32_t *)((const char *)ids->data + j * ids->nb[1] + i * ids->nb[0]);
                if (a < 0 || a >= e->ne2 || seen[a]) continue;
                seen[a] = 1;
                if (item++ % nth == ith) rp_repack(e, a);
            }
        if (seen != seen_small) free(seen);
    }
}

// whether group g holds exactly the n copies es, in that order
static int rp_group_is(const rp_group *g, rp_entry *const *es, int n) {
    if (!g || g->n != n) return 0;
    for (int i = 0; i < n; i++)
        if (g->e[i] != es[i]) return 0;
    return 1;
}

// ids computed inside the graph (its routing), about to pick experts of the stacks ws = {Wg, Wu, Wd}: where ggml
// repacks some of them, the ids pass through rp_lazy_op first, so an expert is repacked when a token first routes to
// it (llama.cpp repacks all of them at load; the issue asks for no such pass before the first token), and the
// stacks' copies are made here without a byte repacked yet and put in ws in place of their stacks (the MUL_MAT_IDs
// read them as built; rp_graph leaves them). Else the ids as they are, ws unchanged.
static struct ggml_tensor *rp_lazy(struct ggml_context *ctx, struct ggml_tensor *ids, struct ggml_tensor *ws[3]) {
    if (!rp_enabled() || ids->op == GGML_OP_NONE) return ids;
    const char *types = getenv("MOECTL_GGML_REPACK");
    rp_entry *es[3];
    int at[3];                                   // es[i] is the copy of ws[at[i]]
    int n = 0, reg;
    pthread_mutex_lock(&rp_lock);
    if (!rp_nranges) {
        pthread_mutex_unlock(&rp_lock);
        return ids;
    }
    for (int k = 0; k < 3; k++) {
        if (ws[k]->ne[2] < 2 || !(reg = rp_eligible(ws[k], types))) continue;
        rp_entry *e = rp_find(ws[k]);
        if (e || (e = rp_new(ws[k], reg - 1))) at[n] = k, es[n++] = e;
    }
    rp_group *g = n ? es[0]->group : NULL;
    if (n && !rp_group_is(g, es, n)) {       // first build of this layer (or its first copy in another group)
        for (g = rp_groups; g && !rp_group_is(g, es, n); g = g->next) {}
        if (!g && (g = calloc(1, sizeof(*g)))) {
            g->n = n;
            memcpy(g->e, es, sizeof(es[0]) * (size_t)n);
            g->next = rp_groups;
            rp_groups = g;
        }
        es[0]->group = g;
    }
    pthread_mutex_unlock(&rp_lock);
    if (!n || !g) return ids;                    // rp_graph then repacks every expert of a stack it copies
    for (int i = 0; i < n; i++) ws[at[i]] = es[i]->t;
    return ggml_map_custom1_inplace(ctx, ids, rp_lazy_op, GGML_N_TASKS_MAX, g);
}

// compute a built graph on the handle's threadpool, its work buffer grown as the plan asks
static void compute(mg_handle *h, struct ggml_cgraph *gf) {
    struct ggml_cplan plan = ggml_graph_plan(gf, h->n_threads, h->pool);
    if (plan.work_size > h->work_size) {
        free(h->work);
        h->work_size = plan.work_size;
        h->work = malloc(h->work_size);
    }
    plan.work_data = h->work;
    ggml_graph_compute(gf, &plan);
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
    rp_graph(gf);                                    // weights with a CPU_REPACK copy read it
    compute(h, gf);
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
    struct ggml_tensor *Y = T == 1 ? matvec(h, ctx, W, X, h->q6k) : ggml_mul_mat(ctx, W, X);   // [N, T] = y [T, N]
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

// A layer's routed experts in llama.cpp's build_moe_ffn order: x [H, 1, T], ids [U, T], weights [1, U, T] ->
// y [H, T] = sum_u weights[u] (down(act(gate x + bg, up x + bu)) + bd) over the used experts (biases: NULL or F32
// [I or H, A], added per used expert as ggml_add_id does). h NULL: no arena (the caller's ggml-alloc places them).
static struct ggml_tensor *experts_ffn(mg_handle *h, struct ggml_context *ctx, struct ggml_tensor *Wg,
                                       struct ggml_tensor *Wu, struct ggml_tensor *Wd, struct ggml_tensor *Bg,
                                       struct ggml_tensor *Bu, struct ggml_tensor *Bd, mg_act act,
                                       struct ggml_tensor *X, struct ggml_tensor *ID, struct ggml_tensor *WT) {
    const int64_t H = Wd->ne[1], T = X->ne[2], U = ID->ne[0];
    struct ggml_tensor *ws[3] = {Wg, Wu, Wd};
    ID = rp_lazy(ctx, ID, ws);                   // in-graph routing: its experts repacked on first use, ws the copies
    Wg = ws[0], Wu = ws[1], Wd = ws[2];
    struct ggml_tensor *G = own(h, ggml_mul_mat_id(ctx, Wg, X, ID));                          // [I, U, T]
    struct ggml_tensor *Up = own(h, ggml_mul_mat_id(ctx, Wu, X, ID));
    if (Bg) G = own(h, ggml_add_id(ctx, G, Bg, ID));
    if (Bu) Up = own(h, ggml_add_id(ctx, Up, Bu, ID));
    struct ggml_tensor *D = own(h, ggml_mul_mat_id(ctx, Wd, activate(h, ctx, G, Up, act), ID));  // [H, U, T]
    if (Bd) D = own(h, ggml_add_id(ctx, D, Bd, ID));
    D = own(h, ggml_mul(ctx, D, WT));
    struct ggml_tensor *acc = NULL;
    for (int64_t u = 0; u < U; u++) {                                                          // sum over U
        struct ggml_tensor *v = ggml_view_2d(ctx, D, H, T, D->nb[2], u * D->nb[1]);
        acc = acc == NULL ? v : own(h, ggml_add(ctx, acc, v));
    }
    return U == 1 ? own(h, ggml_cont(ctx, acc)) : acc;
}

static int moe_once(mg_handle *h, int tg, const void *wg, int tu, const void *wu, int td, const void *wd,
                    const float *bg, const float *bu, const float *bd, mg_act act, int64_t A, int64_t H, int64_t I,
                    const float *x, const int32_t *ids, const float *wts, int64_t U, int64_t T, float *y,
                    int64_t stride) {
    struct ggml_context *ctx = begin(h);
    struct ggml_tensor *X = ext(ctx, GGML_TYPE_F32, H, 1, T, x);
    struct ggml_tensor *ID = ext(ctx, GGML_TYPE_I32, U, T, 1, ids);
    struct ggml_tensor *WT = ext(ctx, GGML_TYPE_F32, 1, U, T, wts);
    struct ggml_tensor *acc = experts_ffn(
        h, ctx, stack(ctx, tg, H, I, A, wg, stride), stack(ctx, tu, H, I, A, wu, stride),
        stack(ctx, td, I, H, A, wd, stride), bg ? ext(ctx, GGML_TYPE_F32, I, A, 1, bg) : NULL,
        bu ? ext(ctx, GGML_TYPE_F32, I, A, 1, bu) : NULL, bd ? ext(ctx, GGML_TYPE_F32, H, A, 1, bd) : NULL, act, X,
        ID, WT);
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

// --- a whole model's forward in one graph (moectl/runtime/ggml_model.py) -----------------------------------------
//
// llama.cpp's own graph for its llama (Mixtral), qwen2moe, qwen3moe, olmoe and gpt-oss (openai-moe) architectures
// (src/models/*.cpp): embedding rows, then per layer RMS norm, Q/K/V (+ biases, + Qwen3's per-head / OLMoE's
// full-width q/k norms), RoPE (YaRN where ext_factor says), the KV cache written at `pos`, attention over positions
// [0, pos + T) (causal within the T new tokens; a sliding-window layer's last n_swa only; GPT-OSS's sinks), the
// output projection, RMS norm, the router (+ bias) with softmax or softmax_weight gating, top-k (renormalised where
// the family does), the experts' mul_mat_id (+ biases, SiLU or swiglu_oai; + Qwen2-MoE's gated shared expert), and
// the final norm and lm_head. One call per forward: the weights stay where they lie (the mapped file), the
// intermediates get ggml-alloc's reused memory, the threadpool wakes once. Why: the per-module path spends ~3 ms a
// layer in Python and torch between ggml calls (docs/gguf.md), which llama.cpp does not.
//
// Legend (ggml order, ne0 first): H = hidden, D = head dim, NH / NKV = query / KV heads, T = new tokens,
// P = positions attended (pos + T), E = experts, U = experts used, I = expert width, S = shared expert width,
// V = vocabulary.

typedef struct {
    int64_t ne[3];         // ggml order: ne[0] = row length
    int64_t nb2;           // bytes from one matrix of a stack to the next (moectl's copies: one expert a row of a
                           // buffer); 0: back to back
    const void *data;      // NULL: absent
    int32_t type;
    int32_t pad;
} mg_w;

typedef struct {
    mg_w attn_norm, wq, wk, wv, wo, bq, bk, bv, bo, q_norm, k_norm, ffn_norm, router, gate, up, down;
    mg_w router_b;                 // F32 [E]: added to the router's logits (GPT-OSS's ffn_gate_inp.bias)
    mg_w gate_b, up_b, down_b;     // F32 [I, E], [I, E], [H, E]: the experts' biases (GPT-OSS's ffn_*_exps.bias)
    mg_w sinks;                    // F32 [NH]: per-head attention sink logits (GPT-OSS's attn_sinks)
    // Qwen2-MoE's shared expert (NULL data: none): a SiLU-gated FFN of width S over every token, its output scaled
    // by sigmoid(shexp_gate_inp . x), one scalar a token, and added to the routed experts'
    mg_w shexp_gate_inp;           // [H] (ffn_gate_inp_shexp)
    mg_w shexp_gate, shexp_up;     // [H, S] each (ffn_gate_shexp, ffn_up_shexp)
    mg_w shexp_down;               // [S, H] (ffn_down_shexp)
} mg_layer_w;

typedef struct {
    int64_t n_layer, n_embd, n_head, n_head_kv, head_dim, n_vocab, n_expert, n_used, n_ctx;
    float eps, freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow;
    float freq_base_swa;           // the sliding-window layers' RoPE base (llama.cpp's rope_freq_base_train_swa)
    float act_alpha, act_limit;    // the experts' activation: alpha > 0 swiglu_oai(alpha, limit), else SiLU(gate) * up
    int32_t rope_mode, n_rot, n_ctx_orig, norm_topk, qk_norm_full, kv_type;   // kv_type: GGML_TYPE_F16 or F32
    int32_t gating;                // MG_GATING_SOFTMAX or MG_GATING_SOFTMAX_WEIGHT
    int32_t n_swa;                 // the sliding window (positions a query sees, itself included) of the layers
                                   // is_swa marks
    mg_w tok_embd, out_norm, output;
    const mg_layer_w *layers;
    const uint8_t *is_swa;         // [n_layer]: 1 where the layer attends a sliding window; NULL: none
    char *k_cache, *v_cache;      // [n_layer, n_ctx, NKV * D] each, of kv_type (F16: llama.cpp's default cache type)
    int64_t serial;                // one number a model descriptor (ggml_model.py): a kept decode graph is this
                                   // model's, not an earlier one's at the same addresses
} mg_model_desc;

// llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX (softmax over all experts, then top-k of the probabilities)
// and _SOFTMAX_WEIGHT (top-k of the logits, then softmax over the selected: GPT-OSS)
enum { MG_GATING_SOFTMAX = 0, MG_GATING_SOFTMAX_WEIGHT = 1 };

// the descriptors' layout as moectl/runtime/ggml_model.py checks it: the layer's size too (the model descriptor
// holds only a pointer to the layers, so a field added there leaves sizeof(mg_model_desc) as it was)
int mg_model_abi(void) {
    return ((int)sizeof(mg_model_desc) * 10000 + (int)sizeof(mg_layer_w)) * 100 + (int)sizeof(mg_w);
}

static struct ggml_tensor *weight(struct ggml_context *ctx, const mg_w *w) {
    return w->data ? stack(ctx, w->type, w->ne[0], w->ne[1], w->ne[2], w->data, w->nb2) : NULL;
}

static struct ggml_tensor *rms(struct ggml_context *ctx, struct ggml_tensor *x, const mg_w *w, float eps) {
    return ggml_mul(ctx, ggml_rms_norm(ctx, x, eps), weight(ctx, w));
}

static const mg_w NO_W;                 // an absent weight (a bias not there)

// x [K, T] -> W x [N, T] (+ b): one token's through matvec (the own Q6_K kernel `q6k` where it applies)
static struct ggml_tensor *linear(struct ggml_context *ctx, const mg_w *w, const mg_w *b, struct ggml_tensor *x,
                                  q6k_rows_fn q6k) {
    struct ggml_tensor *W = weight(ctx, w);
    struct ggml_tensor *y = x->ne[1] == 1 ? matvec(NULL, ctx, W, x, q6k) : ggml_mul_mat(ctx, W, x);
    return b->data ? ggml_add(ctx, y, weight(ctx, b)) : y;
}

static struct ggml_tensor *rope(struct ggml_context *ctx, const mg_model_desc *m, struct ggml_tensor *x,
                                struct ggml_tensor *pos, float freq_base) {
    return ggml_rope_ext(ctx, x, pos, NULL, m->n_rot, m->rope_mode, m->n_ctx_orig, freq_base, m->freq_scale,
                         m->ext_factor, m->attn_factor, m->beta_fast, m->beta_slow);
}

// The first cache position a sliding-window layer's chunk of queries at pos.. can see: a query at p1 sees keys at
// p0 with p1 - p0 < n_swa (llama.cpp's is_masked_swa, LLAMA_SWA_TYPE_STANDARD); the earliest query is pos.
static int64_t swa_start(const mg_model_desc *m, int64_t pos) {
    return pos - m->n_swa + 1 > 0 ? pos - m->n_swa + 1 : 0;
}

// An attention mask [n, T] F16 into dst: 0 where query pos + t sees cache position s0 + j, -INF where that key is in
// its future or `window` or more positions back (a sliding-window layer's n_swa, as llama.cpp's kv cache fills
// kq_mask_swa; INT64_MAX: none). The causal mask of a prefill, a sliding-window layer's, and a kept decode graph's
// (its view padded past pos: the positions not written yet hidden) are all this.
static void fill_mask(ggml_fp16_t *dst, int64_t s0, int64_t n, int64_t pos, int64_t T, int64_t window) {
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), ninf = ggml_fp32_to_fp16(-INFINITY);
    for (int64_t t = 0; t < T; t++)
        for (int64_t j = 0; j < n; j++) {
            const int64_t p0 = s0 + j, p1 = pos + t;
            dst[t * n + j] = p0 > p1 || p1 - p0 >= window ? ninf : zero;
        }
}

// One layer's attention of the T new queries Q [D, NH, T] over this layer's cache positions [s0, s0 + P) (kc, vc:
// [n_ctx, NKV * D] of kv_type): flash attention, as llama.cpp's default on the CPU (build_attn_mha), K and V read
// where they lie in the cache, V not transposed (the non-FA form's transposed copy of V cost ~1.5 ms a token at a
// few hundred positions: ggml copies it element by element); GQA by ggml's broadcast over the head axis (query
// head h reads KV head h / (NH / NKV), transformers' repeat_kv). `mask` [P, T] F16 (-INF: not seen; ggml's flash
// attention skips those positions) or NULL (every position seen); s0 > 0: a sliding-window layer's view.
// `sinks` (F32 [NH] or NULL): each head's sink logit joins its softmax (ggml_flash_attn_ext_add_sinks), taking its
// share of the weight and adding no value. -> [NH * D, T]
static struct ggml_tensor *attention(struct ggml_context *ctx, const mg_model_desc *m, struct ggml_tensor *Q,
                                     char *kc, char *vc, int64_t s0, int64_t P, int64_t T,
                                     struct ggml_tensor *mask, struct ggml_tensor *sinks) {
    const int64_t D = m->head_dim, NH = m->n_head, NKV = m->n_head_kv, KV = NKV * D;
    const enum ggml_type kvt = (enum ggml_type)m->kv_type;
    const size_t es = ggml_type_size(kvt);
    struct ggml_tensor *kall = ext(ctx, kvt, KV * P, 1, 1, kc + s0 * KV * es);
    struct ggml_tensor *vall = ext(ctx, kvt, KV * P, 1, 1, vc + s0 * KV * es);
    struct ggml_tensor *k = ggml_view_3d(ctx, kall, D, P, NKV, KV * es, D * es, 0);      // [D, P, NKV]
    struct ggml_tensor *v = ggml_view_3d(ctx, vall, D, P, NKV, KV * es, D * es, 0);      // [D, P, NKV]
    struct ggml_tensor *q = ggml_permute(ctx, Q, 0, 2, 1, 3);                            // [D, T, NH]
    struct ggml_tensor *att = ggml_flash_attn_ext(ctx, q, k, v, mask, 1.0f / sqrtf((float)D), 0.0f, 0.0f);
    ggml_flash_attn_ext_add_sinks(att, sinks);                                           // [D, NH, T]
    ggml_prec_set_acc(att, GGML_PREC_F32);
    return ggml_reshape_2d(ctx, att, D * NH, T);                                        // [NH*D, T]
}

// Qwen2-MoE's shared expert, as llama.cpp's qwen2moe graph: build_ffn(x, up, gate, down, LLM_FFN_SILU, LLM_FFN_PAR)
// = down(silu(gate x) * up x), times sigmoid(gate_inp . x) a token. x [H, Tn] -> [H, Tn] (S = the shared width).
// llama.cpp writes the sigmoid as silu(g) / g; ggml_sigmoid is the same function without its 0 / 0 at g = 0.
static struct ggml_tensor *shared_expert(struct ggml_context *ctx, const mg_layer_w *L, struct ggml_tensor *x,
                                         q6k_rows_fn q6k) {
    struct ggml_tensor *up = linear(ctx, &L->shexp_up, &NO_W, x, q6k);                       // [S, Tn]
    struct ggml_tensor *gate = linear(ctx, &L->shexp_gate, &NO_W, x, q6k);                   // [S, Tn]
    struct ggml_tensor *y = linear(ctx, &L->shexp_down, &NO_W, ggml_swiglu_split(ctx, gate, up), q6k);
    struct ggml_tensor *g = ggml_sigmoid(ctx, linear(ctx, &L->shexp_gate_inp, &NO_W, x, q6k));   // [1, Tn]
    return ggml_mul(ctx, y, g);                                                              // [H, Tn]
}

// What a model graph reads besides the weights: data the caller fills, so one built graph can serve another step
typedef struct {
    struct ggml_tensor *tok, *pos, *last;    // I32: tokens [T], their positions [T], the row kept [1] (last_only)
    struct ggml_tensor *rows;                // I64 [T]: the cache rows the new K and V go to
    struct ggml_tensor *mask, *mask_swa;     // F16 [P, T], [P - s0_swa, T] (-INF: not seen), or NULL
    int64_t P, s0_swa;                       // the attention views cache positions [0, P), a sliding-window layer's
                                             // [s0_swa, P)
    int32_t *ids;                            // each layer's selected experts [n_layer, T, U] go here, or NULL
    q6k_rows_fn q6k;                         // the handle's own Q6_K matvec (one-token products), or NULL
} mg_inputs;

// The forward's graph into gf: T tokens -> logits [V, T or 1] (last_only: the last token's), their data `logits`.
static struct ggml_tensor *model_graph(struct ggml_context *ctx, struct ggml_cgraph *gf, const mg_model_desc *m,
                                       int64_t T, int32_t last_only, const mg_inputs *in, float *logits) {
    const int64_t H = m->n_embd, D = m->head_dim, NH = m->n_head, NKV = m->n_head_kv;
    const int64_t KV = NKV * D, U = m->n_used, E = m->n_expert;
    const enum ggml_type kvt = (enum ggml_type)m->kv_type;
    const size_t es = ggml_type_size(kvt);                      // bytes an element of the cache
    const mg_act act = {m->act_alpha, m->act_limit};            // SiLU(gate) * up, or GPT-OSS's swiglu_oai

    struct ggml_tensor *inpL = ggml_get_rows(ctx, weight(ctx, &m->tok_embd), in->tok);      // [H, T]
    int64_t Tn = T;                                                                          // rows still carried
    for (int64_t il = 0; il < m->n_layer; il++) {
        const mg_layer_w *L = &m->layers[il];
        struct ggml_tensor *cur = rms(ctx, inpL, &L->attn_norm, m->eps);
        struct ggml_tensor *Q = linear(ctx, &L->wq, &L->bq, cur, in->q6k);                  // [NH*D, T]
        struct ggml_tensor *K = linear(ctx, &L->wk, &L->bk, cur, in->q6k);                  // [KV, T]
        struct ggml_tensor *V = linear(ctx, &L->wv, &L->bv, cur, in->q6k);                  // [KV, T]
        if (L->q_norm.data && m->qk_norm_full) {                    // OLMoE: over all heads at once
            Q = rms(ctx, Q, &L->q_norm, m->eps);
            K = rms(ctx, K, &L->k_norm, m->eps);
        }
        Q = ggml_reshape_3d(ctx, Q, D, NH, T);
        K = ggml_reshape_3d(ctx, K, D, NKV, T);
        if (L->q_norm.data && !m->qk_norm_full) {                   // Qwen3: per head
            Q = rms(ctx, Q, &L->q_norm, m->eps);
            K = rms(ctx, K, &L->k_norm, m->eps);
        }
        const int swa = m->is_swa && m->is_swa[il];
        const float freq_base = swa ? m->freq_base_swa : m->freq_base;
        Q = rope(ctx, m, Q, in->pos, freq_base);                                            // [D, NH, T]
        K = rope(ctx, m, K, in->pos, freq_base);                                            // [D, NKV, T]
        // the new tokens' K and V into the cache rows in->rows, converted to the cache's type (run before the
        // attention reads them: graph order); rows as data, so a kept decode graph writes each step's own row
        char *kc = m->k_cache + il * m->n_ctx * KV * es, *vc = m->v_cache + il * m->n_ctx * KV * es;
        struct ggml_tensor *kdst = ext(ctx, kvt, KV, m->n_ctx, 1, kc);                      // [KV, n_ctx]
        struct ggml_tensor *vdst = ext(ctx, kvt, KV, m->n_ctx, 1, vc);                      // [KV, n_ctx]
        ggml_build_forward_expand(gf, ggml_set_rows(ctx, kdst, ggml_reshape_2d(ctx, K, KV, T), in->rows));
        ggml_build_forward_expand(gf, ggml_set_rows(ctx, vdst, V, in->rows));
        cur = swa ? attention(ctx, m, Q, kc, vc, in->s0_swa, in->P - in->s0_swa, T, in->mask_swa,
                              weight(ctx, &L->sinks))
                  : attention(ctx, m, Q, kc, vc, 0, in->P, T, in->mask, weight(ctx, &L->sinks));  // [NH*D, T]
        cur = linear(ctx, &L->wo, &L->bo, cur, in->q6k);                                    // [H, T]
        struct ggml_tensor *res = inpL;
        if (il == m->n_layer - 1 && last_only && T > 1) {          // the last layer's FFN: only the row kept
            cur = ggml_get_rows(ctx, cur, in->last);
            res = ggml_get_rows(ctx, res, in->last);
            Tn = 1;
        }
        struct ggml_tensor *ffn_inp = ggml_add(ctx, cur, res);
        cur = rms(ctx, ffn_inp, &L->ffn_norm, m->eps);                                      // [H, Tn]
        // routing (llama.cpp's build_moe_ffn): softmax gating picks the top-k probabilities; softmax_weight the
        // top-k logits, then a softmax over the k selected
        struct ggml_tensor *probs = linear(ctx, &L->router, &L->router_b, cur, in->q6k);    // [E, Tn] logits
        if (m->gating == MG_GATING_SOFTMAX) probs = ggml_soft_max(ctx, probs);
        struct ggml_tensor *sel = ggml_argsort_top_k(ctx, probs, (int)U);                   // [U, Tn] int32
        struct ggml_tensor *wts = ggml_get_rows(ctx, ggml_reshape_3d(ctx, probs, 1, E, Tn), sel);   // [1, U, Tn]
        if (m->gating == MG_GATING_SOFTMAX_WEIGHT)
            wts = ggml_reshape_3d(ctx, ggml_soft_max(ctx, ggml_reshape_2d(ctx, wts, U, Tn)), 1, U, Tn);
        if (m->norm_topk) {
            struct ggml_tensor *w2 = ggml_reshape_2d(ctx, wts, U, Tn);
            w2 = ggml_div(ctx, w2, ggml_sum_rows(ctx, w2));
            wts = ggml_reshape_3d(ctx, w2, 1, U, Tn);
        }
        if (in->ids) {                           // the rows routed (the last layer's last row only, see above)
            struct ggml_tensor *dst = ext(ctx, GGML_TYPE_I32, U, Tn, 1, in->ids + (il * T + T - Tn) * U);
            ggml_build_forward_expand(gf, ggml_cpy(ctx, sel, dst));
        }
        struct ggml_tensor *moe = experts_ffn(NULL, ctx, weight(ctx, &L->gate), weight(ctx, &L->up),
                                              weight(ctx, &L->down), weight(ctx, &L->gate_b),
                                              weight(ctx, &L->up_b), weight(ctx, &L->down_b), act,
                                              ggml_reshape_3d(ctx, cur, H, 1, Tn), sel, wts);   // [H, Tn]
        if (L->shexp_gate.data) moe = ggml_add(ctx, moe, shared_expert(ctx, L, cur, in->q6k)); // [H, Tn]
        inpL = ggml_add(ctx, moe, ffn_inp);                                                 // [H, Tn]
    }
    struct ggml_tensor *cur = rms(ctx, inpL, &m->out_norm, m->eps);
    if (last_only && Tn > 1) cur = ggml_get_rows(ctx, cur, in->last);
    const mg_w *out = m->output.data ? &m->output : &m->tok_embd;                         // tied: the embedding
    struct ggml_tensor *y = linear(ctx, out, &NO_W, cur, in->q6k);                          // [V, T or 1]
    y->data = logits;
    ggml_build_forward_expand(gf, y);
    return y;
}

// headers for a model's graph: 96 a layer (attention, routing, experts, Qwen2-MoE's shared expert's ~10, with room
// to spare) and 2 more a used expert (experts_ffn's sum over them: a view and an add each; Qwen2-57B uses 8)
static size_t graph_tensors(const mg_model_desc *m) {
    return (size_t)m->n_layer * (96 + 2 * (size_t)m->n_used) + 256;
}

static size_t graph_meta_size(size_t n_tensors) {
    return ggml_tensor_overhead() * n_tensors + ggml_graph_overhead_custom(n_tensors, false) + 4096;
}

static int any_swa(const mg_model_desc *m) {
    for (int64_t il = 0; m->is_swa && il < m->n_layer; il++)
        if (m->is_swa[il]) return 1;
    return 0;
}

// A decode step's graph is kept and reused while what it holds is unchanged: the descriptor (weights, cache buffers
// and their size, KV type, serial), the positions its attention views, the repack setting, whether ids go out. The
// views are rounded up to DEC_BUCKET positions, as llama.cpp pads its n_kv, so one graph serves DEC_BUCKET steps;
// its mask hides the positions not written yet. Per step only data changes: the token, its position and cache row,
// the masks. llama.cpp reuses its graph the same way (llama-context.cpp: can_reuse). Why: building ~30 nodes a layer
// and placing them (ggml-alloc, ggml's printf-formatted view names) was ~5-10 % of a step on a 48-layer model
// (perf), llama.cpp's graph reuse pays none of it.
#define DEC_BUCKET 256

static int64_t model_graphs_built;                  // mg_model_eval's graphs built so far (tests: a step reuses)

int64_t mg_model_graphs_built(void) { return __atomic_load_n(&model_graphs_built, __ATOMIC_RELAXED); }

static int decode_step(mg_handle *h, const mg_model_desc *m, int32_t token, int64_t pos, float *logits,
                       int32_t *ids_out) {
    int64_t P = (pos + 1 + DEC_BUCKET - 1) / DEC_BUCKET * DEC_BUCKET;
    if (P > m->n_ctx) P = m->n_ctx;
    const int swa = any_swa(m);
    const int64_t s0 = swa ? swa_start(m, pos) / DEC_BUCKET * DEC_BUCKET : 0;
    const char *rv = getenv("MOECTL_GGML_REPACK");
    char repack[64];
    snprintf(repack, sizeof(repack), "%s", rv ? rv : "(unset)");
    const int has_ids = ids_out != NULL;
    if (!(h->dec_gf && !memcmp(h->dec_key, m, sizeof(*m)) && h->dec_P == P && h->dec_s0 == s0 &&
          h->dec_has_ids == has_ids && !strcmp(h->dec_repack, repack))) {
        if (h->dec_ctx) ggml_free(h->dec_ctx);
        h->dec_ctx = NULL;
        h->dec_gf = NULL;
        const size_t n_tensors = graph_tensors(m), need = graph_meta_size(n_tensors);
        if (need > h->dec_meta_size) {
            free(h->dec_meta);
            h->dec_meta_size = 0;
            if (!(h->dec_meta = malloc(need))) return -3;
            h->dec_meta_size = need;
        }
        if (!h->dec_key && !(h->dec_key = malloc(sizeof(*m)))) return -3;
        if (!h->dec_galloc) h->dec_galloc = ggml_gallocr_new(ggml_backend_cpu_buffer_type());
        free(h->dec_mask);
        free(h->dec_mask_swa);
        free(h->dec_ids);
        h->dec_mask = malloc(sizeof(ggml_fp16_t) * (size_t)P);
        h->dec_mask_swa = swa ? malloc(sizeof(ggml_fp16_t) * (size_t)(P - s0)) : NULL;
        h->dec_ids = malloc(sizeof(int32_t) * (size_t)(m->n_layer * m->n_used));
        if (!h->dec_mask || (swa && !h->dec_mask_swa) || !h->dec_ids) return -3;
        struct ggml_init_params ip = {h->dec_meta_size, h->dec_meta, true};
        struct ggml_context *ctx = ggml_init(ip);
        struct ggml_cgraph *gf = ggml_new_graph_custom(ctx, n_tensors, false);
        const mg_inputs in = {ext(ctx, GGML_TYPE_I32, 1, 1, 1, &h->dec_tok), ext(ctx, GGML_TYPE_I32, 1, 1, 1, &h->dec_pos),
                              NULL, ext(ctx, GGML_TYPE_I64, 1, 1, 1, &h->dec_row),
                              ext(ctx, GGML_TYPE_F16, P, 1, 1, h->dec_mask),
                              swa ? ext(ctx, GGML_TYPE_F16, P - s0, 1, 1, h->dec_mask_swa) : NULL,
                              P, s0, has_ids ? h->dec_ids : NULL, h->q6k};
        struct ggml_tensor *y = model_graph(ctx, gf, m, 1, 0, &in, logits);
        const int used = rp_graph(gf);                   // weights with a CPU_REPACK copy read it (counted once)
        __atomic_add_fetch(&model_graphs_built, 1, __ATOMIC_RELAXED);
        if (!ggml_gallocr_alloc_graph(h->dec_galloc, gf)) {
            ggml_free(ctx);
            return -2;
        }
        h->dec_ctx = ctx;
        h->dec_gf = gf;
        h->dec_y = y;
        memcpy(h->dec_key, m, sizeof(*m));
        h->dec_P = P;
        h->dec_s0 = s0;
        h->dec_has_ids = has_ids;
        h->dec_used = used;
        memcpy(h->dec_repack, repack, sizeof(repack));
    } else if (h->dec_used) {
        pthread_mutex_lock(&rp_lock);
        rp_stat[3] += 1;                                 // a graph that used a copy, as a rebuilt one counts
        pthread_mutex_unlock(&rp_lock);
    }
    // the step's data: position pos sees cache positions [0, pos] (a sliding-window layer's: the last n_swa)
    h->dec_tok = token;
    h->dec_pos = (int32_t)pos;
    h->dec_row = pos;
    fill_mask(h->dec_mask, 0, P, pos, 1, INT64_MAX);
    if (swa) fill_mask(h->dec_mask_swa, s0, P - s0, pos, 1, m->n_swa);
    h->dec_y->data = logits;
    compute(h, h->dec_gf);
    if (ids_out) memcpy(ids_out, h->dec_ids, sizeof(int32_t) * (size_t)(m->n_layer * m->n_used));
    return 0;
}

// tokens [T] int32 at positions pos.. -> logits [T or 1, V] (last_only: the last token's); ids_out (or NULL):
// each layer's selected experts [n_layer, T, U] int32. Returns 0, or -1 when pos + T > n_ctx. A decode step
// (T = 1) reuses its graph (decode_step); a longer forward builds its own.
int mg_model_eval(void *hp, const mg_model_desc *m, const int32_t *tokens, int64_t T, int64_t pos,
                  int32_t last_only, float *logits, int32_t *ids_out) {
    mg_handle *h = hp;
    if (pos + T > m->n_ctx || T < 1 || (m->kv_type != GGML_TYPE_F16 && m->kv_type != GGML_TYPE_F32)) return -1;
    if (T == 1 && !getenv("MOECTL_GGML_NO_GRAPH_REUSE")) return decode_step(h, m, tokens[0], pos, logits, ids_out);
    const size_t n_tensors = graph_tensors(m), need = graph_meta_size(n_tensors);
    if (need > h->model_meta_size) {
        free(h->model_meta);
        h->model_meta = malloc(need);
        h->model_meta_size = need;
    }
    if (!h->galloc) h->galloc = ggml_gallocr_new(ggml_backend_cpu_buffer_type());
    struct ggml_init_params ip = {h->model_meta_size, h->model_meta, true};
    struct ggml_context *ctx = ggml_init(ip);
    struct ggml_cgraph *gf = ggml_new_graph_custom(ctx, n_tensors, false);

    int32_t *posv = malloc(sizeof(int32_t) * T);
    int64_t *rowv = malloc(sizeof(int64_t) * T);
    for (int64_t t = 0; t < T; t++) posv[t] = (int32_t)(pos + t), rowv[t] = pos + t;
    int32_t last = (int32_t)(T - 1);
    // causal mask of the new tokens [P, T] F16 (flash attention's type): token t sees positions <= pos + t; the
    // sliding-window layers' over [s0, pos + T), if a layer is one
    const int64_t s0 = swa_start(m, pos);
    ggml_fp16_t *maskv = malloc(sizeof(ggml_fp16_t) * (size_t)(pos + T) * (size_t)T);
    fill_mask(maskv, 0, pos + T, pos, T, INT64_MAX);
    ggml_fp16_t *swa_maskv = any_swa(m) ? malloc(sizeof(ggml_fp16_t) * (size_t)(pos + T - s0) * (size_t)T) : NULL;
    if (swa_maskv) fill_mask(swa_maskv, s0, pos + T - s0, pos, T, m->n_swa);
    const mg_inputs in = {ext(ctx, GGML_TYPE_I32, T, 1, 1, tokens), ext(ctx, GGML_TYPE_I32, T, 1, 1, posv),
                          ext(ctx, GGML_TYPE_I32, 1, 1, 1, &last), ext(ctx, GGML_TYPE_I64, T, 1, 1, rowv),
                          ext(ctx, GGML_TYPE_F16, pos + T, T, 1, maskv),
                          swa_maskv ? ext(ctx, GGML_TYPE_F16, pos + T - s0, T, 1, swa_maskv) : NULL,
                          pos + T, s0, ids_out, h->q6k};
    model_graph(ctx, gf, m, T, last_only, &in, logits);
    rp_graph(gf);                                    // weights with a CPU_REPACK copy read it
    __atomic_add_fetch(&model_graphs_built, 1, __ATOMIC_RELAXED);
    int rc = ggml_gallocr_alloc_graph(h->galloc, gf) ? 0 : -2;
    if (rc == 0) compute(h, gf);
    ggml_free(ctx);
    free(posv);
    free(rowv);
    free(maskv);
    free(swa_maskv);
    return rc;
}

// --- a streaming-read bandwidth probe: the memory roofline beside the decode ratios (stop 54) ----------------------
//
// A decode token reads every weight it uses once (the dense matrices, the lm_head, top-k of each layer's experts) and
// reuses none of it, so its ms/token is at best bytes read / the bandwidth the cores can stream from DRAM. This
// measures that figure on the machine the benchmark runs on (bench/gguf_vs_llamacpp.py), with the loads ggml's
// kernels use here: each of N pthreads reads its own contiguous slice of one buffer far larger than the caches
// (>= 1 GB), 256-bit loads where the CPU has AVX2 (128-bit SSE2 / the compiler's otherwise), four independent sums
// so the loop is bound by memory, not by an add chain, and the sums kept so nothing is elided. No pinning, as ggml's
// threadpool does not pin by default. Why not a ggml op: ggml_sum / sum_rows reduce on one thread only, and a matvec
// measures its dot products too (what the probe is to be compared with).
//
// The buffer is written first, each slice by the thread that reads it (the page faults and first touch, untimed);
// then `passes` timed passes, each from a barrier every reader leaves together to one every reader reaches, timed
// by a thread that reads nothing.

#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

__attribute__((target("avx2"))) static uint64_t bw_read_avx2(const uint8_t *p, size_t n) {
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
    for (size_t i = 0; i + 128 <= n; i += 128) {
        // 4 KB ahead, as moectl's ggml products prefetch (kernels/ggml_patch.py): the hardware prefetchers stop at
        // each page, and without it the probe read less than those products on an Intel host (stop 55)
        _mm_prefetch((const char *)(p + i + 4096), _MM_HINT_T0);
        _mm_prefetch((const char *)(p + i + 4096 + 64), _MM_HINT_T0);
        s0 = _mm256_add_epi64(s0, _mm256_load_si256((const __m256i *)(p + i)));
        s1 = _mm256_add_epi64(s1, _mm256_load_si256((const __m256i *)(p + i + 32)));
        s2 = _mm256_add_epi64(s2, _mm256_load_si256((const __m256i *)(p + i + 64)));
        s3 = _mm256_add_epi64(s3, _mm256_load_si256((const __m256i *)(p + i + 96)));
    }
    __m256i s = _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3));
    return (uint64_t)_mm256_extract_epi64(s, 0) + (uint64_t)_mm256_extract_epi64(s, 1) +
           (uint64_t)_mm256_extract_epi64(s, 2) + (uint64_t)_mm256_extract_epi64(s, 3);
}
#endif

static uint64_t bw_read_plain(const uint8_t *p, size_t n) {
    const uint64_t *q = (const uint64_t *)p;
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (size_t i = 0; i + 4 <= n / 8; i += 4) {
        s0 += q[i];
        s1 += q[i + 1];
        s2 += q[i + 2];
        s3 += q[i + 3];
    }
    return s0 + s1 + s2 + s3;
}

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t changed;
    int state;             // 0: readers wait for every reader to have started; 1: go; -1: one could not, stop
} bw_gate;

typedef struct {
    uint8_t *slice;
    size_t n;
    int passes, avx2;
    bw_gate *gate;
    pthread_barrier_t *bar;
    uint64_t sum;          // read back by the caller: the loads cannot be elided
} bw_reader;

static volatile uint64_t bw_sink;

static void *bw_read_slice(void *ap) {
    bw_reader *r = ap;
    pthread_mutex_lock(&r->gate->lock);
    while (r->gate->state == 0) pthread_cond_wait(&r->gate->changed, &r->gate->lock);
    int go = r->gate->state > 0;
    pthread_mutex_unlock(&r->gate->lock);
    if (!go) return NULL;
    memset(r->slice, 1, r->n);                           // first touch, by the thread that reads the slice
    pthread_barrier_wait(r->bar);                        // every slice written
    for (int p = 0; p < r->passes; p++) {
        pthread_barrier_wait(r->bar);                    // start
#if defined(__x86_64__) || defined(__i386__)
        r->sum += r->avx2 ? bw_read_avx2(r->slice, r->n) : bw_read_plain(r->slice, r->n);
#else
        r->sum += bw_read_plain(r->slice, r->n);
#endif
        pthread_barrier_wait(r->bar);                    // every slice read
    }
    return NULL;
}

static double bw_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// Reads `bytes` (rounded down to whole 4 KiB pages per thread) with `n_threads` readers `passes` times; bytes/s of
// each pass into out[passes]. Returns 0, -1 when the buffer cannot be had, -2 when a reader cannot start, -3 on
// arguments out of range.
int mg_read_bandwidth(int64_t bytes, int n_threads, int passes, double *out) {
    if (n_threads < 1 || n_threads > 1024 || passes < 1 || bytes < 4096 * (int64_t)n_threads) return -3;
    size_t slice = (size_t)bytes / n_threads / 4096 * 4096, total = slice * n_threads;
    uint8_t *buf = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    bw_reader *rs = calloc(n_threads, sizeof(bw_reader));
    pthread_t *ts = calloc(n_threads, sizeof(pthread_t));
    if (buf == MAP_FAILED || !rs || !ts) {
        if (buf != MAP_FAILED) munmap(buf, total);
        free(rs);
        free(ts);
        return -1;
    }
    bw_gate gate = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, (unsigned)n_threads + 1);
    int avx2 = 0, started = 0;
#if defined(__x86_64__) || defined(__i386__)
    avx2 = __builtin_cpu_supports("avx2");
#endif
    for (; started < n_threads; started++) {
        rs[started] = (bw_reader){buf + slice * started, slice, passes, avx2, &gate, &bar, 0};
        if (pthread_create(&ts[started], NULL, bw_read_slice, &rs[started])) break;
    }
    pthread_mutex_lock(&gate.lock);
    gate.state = started == n_threads ? 1 : -1;
    pthread_cond_broadcast(&gate.changed);
    pthread_mutex_unlock(&gate.lock);
    if (gate.state > 0) {
        pthread_barrier_wait(&bar);                      // every slice written (untimed)
        for (int p = 0; p < passes; p++) {
            double t0 = bw_now();
            pthread_barrier_wait(&bar);
            pthread_barrier_wait(&bar);
            out[p] = (double)total / (bw_now() - t0);
        }
    }
    uint64_t sum = 0;
    for (int i = 0; i < started; i++) {
        pthread_join(ts[i], NULL);
        sum += rs[i].sum;
    }
    bw_sink = sum;
    pthread_barrier_destroy(&bar);
    munmap(buf, total);
    free(rs);
    free(ts);
    return started == n_threads ? 0 : -2;
}
