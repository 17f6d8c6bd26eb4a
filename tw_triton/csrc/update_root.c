/* The blockwise-update codec's denominator in C: twin of its torch spec
 * (tw_triton/ops/reference/update_root.py), which the codec divides exp_avg by and
 * multiplies the decoded update by. */
#include "native.h"

#include <math.h>

/* d[i] = sqrtf(v[i]) + eps for n floats: IEEE sqrt (correctly rounded, as CUDA's sqrt.rn),
 * then one fp32 add; a NaN (the root of a negative value) as the positive quiet NaN, as
 * torch's vector path gives it (the codec stores such an entry exact). Returns 0, or -1
 * for a negative count. */
int64_t tw_update_root(const float *v, int64_t n, float eps, float *d) {
    if (n < 0)
        return -1;
    for (int64_t i = 0; i < n; i++) {
        const float r = sqrtf(v[i]) + eps;
        d[i] = r == r ? r : NAN;
    }
    return 0;
}

/* u[i] = x[i] / (sqrtf(v[i]) + eps): the update the codec codes, each op correctly rounded,
 * a NaN as the positive quiet NaN. Returns 0, or -1 for a negative count. */
int64_t tw_update_divide(const float *x, const float *v, int64_t n, float eps, float *u) {
    if (n < 0)
        return -1;
    for (int64_t i = 0; i < n; i++) {
        const float r = x[i] / (sqrtf(v[i]) + eps);
        u[i] = r == r ? r : NAN;
    }
    return 0;
}

/* u[i] = u[i] * (sqrtf(v[i]) + eps), saturated to [-big, big]: the decoded moment, each op
 * correctly rounded, a NaN as the positive quiet NaN. Returns 0, or -1 for a negative count. */
int64_t tw_update_multiply(float *u, const float *v, int64_t n, float eps, float big) {
    if (n < 0)
        return -1;
    for (int64_t i = 0; i < n; i++) {
        float r = u[i] * (sqrtf(v[i]) + eps);
        r = r > big ? big : (r < -big ? -big : r);
        u[i] = r == r ? r : NAN;
    }
    return 0;
}
