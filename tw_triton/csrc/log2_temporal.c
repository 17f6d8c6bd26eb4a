/* The temporal codec in C: twin of quantize_log2_temporal_torch / dequantize_log2_temporal_torch
 * (tw_triton/ops/reference/log2_temporal.py, the spec), one block at a time in buffers that
 * stay in L1. Included after log2.c, whose bounds, codes and values helpers give the
 * absolute blocks. */
#include "native.h"

#define TW_F32_MAX_BITS 0x7F7FFFFF
#define TW_TEMPORAL_ZERO 0x80u /* the code -128: an exact zero */
#define TW_TEMPORAL_QMAX 127
/* The largest min_step taken here (the codec's is 2**29): the step S then stays at most
 * 2**31, so |d| + S / 2 fits a uint32 and r + q * S is exact in a double. */
#define TW_TEMPORAL_MAX_MIN_STEP (1LL << 31)

/* The step S of a block of reference patterns r: max((hi_r - lo_r) // N, min_step) over its
 * positive finite patterns (min_step when there is none). */
TW_INLINE int64_t tw_temporal_step(const int32_t *r, int count, int64_t n_steps, int64_t min_step) {
    int32_t lo, hi, bad;
    tw_log2_bounds(r, count, &lo, &hi, &bad); /* bad is of no interest for a reference */
    const int64_t span = hi > 0 ? (int64_t)hi - lo : 0;
    const int64_t s = span / n_steps;
    return s > min_step ? s : min_step;
}

/* qa = floor((|t - r| + S / 2) / S) of each element, capped at 255; only exact where both
 * patterns are positive finite (< 2**31), the only elements whose q is kept: |d| is taken in
 * uint32, and there |d| + S / 2 < 2**31 + 2**30. The quotient is taken in double: both
 * operands are integers below 2**33, so the correctly rounded quotient is never rounded up
 * across an integer, and truncating it gives the floor exactly. A loop of its own: GCC does
 * not vectorize doubles in a loop that also stores bytes. */
TW_INLINE void tw_temporal_quotients(const int32_t *t, const int32_t *r, int count, uint32_t half, double step,
                                     int32_t *qa) {
    for (int i = 0; i < count; i++) {
        const int32_t v = t[i], w = r[i];
        const uint32_t a = v < w ? (uint32_t)w - (uint32_t)v : (uint32_t)v - (uint32_t)w;
        const uint32_t x = a + half;
        /* uint32 -> double exactly through a signed conversion (which vectorizes). */
        double qd = ((double)(int32_t)(x ^ 0x80000000u) + 2147483648.0) / step;
        qd = qd < 255.0 ? qd : 255.0;
        qa[i] = (int32_t)qd;
    }
}

/* The temporal codes of a block from its quotients: q (two's complement) of each positive
 * element over a positive reference, 0x80 for a zero, 0 for the rest. Returns bit 0 set when
 * some element does not code temporally (not a zero, nor a positive over a positive with
 * |q| <= 127), bit 1 when some element is negative, NaN or infinite. */
TW_INLINE int32_t tw_temporal_codes(const int32_t *t, const int32_t *r, const int32_t *qa, int count, uint8_t *c) {
    uint32_t notok = 0, bad = 0;
    for (int i = 0; i < count; i++) {
        const int32_t v = t[i], w = r[i];
        const uint32_t pos = (uint32_t)v - 1u < (uint32_t)(TW_F32_INF_BITS - 1);
        const uint32_t zero = ((uint32_t)v & 0x7FFFFFFFu) == 0u;
        const uint32_t rpos = (uint32_t)w - 1u < (uint32_t)(TW_F32_INF_BITS - 1);
        const uint32_t ok = zero | (pos & rpos & (qa[i] <= TW_TEMPORAL_QMAX));
        const uint8_t q = (uint8_t)(v < w ? -qa[i] : qa[i]);
        c[i] = zero ? (uint8_t)TW_TEMPORAL_ZERO : (ok ? q : 0);
        notok |= ok ^ 1u;
        bad |= (pos | zero) ^ 1u;
    }
    return (int32_t)(notok | (bad << 1));
}

/* Encode n float32 elements x against the float32 reference ref into codes (one byte per
 * element) and int32 lo / hi per block: 0, 0 for a temporal block, the absolute log2 bounds
 * for an absolute one, -1, -1 (codes 0) for a block holding a negative, NaN or infinite
 * element. Returns the number of blocks, or -1 for parameters the codec does not take. */
int64_t tw_log2_temporal_encode(const float *x, const float *ref, int64_t n, int32_t block, int32_t bits,
                                int64_t min_step, uint8_t *codes, int32_t *lo_out, int32_t *hi_out) {
    if (block < 32 || block > TW_MAX_BLOCK || (block & (block - 1)) || (bits != 8 && bits != 4 && bits != 2) ||
        n < 0 || min_step < 1 || min_step > TW_TEMPORAL_MAX_MIN_STEP)
        return -1;
    float v[TW_MAX_BLOCK] __attribute__((aligned(64)));
    float w[TW_MAX_BLOCK] __attribute__((aligned(64)));
    int32_t qa[TW_MAX_BLOCK] __attribute__((aligned(64)));
    uint8_t c[TW_MAX_BLOCK] __attribute__((aligned(64)));
    const int32_t *t = (const int32_t *)v, *r = (const int32_t *)w;
    const int64_t levels = (1 << bits) - 2;
    const float n_steps = (float)levels;
    const int64_t nb = (n + block - 1) / block;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t s0 = b * block;
        const int m = (int)(n - s0 < block ? n - s0 : block);
        memcpy(v, x + s0, (size_t)m * 4);
        memcpy(w, ref + s0, (size_t)m * 4);
        /* The spec's padding: zeros, which code as zeros and are no positive reference. */
        if (m < block) {
            memset(v + m, 0, (size_t)(block - m) * 4);
            memset(w + m, 0, (size_t)(block - m) * 4);
        }
        const int64_t s = tw_temporal_step(r, block, levels, min_step);
        tw_temporal_quotients(t, r, block, (uint32_t)(s / 2), (double)s, qa);
        const int32_t flags = tw_temporal_codes(t, r, qa, block, c);
        int32_t lo = 0, hi = 0;
        if (flags & 2) {
            lo = hi = -1;
            memset(c, 0, (size_t)block);
        } else if (flags & 1) {
            /* Absolute: at least one positive element (the one that did not code). */
            int32_t bad;
            tw_log2_bounds(t, block, &lo, &hi, &bad);
            const float step = (float)(hi - lo) / n_steps;
            tw_log2_codes(t, block, lo, step > 0.0f ? step : 1.0f, n_steps, c);
        }
        lo_out[b] = lo;
        hi_out[b] = hi;
        memcpy(codes + s0, c, (size_t)m);
    }
    return nb;
}

/* A temporal block's patterns: 0 for the zero code, else clamp(r + q * S, 1, 0x7F7FFFFF),
 * taken in double, where every value is an integer below 2**40: exact. */
TW_INLINE void tw_temporal_values(const uint8_t *c, const int32_t *r, int count, double step, int32_t *t) {
    for (int i = 0; i < count; i++) {
        double p = (double)r[i] + (double)(int8_t)c[i] * step;
        p = p > 1.0 ? p : 1.0;
        p = p < (double)TW_F32_MAX_BITS ? p : (double)TW_F32_MAX_BITS;
        t[i] = c[i] == TW_TEMPORAL_ZERO ? 0 : (int32_t)p;
    }
}

/* The largest code of a block (an absolute block's codes must not pass 2**bits - 1). */
TW_INLINE uint32_t tw_max_code(const uint8_t *c, int count) {
    uint32_t mx = 0;
    for (int i = 0; i < count; i++) mx = c[i] > mx ? c[i] : mx;
    return mx;
}

/* Decode n elements against the float32 reference ref into float32 out (which may be ref
 * itself: a block's reference is read before its values are written). Returns the number
 * of blocks decoded: all of them, or the index of the first block that is neither temporal
 * (0, 0) nor absolute with bounds 0 <= lo <= hi < inf and codes up to 2**bits - 1 (never
 * written by the encoder but the -1, -1 of an uncodable block: the integer arithmetic could
 * overflow), which is left unwritten with every block after it for the torch path; -1 for
 * bad parameters. */
int64_t tw_log2_temporal_decode(const uint8_t *codes, const int32_t *lo, const int32_t *hi, const float *ref,
                                int64_t n, int32_t bits, int32_t block, int64_t min_step, float *out) {
    if (block < 32 || block > TW_MAX_BLOCK || (block & (block - 1)) || (bits != 8 && bits != 4 && bits != 2) ||
        n < 0 || min_step < 1 || min_step > TW_TEMPORAL_MAX_MIN_STEP)
        return -1;
    int32_t r[TW_MAX_BLOCK] __attribute__((aligned(64)));
    int32_t t[TW_MAX_BLOCK] __attribute__((aligned(64)));
    const int64_t levels = (1 << bits) - 2;
    const float n_steps = (float)levels;
    const int64_t nb = (n + block - 1) / block;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t s0 = b * block;
        const int m = (int)(n - s0 < block ? n - s0 : block);
        const uint8_t *c = codes + s0;
        if (lo[b] == 0 && hi[b] == 0) {
            memcpy(r, ref + s0, (size_t)m * 4); /* the spec's zero padding is no positive reference */
            const int64_t s = tw_temporal_step(r, m, levels, min_step);
            tw_temporal_values(c, r, m, (double)s, t);
        } else if (0 <= lo[b] && lo[b] <= hi[b] && hi[b] < TW_F32_INF_BITS &&
                   tw_max_code(c, m) <= (uint32_t)levels + 1u) {
            tw_log2_values(c, m, lo[b], hi[b], (float)(hi[b] - lo[b]) / n_steps, t);
        } else {
            return b;
        }
        memcpy(out + s0, t, (size_t)m * 4);
    }
    return nb;
}

/* The check that precedes a decode (temporal_code_errors in the spec): the number of blocks
 * of n elements that hold only what an encoder writes: all of them, or the index of the
 * first that does not (bounds other than 0, 0 / -1, -1 / 1 <= lo <= hi < inf; an absolute
 * code above 2**bits - 1, an uncodable block's above 0; a temporal code other than the zero
 * code over a reference pattern that is not positive finite); -1 for bad parameters. It
 * writes nothing, so a decode in place over the reference starts only from checked codes. */
int64_t tw_log2_temporal_check(const uint8_t *codes, const int32_t *lo, const int32_t *hi, const float *ref,
                               int64_t n, int32_t bits, int32_t block) {
    if (block < 32 || block > TW_MAX_BLOCK || (block & (block - 1)) || (bits != 8 && bits != 4 && bits != 2) ||
        n < 0)
        return -1;
    const uint32_t levels = (1u << bits) - 1u;
    const int64_t nb = (n + block - 1) / block;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t s0 = b * block;
        const int m = (int)(n - s0 < block ? n - s0 : block);
        const uint8_t *c = codes + s0;
        if (lo[b] == 0 && hi[b] == 0) {
            const int32_t *r = (const int32_t *)(ref + s0);
            uint32_t bad = 0;
            for (int i = 0; i < m; i++) {
                const uint32_t rpos = (uint32_t)r[i] - 1u < (uint32_t)(TW_F32_INF_BITS - 1);
                bad |= (uint32_t)(c[i] != TW_TEMPORAL_ZERO) & (rpos ^ 1u);
            }
            if (bad) return b;
        } else if (lo[b] == -1 && hi[b] == -1) {
            if (tw_max_code(c, m) > 0u) return b;
        } else if (1 <= lo[b] && lo[b] <= hi[b] && hi[b] < TW_F32_INF_BITS) {
            if (tw_max_code(c, m) > levels) return b;
        } else {
            return b;
        }
    }
    return nb;
}
