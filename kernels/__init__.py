"""Triton kernels of tw_triton (installed as ``tw_triton.kernels``).

One file per operation: the ``@triton.jit`` kernel and the thin launcher that sizes the grid
and allocates outputs. No policy, no file I/O and no torch fallback live here: the kernels
serve the "cuda" backend of :mod:`tw_triton.ops` (imported on first use, so triton stays
optional) and match its plain-torch reference bit for bit (docs/codecs.md).
"""

from .dequantize_blockwise import dequantize_blockwise
from .dequantize_log2 import dequantize_log2
from .dequantize_log2_temporal import dequantize_log2_temporal
from .quantize_blockwise import quantize_blockwise
from .quantize_log2 import quantize_log2
from .quantize_log2_temporal import quantize_log2_temporal

__all__ = [
    "quantize_blockwise",
    "dequantize_blockwise",
    "quantize_log2",
    "dequantize_log2",
    "quantize_log2_temporal",
    "dequantize_log2_temporal",
]
