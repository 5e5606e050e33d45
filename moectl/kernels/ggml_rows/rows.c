// The expert-rows kernels' dispatch (rows.h): each family's file answers for its types.
#include "rows.h"

// exported: the tests call the kernels directly (tests/test_ggml_expert_rows.py)
__attribute__((visibility("default"))) ggml_moectl_rows_fn ggml_moectl_rows_kernel(enum ggml_type type) {
    ggml_moectl_rows_fn f = ggml_moectl_rows_k(type);
    return f != NULL ? f : ggml_moectl_rows_iq(type);
}
