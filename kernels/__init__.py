"""Triton kernels of tw_triton (installed as ``tw_triton.kernels``).

One file per operation: the ``@triton.jit`` kernel and the thin launcher that sizes the grid
and allocates outputs. No policy, no file I/O and no torch fallback live here: the kernels
serve the "cuda" backend of :mod:`tw_triton.ops` (imported on first use, so triton stays
optional) and match its plain-torch reference bit for bit (docs/codecs.md).
"""

from .bitmask import bitmask_decode, bitmask_encode, mask_popcount
from .bitmask_grouped import bitmask_encode_grouped
from .copy_grouped import copy_grouped
from .delta_statistics_grouped import delta_statistics_grouped
from .dequantize_blockwise import dequantize_blockwise
from .dequantize_blockwise_grouped import dequantize_blockwise_grouped
from .dequantize_blockwise_update_grouped import dequantize_blockwise_update_grouped
from .dequantize_log2 import dequantize_log2
from .dequantize_log2_grouped import dequantize_log2_grouped
from .dequantize_log2_temporal import dequantize_log2_temporal
from .dequantize_log2_temporal_grouped import dequantize_log2_temporal_grouped
from .fingerprint import fingerprints
from .log2_temporal_check import log2_temporal_check, log2_temporal_check_grouped
from .quantize_blockwise import quantize_blockwise
from .quantize_blockwise_grouped import quantize_blockwise_grouped
from .quantize_blockwise_update_grouped import quantize_blockwise_update_grouped
from .quantize_log2 import quantize_log2
from .quantize_log2_grouped import quantize_log2_grouped
from .quantize_log2_temporal import quantize_log2_temporal
from .quantize_log2_temporal_grouped import quantize_log2_temporal_grouped
from .sparsity_counts_grouped import sparsity_counts_grouped
from .tiles import aligned

__all__ = [
    "aligned",
    "copy_grouped",
    "delta_statistics_grouped",
    "dequantize_blockwise",
    "dequantize_blockwise_grouped",
    "dequantize_blockwise_update_grouped",
    "dequantize_log2",
    "dequantize_log2_grouped",
    "fingerprints",
    "log2_temporal_check",
    "log2_temporal_check_grouped",
    "mask_popcount",
    "quantize_blockwise",
    "quantize_blockwise_grouped",
    "quantize_blockwise_update_grouped",
    "quantize_log2",
    "quantize_log2_grouped",
    "bitmask_decode",
    "bitmask_encode",
    "bitmask_encode_grouped",
    "quantize_log2_temporal",
    "quantize_log2_temporal_grouped",
    "dequantize_log2_temporal",
    "dequantize_log2_temporal_grouped",
    "sparsity_counts_grouped",
]
