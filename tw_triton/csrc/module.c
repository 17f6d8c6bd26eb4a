/* An empty Python module: it only makes setuptools build and install this shared library,
 * whose C functions tw_triton/codecs/native.py calls through ctypes. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static struct PyModuleDef tw_native_module = {
    PyModuleDef_HEAD_INIT, "_native", "tw_triton's compiled CPU codec (called through ctypes).", -1, NULL,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&tw_native_module); }
