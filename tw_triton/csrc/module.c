/* An empty Python module: it only makes setuptools build and install this shared library,
 * whose C functions tw_triton/ops/backends/native.py calls through ctypes. The same sources make
 * two modules on x86-64 (setup.py): _native for any CPU and _native_avx2. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "native.h"

#ifndef TW_MODULE
#define TW_MODULE _native
#endif
#define TW_STR2(x) #x
#define TW_STR(x) TW_STR2(x)
#define TW_CAT2(a, b) a##b
#define TW_CAT(a, b) TW_CAT2(a, b)

/* Whether this CPU runs the AVX2 build (asked of the baseline one before loading it). */
int tw_cpu_has_avx2(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    return __builtin_cpu_supports("avx2") ? 1 : 0;
#else
    return 0;
#endif
}

static struct PyModuleDef tw_native_module = {
    PyModuleDef_HEAD_INIT, TW_STR(TW_MODULE), "tw_triton's compiled CPU codec (called through ctypes).", -1, NULL,
};

PyMODINIT_FUNC TW_CAT(PyInit_, TW_MODULE)(void) { return PyModule_Create(&tw_native_module); }
