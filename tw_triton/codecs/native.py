"""The compiled CPU codec under its former path: it lives in :mod:`tw_triton.ops.backends.native`.

Kept so that ``from tw_triton.codecs import native`` (benchmarks) keeps working; new code
imports the backend module itself.
"""

# alias for other areas until the merge
from ..ops.backends.native import (  # noqa: F401
    ENV_NATIVE, SPLIT_MIN_ELEMENTS, decode_blockwise, decode_log2, enabled, encode_blockwise, encode_log2, library,
    load, merge_planes, range_slices,
)
