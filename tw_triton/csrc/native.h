/* The compiled CPU codec of tw_triton: declarations shared by its C files.
 *
 * Every function is a byte-for-byte twin of a plain-torch reference in tw_triton/codecs
 * (the spec): same bytes out, same decoded values. Only correctly rounded fp32/fp64 ops and
 * integer ops are used, and the build turns off FMA contraction (-ffp-contract=off).
 * Inputs are contiguous; dtypes: TW_F32 (float32) or TW_BF16 (bfloat16). The Python side
 * (tw_triton/ops/backends/native.py) sends anything else to the torch path. */
#ifndef TW_NATIVE_H
#define TW_NATIVE_H

#include <stdint.h>
#include <string.h>

#define TW_F32 0
#define TW_BF16 1
#define TW_MAX_BLOCK 4096
/* 1.5 * 2**23: adding it to |v| < 2**22 rounds v to an integer, ties to even. */
#define TW_RNE_MAGIC 12582912.0f
#define TW_FLT_MAX 3.40282346638528859812e+38f

/* Every helper is inlined into the block loops, whose inner loops the compiler vectorizes
 * (setup.py builds the library twice on x86-64: for the baseline and for AVX2). */
#if defined(__GNUC__)
#define TW_INLINE static inline __attribute__((always_inline))
#else
#define TW_INLINE static inlineint64_t tw_update_root(const float *v, int64_t n, float eps, float *d);
int64_t tw_update_divide(const float *x, const float *v, int64_t n, float eps, float *u);
int64_t tw_update_multiply(float *u, const float *v, int64_t n, float eps, float big);

#endif

TW_INLINE uint32_t tw_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

TW_INLINE float tw_float(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Elements [start, start + m) of a TW_F32 or TW_BF16 array as fp32 (exact), into dst. */
TW_INLINE void tw_load_f32(float *dst, const void *src, int dtype, int64_t start, int m) {
    if (dtype == TW_F32) {
        memcpy(dst, (const float *)src + start, (size_t)m * 4);
    } else {
        const uint16_t *s = (const uint16_t *)src + start;
        uint32_t *d = (uint32_t *)dst;
        for (int i = 0; i < m; i++) d[i] = (uint32_t)s[i] << 16;
    }
}

/* fp32 bit patterns to bfloat16, round to nearest even: torch's conversion for every
 * non-NaN value (callers never pass a NaN). Taking the patterns as integers keeps the loop
 * vectorizable. Callers read their block buffer here as integers after writing it as
 * floats, which GCC cannot follow: it would warn that the buffer may be uninitialized. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"int64_t tw_update_root(const float *v, int64_t n, float eps, float *d);
int64_t tw_update_divide(const float *x, const float *v, int64_t n, float eps, float *u);
int64_t tw_update_multiply(float *u, const float *v, int64_t n, float eps, float big);

#endif
TW_INLINE void tw_store_bf16(uint16_t *dst, const uint32_t *bits, int count) {
    for (int i = 0; i < count; i++) dst[i] = (uint16_t)((bits[i] + 0x7FFFu + ((bits[i] >> 16) & 1u)) >> 16);
}

/* Pack one code per byte LSB-first into nbytes bytes (u holds 8 / bits codes per byte). */
TW_INLINE void tw_pack(const uint8_t *u, int bits, uint8_t *out, int nbytes) {
    if (bits == 8) {
        memcpy(out, u, (size_t)nbytes);
    } else if (bits == 4) {
        for (int j = 0; j < nbytes; j++) out[j] = (uint8_t)(u[2 * j] | (u[2 * j + 1] << 4));
    } else {
        for (int j = 0; j < nbytes; j++)
            out[j] = (uint8_t)(u[4 * j] | (u[4 * j + 1] << 2) | (u[4 * j + 2] << 4) | (u[4 * j + 3] << 6));
    }
}

/* Unpack nbytes packed bytes into 8 / bits codes each (the inverse of tw_pack). */
TW_INLINE void tw_unpack(const uint8_t *c, int nbytes, int bits, uint8_t *u) {
    if (bits == 8) {
        memcpy(u, c, (size_t)nbytes);
    } else if (bits == 4) {
        for (int j = 0; j < nbytes; j++) {
            u[2 * j] = c[j] & 15;
            u[2 * j + 1] = c[j] >> 4;
        }
    } else {
        for (int j = 0; j < nbytes; j++) {
            u[4 * j] = c[j] & 3;
            u[4 * j + 1] = (c[j] >> 2) & 3;
            u[4 * j + 2] = (c[j] >> 4) & 3;
            u[4 * j + 3] = c[j] >> 6;
        }
    }
}

int tw_cpu_has_avx2(void);
int64_t tw_blockwise_encode(const void *x, int x_dtype, const void *ref, int ref_dtype, int64_t n,
                            int32_t block, int32_t bits, int32_t qmax, uint8_t *codes, float *scales);
int64_t tw_blockwise_decode(const uint8_t *codes, const float *scales, int64_t n, int32_t bits,
                            int32_t block, const void *ref, int ref_dtype, void *out, int out_dtype);
int64_t tw_log2_encode(const void *x, int x_dtype, int64_t n, int32_t block, int32_t bits, uint8_t *codes,
                       int32_t *lo_out, int32_t *hi_out);
int64_t tw_log2_decode(const uint8_t *codes, const int32_t *lo, const int32_t *hi, int64_t n, int32_t bits,
                       int32_t block, void *out, int out_dtype);
int64_t tw_log2_temporal_encode(const float *x, const float *ref, int64_t n, int32_t block, int32_t bits,
                                int64_t min_step, uint8_t *codes, int32_t *lo_out, int32_t *hi_out);
int64_t tw_log2_temporal_decode(const uint8_t *codes, const int32_t *lo, const int32_t *hi, const float *ref,
                                int64_t n, int32_t bits, int32_t block, int64_t min_step, float *out);
int64_t tw_delta_statistics(const void *x, int x_dtype, const void *ref, int ref_dtype, int64_t n, int32_t block,
                            float *s, int64_t *out);
int64_t tw_sparsity_counts(const void *x, int64_t n, int32_t itemsize, int32_t prev_zero, int64_t *nnz_out,
                           int64_t *runs_out);
int64_t tw_log2_temporal_check(const uint8_t *codes, const int32_t *lo, const int32_t *hi, const float *ref,
                               int64_t n, int32_t bits, int32_t block);
int64_t tw_update_root(const float *v, int64_t n, float eps, float *d);
int64_t tw_update_divide(const float *x, const float *v, int64_t n, float eps, float *u);
int64_t tw_update_multiply(float *u, const float *v, int64_t n, float eps, float big);

#endif
