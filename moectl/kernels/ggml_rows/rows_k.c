// Expert-rows kernels (rows.h) for the K-quants ggml does not repack on x86: Q5_K, Q6_K, Q3_K. (Not yet written.)
#include "rows.h"

ggml_moectl_rows_fn ggml_moectl_rows_k(enum ggml_type type) {
    (void) type;
    return NULL;
}
