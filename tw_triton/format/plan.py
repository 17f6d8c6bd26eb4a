"""Planning a file before anything is written: check the state, run the entropy stage on
each buffer, checksum the stored bytes, and lay the buffers out (decreasing element size,
so that every buffer is aligned to its element). The result, a :class:`Plan`, is final:
:mod:`tw_triton.format.writer` writes its header once. Why: docs/format.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..codecs.entropy import EntropyPolicy, encode_buffer
from ..errors import CheckpointError
from ..parallel import parallel_map
from ..qstate import EncodedEntry, QuantizedState
from .checksum import crc32
from .files import byte_view
from .spec import BUFFER_DTYPE_NAMES, BUFFER_NAME_RE, ENTRY_DTYPE_NAMES, STAGED_DTYPE, check_shape, tensor_key


# The tensor's byte view is made when it is written, not kept: a plan lives until its file
# is written, long enough for Python's collector to promote what it holds, and a view costs
# two tracked objects and a tensor; fewer put the next full collection further off.
@dataclass(frozen=True)
class PlannedBuffer:
    """One buffer of a planned file: its bytes, where they go, and their manifest record."""

    entry: str
    name: str
    key: str
    tensor: torch.Tensor  # CPU, contiguous: the buffer as the codec made it
    st_dtype: str  # the safetensors name of the tensor's dtype
    begin: int
    end: int
    staged: Any  # the stage's output (bytes-like), None when the tensor's bytes are stored
    stage: dict[str, Any] | None  # the manifest record of the stage, None when raw
    crc32: int  # of the stored bytes

    @property
    def data(self) -> memoryview:
        """The bytes stored in the file: the tensor's, or its stage's output."""
        return byte_view(self.tensor) if self.staged is None else memoryview(self.staged)

    @property
    def table_dtype(self) -> str:
        """The dtype in the safetensors tensor table: U8 bytes for a staged buffer."""
        return STAGED_DTYPE if self.stage is not None else self.st_dtype

    @property
    def table_shape(self) -> list[int]:
        """The shape in the safetensors tensor table: the stored bytes of a staged buffer."""
        return [self.end - self.begin] if self.stage is not None else list(self.tensor.shape)


@dataclass(frozen=True)
class Plan:
    """A file ready to be written: the state, and its buffers in file order."""

    qstate: QuantizedState
    buffers: list[PlannedBuffer]  # in file order
    by_entry: dict[str, dict[str, PlannedBuffer]]  # entry path -> buffer name -> plan
    data_size: int


def plan_file(qstate: QuantizedState, path: str, policy: EntropyPolicy | None) -> Plan:
    """Check what can be checked before touching the disk, run the entropy stage, and lay
    the buffers out.

    Args:
        qstate: the state to write.
        path: the destination, for messages.
        policy: the entropy stage's policy (``None``: every buffer raw).

    Returns:
        The :class:`Plan`, checksums taken.

    Raises:
        CheckpointError: ``qstate`` cannot be represented (names, dtypes, JSON keys).
    """
    pending = _check_state(qstate, path)

    def stage(item: tuple[str, str, torch.Tensor, str]) -> tuple[Any, dict[str, Any] | None, int, int]:
        """(stage output or None, its record or None, CRC-32 and size of the stored bytes)"""
        entry_path, name, tensor, _ = item
        view = byte_view(tensor)
        staged = None
        if policy is not None:
            try:
                staged = encode_buffer(tensor, view, policy)
            except Exception as exc:
                # zstd's own errors (out of memory, a bad level) name no checkpoint.
                raise CheckpointError(
                    f"checkpoint {path}: entry {entry_path!r} buffer {name!r}: entropy stage "
                    f"failed: {type(exc).__name__}: {exc}"
                ) from exc
        if staged is None:
            return None, None, crc32(view), len(view)
        return staged.data, staged.record, crc32(staged.data), len(staged.data)

    # Buffers are staged and checksummed independently, so on several threads (zstd and
    # the CRC-32 release the GIL).
    stored = parallel_map(
        stage,
        pending,
        sizes=[t.numel() * t.element_size() for _, _, t, _ in pending],
    )

    # Decreasing element size keeps every buffer aligned to its element size (staged
    # buffers are bytes); the sort is stable, so within one size the file follows the
    # entry order.
    def stored_itemsize(i: int) -> int:
        return 1 if stored[i][1] is not None else pending[i][2].element_size()

    order = sorted(range(len(pending)), key=lambda i: -stored_itemsize(i))
    buffers: list[PlannedBuffer] = []
    by_entry: dict[str, dict[str, PlannedBuffer]] = {p: {} for p in qstate.entries}
    offset = 0
    for i in order:
        entry_path, name, tensor, st_dtype = pending[i]
        staged, stage_record, crc, nbytes = stored[i]
        key = tensor_key(entry_path, name)
        buffers.append(
            PlannedBuffer(
                entry_path, name, key, tensor, st_dtype, offset, offset + nbytes, staged, stage_record, crc
            )
        )
        offset += nbytes
    # by_entry keeps each entry's own buffer order for the manifest.
    lookup = {(b.entry, b.name): b for b in buffers}
    for entry_path, name, _, _ in pending:
        by_entry[entry_path][name] = lookup[(entry_path, name)]
    return Plan(qstate, buffers, by_entry, offset)


def _check_state(qstate: QuantizedState, path: str) -> list[tuple[str, str, torch.Tensor, str]]:
    """Check ``qstate``; return its buffers as (entry path, name, host tensor, safetensors
    dtype), in entry order."""
    if not isinstance(qstate, QuantizedState):
        raise CheckpointError(f"checkpoint {path}: expected a QuantizedState, got {type(qstate).__name__}")
    if not isinstance(qstate.entries, dict):
        raise CheckpointError(f"checkpoint {path}: entries must be a dict")
    if not isinstance(qstate.checkpoint_id, str):
        raise CheckpointError(f"checkpoint {path}: checkpoint_id must be a str")
    if qstate.reference_id is not None and not isinstance(qstate.reference_id, str):
        raise CheckpointError(f"checkpoint {path}: reference_id must be a str or None")
    pending: list[tuple[str, str, torch.Tensor, str]] = []
    for entry_path, entry in qstate.entries.items():
        where = f"checkpoint {path}: entry {entry_path!r}"
        if not isinstance(entry_path, str):
            raise CheckpointError(f"{where}: entry paths must be str")
        try:
            entry_path.encode("utf-8")
        except UnicodeEncodeError as exc:
            # Tensor keys hold the path, and safetensors headers must be valid UTF-8.
            raise CheckpointError(f"{where}: entry path is not valid UTF-8 ({exc.reason})") from exc
        if not isinstance(entry, EncodedEntry):
            raise CheckpointError(f"{where}: expected an EncodedEntry, got {type(entry).__name__}")
        if not isinstance(entry.codec, str) or not entry.codec:
            raise CheckpointError(f"{where}: codec must be a non-empty str")
        if not isinstance(entry.params, dict):
            raise CheckpointError(f"{where}: params must be a dict")
        if entry.dtype not in ENTRY_DTYPE_NAMES:
            raise CheckpointError(f"{where}: dtype {entry.dtype} cannot be recorded")
        check_shape(tuple(entry.shape), entry.dtype.itemsize, where)
        if not isinstance(entry.buffers, dict):
            raise CheckpointError(f"{where}: buffers must be a dict")
        if not entry.buffers:
            # Every codec stores at least one buffer (a 0-element one included).
            raise CheckpointError(
                f"{where}: holds no buffers (were they given up by dequantize_state_dict("
                "release_buffers=True)?): the file could not be loaded"
            )
        for name, tensor in entry.buffers.items():
            bwhere = f"{where} buffer {name!r}"
            if not isinstance(name, str) or not BUFFER_NAME_RE.fullmatch(name):
                raise CheckpointError(f"{bwhere}: buffer names must match [A-Za-z0-9_.-]+")
            if not isinstance(tensor, torch.Tensor):
                raise CheckpointError(f"{bwhere}: expected a tensor, got {type(tensor).__name__}")
            if tensor.layout != torch.strided:
                raise CheckpointError(f"{bwhere}: only dense tensors can be stored")
            if tensor.dtype not in BUFFER_DTYPE_NAMES:
                raise CheckpointError(f"{bwhere}: dtype {tensor.dtype} has no safetensors name")
            pending.append((entry_path, name, _host_contiguous(tensor), BUFFER_DTYPE_NAMES[tensor.dtype]))
        _check_json_keys(entry.params, f"{where} params")
    for field_name in ("skeleton", "rules", "metadata"):
        _check_json_keys(getattr(qstate, field_name), f"checkpoint {path}: {field_name}")
    if not isinstance(qstate.aliases, dict):
        raise CheckpointError(f"checkpoint {path}: aliases must be a dict")
    for alias, target in qstate.aliases.items():
        if not isinstance(alias, str) or not isinstance(target, str):
            raise CheckpointError(f"checkpoint {path}: aliases must map str to str")
        if target not in qstate.entries:
            raise CheckpointError(
                f"checkpoint {path}: alias {alias!r} points to {target!r}, which is not an entry"
            )
        if alias in qstate.entries:
            raise CheckpointError(f"checkpoint {path}: alias {alias!r} is also an entry")
    return pending


def _check_json_keys(value: Any, where: str) -> None:
    """Refuse dict keys that are not str: JSON would silently turn ``1`` into ``"1"``
    (and ``{1: a, "1": b}`` into a duplicate key that no reader accepts)."""
    stack = [value]
    seen: set[int] = set()  # a cycle must not loop here; json.dumps reports it later
    while stack:
        node = stack.pop()
        if isinstance(node, (dict, list, tuple)):
            if id(node) in seen:
                continue
            seen.add(id(node))
        if isinstance(node, dict):
            for k, v in node.items():
                if not isinstance(k, str):
                    raise CheckpointError(
                        f"{where}: dict key {k!r} is a {type(k).__name__}, expected str "
                        "(JSON keys are strings)"
                    )
                stack.append(v)
        elif isinstance(node, (list, tuple)):
            stack.extend(node)


def _host_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.contiguous()
