// Expert-rows kernels (rows.h) for the IQ types: IQ4_XS, IQ2_XXS, IQ3_XXS. (Not yet written.)
#include "rows.h"

ggml_moectl_rows_fn ggml_moectl_rows_iq(enum ggml_type type) {
    (void) type;
    return NULL;
}
