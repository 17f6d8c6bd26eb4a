"""CUDA-only checks of the streams, events and buffers of a device save and load
(docs/design.md, "Invariants"; marker ``cuda``).

Skipped without a GPU; with one, ``pytest -m cuda`` (and benchmarks/gpu/validate.py) runs
them and a skip fails. ``torch.cuda._sleep`` keeps a stream busy for a while, so that work
queued behind it runs late: a missing stream dependency or a buffer released too early
then shows as wrong bytes instead of passing by luck.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import tw_triton
from tw_triton.codecs import ExactCodec
from tw_triton.format import read_file
from tw_triton.qstate import QuantizedState
from tw_triton.writer import AsyncWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"))

import _end_to_end  # noqa: E402
import _identity  # noqa: E402

pytestmark = pytest.mark.cuda

SLEEP_CYCLES = 200_000_000  # ~0.1 s on a 2 GHz GPU clock


def _exact_state(t: torch.Tensor) -> QuantizedState:
    entry = ExactCodec().wrap(t).entry
    return QuantizedState(
        entries={"x": entry},
        skeleton={"tensor": "x"},
        checkpoint_id="c",
        reference_id=None,
        aliases={},
        rules=[],
        metadata={},
    )


def test_side_stream_copy_waits_for_the_producing_stream(tmp_path):
    x = torch.zeros(1 << 22, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    x.fill_(7.0)  # queued behind the sleep on the current stream
    with AsyncWriter(fsync=False) as w:
        w.submit(_exact_state(x), tmp_path / "a.tw").result()
    data = read_file(tmp_path / "a.tw").entries["x"].buffers["data"]
    assert bool((data == 7.0).all()), "the copy ran before the producing stream's work"


def test_device_buffers_stay_alive_until_their_copy_is_done(tmp_path):
    """Once the caller drops its snapshot, the caching allocator may hand its memory to the
    next allocation on the producing stream; the writer must hold it until the copy ran."""
    n = 1 << 24
    with AsyncWriter(fsync=False) as w:
        x = torch.full((n,), 3.0, device="cuda")
        torch.cuda._sleep(SLEEP_CYCLES)  # the side stream's copy waits behind this
        fut = w.submit(_exact_state(x), tmp_path / "a.tw")
        del x
        y = torch.empty(n, device="cuda")  # would reuse x's block if it had been freed
        y.fill_(-1.0)
        fut.result()
    data = read_file(tmp_path / "a.tw").entries["x"].buffers["data"]
    assert bool((data == 3.0).all())


def test_failed_staging_returns_its_pinned_buffer_only_after_the_copies(tmp_path, monkeypatch):
    w = AsyncWriter(fsync=False)
    released_while_busy: list[bool] = []
    real_copy, real_release = w.staging.copy_to_host, w.staging.pool.release

    def copy_then_fail(tensors, views, **kwargs):  # stage() passes live=
        torch.cuda._sleep(SLEEP_CYCLES)
        real_copy(tensors, views, **kwargs)
        raise RuntimeError("staging failed after a copy was enqueued")

    def release(buf):
        released_while_busy.append(not all(s.query() for s in w.staging.side_streams.values()))
        real_release(buf)

    monkeypatch.setattr(w.staging, "copy_to_host", copy_then_fail)
    monkeypatch.setattr(w.staging.pool, "release", release)
    with pytest.raises(RuntimeError, match="staging failed"):
        w.submit(_exact_state(torch.ones(1 << 20, device="cuda")), tmp_path / "a.tw")
    w.close()
    assert released_while_busy == [False]


def test_saves_hold_the_values_at_save_time_while_training_goes_on(tmp_path):
    r = _end_to_end.run_concurrency(torch.device("cuda"), tmp_path, size="tiny", saves=4)
    assert r["problem_count"] == 0, r["problems"]


def test_misaligned_and_strided_views_encode_like_the_cpu():
    for name in _identity.kernel_codecs()[0]:
        for bits in (8, 4, 2):
            for layout in ("offset", "transposed"):
                case = _identity.Case(name, bits, 128, torch.bfloat16, "adversarial", layout, torch.bfloat16)
                problems = _identity.run_case(tw_triton.codecs.get_codec(name), case, torch.device("cuda"), 0)
                assert not problems, f"{case.label()}: {problems}"


def test_encode_and_load_on_a_device_that_is_not_current(tmp_path):
    """The last device (cuda:1 on a 2-GPU machine) while cuda:0 is current: kernels,
    flags, the side-stream copy and the load land on the tensors' device. On a one-GPU
    machine this is cuda:0 and checks the same code without the device switch."""
    dev = torch.device("cuda", torch.cuda.device_count() - 1)
    torch.cuda.set_device(0)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(512, 1024, generator=gen).to(torch.bfloat16)
    state = {"model": {"w": w.to(dev), "b": torch.randn(1024, generator=gen).to(dev)}}
    q = tw_triton.quantize_state_dict(state)
    assert q.entries["model/w"].codec == "blockwise"
    assert all(t.device == dev for e in q.entries.values() for t in e.buffers.values())
    with AsyncWriter(fsync=False) as writer:
        writer.submit(q, tmp_path / "a.tw").result()
    cpu = tw_triton.quantize_state_dict({"model": {"w": w, "b": state["model"]["b"].cpu()}})
    got = read_file(tmp_path / "a.tw").entries["model/w"].buffers
    for name, buf in cpu.entries["model/w"].buffers.items():
        assert torch.equal(got[name], buf), name
    back = tw_triton.load(tmp_path / "a.tw", device=dev)
    assert back["model"]["w"].device == dev
    want = tw_triton.dequantize_state_dict(cpu)["model"]["w"]
    assert torch.equal(back["model"]["w"].cpu().view(torch.int16), want.view(torch.int16))
    assert torch.cuda.current_device() == 0


def test_restore_to_cuda_keeps_adamw_steps_on_the_cpu(tmp_path):
    """Issue 29, item 11: after a restore to CUDA the optimizer's 0-dim ``step`` tensors
    are where torch.optim keeps them (the CPU), its moments on the GPU, and a later step
    runs without reading a step back from the device."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64, device="cuda")).sum().backward()
    opt.step()
    assert all(s["step"].device.type == "cpu" for s in opt.state.values())
    with tw_triton.Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, model=model, optimizer=opt)
    fresh_model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8)).cuda()
    fresh = torch.optim.AdamW(fresh_model.parameters())
    with tw_triton.Checkpointer(tmp_path / "ck") as ck:
        ck.restore(device="cuda", rng=False, model=fresh_model, optimizer=fresh)
    for p in fresh_model.parameters():
        assert fresh.state[p]["step"].device.type == "cpu"
        assert float(fresh.state[p]["step"]) == 1.0
        assert fresh.state[p]["exp_avg"].device.type == "cuda"
    fresh_model(torch.randn(4, 64, device="cuda")).sum().backward()
    fresh.step()
    assert all(float(s["step"]) == 2.0 and s["step"].device.type == "cpu" for s in fresh.state.values())
