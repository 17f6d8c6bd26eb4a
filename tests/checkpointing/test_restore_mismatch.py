"""Restoring into objects that do not fit the checkpoint (a missing or extra parameter, a
changed shape, an optimizer over other parameters) raises a CheckpointError that names the
file, the state's name and what did not fit (the error of ``load_state_dict`` is its cause);
loading to CUDA where there is none says so, whichever checkpoint is asked for, instead of
blaming the file."""

from __future__ import annotations

import pytest
import torch

from tw_triton.checkpointer import Checkpointer
from tw_triton.errors import CheckpointError, TwTritonError


def mlp(out: int = 64, extra: bool = False, bias: bool = True) -> torch.nn.Sequential:
    layers = [torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, out, bias=bias)]
    return torch.nn.Sequential(*layers, *([torch.nn.Linear(out, 8)] if extra else []))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("saved")
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    with Checkpointer(directory, keyframe_every=2, fsync=False) as ckpt:
        for step in range(3):  # a keyframe, a delta, a keyframe
            model(torch.randn(4, 64)).square().mean().backward()
            opt.step()
            ckpt.save(step, model=model, optimizer=opt)
    return directory


MODELS = {
    "a missing parameter": (lambda: mlp(bias=False), "Unexpected key"),
    "an extra parameter": (lambda: mlp(extra=True), "Missing key"),
    "a changed shape": (lambda: mlp(out=32), "size mismatch"),
}


@pytest.mark.parametrize("step", [1, 2], ids=["delta", "keyframe"])
@pytest.mark.parametrize("case", MODELS)
def test_a_model_that_does_not_fit_is_a_checkpoint_error_naming_file_and_name(saved, step, case):
    build, detail = MODELS[case]
    with pytest.raises(
        CheckpointError, match=rf"(?s)step-0000000{step}\.tw\.safetensors.*'model'.*{detail}"
    ) as err:
        Checkpointer(saved).restore(step, model=build(), rng=False)
    assert isinstance(err.value.__cause__, RuntimeError)


def test_an_optimizer_over_other_parameters_is_a_checkpoint_error(saved):
    model = mlp()
    opt = torch.optim.AdamW(list(model.parameters())[:2])
    with pytest.raises(
        CheckpointError, match=r"(?s)step-00000002\.tw\.safetensors.*'optimizer'.*AdamW.*size"
    ):
        Checkpointer(saved).restore(model=model, optimizer=opt, rng=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("step", [None, 1, 2])
@pytest.mark.parametrize("verify", [True, False])
def test_loading_to_cuda_without_cuda_says_so_not_that_the_file_is_bad(saved, step, verify):
    with pytest.raises(TwTritonError, match="CUDA is not available") as err:
        Checkpointer(saved).load(step, device="cuda", verify=verify)
    assert not isinstance(err.value, CheckpointError)


@pytest.mark.parametrize("how", ["a model built on meta", "device='meta'"])
def test_restoring_into_or_onto_the_meta_device_is_refused_before_anything_is_read(saved, how, monkeypatch):
    # A model built on the meta device (large-model init) made restore() load every
    # tensor to meta, load_state_dict a no-op, and then fail on the RNG states ("Cannot
    # copy out of meta tensor") with the model still holding no data.
    from tw_triton import format as fmt

    monkeypatch.setattr(fmt, "read_file", lambda *a, **k: pytest.fail("read before the device was checked"))
    if how == "device='meta'":
        model, kwargs = mlp(), {"device": "meta"}
    else:
        with torch.device("meta"):
            model, kwargs = mlp(), {}
    rng = torch.get_rng_state()
    with pytest.raises(CheckpointError, match="meta device") as err:
        Checkpointer(saved).restore(model=model, **kwargs)
    if how == "a model built on meta":
        assert (
            "'0.weight'" in str(err.value)
            and "to_empty" in str(err.value)
            and "assign=True" in str(err.value)
        )
    assert torch.equal(torch.get_rng_state(), rng)
