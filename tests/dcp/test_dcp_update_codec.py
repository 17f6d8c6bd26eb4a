"""A codec whose entries need a partner entry (``blockwise-update``) under DCP: each rule's
chunks are coded on their own, so the writer codes its fallback (blockwise, the same bits
and block) and says so; the checkpoint loads as any other (one process, no process group)."""

from __future__ import annotations

import glob
import logging

import _dcp_workers as W
import pytest
import torch

import tw_triton.dcp as tw_dcp
from tw_triton import format as fmt
from tw_triton.dcp import DistributedCheckpointer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

RULES = [("*exp_avg", {"codec": "blockwise-update", "bits": 3, "block": 64, "min_numel": 0})]


def test_dcp_codes_blockwise_update_rules_as_blockwise_and_loads(tmp_path, caplog):
    model = W.make_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = DistributedCheckpointer(str(tmp_path), rules=RULES, keyframe_every=2, keep=10)
    saved = {}
    with caplog.at_level(logging.INFO, logger="tw_triton"):
        for step in range(2):
            W.train_step(model, opt, step)
            state = W.app_state(model, opt)
            ckpt.save(state, step)
            saved[step] = W.full_tensors(state)
    assert "fallback (blockwise)" in caplog.text
    for step in range(2):
        files = glob.glob(f"{tmp_path}/step_0000000{step}/*.tw.safetensors")
        assert files
        for f in files:
            entries = fmt.read_manifest(f)["entries"]
            moments = [e for p, e in entries.items() if p.endswith("/exp_avg")]
            assert moments
            for e in moments:
                assert e["codec"] == "blockwise"
                assert e["params"] == {
                    "bits": 4,
                    "block": 64,
                    "packing": "lsb-first",
                    "delta": False,
                    "qmax": 3,
                }
        fresh = W.make_model(7)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        W.train_step(fresh, fresh_opt, 0)
        back = W.app_state(fresh, fresh_opt)
        tw_dcp.load(back, f"{tmp_path}/step_0000000{step}", no_dist=True)
        loaded = W.full_tensors(back)
        for k, t in saved[step].items():
            err = (loaded[k].float() - t.float()).abs().max()
            assert err <= (t.abs().max() / 3 if k.endswith("exp_avg") else 1e-2 * (1 + t.abs().max())), k
