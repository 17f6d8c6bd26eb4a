/* Byte planes of the entropy stage (tw_triton/codecs/entropy.py): plane k holds byte k
 * (in memory order) of every width-byte element. Merging them back is pure data movement,
 * so any order of the same moves gives the same bytes; the work is one pass over the
 * elements instead of the numpy path's few passes per plane. */
#include "native.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define TW_LITTLE_ENDIAN 1
#else
#define TW_LITTLE_ENDIAN 0
#endif

/* Widths 2, 4 and 8 on a little-endian machine: byte k of a word is bits 8k..8k+7, so an
 * element is built with shifts the compiler vectorizes. The plane pointers are copied into
 * restrict locals: stores through uint8_t may alias anything, so without them every store
 * would reload the pointers and nothing would vectorize. */
#define TW_PLANE_MERGE(T, W)                                                                    \
    static void tw_merge_##W(const uint8_t *const *planes, int64_t count, uint8_t *restrict out) { \
        const uint8_t *restrict p[W];                                                          \
        for (int k = 0; k < W; k++) p[k] = planes[k];                                          \
        for (int64_t i = 0; i < count; i++) {                                                  \
            T w = 0;                                                                           \
            for (int k = 0; k < W; k++) w |= (T)p[k][i] << (8 * k);                            \
            memcpy(out + i * W, &w, W);                                                        \
        }                                                                                      \
    }

TW_PLANE_MERGE(uint16_t, 2)
TW_PLANE_MERGE(uint32_t, 4)
TW_PLANE_MERGE(uint64_t, 8)

/* out[i * width + k] = planes[k][i] for i < count. Returns 0, or -1 for width < 1. */
int64_t tw_planes_merge(const uint8_t *const *planes, int32_t width, int64_t count, uint8_t *out) {
    if (width < 1) return -1;
    if (TW_LITTLE_ENDIAN && width == 2) {
        tw_merge_2(planes, count, out);
    } else if (TW_LITTLE_ENDIAN && width == 4) {
        tw_merge_4(planes, count, out);
    } else if (TW_LITTLE_ENDIAN && width == 8) {
        tw_merge_8(planes, count, out);
    } else {
        for (int k = 0; k < width; k++) {
            const uint8_t *restrict p = planes[k];
            uint8_t *restrict o = out + k;
            for (int64_t i = 0; i < count; i++) o[i * width] = p[i];
        }
    }
    return 0;
}
