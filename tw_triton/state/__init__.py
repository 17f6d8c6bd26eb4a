"""The state-level API: encode a whole training state, save it, load it back.

:func:`quantize_state_dict` turns any nested training state into a
:class:`~tw_triton.qstate.QuantizedState` (a consistent snapshot: later changes to the
source tensors do not change it); :func:`save` writes it to one file and :func:`load`
reads it back; :func:`dequantize_state_dict` decodes one in memory. With ``reference``,
quantized entries store the delta from the reference tensor at the same path, and the
file records which reference (``reference_id``, per-entry fingerprints) so that a load
against the wrong one raises :class:`~tw_triton.errors.ReferenceMismatchError`.

Modules: :mod:`.encode`, :mod:`.decode`, :mod:`.references` (resolving and checking a
reference), :mod:`.entries` (codec and manifest checks of stored entries),
:mod:`.fingerprints`, :mod:`.io` (files). The why (snapshots and syncs, shared storage,
references): docs/design.md; usage: docs/quickstart.md.
"""

from .decode import dequantize_entries, dequantize_state_dict
from .encode import quantize_state_dict
from .entries import check_manifest, delta_paths, disjoint_paths, manifest_delta_paths
from .fingerprints import FINGERPRINT_PREFIX, FINGERPRINT_SAMPLES
from .io import decode_targets, load, save, state_of
from .references import find_checkpoint

__all__ = [
    "FINGERPRINT_PREFIX",
    "FINGERPRINT_SAMPLES",
    "check_manifest",
    "decode_targets",
    "delta_paths",
    "dequantize_entries",
    "dequantize_state_dict",
    "disjoint_paths",
    "find_checkpoint",
    "load",
    "manifest_delta_paths",
    "quantize_state_dict",
    "save",
    "state_of",
]
