/* The blockwise codec in C: twin of quantize_blockwise_torch / dequantize_blockwise_torch
 * (tw_triton/codecs/blockwise.py, the spec), one block at a time in buffers that stay in L1. */
#include <math.h>

#include "native.h"

/* Codes of a block where some fp32 quotient fl32(d / s) landed exactly on a half-integer
 * v, which the exact quotient may be above or below: the sign of d - v * s decides,
 * computed exactly in fp32 as the kernel does (nearest_integer_at_ties in blockwise.py:
 * s = s_hi + s_lo with s_hi the top 12 significant bits, so v * s_hi, d - v * s_hi and
 * 2v * s_lo are exact). Elements off a half-integer round as in tw_block_codes. */
TW_INLINE void tw_block_codes_ties(const float *d, int count, float s, int32_t qmax, int32_t bias, uint8_t *u) {
    const float fq = (float)qmax;
    const float off = TW_RNE_MAGIC + (float)bias;
    const float s_hi = tw_float(tw_bits(s) & 0xFFFFF000u);
    const float s_lo = s - s_hi;
    for (int i = 0; i < count; i++) {
        float v = d[i] / s;
        float near = (v + TW_RNE_MAGIC) - TW_RNE_MAGIC;
        float e = v - near;
        float r2 = d[i] - v * s_hi;
        r2 = r2 + r2;
        float p2 = (v + v) * s_lo;
        float side = r2 > p2 ? v + 0.5f : (r2 < p2 ? v - 0.5f : near);
        float q = (e == 0.5f) | (e == -0.5f) ? side : near;
        q = q > fq ? fq : q;
        q = q < -fq ? -fq : q;
        u[i] = (uint8_t)tw_bits(q + off);
    }
}

/* Codes of one block with a positive finite scale s. fl32(d / s) rounds to the same
 * integer as the exact quotient unless it lands exactly on a half-integer (rounding is
 * monotone, and half-integers below 2**8 are fp32 values); the flag returned says a block
 * must be redone in fp64. Clamping before rounding is the same as after (qmax is an
 * integer). The sum v + 1.5 * 2**23 + bias lies in [2**23, 2**24), where fp32 steps by 1:
 * its low byte is the code. */
TW_INLINE int tw_block_codes(const float *d, int count, float s, int32_t qmax, int32_t bias, uint8_t *u) {
    const float fq = (float)qmax;
    const float off = TW_RNE_MAGIC + (float)bias;
    int32_t tie = 0;
    for (int i = 0; i < count; i++) {
        float v = d[i] / s;
        v = v > fq ? fq : v;
        v = v < -fq ? -fq : v;
        float w = v + off;
        float e = v - (w - off);
        tie |= (e == 0.5f) | (e == -0.5f);
        u[i] = (uint8_t)tw_bits(w);
    }
    return tie;
}

/* max |d| as a bit pattern: for non-negative floats integer order is float order, and a
 * NaN or an infinity is at or above bits(+inf). */
TW_INLINE uint32_t tw_block_absmax_bits(const float *d, int count) {
    const uint32_t *b = (const uint32_t *)d;
    uint32_t mx = 0;
    for (int i = 0; i < count; i++) {
        uint32_t a = b[i] & 0x7FFFFFFFu;
        mx = a > mx ? a : mx;
    }
    return mx;
}

TW_INLINE void tw_sub(float *d, const float *r, int count) {
    for (int i = 0; i < count; i++) d[i] = d[i] - r[i];
}

/* Encode n elements (x, and ref when not NULL: contiguous TW_F32 or TW_BF16) into packed
 * codes (ceil(n * bits / 8) bytes) and one fp32 scale per block. Returns the number of
 * blocks, or -1 for parameters the codec does not take. */
int64_t tw_blockwise_encode(const void *x, int x_dtype, const void *ref, int ref_dtype, int64_t n,
                            int32_t block, int32_t bits, int32_t qmax, uint8_t *codes, float *scales) {
    if (block < 32 || block > TW_MAX_BLOCK || (block & (block - 1)) || (bits != 8 && bits != 4 && bits != 2) ||
        qmax < 1 || qmax > (1 << (bits - 1)) - 1 || n < 0)
        return -1;
    float d[TW_MAX_BLOCK] __attribute__((aligned(64)));
    float r[TW_MAX_BLOCK] __attribute__((aligned(64)));
    uint8_t u[TW_MAX_BLOCK] __attribute__((aligned(64)));
    const int32_t bias = 1 << (bits - 1);
    const int64_t nb = (n + block - 1) / block;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t s0 = b * block;
        const int m = (int)(n - s0 < block ? n - s0 : block);
        tw_load_f32(d, x, x_dtype, s0, m);
        if (ref != NULL) {
            tw_load_f32(r, ref, ref_dtype, s0, m);
            tw_sub(d, r, m);
        }
        /* Zero padding never raises the absmax; its codes (q = 0) fill the last byte. */
        if (m < block) memset(d + m, 0, (size_t)(block - m) * 4);
        const uint32_t mx = tw_block_absmax_bits(d, block);
        /* NaN or Inf in the block: scale +inf, codes q = 0 (the tensor is then stored exact). */
        const float s = mx >= 0x7F800000u ? INFINITY : tw_float(mx) / (float)qmax;
        scales[b] = s;
        if (s == 0.0f || s == INFINITY) {
            memset(u, bias, (size_t)block);
        } else if (tw_block_codes(d, block, s, qmax, bias, u)) {
            tw_block_codes_ties(d, block, s, qmax, bias, u);
        }
        const int64_t byte0 = s0 * bits / 8;
        const int nbytes = (int)(((int64_t)m * bits + 7) / 8);
        tw_pack(u, bits, codes + byte0, nbytes);
    }
    return nb;
}

/* q * s, saturated to fp32's finite range (NaN stays NaN), for one block. */
TW_INLINE void tw_block_products(const uint8_t *u, int count, int32_t bias, float s, float *p) {
    for (int i = 0; i < count; i++) {
        float v = (float)((int32_t)u[i] - bias) * s;
        v = v > TW_FLT_MAX ? TW_FLT_MAX : v;
        v = v < -TW_FLT_MAX ? -TW_FLT_MAX : v;
        p[i] = v;
    }
}

/* p + r, saturated to +-lim; returns nonzero when a result is NaN. */
TW_INLINE int tw_block_add_sat(float *p, const float *r, int count, float lim) {
    int32_t nan = 0;
    for (int i = 0; i < count; i++) {
        float v = p[i] + r[i];
        nan |= v != v;
        v = v > lim ? lim : v;
        v = v < -lim ? -lim : v;
        p[i] = v;
    }
    return nan;
}

TW_INLINE int tw_block_sat(float *p, int count, float lim) {
    int32_t nan = 0;
    for (int i = 0; i < count; i++) {
        float v = p[i];
        nan |= v != v;
        v = v > lim ? lim : v;
        v = v < -lim ? -lim : v;
        p[i] = v;
    }
    return nan;
}

/* Decode n elements into out (TW_F32 or TW_BF16), adding ref (TW_F32 or TW_BF16, or NULL)
 * after the saturated product. out may be ref itself: each block of ref is read before the
 * same block of out is written. Returns the number of blocks decoded: all of them, or the
 * index of the first block with a NaN result, which is left unwritten with every block
 * after it (NaN payloads differ between torch's vector and scalar conversions, so the
 * caller finishes those blocks with the torch path); -1 for bad parameters. */
int64_t tw_blockwise_decode(const uint8_t *codes, const float *scales, int64_t n, int32_t bits,
                            int32_t block, const void *ref, int ref_dtype, void *out, int out_dtype) {
    if (block < 32 || block > TW_MAX_BLOCK || (block & (block - 1)) || (bits != 8 && bits != 4 && bits != 2) || n < 0)
        return -1;
    float p[TW_MAX_BLOCK] __attribute__((aligned(64)));
    float r[TW_MAX_BLOCK] __attribute__((aligned(64)));
    uint8_t u[TW_MAX_BLOCK] __attribute__((aligned(64)));
    const int32_t bias = 1 << (bits - 1);
    const float lim = out_dtype == TW_F32 ? TW_FLT_MAX : tw_float(0x7F7F0000u); /* bf16's largest */
    const int64_t nb = (n + block - 1) / block;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t s0 = b * block;
        const int m = (int)(n - s0 < block ? n - s0 : block);
        const int nbytes = (int)(((int64_t)m * bits + 7) / 8);
        tw_unpack(codes + s0 * bits / 8, nbytes, bits, u);
        tw_block_products(u, m, bias, scales[b], p);
        int nan;
        if (ref != NULL) {
            tw_load_f32(r, ref, ref_dtype, s0, m);
            nan = tw_block_add_sat(p, r, m, lim);
        } else {
            nan = tw_block_sat(p, m, lim);
        }
        if (nan) return b;
        if (out_dtype == TW_F32)
            memcpy((float *)out + s0, p, (size_t)m * 4);
        else
            tw_store_bf16((uint16_t *)out + s0, (const uint32_t *)p, m);
    }
    return nb;
}
