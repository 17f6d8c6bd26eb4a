/* The same library compiled for AVX2 (setup.py adds -mavx2 on x86-64): the module
 * tw_triton._native_avx2, which tw_triton/ops/backends/native.py loads when the CPU has AVX2.
 * Wider vectors change the speed only: every operation rounds the same. */
#define TW_MODULE _native_avx2
#include "native.c"
