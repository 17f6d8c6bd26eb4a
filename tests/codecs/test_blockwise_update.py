"""The ``blockwise-update`` codec: Adam's first moment coded as ``u = m / (sqrt(v_hat) +
eps)``, ``v_hat`` its partner entry as a loader decodes it. Its error bound, its values
against an oracle built from the stored buffers, the order of encode and decode, the
fallback to blockwise without a usable partner, NaN/Inf, and the checks of a file's
partners."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tw_triton
from tw_triton.codecs import get_codec
from tw_triton.codecs.blockwise import QuantizedTensor, dequantize
from tw_triton.errors import CheckpointError, QuantizationError
from tw_triton.format import read_manifest
from tw_triton.state import check_manifest, dequantize_entries

M, V = "optimizer/state/0/exp_avg", "optimizer/state/0/exp_avg_sq"


def state_of(m: torch.Tensor, v: torch.Tensor, **extra: torch.Tensor) -> dict:
    st_ = {"step": torch.tensor(3.0), "exp_avg": m, "exp_avg_sq": v, **extra}
    return {"optimizer": {"state": {0: st_}, "param_groups": [{"params": [0]}]}}


def rules(bits=3, block=128, eps=1e-8, v_codec="log2", **more):
    spec = {"codec": "blockwise-update", "bits": bits, "block": block, "eps": eps, "min_numel": 0, **more}
    v_spec = {"codec": v_codec, "bits": 4, "block": block, "min_numel": 0} if v_codec != "exact" else "exact"
    return [("*exp_avg", spec), ("*exp_avg_sq", v_spec)]


def moments(n: int, seed: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """A first and second moment of the same gradients, spanning a few octaves."""
    g = torch.Generator().manual_seed(seed)
    grads = torch.randn(8, n, generator=g) * torch.exp2(4 * torch.randn(n, generator=g))
    return (0.1 * grads.sum(0)).to(dtype), 0.01 * grads.square().sum(0)


def oracle(entry, v_hat: torch.Tensor) -> torch.Tensor:
    """``u_hat * (sqrt(v_hat) + eps)`` from the stored buffers, in the spec's words."""
    p = entry.params
    q = QuantizedTensor(
        entry.buffers["codes"],
        entry.buffers["scales"],
        tuple(entry.shape),
        torch.float32,
        p["bits"],
        p["block"],
        torch.tensor(False),
    )
    eps32 = torch.tensor(p["eps"], dtype=torch.float32)
    root = torch.from_numpy(np.sqrt(v_hat.numpy()))  # IEEE: correctly rounded
    return (dequantize(q) * (root + eps32)).to(entry.dtype)


def assert_within_bound(m, m_hat, v_hat, bits, block, eps):
    """Half a step of ``u``'s block, scaled by ``sqrt(v_hat) + eps``, plus fp32 roundings:
    holds only if the encoder divided by the ``v_hat`` the decoder multiplies by."""
    d = torch.sqrt(v_hat) + torch.tensor(eps, dtype=torch.float32)
    u = m.float() / d
    n, qmax = m.numel(), 3 if bits == 3 else 2 ** (bits - 1) - 1
    s = torch.nn.functional.pad(u.abs(), (0, (-n) % block)).view(-1, block).amax(1) / qmax
    s = s.repeat_interleave(block)[:n]
    err = (m_hat.float() - m.float()).abs()
    slack = 1e-6 * (m.float().abs() + s * qmax * d)
    if m.dtype == torch.bfloat16:
        slack += m_hat.float().abs() * 2**-8
    assert bool((err <= (s / 2) * d * (1 + 1e-6) + slack).all())


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 5000),
    seed=st.integers(0, 2**31 - 1),
    bits=st.sampled_from((8, 4, 3, 2)),
    block=st.sampled_from((32, 128, 1024)),
    eps=st.sampled_from((1e-8, 1e-6, 1e-3)),
    v_codec=st.sampled_from(("log2", "exact")),
    dtype=st.sampled_from((torch.float32, torch.bfloat16)),
)
def test_round_trip_within_the_blockwise_bound_times_the_denominator(
    n, seed, bits, block, eps, v_codec, dtype
):
    m, v = moments(n, seed, dtype)
    q = tw_triton.quantize_state_dict(state_of(m, v), rules=rules(bits, block, eps, v_codec))
    entry = q.entries[M]
    assert entry.codec == "blockwise-update" and entry.params["partner"] == V
    assert entry.params["bits"] == (4 if bits == 3 else bits) and entry.params.get("qmax") == (
        3 if bits == 3 else None
    )
    out = tw_triton.dequantize_state_dict(q)["optimizer"]["state"][0]
    v_hat, m_hat = out["exp_avg_sq"], out["exp_avg"]
    # The decode is the spec's, against the partner as the loader decodes it.
    assert torch.equal(m_hat, oracle(entry, v_hat))
    assert_within_bound(m, m_hat, v_hat, bits, block, eps)


def test_a_file_decodes_what_the_state_api_decodes_and_only_closes_over_partners(tmp_path):
    m, v = moments(4096, 1)
    q = tw_triton.quantize_state_dict(state_of(m, v), rules=rules())
    whole = tw_triton.dequantize_state_dict(q)["optimizer"]["state"][0]
    tw_triton.save(q, tmp_path / "a.tw", fsync=False)
    loaded = tw_triton.load(tmp_path / "a.tw")["optimizer"]["state"][0]
    assert torch.equal(loaded["exp_avg"], whole["exp_avg"])
    # Only the dependent entry asked for: its partner is decoded with it, not returned.
    back = tw_triton.format.read_file(tmp_path / "a.tw")
    only = dequantize_entries(back, [M])
    assert list(only) == [M] and torch.equal(only[M], whole["exp_avg"])
    assert "blockwise-update" in read_manifest(tmp_path / "a.tw")["entries"][M]["codec"]


def test_a_delta_partner_is_decoded_against_the_encoders_reference():
    """Partner coded ``log2-temporal`` against a reference: ``v_hat`` is its delta decode."""
    m, v = moments(4096, 2)
    ref = state_of(torch.zeros_like(m), v * 1.05)
    spec = rules(v_codec="log2-temporal")
    q = tw_triton.quantize_state_dict(state_of(m, v), rules=spec, reference=ref)
    assert q.entries[V].codec == "log2-temporal" and q.entries[V].params["delta"]
    out = tw_triton.dequantize_state_dict(q, reference=ref)["optimizer"]["state"][0]
    assert torch.equal(out["exp_avg"], oracle(q.entries[M], out["exp_avg_sq"]))
    assert not torch.equal(out["exp_avg_sq"], v)  # lossy: the encoder used the decode
    assert_within_bound(m, out["exp_avg"], out["exp_avg_sq"], 3, 128, 1e-8)


def test_a_file_with_a_delta_partner_loads_against_a_reference_file(tmp_path):
    """The load that reads the reference file on a thread while it decodes the entries
    that need none: the dependent entry waits for its delta partner."""
    m, v = moments(4096, 9)
    ref = state_of(torch.zeros_like(m), v * 0.97)
    tw_triton.save(tw_triton.quantize_state_dict(ref, rules="exact"), tmp_path / "ref.tw", fsync=False)
    q = tw_triton.quantize_state_dict(state_of(m, v), rules=rules(v_codec="log2-temporal"), reference=ref)
    tw_triton.save(q, tmp_path / "delta.tw", fsync=False)
    out = tw_triton.load(tmp_path / "delta.tw", reference=str(tmp_path / "ref.tw"))
    want = tw_triton.dequantize_state_dict(q, reference=ref)
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(out["optimizer"]["state"][0][key], want["optimizer"]["state"][0][key])


def test_without_a_usable_partner_it_is_coded_blockwise_and_logged(caplog):
    m, v = moments(4096, 3)
    cases = {
        "missing": {"exp_avg": m},
        "shape": {"exp_avg": m, "exp_avg_sq": v[:-1]},
        "dtype": {"exp_avg": m, "exp_avg_sq": v.to(torch.bfloat16)},
    }
    for why, st_ in cases.items():
        state = {"optimizer": {"state": {0: st_}, "param_groups": [{"params": [0]}]}}
        with caplog.at_level(logging.WARNING, logger="tw_triton"):
            caplog.clear()
            q = tw_triton.quantize_state_dict(state, rules=rules())
        entry = q.entries[M]
        assert entry.codec == "blockwise", why
        assert entry.params == {"bits": 4, "block": 128, "packing": "lsb-first", "delta": False, "qmax": 3}
        assert "coded without a partner" in caplog.text and repr(M) in caplog.text, why
        plain = tw_triton.quantize_state_dict({"m": m}, rules=[("m", {"codec": "int3", "delta": False})])
        assert torch.equal(entry.buffers["codes"], plain.entries["m"].buffers["codes"]), why


def test_a_partner_named_by_the_rule_and_amsgrads_maximum_first():
    m, v = moments(4096, 4)
    q = tw_triton.quantize_state_dict(state_of(m, v, max_exp_avg_sq=v * 2), rules=rules())
    assert q.entries[M].params["partner"] == "optimizer/state/0/max_exp_avg_sq"
    q = tw_triton.quantize_state_dict(state_of(m, v, other=v * 2), rules=rules(partner_key="other"))
    assert q.entries[M].params["partner"] == "optimizer/state/0/other"
    out = tw_triton.dequantize_state_dict(q)["optimizer"]["state"][0]
    assert torch.equal(out["exp_avg"], oracle(q.entries[M], out["other"]))


@pytest.mark.parametrize("where", ["moment", "partner"])
def test_nan_or_inf_is_stored_exact_and_logged(caplog, where):
    m, v = moments(4096, 5)
    if where == "moment":
        m[7] = float("nan")
    else:
        v[9] = float("inf")  # the partner is stored exact (log2 refuses it), and so is m
    with caplog.at_level(logging.WARNING, logger="tw_triton"):
        q = tw_triton.quantize_state_dict(state_of(m, v), rules=rules())
    assert q.entries[M].codec == "exact" and "stored exact" in caplog.text
    out = tw_triton.dequantize_state_dict(q)["optimizer"]["state"][0]
    torch.testing.assert_close(out["exp_avg"], m, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [-1.0, float("-inf"), float("inf"), float("nan")])
def test_a_partner_value_that_is_negative_or_not_finite_under_an_exact_partner_is_stored_exact(caplog, bad):
    m, v = moments(4096, 6)
    v[3] = bad
    with caplog.at_level(logging.WARNING, logger="tw_triton"):
        q = tw_triton.quantize_state_dict(state_of(m, v), rules=rules(v_codec="exact"))
    assert q.entries[M].codec == "exact" and "stored exact" in caplog.text


def test_the_codec_needs_its_partner_to_encode_and_decode():
    codec = get_codec("blockwise-update")
    params = codec.resolve_params({"bits": 4}, bits=8, block=128)
    with pytest.raises(QuantizationError, match="partner"):
        codec.encode(torch.ones(128), params, None)
    m, v = moments(256, 7)
    q = tw_triton.quantize_state_dict(state_of(m, v), rules=rules())
    with pytest.raises(CheckpointError, match="without its partner"):
        codec.decode(q.entries[M], None, None, "here")


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"eps": 0.0}, "eps"),
        ({"eps": float("inf")}, "eps"),
        ({"eps": True}, "eps"),
        ({"bits": 5}, "bits"),
        ({"partner_key": "a/b"}, "partner_key"),
        ({"delta": True}, "no parameter"),
    ],
)
def test_bad_rule_params_are_refused(spec, match):
    with pytest.raises(QuantizationError, match=match):
        tw_triton.quantize_state_dict(
            {"m": torch.ones(64)}, rules=[("m", {"codec": "blockwise-update", **spec})]
        )


@pytest.mark.parametrize(
    "partner, match",
    [
        ("nope", "no entry there"),
        ("optimizer/state/0/step", "torch.float32 of shape \\(\\)"),
        (M, "coded with a partner itself"),
    ],
)
def test_a_recorded_partner_that_cannot_serve_is_refused(tmp_path, partner, match):
    m, v = moments(4096, 8)
    q = tw_triton.quantize_state_dict(state_of(m, v), rules=rules())
    q.entries[M].params = {**q.entries[M].params, "partner": partner}
    with pytest.raises(CheckpointError, match=match) as info:
        tw_triton.dequantize_state_dict(q)
    assert repr(M) in str(info.value) and "expected a float32 entry of shape (4096,)" in str(info.value)
    tw_triton.save(q, tmp_path / "bad.tw", fsync=False)
    with pytest.raises(CheckpointError, match=match):
        check_manifest(read_manifest(tmp_path / "bad.tw"), str(tmp_path / "bad.tw"))
    with pytest.raises(CheckpointError, match=match):
        tw_triton.load(tmp_path / "bad.tw")


def test_the_grouped_device_path_codes_what_the_host_path_codes(monkeypatch):
    """A device state's encode (grouped launches, forced on CPU tensors): the dependent
    entries stay out of the groups and are coded after the sync, to the host path's bytes;
    the first save's precompile launches their blockwise kernels instead of failing."""
    from tw_triton import kernel_variants
    from tw_triton.state import encode as state_encode

    m, v = moments(4096, 10)
    ref = state_of(torch.zeros_like(m), v * 1.02)
    spec = rules(v_codec="log2-temporal")
    host = tw_triton.quantize_state_dict(state_of(m, v), rules=spec, reference=ref)
    monkeypatch.setattr(state_encode, "groups_launches", lambda device: True)
    grouped = tw_triton.quantize_state_dict(state_of(m, v), rules=spec, reference=ref)
    assert list(grouped.entries) == list(host.entries)
    for path, e in host.entries.items():
        g = grouped.entries[path]
        assert (g.codec, g.params) == (e.codec, e.params), path
        assert all(torch.equal(g.buffers[k], b) for k, b in e.buffers.items()), path
    assert grouped.entries[M].codec == "blockwise-update"
    ran = kernel_variants.precompile_saves(
        state_of(m, v), spec, bits=8, block=128, delta_mode="closed", device=torch.device("cpu"), copy=True
    )
    assert ran >= 2


@pytest.mark.cuda
def test_a_cuda_state_codes_and_decodes_the_cpus_bytes_and_values():
    """The same correctly rounded ops and the blockwise kernel on a GPU: the CPU's codes,
    keyframe (log2 partner) and delta (log2-temporal partner), and the same decode."""
    m, v = moments(3 * 4096 + 100, 11)
    ref = state_of(torch.zeros_like(m), v * 1.03)
    spec = rules(v_codec="log2-temporal")
    cuda = {k: t.cuda() for k, t in ref["optimizer"]["state"][0].items()}
    ref_cuda = {"optimizer": {"state": {0: cuda}, "param_groups": [{"params": [0]}]}}
    for reference, reference_cuda in ((None, None), (ref, ref_cuda)):
        host = tw_triton.quantize_state_dict(state_of(m, v), rules=spec, reference=reference)
        dev = tw_triton.quantize_state_dict(
            state_of(m.cuda(), v.cuda()), rules=spec, reference=reference_cuda
        )
        for path, e in host.entries.items():
            g = dev.entries[path]
            assert (g.codec, g.params) == (e.codec, e.params), path
            assert all(torch.equal(g.buffers[k].cpu(), b) for k, b in e.buffers.items()), path
        a = tw_triton.dequantize_state_dict(host, reference=reference)
        b = tw_triton.dequantize_state_dict(dev, reference=reference_cuda, device="cuda")
        assert torch.equal(a["optimizer"]["state"][0]["exp_avg"], b["optimizer"]["state"][0]["exp_avg"].cpu())


def test_the_denominator_square_root_is_correctly_rounded_on_the_cpu() -> None:
    # torch's fp32 sqrt on a CPU may be 1 ulp off (3e38 is one such input); numpy's is IEEE,
    # the bits of CUDA's sqrt.rn that the grouped kernel uses.
    from tw_triton.codecs.blockwise_update import denominator

    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 0x7F800000, (200_000,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = torch.cat([bits.view(torch.float32), torch.tensor([3e38, 0.0, float("inf")])])
    want = torch.from_numpy(np.sqrt(x.numpy()) + np.float32(0.0))
    assert torch.equal(denominator(x, 0.0).view(torch.int32), want.view(torch.int32))


def test_a_device_load_decodes_in_groups_what_the_host_decodes_and_checks_alike(monkeypatch, tmp_path):
    """The grouped decode of the dependent entries (forced on CPU tensors, as a load to a
    GPU runs it): the host path's values, and the same refusal of a bad entry."""
    from tw_triton.state import decode as state_decode

    m, v = moments(4096 + 300, 12)
    m2, v2 = moments(700, 13, torch.bfloat16)
    st_ = state_of(m, v)
    st_["optimizer"]["state"][1] = {"exp_avg": m2, "exp_avg_sq": v2}
    q = tw_triton.quantize_state_dict(st_, rules=rules())
    tw_triton.save(q, tmp_path / "u.tw", fsync=False)
    host = tw_triton.load(tmp_path / "u.tw")["optimizer"]["state"]
    used = []
    real = state_decode.decode_grouped_with_partners
    monkeypatch.setattr(state_decode, "decode_grouped_with_partners", lambda *a: used.append(1) or real(*a))
    monkeypatch.setattr(state_decode, "groups_launches", lambda device: True)
    grouped = tw_triton.load(tmp_path / "u.tw")["optimizer"]["state"]
    assert used
    for i in (0, 1):
        a, b = host[i]["exp_avg"], grouped[i]["exp_avg"]
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), i
    q.entries[M].buffers["scales"] = q.entries[M].buffers["scales"][:-1]
    errors = []
    for forced in (True, False):
        monkeypatch.setattr(state_decode, "groups_launches", lambda device, f=forced: f)
        with pytest.raises(CheckpointError, match="scales") as info:
            tw_triton.dequantize_state_dict(q)
        errors.append(str(info.value))
    assert errors[0] == errors[1] and repr(M) in errors[0]


def test_a_fallback_repeated_at_every_save_warns_once_per_reason(caplog):
    m, v = moments(4096, 3)

    def fallback_records(state):
        with caplog.at_level(logging.DEBUG, logger="tw_triton"):
            caplog.clear()
            tw_triton.quantize_state_dict(
                {"optimizer": {"state": {0: state}, "param_groups": [{"params": [0]}]}}, rules=rules()
            )
        return [r for r in caplog.records if "coded without a partner" in r.getMessage()]

    first = fallback_records({"exp_avg": m})
    assert [r.levelno for r in first] == [logging.WARNING]
    assert "no partner entry in the state" in first[0].getMessage()
    assert [r.levelno for r in fallback_records({"exp_avg": m})] == [logging.DEBUG]
    other = fallback_records({"exp_avg": m, "exp_avg_sq": v.to(torch.bfloat16)})
    assert [r.levelno for r in other] == [logging.WARNING]
    assert "its partner is bfloat16, not float32" in other[0].getMessage()
