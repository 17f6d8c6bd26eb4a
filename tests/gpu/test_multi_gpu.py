"""Two GPUs, a rank each (NCCL, FSDP2): DCP saves and loads on CUDA, and no rank gives the
other's GPU a CUDA context (marker ``cuda(devices=2)``: skipped on a machine with fewer).

The worker is ``tests/_gpu_workers.py``; the same checks on the CPU with gloo are
``tests/dcp/test_dcp.py``.
"""

from __future__ import annotations

import _dcp_workers as W
import _gpu_workers as G
import pytest
import torch
import torch.multiprocessing as mp

pytestmark = [pytest.mark.cuda(devices=2), pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("gpus"))
    mp.start_processes(G.main_gpus, args=(2, W.free_port(), root), nprocs=2, start_method="spawn", join=True)
    return [torch.load(f"{root}/rank{r}.pt") for r in range(2)]


def test_fsdp2_on_gpus_round_trips_bit_for_bit_and_a_delta_holds_the_staged_values(ranks):
    out = ranks[0]
    for k, v in out["full1"].items():
        assert torch.equal(out["loaded"][k], v), k
    for name in ("model.0.weight", "model.2.weight"):
        delta = out["full2"][name] - out["full1"][name]
        err = (out["loaded_delta"][name] - out["full2"][name]).abs().max().item()
        assert 0 < err <= delta.abs().max().item() / 127 * 0.51 + 1e-7, name
    # Staged before the parameters moved by +1.
    assert torch.equal(out["loaded_delta"]["model.0.bias"], out["full2"]["model.0.bias"])


def test_each_ranks_checkpointer_loads_to_its_gpu_what_the_cpu_loads(ranks):
    assert [r["own_same"] for r in ranks] == [True, True]


def test_no_rank_gives_another_ranks_gpu_a_context(ranks):
    """The writer's and readers' threads have device 0 current; a runtime call there without
    a device made current first would give rank 1 a context on GPU 0 (hundreds of MiB)."""
    for rank, r in enumerate(ranks):
        new = sorted(set(r["contexts_after"]) - set(r["contexts_before"]))
        assert not new, (
            f"rank {rank}: tw_triton made contexts on GPUs {new} (torch had {r['contexts_before']})"
        )
