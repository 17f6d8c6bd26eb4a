/* The statistics of the weight-delta bits choice in C: twin of delta_statistics_torch
 * (tw_triton/ops/reference/delta_statistics.py, the spec): the same four integers. */
#include <math.h>

#include "native.h"

TW_INLINE int tw_nonfinite(float v) { return (tw_bits(v) & 0x7FFFFFFFu) >= 0x7F800000u; }

/* floor(v * (scale / max(top, FLT_MIN))) as the spec takes it: the correctly rounded
 * reciprocal, times the power-of-two scale (exact), then one fp32 product. Returns the
 * factor, which is not finite when the reciprocal overflows. */
TW_INLINE float tw_level_factor(float top, float scale) {
    const float t = top > 1.17549435e-38f ? top : 1.17549435e-38f;
    return (1.0f / t) * scale;
}

/* x (TW_F32 or TW_BF16, n elements) minus ref (same, or NULL): into out the fp32 bits of
 * A = max_b s_b (s_b the largest |x - ref| of block b, kept in s, one per block) and of
 * B = max |x|, then sum_b floor(s_b * (4096 / A))**2 and sum_i floor(|x_i| * (256 / B))**2.
 * Returns 0; 1 where the spec's arithmetic leaves the finite range (a NaN or infinite
 * element or difference, or a maximum whose reciprocal overflows: the caller asks the
 * spec); -1 for bad parameters. */
int64_t tw_delta_statistics(const void *x, int x_dtype, const void *ref, int ref_dtype, int64_t n, int32_t block,
                            float *s, int64_t *out) {
    if (block < 1 || block > TW_MAX_BLOCK || n < 1 || (x_dtype != TW_F32 && x_dtype != TW_BF16) ||
        (ref != NULL && ref_dtype != TW_F32 && ref_dtype != TW_BF16))
        return -1;
    float v[TW_MAX_BLOCK] __attribute__((aligned(64)));
    float r[TW_MAX_BLOCK] __attribute__((aligned(64)));
    const int64_t nb = (n + block - 1) / block;
    float a = 0.0f, b = 0.0f;
    int bad = 0;
    for (int64_t k = 0; k < nb; k++) {
        const int64_t s0 = k * block;
        const int m = (int)(n - s0 < block ? n - s0 : block);
        tw_load_f32(v, x, x_dtype, s0, m);
        if (ref != NULL) tw_load_f32(r, ref, ref_dtype, s0, m);
        float sb = 0.0f, xb = 0.0f;
        for (int i = 0; i < m; i++) {
            const float xa = fabsf(v[i]);
            const float d = ref != NULL ? fabsf(v[i] - r[i]) : xa;
            bad |= tw_nonfinite(d) | tw_nonfinite(xa);
            sb = d > sb ? d : sb;
            xb = xa > xb ? xa : xb;
        }
        s[k] = sb;
        a = sb > a ? sb : a;
        b = xb > b ? xb : b;
    }
    const float fa = tw_level_factor(a, 4096.0f), fb = tw_level_factor(b, 256.0f);
    if (bad || tw_nonfinite(fa) || tw_nonfinite(fb)) return 1;
    int64_t qs = 0, qx = 0;
    for (int64_t k = 0; k < nb; k++) {
        const int64_t q = (int64_t)floorf(s[k] * fa);
        qs += q * q;
    }
    for (int64_t k = 0; k < nb; k++) {
        const int64_t s0 = k * block;
        const int m = (int)(n - s0 < block ? n - s0 : block);
        tw_load_f32(v, x, x_dtype, s0, m);
        int64_t part = 0;
        for (int i = 0; i < m; i++) {
            const int64_t q = (int64_t)floorf(fabsf(v[i]) * fb);
            part += q * q;
        }
        qx += part;
    }
    out[0] = (int64_t)(int32_t)tw_bits(a);
    out[1] = (int64_t)(int32_t)tw_bits(b);
    out[2] = qs;
    out[3] = qx;
    return 0;
}
