/* Sparsity counts in C: twin of sparsity_counts (tw_triton/codecs/bitmask.py), which picks
 * the bitmask codec for a tensor the rules store exact. */
#include "native.h"

/* The elements of n items of itemsize bytes (2, 4 or 8) whose bit pattern is not zero, and
 * the runs of consecutive zero patterns, counting a run that starts at x only if prev_zero
 * is 0 (the element before x, in the caller's tensor, is not zero). Returns 0, or -1 for
 * an itemsize or a count it does not take. */
int64_t tw_sparsity_counts(const void *x, int64_t n, int32_t itemsize, int32_t prev_zero, int64_t *nnz_out,
                           int64_t *runs_out) {
    if (n <= 0) {
        *nnz_out = *runs_out = 0;
        return n == 0 ? 0 : -1;
    }
    int64_t zeros = 0, starts = 0;
    /* Each element against the one before it, read again rather than carried, so that the
     * loop has no dependency between iterations and vectorizes. */
#define TW_COUNT(T)                                                 \
    do {                                                            \
        const T *v = (const T *)x;                                  \
        zeros = v[0] == 0;                                          \
        starts = zeros & (prev_zero == 0);                          \
        for (int64_t i = 1; i < n; i++) {                           \
            const int64_t z = v[i] == 0, zp = v[i - 1] == 0;        \
            zeros += z;                                             \
            starts += z & (zp ^ 1);                                 \
        }                                                           \
    } while (0)
    if (itemsize == 2)
        TW_COUNT(uint16_t);
    else if (itemsize == 4)
        TW_COUNT(uint32_t);
    else if (itemsize == 8)
        TW_COUNT(uint64_t);
    else
        return -1;
#undef TW_COUNT
    *nnz_out = n - zeros;
    *runs_out = starts;
    return 0;
}
