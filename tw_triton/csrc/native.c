/* The whole library as one translation unit (setup.py compiles this file, or
 * native_avx2.c, which includes it with AVX2 code generation). */
#include "module.c"
#include "blockwise.c"
#include "log2.c"
#include "log2_temporal.c"
#include "planes.c"
#include "sparsity.c"
#include "delta_statistics.c"
#include "update_root.c"
