"""The smoke test's save and load of a real model state on the device (GPU validation).

An LM and its AdamW state (``_end_to_end.build``) are saved twice by a ``Checkpointer`` with
the defaults, a keyframe and then a delta after one more training step, from the device;
the same two states, copied to the CPU first, by a second ``Checkpointer`` from the CPU.
Both are loaded back, the device's to the device: the check is that every decoded tensor is
bit for bit what the CPU path decodes (the kernels' contract), that nothing decoded is
garbage (a relative RMS error under 0.9 per tensor: the default preset codes moments at 4
bits, up to ~0.3 on the CPU here; a zeroed tensor gives 1.0), and that the load lands on
the device, except what the library decodes on the host whatever the device (the
optimizer's 0-dim ``step`` tensors, numpy leaves: ``host_leaf_paths``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _end_to_end import build, sync
from _identity import same_bits

from tw_triton import Checkpointer
from tw_triton.format import read_file
from tw_triton.state.decode import host_leaf_paths
from tw_triton.tree import flatten

MAX_REL_RMS = 0.9


def _to_cpu(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: _to_cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_to_cpu(v) for v in state)
    return state


def misplaced(loaded: dict[str, Any], device: torch.device, on_host: set[str]) -> list[str]:
    """The leaves of a load to ``device`` that are not where the library puts them: on
    ``device``, or on the CPU for the paths in ``on_host`` (see :func:`host_paths`)."""
    out = []
    for name, t in loaded.items():
        want = "cpu" if name in on_host else device.type
        got = t.device.type if isinstance(t, torch.Tensor) else "cpu"  # a numpy leaf
        if got != want:
            out.append(f"{name}: loaded on {got}, not {want}")
    return out


def host_paths(path: str | Path) -> set[str]:
    """The paths of the file at ``path`` that a load decodes on the host whatever the
    device, aliases included."""
    q = read_file(path)
    on_host = host_leaf_paths(q)
    return on_host | {alias for alias, target in q.aliases.items() if target in on_host}


def save_load_once(
    device: torch.device, workdir: Path, *, size: str, log: Callable[[str], None] = lambda _: None
) -> dict[str, Any]:
    """Save a keyframe and a delta from ``device`` and from the CPU; load and compare."""
    model, opt, step = build(device, size)
    ck_dev = Checkpointer(workdir / "smoke-device", keep_last=2)
    ck_cpu = Checkpointer(workdir / "smoke-cpu", keep_last=2)
    problems: list[str] = []
    expected: dict[int, dict[str, torch.Tensor]] = {}
    t0 = time.perf_counter()
    for s in (1, 2):
        if s == 2:
            step()
        sync(device)
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        expected[s] = flatten(_to_cpu(state))[0]
        ck_dev.save(s, model=model, optimizer=opt).result()
        ck_cpu.save(s, **_to_cpu(state)).result()
    saved_s = time.perf_counter() - t0
    n_tensors = 0
    for s in (1, 2):
        on_dev = flatten(ck_dev.load(s, device=device))[0]
        problems += [f"step {s} {bad}" for bad in misplaced(on_dev, device, host_paths(ck_dev.path_for(s)))]
        from_dev = flatten(ck_dev.load(s, device="cpu"))[0]
        from_cpu = flatten(ck_cpu.load(s, device="cpu"))[0]
        if sorted(from_dev) != sorted(from_cpu):
            problems.append(f"step {s}: different tensors saved from the device and the CPU")
            continue
        for name, want in from_cpu.items():
            n_tensors += 1
            got = from_dev[name]
            bad = same_bits(got, want)
            if bad:
                problems.append(f"step {s} {name}: device save decodes differently from the CPU save: {bad}")
            ref = expected[s].get(name)  # None: saved by the library itself (RNG states)
            if ref is not None and ref.is_floating_point() and ref.numel():
                err = (want.double() - ref.double()).norm() / max(ref.double().norm(), 1e-30)
                if err > MAX_REL_RMS:
                    problems.append(f"step {s} {name}: relative RMS error {float(err):.3g}")
    ck_dev.close()
    ck_cpu.close()
    log(f"smoke save/load: {n_tensors} tensors compared, {len(problems)} problem(s)")
    return {
        "size": size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "tensors_compared": n_tensors,
        "save_s": round(saved_s, 3),
        "problems": problems[:50],
        "problem_count": len(problems),
    }
