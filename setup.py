"""Build of the optional compiled CPU codec (everything else is in pyproject.toml).

``tw_triton._native`` is a plain C shared library that ``tw_triton.codecs.native`` calls
through ctypes; it is a Python extension only so that pip builds and installs it. It is
optional: without a C compiler the install still succeeds and the CPU path runs the
plain-torch codec, which writes the same bytes (only slower).
"""

import sys

from setuptools import Extension, setup

# Value-safe flags only: no -ffast-math (it would change results and flush subnormals).
# -ffp-contract=off keeps a * b + c two roundings, as the spec and the kernels have them;
# -fno-trapping-math lets the compiler vectorize the clamps (nothing here reads FP flags).
if sys.platform == "win32":
    CFLAGS = ["/O2", "/fp:precise"]
else:
    CFLAGS = ["-O3", "-std=c11", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]

setup(
    ext_modules=[
        Extension(
            "tw_triton._native",
            sources=["tw_triton/csrc/module.c", "tw_triton/csrc/blockwise.c", "tw_triton/csrc/log2.c"],
            depends=["tw_triton/csrc/native.h"],
            extra_compile_args=CFLAGS,
            optional=True,
        )
    ]
)
