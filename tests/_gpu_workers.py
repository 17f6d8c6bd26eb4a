"""Worker of the multi-GPU test (spawned; a rank per GPU, NCCL, FSDP2 on CUDA).

Each rank makes its own GPU current on its main thread, as ``torchrun`` jobs do; the
library's own threads (the writer, the readers) never choose a device themselves.
"""

from __future__ import annotations

import os

import _dcp_workers as W
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import tw_triton
from tw_triton.dcp import StorageReader, StorageWriter


def other_contexts(rank: int) -> list[int]:
    """The GPUs other than this rank's that have a CUDA context in this process."""
    return [i for i in range(torch.cuda.device_count()) if i != rank and torch._C._cuda_hasPrimaryContext(i)]


def fsdp_on_cuda(seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    model = W.make_model(seed).cuda()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(8, W.IN, generator=g).cuda()).square().mean().backward()
    opt.step()
    opt.zero_grad()


def cpu(full: dict) -> dict:
    return {k: v.cpu() for k, v in full.items()}


@W.rank_process
def main_gpus(rank: int, world: int, port: int, root: str) -> None:
    """FSDP2 over the GPUs: an exact DCP save and load, an async delta, and each rank's own
    Checkpointer on its GPU; which other GPUs got a context, before and after tw_triton."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    model, opt = fsdp_on_cuda(seed=0)
    train_step(model, opt, 0)
    state = W.app_state(model, opt)
    full1 = cpu(W.full_tensors(state))
    dist.barrier()
    before = other_contexts(rank)

    dcp.save(state, storage_writer=StorageWriter(f"{root}/key", rules="exact"))
    fresh, fresh_opt = fsdp_on_cuda(seed=123)
    fresh_state = W.app_state(fresh, fresh_opt)
    dcp.load(fresh_state, storage_reader=StorageReader(f"{root}/key"))
    loaded = cpu(W.full_tensors(fresh_state))

    train_step(model, opt, 1)
    state = W.app_state(model, opt)
    full2 = cpu(W.full_tensors(state))
    W.async_delta_then_move(state, model, root)
    fresh, fresh_opt = fsdp_on_cuda(seed=321)
    fresh_state = W.app_state(fresh, fresh_opt)
    dcp.load(fresh_state, storage_reader=StorageReader(f"{root}/delta"))
    loaded_delta = cpu(W.full_tensors(fresh_state))

    # A rank's own state on its GPU, through the Checkpointer's writer thread, its
    # pinned staging and a load's ring of pinned slots.
    g = torch.Generator().manual_seed(rank)
    w = torch.randn(512, 256, generator=g).to(dev)
    with tw_triton.Checkpointer(f"{root}/own{rank}", keyframe_every=2, fsync=False) as ck:
        for step in range(3):
            ck.save(step, model={"w": w + step / 100})
        ck.flush()
        own_gpu = ck.load(2, device=dev)["model"]["w"]
        own_cpu = ck.load(2)["model"]["w"]
    own_same = own_gpu.device == dev and torch.equal(own_gpu.cpu(), own_cpu)
    torch.cuda.synchronize(dev)
    after = other_contexts(rank)
    torch.save(
        {
            "full1": full1,
            "loaded": loaded,
            "full2": full2,
            "loaded_delta": loaded_delta,
            "own_same": own_same,
            "contexts_before": before,
            "contexts_after": after,
        },
        f"{root}/rank{rank}.pt",
    )
    dist.barrier()
