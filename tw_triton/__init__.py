"""tw_triton: small PyTorch training checkpoints by fused blockwise delta quantization."""

from .codec import QuantizedTensor, dequantize, quantize
from .errors import (
    CheckpointError,
    QuantizationError,
    ReferenceMismatchError,
    TwTritonError,
)

__version__ = "0.1.0"

__all__ = [
    "QuantizedTensor",
    "quantize",
    "dequantize",
    "TwTritonError",
    "QuantizationError",
    "CheckpointError",
    "ReferenceMismatchError",
]
