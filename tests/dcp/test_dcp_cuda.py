"""DCP on a GPU (marker ``cuda``; skipped without one): issue 29, item 12.

A state on CUDA saved through DCP (synchronously and with ``async_save``) writes the same
entries, byte for byte, as the same state saved from the CPU; loaded onto CUDA targets it
gives what a CPU load gives, deltas included. ``torch.cuda._sleep`` keeps the stream busy
so that a copy not ordered after the encode, or a write before the copy is done, shows as
wrong bytes. The checks without a GPU are in test_dcp_device.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tw_triton.dcp as tw_dcp
from tw_triton.dcp import StorageWriter
from tw_triton.format import read_file
from tw_triton.pinned_staging import DeviceStaging

pytestmark = [pytest.mark.cuda, pytest.mark.filterwarnings("ignore::UserWarning")]

SLEEP_CYCLES = 200_000_000  # ~0.1 s on a 2 GHz GPU clock


def _state(device: str, shift: float = 0.0) -> dict:
    g = torch.Generator().manual_seed(0)
    cpu = {
        "model": {"w": torch.randn(256, 128, generator=g) + shift, "b": torch.randn(256, generator=g)},
        "optim": {
            "exp_avg": torch.randn(256, 128, generator=g) * 1e-3,
            "exp_avg_sq": torch.rand(256, 128, generator=g) * 1e-6,
        },
    }
    return {k: {n: t.to(device) for n, t in v.items()} for k, v in cpu.items()}


def _entries(path: str) -> dict[str, tuple]:
    qstate = read_file(f"{path}/__0_0.tw.safetensors")
    return {
        name: (e.codec, tuple(e.shape), {b: t.numpy().tobytes() for b, t in e.buffers.items()})
        for name, e in qstate.entries.items()
    }


def _loaded(path: str, device: str) -> dict[str, torch.Tensor]:
    state = {k: {n: torch.zeros_like(t) for n, t in v.items()} for k, v in _state(device).items()}
    tw_dcp.load(state, path, no_dist=True)
    assert all(t.device.type == device for v in state.values() for t in v.values())
    return {f"{k}.{n}": t.cpu() for k, v in state.items() for n, t in v.items()}


@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_a_cuda_save_writes_the_bytes_of_a_cpu_save(tmp_path, mode):
    on_cpu, on_gpu = str(tmp_path / "cpu"), str(tmp_path / "gpu")
    dcp.save(_state("cpu"), storage_writer=StorageWriter(on_cpu, rules="small"), no_dist=True)
    state = _state("cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)  # the encode and the copies queue behind it
    staging = DeviceStaging(None)
    writer = StorageWriter(on_gpu, rules="small", staging=staging)
    if mode == "save":
        dcp.save(state, storage_writer=writer, no_dist=True)
    else:
        fut = dcp.async_save(state, storage_writer=writer, no_dist=True)
        # Queued on the training stream after the staging: must not reach the checkpoint.
        for v in state.values():
            for t in v.values():
                t.add_(1.0)
        fut.result()
    assert _entries(on_gpu) == _entries(on_cpu)
    assert staging.pool.held_bytes > 0  # the copies went through its pinned pool


def test_a_cuda_load_decodes_what_a_cpu_load_does(tmp_path):
    key, delta = str(tmp_path / "key"), str(tmp_path / "delta")
    dcp.save(_state("cuda"), storage_writer=StorageWriter(key, rules="small", as_keyframe=True), no_dist=True)
    dcp.save(
        _state("cuda", 0.01), storage_writer=StorageWriter(delta, rules="small", reference=key), no_dist=True
    )
    for path in (key, delta):
        gpu, cpu = _loaded(path, "cuda"), _loaded(path, "cpu")
        assert gpu.keys() == cpu.keys()
        for k in cpu:
            assert torch.equal(gpu[k], cpu[k]), (path, k)
