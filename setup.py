"""Build of the optional compiled CPU codec (everything else is in pyproject.toml).

``tw_triton._native`` is a plain C shared library that ``tw_triton.ops.backends.native`` calls
through ctypes; it is a Python extension only so that pip builds and installs it. It is
optional: without a C compiler the install still succeeds and the CPU path runs the
plain-torch codec, which writes the same bytes (only slower).
"""

import platform
import sys

from setuptools import Extension, setup

# Value-safe flags only: no -ffast-math (it would change results and flush subnormals).
# -ffp-contract=off keeps a * b + c two roundings, as the spec and the kernels have them;
# -fno-trapping-math lets the compiler vectorize the clamps (nothing here reads FP flags).
if sys.platform == "win32":
    CFLAGS = ["/O2", "/fp:precise"]
else:
    CFLAGS = ["-O3", "-std=c11", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]
SOURCES = ["tw_triton/csrc/native.c"]
DEPENDS = [
    f"tw_triton/csrc/{name}"
    for name in (
        "native.h",
        "module.c",
        "blockwise.c",
        "log2.c",
        "log2_temporal.c",
        "planes.c",
        "update_root.c",
        "sparsity.c",
        "delta_statistics.c",
    )
]

extensions = [
    Extension("tw_triton._native", sources=SOURCES, depends=DEPENDS, extra_compile_args=CFLAGS, optional=True)
]
# A second build for AVX2 CPUs (twice the vector width; -mavx2 alone adds no FMA), chosen
# at run time by tw_triton.ops.backends.native.
if sys.platform != "win32" and platform.machine().lower() in ("x86_64", "amd64"):
    extensions.append(
        Extension(
            "tw_triton._native_avx2",
            sources=["tw_triton/csrc/native_avx2.c"],
            depends=DEPENDS + SOURCES,
            extra_compile_args=CFLAGS + ["-mavx2"],
            optional=True,
        )
    )

setup(ext_modules=extensions)
