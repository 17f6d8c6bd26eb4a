/* The log2 codec in C: twin of quantize_log2_torch / dequantize_log2_torch
 * (tw_triton/codecs/log2.py, the spec), one block at a time in buffers that stay in L1. */
#include "native.h"

#define TW_F32_INF_BITS 0x7F800000
#define TW_NEG_ZERO_BITS INT32_MIN

/* Classify a block's fp32 bit patterns: *bad when some element is negative, NaN or
 * infinite; else the smallest and largest positive pattern (INT32_MAX and 0 when none). */
TW_INLINE void tw_log2_bounds(const int32_t *t, int count, int32_t *lo, int32_t *hi, int32_t *bad) {
    int32_t mn = INT32_MAX, mx = 0;
    uint32_t other = 0;
    for (int i = 0; i < count; i++) {
        const int32_t v = t[i];
        /* positive and finite: 1 <= v < bits(+inf); zero: +0 or -0 */
        const uint32_t pos = (uint32_t)v - 1u < (uint32_t)(TW_F32_INF_BITS - 1);
        const uint32_t zero = ((uint32_t)v & 0x7FFFFFFFu) == 0u;
        other |= (pos | zero) ^ 1u;
        /* A bitwise select (all ones where positive): GCC vectorizes it, not a ?: here. */
        const int32_t keep = -(int32_t)pos;
        const int32_t a = (v & keep) | (INT32_MAX & ~keep);
        const int32_t b = v & keep;
        mn = a < mn ? a : mn;
        mx = b > mx ? b : mx;
    }
    *lo = mn;
    *hi = mx;
    *bad = (int32_t)other;
}

/* u = 1 + clamp(rne(fl32(fl32(t - lo) / step)), 0, N) for a positive element, 0 otherwise.
 * t - lo is taken in int32 and rounded to fp32 once, as torch does; masked elements may
 * compute anything (unsigned arithmetic keeps that defined). */
TW_INLINE void tw_log2_codes(const int32_t *t, int count, int32_t lo, float step, float n_steps, uint8_t *u) {
    for (int i = 0; i < count; i++) {
        const int32_t v = t[i];
        const int32_t pos = (v > 0) & (v < TW_F32_INF_BITS);
        float r = (float)(int32_t)((uint32_t)v - (uint32_t)lo) / step;
        r = r < 0.0f ? 0.0f : r;
        r = r > n_steps ? n_steps : r;
        r = (r + TW_RNE_MAGIC) - TW_RNE_MAGIC;
        u[i] = pos ? (uint8_t)(int32_t)(r + 1.0f) : 0;
    }
}

/* Encode n elements (contiguous TW_F32 or TW_BF16) into packed codes and int32 lo / hi
 * per block (-1, -1 for a block holding a negative, NaN or infinite element, whose codes
 * are then 0). Returns the number of blocks, or -1 for parameters the codec does not take. */
int64_t tw_log2_encode(const void *x, int x_dtype, int64_t n, int32_t block, int32_t bits, uint8_t *codes,
                       int32_t *lo_out, int32_t *hi_out) {
    if (block < 32 || block > TW_MAX_BLOCK || (block & (block - 1)) || (bits != 8 && bits != 4 && bits != 2) || n < 0)
        return -1;
    float v[TW_MAX_BLOCK] __attribute__((aligned(64)));
    uint8_t u[TW_MAX_BLOCK] __attribute__((aligned(64)));
    const int32_t *t = (const int32_t *)v;
    const float n_steps = (float)((1 << bits) - 2);
    const int64_t nb = (n + block - 1) / block;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t s0 = b * block;
        const int m = (int)(n - s0 < block ? n - s0 : block);
        tw_load_f32(v, x, x_dtype, s0, m);
        /* A zero is coded as itself and never widens the bounds. */
        if (m < block) memset(v + m, 0, (size_t)(block - m) * 4);
        int32_t lo, hi, bad;
        tw_log2_bounds(t, block, &lo, &hi, &bad);
        if (bad) {
            lo = hi = -1;
            memset(u, 0, (size_t)block);
        } else {
            if (hi == 0) lo = 0; /* no positive element: bounds 0, codes 0 */
            const float step = (float)(hi - lo) / n_steps;
            tw_log2_codes(t, block, lo, step > 0.0f ? step : 1.0f, n_steps, u);
        }
        lo_out[b] = lo;
        hi_out[b] = hi;
        tw_pack(u, bits, codes + s0 * bits / 8, (int)(((int64_t)m * bits + 7) / 8));
    }
    return nb;
}

/* t = min(hi, lo + trunc(fl32(fl32(u - 1) * step) + 0.5)), and +0 where u = 0. */
TW_INLINE void tw_log2_values(const uint8_t *u, int count, int32_t lo, int32_t hi, float step, int32_t *t) {
    for (int i = 0; i < count; i++) {
        const float p = (float)((int32_t)u[i] - 1) * step + 0.5f;
        int32_t v = (int32_t)p + lo; /* p < 2**31 and lo <= hi < 2**31 - p: no overflow */
        v = v < hi ? v : hi;
        t[i] = u[i] ? v : 0;
    }
}

/* Decode n elements into out (TW_F32 or TW_BF16). Returns the number of blocks decoded:
 * all of them, or the index of the first block whose bounds are not 0 <= lo <= hi < inf
 * (never written by the encoder: its results may be NaN patterns, or overflow the integer
 * arithmetic), which is left unwritten with every block after it for the torch path; -1
 * for bad parameters. */
int64_t tw_log2_decode(const uint8_t *codes, const int32_t *lo, const int32_t *hi, int64_t n, int32_t bits,
                       int32_t block, void *out, int out_dtype) {
    if (block < 32 || block > TW_MAX_BLOCK || (block & (block - 1)) || (bits != 8 && bits != 4 && bits != 2) || n < 0)
        return -1;
    uint8_t u[TW_MAX_BLOCK] __attribute__((aligned(64)));
    int32_t t[TW_MAX_BLOCK] __attribute__((aligned(64)));
    const float n_steps = (float)((1 << bits) - 2);
    const int64_t nb = (n + block - 1) / block;
    for (int64_t b = 0; b < nb; b++) {
        if (!(0 <= lo[b] && lo[b] <= hi[b] && hi[b] < TW_F32_INF_BITS)) return b;
        const int64_t s0 = b * block;
        const int m = (int)(n - s0 < block ? n - s0 : block);
        tw_unpack(codes + s0 * bits / 8, (int)(((int64_t)m * bits + 7) / 8), bits, u);
        const float step = (float)(hi[b] - lo[b]) / n_steps;
        tw_log2_values(u, m, lo[b], hi[b], step, t);
        if (out_dtype == TW_F32)
            memcpy((int32_t *)out + s0, t, (size_t)m * 4);
        else
            tw_store_bf16((uint16_t *)out + s0, (const uint32_t *)t, m);
    }
    return nb;
}
