"""Steps (d) and (e) of the GPU validation: a whole training state on the device.

(d) **Save and load** a transformer + AdamW state on the device (about 2.2 GB on a GPU:
184 M parameters, fp32 weights and both moments), against ``torch.save`` /
``torch.load(map_location=device)``, safetensors ``save_file`` / ``load_file(device=...)``
and DCP ``async_save``. Per method, medians over rounds that take turns:

* ``blocked_s``: until the save call returns to the loop (the device synchronized before
  the clock starts, so no earlier training work is counted);
* ``blocked_in_loop_s`` (tw_triton only): the same, with ``save()`` called as a training
  loop calls it: right after a training step is queued, nothing synchronized (separate
  Checkpointers, so the files and chains measured above do not change). A save that waits
  for the whole device, rather than for its own kernels, counts that step here;
* ``total_s``: until the file is durable (``torch.save`` and ``save_file`` followed by an
  fsync of the file; DCP and tw_triton fsync themselves);
* ``peak_device_bytes``: ``torch.cuda.max_memory_allocated`` during the save above what was
  allocated before it;
* ``load_s``: from the files (warm page cache: they were just written) to every tensor on
  the device, device synchronized. ``tw delta`` loads the first delta after the keyframe
  (one link: its file and the keyframe's); ``tw chain`` the newest delta, whose closed-loop
  chain grows by a link a round (``links``: the deltas it decodes; ``per_link_s``: its time
  beyond the keyframe's, per link). The first H100 run loaded the newest only, and its
  median of 1.58 s was of chains of 2 to 4 links, about 0.45 s each.

Goals (reported, not failing): tw_triton's blocking <= 5 % of ``torch.save``'s; load <=
safetensors'.

(e) **Concurrency**: saves while training runs on the default stream. Right after each
``save()`` returns, the parameters and optimizer moments are overwritten in place and more
work is queued; the files must hold the values at the time of ``save()``: exact entries
bit for bit, and coded entries byte for byte what the CPU torch path makes of those
values (against the keyframe's values for a delta). Fails on any difference.

On the CPU (``--dry-run``) the same code runs on a tiny model; the Checkpointer's device
branch (encode during ``save()``, no writer-thread encode) is forced for (e), beside its
normal CPU branch, so both are exercised.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import tw_triton
from tw_triton import Checkpointer
from tw_triton.codecs import get_codec
from tw_triton.errors import TwTritonError
from tw_triton.format import read_file
from tw_triton.tree import flatten


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fsync_path(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------ model


class TinyLM(torch.nn.Module):
    """Embedding, a transformer encoder and an output head: the shape of an LM's state."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        layer = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True)
        self.enc = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, vocab)
        self.vocab = vocab

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(tokens)))


def build(
    device: torch.device, size: str, seed: int = 0
) -> tuple[TinyLM, torch.optim.Optimizer, Callable[[], None]]:
    """Model, AdamW after one step, and a function that runs one more training step."""
    torch.manual_seed(seed)
    vocab, width, layers, heads = {
        "large": (16000, 1024, 12, 16),  # 184 M parameters: ~2.2 GB with both moments
        "medium": (8000, 512, 4, 8),  # 20 M parameters
        "tiny": (500, 64, 2, 4),
    }[size]
    model = TinyLM(vocab, width, layers, heads).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator(device=device).manual_seed(seed)

    def step() -> None:
        tokens = torch.randint(0, vocab, (4, 64), device=device, generator=gen)
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    step()
    return model, opt, step


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    tensors = flatten({"model": model.state_dict(), "optimizer": opt.state_dict()})[0]
    return sum(t.numel() * t.element_size() for t in tensors.values())


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# ------------------------------------------------------------------------------ (d)

SAVE_METHODS = ("torch.save", "safetensors", "dcp.async_save", "tw keyframe", "tw delta")
LOAD_METHODS = ("torch.load", "safetensors", "tw keyframe", "tw delta", "tw chain")


def _flat_tensors(state: Any) -> dict[str, torch.Tensor]:
    return flatten(state)[0]


def run_save_load(
    device: torch.device,
    workdir: Path,
    *,
    size: str,
    rounds: int,
    budget_s: float | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Time every save and load method on one state; medians per method.

    Args:
        rounds: timed rounds at most, after one warm-up round.
        budget_s: no round is started that the last one's duration says would end past it;
            the warm-up and one timed round always run.
    """
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file

    t_start = time.perf_counter()
    model, opt, step = build(device, size)
    nbytes = state_bytes(model, opt)
    log(
        f"end-to-end: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, "
        f"state {nbytes / 2**30:.2f} GiB on {device}"
    )
    ck_kf = Checkpointer(workdir / "tw-keyframe", keyframe_every=1, keep_last=1)
    ck_delta = Checkpointer(workdir / "tw-delta", keyframe_every=1_000_000, keep_last=1)
    ck_delta.save(0, model=model, optimizer=opt).result()  # the keyframe the deltas use
    # The same two kinds of save, timed as a loop calls them (blocked_in_loop_s).
    in_loop = {
        "tw keyframe": Checkpointer(workdir / "tw-loop-keyframe", keyframe_every=1, keep_last=1),
        "tw delta": Checkpointer(workdir / "tw-loop-delta", keyframe_every=1_000_000, keep_last=1),
    }
    in_loop["tw delta"].save(0, model=model, optimizer=opt).result()
    in_loop_s: dict[str, list[float]] = {m: [] for m in in_loop}
    saves: dict[str, list[dict[str, float]]] = {m: [] for m in SAVE_METHODS}
    loads: dict[str, list[float]] = {m: [] for m in LOAD_METHODS}
    last_step = 0
    done, last_round_s = 0, 0.0
    for r in range(rounds + 1):  # round 0 warms up (allocations, Triton compiles); not kept
        t_round = time.perf_counter()
        if r >= 2 and budget_s is not None and (t_round - t_start) + last_round_s > budget_s:
            log(f"end-to-end: {done} timed round(s) of {rounds}: the next would overrun {budget_s:.0f} s")
            break
        step()
        last_step = r + 1
        this_round: list[str] = []  # logged as the round ends: a kill later keeps it
        for method in SAVE_METHODS:
            sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
            t0 = time.perf_counter()
            if method == "torch.save":
                torch.save(state, workdir / "state.pt")
                fsync_path(workdir / "state.pt")
                blocked = total = time.perf_counter() - t0
            elif method == "safetensors":
                flat = {k: v.contiguous() for k, v in _flat_tensors(state).items()}
                save_file(flat, str(workdir / "state.safetensors"))
                fsync_path(workdir / "state.safetensors")
                blocked = total = time.perf_counter() - t0
            elif method == "dcp.async_save":
                with _quiet_dcp():
                    fut = dcp.async_save(state, checkpoint_id=str(workdir / f"dcp-{r}"), no_dist=True)
                blocked = time.perf_counter() - t0
                fut.result()
                total = time.perf_counter() - t0
            else:
                ck = ck_kf if method == "tw keyframe" else ck_delta
                fut = ck.save(last_step, model=model, optimizer=opt)
                blocked = time.perf_counter() - t0
                fut.result()
                total = time.perf_counter() - t0
            peak = (torch.cuda.max_memory_allocated(device) - base) if device.type == "cuda" else None
            this_round.append(f"{method} {blocked:.3f}/{total:.3f} s")
            if r:
                saves[method].append({"blocked_s": blocked, "total_s": total, "peak_device_bytes": peak})
        for method, ck in in_loop.items():
            sync(device)  # the saves above are not counted
            step()  # queued; save() follows at once, as in a training loop
            t0 = time.perf_counter()
            fut = ck.save(last_step, model=model, optimizer=opt)
            blocked = time.perf_counter() - t0
            fut.result()
            this_round.append(f"{method} in the loop {blocked:.3f} s")
            if r:
                in_loop_s[method].append(blocked)
        for method in LOAD_METHODS:
            sync(device)
            t0 = time.perf_counter()
            if method == "torch.load":
                out = torch.load(workdir / "state.pt", map_location=device, weights_only=True)
            elif method == "safetensors":
                out = load_file(str(workdir / "state.safetensors"), device=str(device))
            elif method == "tw keyframe":
                out = ck_kf.load(last_step, device=device)
            else:  # step 1: the first delta after the keyframe of step 0; the newest: a chain
                out = ck_delta.load(1 if method == "tw delta" else last_step, device=device)
            sync(device)
            this_round.append(f"load {method} {time.perf_counter() - t0:.3f} s")
            if r:
                loads[method].append(time.perf_counter() - t0)
            del out
        last_round_s = time.perf_counter() - t_round
        done = r
        log(
            f"end-to-end round {r}{' (warm-up)' if r == 0 else ''} in {last_round_s:.1f} s "
            f"(save: blocked/total): {'; '.join(this_round)}"
        )
    # Where a load's time goes (the first H100 run: a delta loaded in 3.8x safetensors' time):
    # one more load of each kind under cProfile, its heaviest functions by their own time.
    profiles = {}
    for method, ck, at in (("tw keyframe", ck_kf, last_step), ("tw delta", ck_delta, 1)):
        sync(device)
        profiles[method] = profile_call(lambda: (ck.load(at, device=device), sync(device)))
        sync(device)
        with phase_timers() as phases:
            t0 = time.perf_counter()
            ck.load(at, device=device)
            sync(device)
        profiles[method]["phases_wall_s"] = round(time.perf_counter() - t0, 4)
        profiles[method]["phases"] = phases
    # Whether the host's half bounds a load: the keyframe again at other reading-thread
    # counts (tw_triton.parallel caps the default at MAX_THREADS, below a GPU host's cores).
    # Two loads a count, each at most about twice the default's time (fewer threads).
    kf_s = statistics.median(loads["tw keyframe"]) if loads["tw keyframe"] else 0.0
    need_s = 2 * len(sweep_counts()) * 2 * kf_s
    if budget_s is None or (time.perf_counter() - t_start) + need_s <= budget_s:
        thread_sweep = sweep_threads(lambda: (ck_kf.load(last_step, device=device), sync(device)))
    else:
        thread_sweep = {"skipped": f"about {need_s:.0f} s needed, past the step's budget of {budget_s:.0f} s"}
        log(f"end-to-end: thread sweep skipped ({thread_sweep['skipped']})")
    sizes = {
        "torch.save": (workdir / "state.pt").stat().st_size,
        "safetensors": (workdir / "state.safetensors").stat().st_size,
        "dcp.async_save": sum(p.stat().st_size for p in (workdir / f"dcp-{done}").rglob("*") if p.is_file()),
        "tw keyframe": os.path.getsize(ck_kf.path_for(last_step)),
        "tw delta": os.path.getsize(ck_delta.path_for(last_step)),
    }
    ck_kf.close()
    ck_delta.close()
    for ck in in_loop.values():
        ck.close()
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    save_rows = {
        m: {
            "blocked_s": med([x["blocked_s"] for x in v]),
            "total_s": med([x["total_s"] for x in v]),
            "peak_device_bytes": (max(x["peak_device_bytes"] for x in v) if device.type == "cuda" else None),
            "file_bytes": sizes[m],
        }
        for m, v in saves.items()
    }
    for m, v in in_loop_s.items():
        save_rows[m]["blocked_in_loop_s"] = med(v)
    load_rows = {m: {"load_s": med(v)} for m, v in loads.items()}
    # The chain's rounds each loaded one link more than the one before: its median round's.
    chain_links = list(range(2, done + 2))
    load_rows["tw chain"]["links"] = med(chain_links) if chain_links else None
    if load_rows["tw chain"]["links"] and load_rows["tw keyframe"]["load_s"] is not None:
        extra = load_rows["tw chain"]["load_s"] - load_rows["tw keyframe"]["load_s"]
        load_rows["tw chain"]["per_link_s"] = round(extra / load_rows["tw chain"]["links"], 4)
    ts = save_rows["torch.save"]["blocked_s"]
    st = load_rows["safetensors"]["load_s"]
    goals = {
        "tw_blocking_vs_torch_save": {
            m: round(save_rows[m]["blocked_s"] / ts, 4) for m in ("tw keyframe", "tw delta")
        },
        "tw_load_vs_safetensors": {
            m: round(load_rows[m]["load_s"] / st, 4) for m in ("tw keyframe", "tw delta")
        },
    }
    if device.type == "cuda":
        goals["blocking_goal_met"] = all(v <= 0.05 for v in goals["tw_blocking_vs_torch_save"].values())
        goals["load_goal_met"] = all(v <= 1.0 for v in goals["tw_load_vs_safetensors"].values())
    return {
        "state_bytes": nbytes,
        "parameters": sum(p.numel() for p in model.parameters()),
        "rounds": done,
        "rounds_planned": rounds,
        "save": save_rows,
        "load": load_rows,
        "goals": goals,
        "load_profile": profiles,
        "keyframe_load_by_threads": thread_sweep,
    }


def sweep_counts(cores: int | None = None) -> list[int]:
    """The reading-thread counts :func:`sweep_threads` times: 4, 8, 16 and 32, each at most
    the machine's cores."""
    cores = cores or os.cpu_count() or 1
    return sorted({min(c, cores) for c in (4, 8, 16, 32)})


def sweep_threads(
    load: Callable[[], Any], counts: list[int] | None = None, repeats: int = 2
) -> dict[str, Any]:
    """``load()``'s best seconds of ``repeats`` with ``TW_TRITON_THREADS`` at each of
    ``counts`` (default :func:`sweep_counts`), and the default count; the variable is put
    back as it was."""
    from tw_triton.parallel import ENV_THREADS, cpu_threads

    saved = os.environ.get(ENV_THREADS)
    seconds: dict[str, float] = {}
    try:
        for count in counts or sweep_counts():
            os.environ[ENV_THREADS] = str(count)
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                load()
                best = min(best, time.perf_counter() - t0)
            seconds[str(count)] = round(best, 4)
    finally:
        if saved is None:
            os.environ.pop(ENV_THREADS, None)
        else:
            os.environ[ENV_THREADS] = saved
    return {"default_threads": cpu_threads(), "seconds": seconds}


# The phases of a load, timed in every thread that runs them (the cProfile table above sees
# only the loading thread, where the reading threads' work is a wait): (label, module,
# attribute). Nested: a buffer's read holds its entropy decode, upload and checksums.
LOAD_PHASES = (
    ("read the files", "tw_triton.format.reader", "read_file"),
    ("read: one buffer", "tw_triton.format.reader", "MappedCheckpoint.read_buffer"),
    ("read: a compressed buffer to the device", "tw_triton.format.reader", "upload_staged"),
    ("read: decode a piece of byte planes", "tw_triton.codecs.entropy.planes", "PlaneStream.fill"),
    ("read: zstd decode", "tw_triton.codecs.entropy.zstd", "FrameReader.fill"),
    ("read: a raw buffer to the device", "tw_triton.format.reader", "upload_raw"),
    ("read: wait for a free pinned slot", "tw_triton.pinned_memory", "PinnedRing._acquire"),
    ("read: pin the ring's slab", "tw_triton.pinned_memory", "PinnedRing.__init__"),
    ("read: CRC-32", "tw_triton.format.checksum", "crc32"),
    ("decode the entries", "tw_triton.state.decode", "decode_entries"),
    ("decode: grouped launches", "tw_triton.state.grouped", "decode_grouped"),
    ("rebuild the tree", "tw_triton.tree", "unflatten"),
)


@contextlib.contextmanager
def phase_timers(phases: tuple[tuple[str, str, str], ...] = LOAD_PHASES) -> Iterator[dict[str, Any]]:
    """Time ``phases`` while the block runs, in whichever thread calls them: yields a dict
    that holds, on exit, ``{label: {"calls", "seconds" (summed over calls and threads),
    "threads"}}``. Each function is replaced where it is defined and in every module that
    imported it by name, and put back on exit."""
    import importlib
    import sys
    import threading

    lock = threading.Lock()
    totals: dict[str, list[Any]] = {label: [0, 0.0, set()] for label, _, _ in phases}
    undo: list[tuple[Any, str, Any]] = []

    def timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                with lock:
                    row = totals[label]
                    row[0] += 1
                    row[1] += dt
                    row[2].add(threading.get_ident())

        return wrapper

    for label, module, attribute in phases:
        owner: Any = importlib.import_module(module)
        *path, name = attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        original = getattr(owner, name)
        wrapper = timed(label, original)
        # A module's own namespace only: getattr would run a lazy module's __getattr__
        # (transformers imports its submodules so, and some need packages not installed).
        holders = (
            [owner]
            if path
            else [m for m in list(sys.modules.values()) if getattr(m, "__dict__", {}).get(name) is original]
        )
        for holder in holders:
            undo.append((holder, name, original))
            setattr(holder, name, wrapper)
    result: dict[str, Any] = {}
    try:
        yield result
    finally:
        for holder, name, original in reversed(undo):
            setattr(holder, name, original)
        for label, (calls, seconds, threads) in totals.items():
            result[label] = {"calls": calls, "seconds": round(seconds, 4), "threads": len(threads)}


def profile_call(fn: Callable[[], Any], top: int = 25) -> dict[str, Any]:
    """``fn()`` under cProfile (every thread's work shows as the wait of the one that runs
    ``fn``): its wall time, and the ``top`` functions by their own time."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    try:
        fn()
    finally:
        prof.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats  # {(file, line, name): (calls, primitive, own, cumulative, callers)}

    def table(rows: list) -> list[dict[str, Any]]:
        return [
            {
                "function": f"{os.path.basename(f)}:{line}:{name}",
                "calls": calls,
                "own_s": round(own, 4),
                "cumulative_s": round(cum, 4),
            }
            for (f, line, name), (calls, _, own, cum, _) in rows
        ]

    by_own = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    # The library's own functions by cumulative time: which phase the waits are in, where
    # the own times show only a lock's acquire (the work of the reading threads).
    ours = [kv for kv in stats.items() if f"{os.sep}tw_triton{os.sep}" in kv[0][0]]
    by_cumulative = sorted(ours, key=lambda kv: -kv[1][3])[:top]
    return {"wall_s": round(wall, 4), "top_own_time": table(by_own), "top_cumulative": table(by_cumulative)}


# ------------------------------------------------------------------------------ (e)


def _clone_tree(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _clone_tree(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_clone_tree(v) for v in tree)
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    return tree


def _scramble(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Overwrite every parameter and moment in place, as the next steps would."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-3.0).add_(1.0)
        for s in opt.state.values():
            for k in ("exp_avg", "exp_avg_sq"):
                if k in s:
                    s[k].mul_(5.0).add_(1.0)


def check_file_holds(
    path: str,
    expected: dict[str, torch.Tensor],
    refs: dict[str, torch.Tensor] | None,
    decoded: dict[str, torch.Tensor] | None = None,
) -> list[str]:
    """Differences between the file at ``path`` and the CPU encoding of ``expected``.

    Exact entries must hold ``expected`` bit for bit; coded entries the bytes the CPU path
    encodes from ``expected`` (with the file's own params, against ``refs`` for a delta; an
    entry coded with a partner, ``blockwise-update``, with its partner as ``decoded``, the
    file's own values as a loader decodes them).
    """
    q = read_file(path)
    problems = []
    for name, want in expected.items():
        name = q.aliases.get(name, name)
        entry = q.entries.get(name)
        if entry is None:
            problems.append(f"{path}: no entry {name!r}")
            continue
        if entry.codec == "exact":
            got = entry.buffers["data"].reshape(-1)
            if got.dtype != want.dtype or not torch.equal(
                got.view(torch.uint8), want.contiguous().reshape(-1).view(torch.uint8)
            ):
                problems.append(f"{path}: exact entry {name!r} differs from the value at save()")
            continue
        codec = get_codec(entry.codec)
        params = {k: v for k, v in entry.params.items() if k != "ref_fp"}
        ref = None
        if codec.uses_reference(params):
            if refs is None or name not in refs:
                problems.append(f"{path}: delta entry {name!r} without a keyframe value to check against")
                continue
            ref = refs[name]
        partner = codec.partner_of(params)
        if partner is not None:
            if decoded is None or partner not in decoded:
                problems.append(f"{path}: entry {name!r} without its partner {partner!r} decoded")
                continue
            rule_params = {k: v for k, v in params.items() if k not in ("partner", "packing")}
            enc = codec.encode_with_partner(want, rule_params, partner, decoded[partner], None)
        else:
            enc = codec.encode(want, params, ref)
        for bname, buf in enc.entry.buffers.items():
            stored = entry.buffers.get(bname)
            if stored is None or not torch.equal(
                stored.reshape(-1).view(torch.uint8), buf.reshape(-1).contiguous().view(torch.uint8)
            ):
                problems.append(
                    f"{path}: {entry.codec} entry {name!r} buffer {bname!r} is not the "
                    "encoding of the value at save()"
                )
    return problems


def check_saved_step(ck: Checkpointer, step: int, want: dict[str, torch.Tensor]) -> list[str]:
    """Differences between the file of ``step`` and ``want`` (its flat state at save()).

    A file or reference the library refuses to read (a checksum, a delta's reference
    fingerprint) is a difference too: it is how a snapshot that changed while it was being
    written often shows, and it must be counted, not end the run.

    Args:
        ck: the Checkpointer that saved ``step`` (flushed).
        step: the step to check.
        want: the values at save(), flat by path, on the CPU.

    Returns:
        One line per difference (empty if the file holds ``want``).
    """
    path = ck.path_for(step)
    try:
        ref_step = read_file(path).metadata.get("reference_step")
        refs = None
        if ref_step is not None:
            # What the delta was coded against is what a loader decodes for its reference:
            # the keyframe's exact values (open loop) or the reconstruction of the save
            # before it (closed loop), itself checked against its own save in this loop.
            refs = {k: v.cpu() for k, v in flatten(ck.load(ref_step, device="cpu"))[0].items()}
        decoded = None
        if any(get_codec(e.codec).partner_of(e.params) for e in read_file(path).entries.values()):
            decoded = {k: v.cpu() for k, v in flatten(ck.load(step, device="cpu"))[0].items()}
        return check_file_holds(path, want, refs, decoded)
    except TwTritonError as e:
        return [f"{path}: does not load ({type(e).__name__}: {e})"]


def run_concurrency(
    device: torch.device,
    workdir: Path,
    *,
    size: str,
    saves: int,
    force_device_branch: bool = False,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Save while training runs and the state is overwritten after each ``save()``."""
    import tw_triton.save_pipeline as ckmod

    model, opt, step = build(device, size, seed=1)
    busy = torch.randn(
        2048 if device.type == "cuda" else 64, 2048 if device.type == "cuda" else 64, device=device
    )
    expected: dict[int, dict[str, torch.Tensor]] = {}
    directory = workdir / ("concurrency-device-branch" if force_device_branch else "concurrency")
    original = ckmod.all_on_cpu
    if force_device_branch:
        # The branch a CUDA state takes (encode in save(), buffers handed to the writer).
        ckmod.all_on_cpu = lambda tree: False
    try:
        ck = Checkpointer(directory, keyframe_every=3, keep_last=None, fsync=False)
        for s in range(saves):
            step()
            # The values at save(): cloned on the same stream before save() is called.
            expected[s] = _clone_tree({"model": model.state_dict(), "optimizer": opt.state_dict()})
            for _ in range(8):
                busy = torch.tanh(busy @ busy)  # queue work: the device runs behind the host
            ck.save(s, model=model, optimizer=opt)
            _scramble(model, opt)  # right after save() returns, on the default stream
            for _ in range(8):
                busy = torch.tanh(busy @ busy)
        ck.flush()
        problems: list[str] = []
        by_step: dict[int, dict[str, Any]] = {}
        for s in range(saves):
            want = {k: v.cpu() for k, v in flatten(expected[s])[0].items()}
            found = check_saved_step(ck, s, want)
            if found:
                by_step[s] = {"count": len(found), "first": found[0]}
            problems += found
        ck.close()
    finally:
        ckmod.all_on_cpu = original
    log(
        f"concurrency ({'device branch' if force_device_branch else 'default branch'}): "
        f"{saves} saves, {len(problems)} problem(s)"
    )
    return {
        "saves": saves,
        "problems": problems[:50],
        "problem_count": len(problems),
        "problem_steps": by_step,
        "device_branch_forced": force_device_branch,
        "tw_triton": tw_triton.__version__,
    }
