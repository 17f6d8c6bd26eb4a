"""tw_triton: small PyTorch training checkpoints by fused blockwise delta quantization."""

from .checkpointer import Checkpointer
from .codecs import Codec, register_codec
from .codecs.blockwise import QuantizedTensor, dequantize, quantize
from .errors import (
    CheckpointError,
    CheckpointIOError,
    QuantizationError,
    ReferenceMismatchError,
    TwTritonError,
    UnsupportedTensorError,
)
from .snapshot_pool import SnapshotPool
from .state import decode_targets, dequantize_state_dict, load, quantize_state_dict, save
from .writer import AsyncWriter

__version__ = "0.2.0"

__all__ = [
    "QuantizedTensor",
    "quantize",
    "dequantize",
    "TwTritonError",
    "QuantizationError",
    "CheckpointError",
    "CheckpointIOError",
    "ReferenceMismatchError",
    "UnsupportedTensorError",
    "quantize_state_dict",
    "dequantize_state_dict",
    "save",
    "load",
    "decode_targets",
    "Codec",
    "register_codec",
    "AsyncWriter",
    "SnapshotPool",
    "Checkpointer",
]
