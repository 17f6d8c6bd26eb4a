"""tw_triton through torch.distributed.checkpoint against plain DCP, on one sharded state.

Two ranks (gloo on the CPU; ``cpu:gloo,cuda:nccl`` with one GPU per rank when CUDA is
there) shard an MLP with FSDP2 (``fully_shard``) and take AdamW steps. The same state is
then saved by:

* ``dcp``        plain ``FileSystemWriter``;
* ``dcp+zstd``   ``FileSystemWriter`` with DCP's EXPERIMENTAL zstd stream extension
                 (``_extensions=[ZStandard()]``, wrapped in ``tw_triton.dcp.compat``);
* ``tw keyframe`` ``tw_triton.dcp.StorageWriter(rules="small", as_keyframe=True)``: weights
                 exact, AdamW moments coded (exp_avg int4, exp_avg_sq log2 4 bits);
* ``tw delta``   the same rules, weights as int8 deltas against that keyframe.

For each: bytes on disk, the time ``dcp.async_save`` blocks the caller (staging: a full
CPU copy for DCP, encode + copy of the encoded bytes for tw_triton), the total until the
save's future resolves, and ``dcp.load`` into a fresh model. One run, alternating writers
per round, one unrecorded warm-up round, median of ``--repeats``; ratios against plain DCP are what to read, because the
machine is shared.

    python benchmarks/dcp_compare.py                 # ~8.4 M parameters + AdamW
    python benchmarks/dcp_compare.py --width 512 --repeats 1   # quick look
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.common import fmt_table, machine_description, median, mib, write_result  # noqa: E402


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tw_triton.dcp import Keyframe, StorageReader, StorageWriter, compat

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available() and not args.cpu
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world,))

    def build(seed: int):
        torch.manual_seed(seed)
        layers = [torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]
        model = torch.nn.Sequential(*layers).to(device)
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(model, opt, seed):
        g = torch.Generator(device=device).manual_seed(seed)
        model(torch.randn(16, args.width, device=device, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    def state_of(model, opt):
        return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}

    model, opt = build(0)
    step(model, opt, 0)
    root = os.path.join(out, "ckpt")
    keyframe_dir = os.path.join(root, "keyframe_ref")
    dcp.save(
        state_of(model, opt), storage_writer=StorageWriter(keyframe_dir, rules="small", as_keyframe=True)
    )
    keyframe = Keyframe(keyframe_dir)
    step(model, opt, 1)
    state = state_of(model, opt)
    zstd = compat.zstd_extensions()
    writers = {
        "dcp": lambda p: dcp.FileSystemWriter(p),
        "dcp+zstd": (lambda p: dcp.FileSystemWriter(p, _extensions=zstd)) if zstd else None,
        "tw keyframe": lambda p: StorageWriter(p, rules="small", as_keyframe=True),
        "tw delta": lambda p: StorageWriter(p, rules="small", reference=keyframe),
    }
    writers = {k: v for k, v in writers.items() if v is not None}
    readers = {
        "dcp": dcp.FileSystemReader,
        "dcp+zstd": dcp.FileSystemReader,
        "tw keyframe": StorageReader,
        "tw delta": StorageReader,
    }
    times: dict[str, dict[str, list[float]]] = {k: {"block": [], "total": [], "load": []} for k in writers}
    sizes: dict[str, int] = {}
    for r in range(-1, args.repeats):  # round -1 warms up every path, unrecorded
        for name, make in writers.items():
            path = os.path.join(root, f"{name.replace(' ', '_')}_{r}")
            dist.barrier()
            t0 = time.perf_counter()
            fut = dcp.async_save(state, storage_writer=make(path))
            t1 = time.perf_counter()
            fut.result()
            dist.barrier()
            t2 = time.perf_counter()
            fresh_model, fresh_opt = build(1)
            target = state_of(fresh_model, fresh_opt)
            dist.barrier()
            t3 = time.perf_counter()
            dcp.load(target, storage_reader=readers[name](path))
            dist.barrier()
            t4 = time.perf_counter()
            if r < 0:
                shutil.rmtree(path, ignore_errors=True) if rank == 0 else None
                continue
            times[name]["block"].append(t1 - t0)
            times[name]["total"].append(t2 - t0)
            times[name]["load"].append(t4 - t3)
            if rank == 0:
                sizes[name] = _dir_bytes(path)
                shutil.rmtree(path) if r < args.repeats - 1 else None
    if rank == 0:
        torch.save({"times": times, "sizes": sizes, "device": str(device)}, os.path.join(out, "result.pt"))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cpu", action="store_true", help="stay on the CPU even with CUDA")
    ap.add_argument("--no-write", action="store_true", help="do not write results/dcp_compare.json")
    args = ap.parse_args()
    out = tempfile.mkdtemp(prefix="dcp_compare_")
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_worker, args=(2, port, args, out), nprocs=2, start_method="spawn", join=True)
        res = torch.load(os.path.join(out, "result.pt"))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    times, sizes = res["times"], res["sizes"]
    base = {k: median(v) for k, v in times["dcp"].items()}
    params = args.layers * (args.width * args.width + args.width)
    rows = []
    for name in times:
        t = {k: median(v) for k, v in times[name].items()}
        rows.append(
            [
                name,
                f"{mib(sizes[name]):.1f}",
                f"{sizes['dcp'] / sizes[name]:.2f}x smaller",
                f"{t['block'] / base['block']:.2f}",
                f"{t['total'] / base['total']:.2f}",
                f"{t['load'] / base['load']:.2f}",
            ]
        )
    print(f"# DCP comparison: {params / 1e6:.1f} M parameters + AdamW, FSDP2 on 2 ranks ({res['device']})")
    print(f"machine: {machine_description()}; median of {args.repeats}; times as ratios to plain DCP\n")
    print(fmt_table(["writer", "MiB on disk", "vs dcp", "async_save blocks", "total save", "load"], rows))
    print(
        f"\nplain DCP absolute (this run): block {base['block'] * 1e3:.0f} ms, total "
        f"{base['total'] * 1e3:.0f} ms, load {base['load'] * 1e3:.0f} ms"
    )
    if not args.no_write:
        write_result(
            "dcp_compare",
            {"args": vars(args), "device": res["device"], "params": params, "sizes": sizes, "times": times},
        )


if __name__ == "__main__":
    main()
