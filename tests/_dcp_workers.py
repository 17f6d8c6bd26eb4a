"""Worker functions for the multi-process DCP tests (spawned; 2 ranks, gloo, CPU)."""

from __future__ import annotations

import functools
import os
import socket
import sys
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from tw_triton.dcp import StorageReader, StorageWriter, compat

# Output dims 65 and 97 do not divide by 2 ranks: FSDP2 shards them unevenly. Weights have
# >= 4096 elements, so the default rules and presets quantize them.
IN, HID, OUT = 128, 65, 97


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.ReLU(), torch.nn.Linear(HID, OUT))


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, IN, generator=g)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def app_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def full_tensors(state: dict) -> dict[str, torch.Tensor]:
    """fqn -> the whole tensor (a collective for DTensors: call on every rank)."""
    flat, _ = compat.flatten_state_dict(state)
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in flat.items()
        if isinstance(v, torch.Tensor)
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_process(body: Callable[[int, int, int, str], None]) -> Callable[[int, int, int, str], None]:
    """A spawned rank's ``body(rank, world, port, root)``, which writes its results under
    ``root``: its traceback is printed before the process group is torn down (a teardown
    under a failure can abort the process, gloo's threads, and then Python never prints
    it), and after a success the interpreter's own teardown is skipped (a rare SIGABRT,
    "terminate called without an active exception", was seen there; where is not known)."""

    @functools.wraps(body)
    def run(rank: int, world: int, port: int, root: str) -> None:
        try:
            body(rank, world, port, root)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            raise
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    return run


def setup(rank: int, world: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def fsdp_model_and_opt(seed: int = 0):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = make_model(seed)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def load_into_fresh(path: str, **reader_kw) -> dict[str, torch.Tensor]:
    """Load ``path`` into a fresh FSDP2 model + AdamW and return the full tensors."""
    model, opt = fsdp_model_and_opt(seed=123)
    state = app_state(model, opt)
    dcp.load(state, storage_reader=StorageReader(path, **reader_kw))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    return full_tensors(app_state(model, opt))


def async_delta_then_move(state: dict, model: torch.nn.Module, root: str) -> None:
    """``async_save`` a delta of ``state`` against ``{root}/key`` to ``{root}/delta``, and move
    every parameter by +1 before the upload finishes: the checkpoint must hold the staged
    values."""
    fut = dcp.async_save(
        state, storage_writer=StorageWriter(f"{root}/delta", rules="small", reference=f"{root}/key")
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    fut.result()
    dist.barrier()


@rank_process
def main_sharded(rank: int, world: int, port: int, root: str) -> None:
    """Save/load, async_save with a delta, 1 -> 2 resharding; results go to ``root``."""
    setup(rank, world, port)
    model, opt = fsdp_model_and_opt()
    train_step(model, opt, 0)
    state = app_state(model, opt)
    full1 = full_tensors(state)

    # 1. Exact save and load: bit for bit, in a fresh model and optimizer.
    dcp.save(state, storage_writer=StorageWriter(f"{root}/key", rules="exact"))
    loaded = load_into_fresh(f"{root}/key")

    # 2. Train on; async_save a delta against the keyframe; change the parameters
    # before the upload finishes: the checkpoint must hold the staged values.
    train_step(model, opt, 1)
    state = app_state(model, opt)
    full2 = full_tensors(state)
    async_delta_then_move(state, model, root)
    loaded_delta = load_into_fresh(f"{root}/delta")

    # 3. 1 -> 2: the parent saved these with one process.
    loaded_one = {name: load_into_fresh(f"{root}/one_{name}") for name in ("exact", "small")}
    if rank == 0:
        torch.save(
            {
                "full1": full1,
                "loaded": loaded,
                "full2": full2,
                "loaded_delta": loaded_delta,
                "loaded_one": loaded_one,
            },
            f"{root}/rank0.pt",
        )
    dist.barrier()


def main_checkpointer(rank: int, world: int, port: int, root: str) -> None:
    """DistributedCheckpointer: steps 0..3 (keyframe every 3, keep 2), then rank 1 dies
    in the middle of step 4, after writing its file and before the metadata."""
    import datetime

    import tw_triton.dcp.writer as writer
    from tw_triton.dcp import DistributedCheckpointer

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=20))
    model, opt = fsdp_model_and_opt()
    ckpt = DistributedCheckpointer(f"{root}/run", rules="small", keyframe_every=3, keep=2)
    saved = {}
    for step in range(4):
        train_step(model, opt, step)
        state = app_state(model, opt)
        fut = ckpt.save(state, step, asynchronous=(step == 2))
        if fut is not None:
            ckpt.wait()
        saved[step] = full_tensors(state)
    if rank == 0:
        torch.save(saved, f"{root}/saved.pt")
    dist.barrier()
    train_step(model, opt, 4)
    if rank == 1:
        real_write = writer.write_file

        def write_then_die(*args, **kwargs):
            real_write(*args, **kwargs)
            os._exit(17)

        writer.write_file = write_then_die
    ckpt.save(app_state(model, opt), 4)  # rank 0 fails in DCP's collective; rank 1 exits
    os._exit(0)  # not reached on a correct run
