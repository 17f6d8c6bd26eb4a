"""The reference backend of the codec ops: plain torch, any device, the specification.

Each op of :mod:`tw_triton.ops` is implemented here once, as readable torch code over
chunks of the tensor; the Triton kernels and the compiled CPU codec are held to these bytes
and values by the tests. The codecs' rules are stated in docs/codecs.md.
"""

from __future__ import annotations

from .bitmask import (
    bitmask_decode_torch,
    bitmask_encode_many_torch,
    bitmask_encode_torch,
    mask_popcount_torch,
    nonzero_count,
    sparsity_counts_many_torch,
    sparsity_counts_torch,
)
from .blockwise_decode import crumb_table, dequantize_blockwise_torch, signed_codes
from .blockwise_encode import (
    nearest_integer_at_ties,
    nearest_integer_by_reciprocal,
    pack_codes,
    quantize_blockwise_torch,
)
from .buffers import CHUNK_ELEMENTS, copy_flat_range, release_scratch, scratch, scratch_buffers
from .delta_statistics import delta_statistics_many_torch, delta_statistics_torch
from .grouped import (
    FINGERPRINT_SAMPLES,
    copy_many_torch,
    dequantize_blockwise_many_torch,
    dequantize_blockwise_update_many_torch,
    dequantize_log2_many_torch,
    dequantize_log2_temporal_many_torch,
    fingerprint_torch,
    fingerprints_torch,
    quantize_blockwise_many_torch,
    quantize_blockwise_update_many_torch,
    quantize_log2_many_torch,
    quantize_log2_temporal_many_torch,
)
from .log2 import dequantize_log2_torch, levels, log2_levels_by_reciprocal, quantize_log2_torch
from .log2_temporal import (
    dequantize_log2_temporal_torch,
    log2_temporal_code_errors_torch,
    log2_temporal_code_flags_many_torch,
    quantize_log2_temporal_torch,
)
from .update_root import update_divide_torch, update_multiply_torch, update_root_torch

# The ops this backend implements (registered by tw_triton.ops as the default of every device).
REFERENCE = {
    "update_root": update_root_torch,
    "update_divide": update_divide_torch,
    "update_multiply": update_multiply_torch,
    "quantize_blockwise": quantize_blockwise_torch,
    "dequantize_blockwise": dequantize_blockwise_torch,
    "quantize_log2": quantize_log2_torch,
    "dequantize_log2": dequantize_log2_torch,
    "quantize_blockwise_many": quantize_blockwise_many_torch,
    "quantize_blockwise_update_many": quantize_blockwise_update_many_torch,
    "quantize_log2_many": quantize_log2_many_torch,
    "fingerprints": fingerprints_torch,
    "copy_many": copy_many_torch,
    "dequantize_blockwise_many": dequantize_blockwise_many_torch,
    "bitmask_encode": bitmask_encode_torch,
    "bitmask_decode": bitmask_decode_torch,
    "mask_popcount": mask_popcount_torch,
    "quantize_log2_temporal": quantize_log2_temporal_torch,
    "quantize_log2_temporal_many": quantize_log2_temporal_many_torch,
    "dequantize_log2_temporal": dequantize_log2_temporal_torch,
    "log2_temporal_code_errors": log2_temporal_code_errors_torch,
    "log2_temporal_code_flags_many": log2_temporal_code_flags_many_torch,
    "sparsity_counts": sparsity_counts_torch,
    "delta_statistics": delta_statistics_torch,
    "delta_statistics_many": delta_statistics_many_torch,
    "sparsity_counts_many": sparsity_counts_many_torch,
    "dequantize_log2_temporal_many": dequantize_log2_temporal_many_torch,
    "dequantize_log2_many": dequantize_log2_many_torch,
    "dequantize_blockwise_update_many": dequantize_blockwise_update_many_torch,
    "bitmask_encode_many": bitmask_encode_many_torch,
}

__all__ = [
    "CHUNK_ELEMENTS",
    "FINGERPRINT_SAMPLES",
    "copy_many_torch",
    "REFERENCE",
    "update_divide_torch",
    "update_multiply_torch",
    "update_root_torch",
    "bitmask_decode_torch",
    "mask_popcount_torch",
    "bitmask_encode_many_torch",
    "bitmask_encode_torch",
    "copy_flat_range",
    "crumb_table",
    "delta_statistics_many_torch",
    "delta_statistics_torch",
    "dequantize_blockwise_many_torch",
    "dequantize_blockwise_update_many_torch",
    "dequantize_blockwise_torch",
    "dequantize_log2_many_torch",
    "dequantize_log2_temporal_many_torch",
    "dequantize_log2_temporal_torch",
    "dequantize_log2_torch",
    "fingerprint_torch",
    "fingerprints_torch",
    "levels",
    "log2_levels_by_reciprocal",
    "log2_temporal_code_errors_torch",
    "log2_temporal_code_flags_many_torch",
    "nonzero_count",
    "nearest_integer_at_ties",
    "nearest_integer_by_reciprocal",
    "pack_codes",
    "quantize_blockwise_many_torch",
    "quantize_blockwise_update_many_torch",
    "quantize_blockwise_torch",
    "quantize_log2_many_torch",
    "quantize_log2_temporal_many_torch",
    "quantize_log2_temporal_torch",
    "quantize_log2_torch",
    "release_scratch",
    "scratch",
    "scratch_buffers",
    "signed_codes",
    "sparsity_counts_many_torch",
    "sparsity_counts_torch",
]
