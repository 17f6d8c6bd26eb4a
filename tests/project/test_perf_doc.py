"""docs/performance.md's generated tables: what they say, and that the page holds the results."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.append(str(BENCH))

from harness import perf_doc  # noqa: E402

RESULTS = BENCH / "results"


def _load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def _block(page: str, name: str) -> str:
    start, end = perf_doc.marker(name)
    return page[page.index(start) + len(start) : page.index(end)].strip("\n")


def test_the_page_holds_the_tables_of_the_stored_results():
    """Fails when a result file changed and `make_results.py --no-run` was not run."""
    page = (REPO / "docs" / "performance.md").read_text()
    speed, codec = _load("speed_compare"), _load("codec_cpu")
    assert _block(page, "speed-headline") == perf_doc.speed_headline(speed)
    assert _block(page, "speed-goals") == perf_doc.goals_table(speed, codec)
    assert _block(page, "codec-cpu") == perf_doc.codec_table(codec)
    assert _block(page, "optimizer-goals") == perf_doc.optimizer_goals(_load("optimizers"))
    readme = (REPO / "README.md").read_text()
    optimizers_md = (RESULTS / "optimizers.md").read_text()
    assert _block(readme, "optimizers-table") == perf_doc.results_table(optimizers_md)


def test_the_optimizer_goals_count_only_optimizers_with_a_moment():
    result = copy.deepcopy(_load("optimizers"))
    assert not perf_doc.has_moment("ASGD") and not perf_doc.has_moment("LBFGS")
    assert perf_doc.has_moment("Adafactor") and perf_doc.has_moment("SGD")
    for r in result["rows"]:
        r["delta_ratio"], r["keyframe_ratio"], r["restored_weight_error"] = 9.0, 2.0, 0.001
    text = perf_doc.optimizer_goals(result)
    assert "9.0-9.0x for 12 of 12 | yes |" in text and text.count("| yes |") == 4
    next(r for r in result["rows"] if r["optimizer"] == "SGD")["delta_ratio"] = 7.5
    next(r for r in result["rows"] if r["optimizer"] == "ASGD")["delta_ratio"] = 1.0  # keeps no moment
    assert "for 11 of 12; SGD 7.50x | no |" in perf_doc.optimizer_goals(result)


def test_the_headline_reads_each_ratio_from_its_row():
    speed = copy.deepcopy(_load("speed_compare"))
    for r in speed["save_rows"]:
        if r["method"] == "tw default keyframe":
            r["blocked_vs_torch_save"], r["size_vs_torch_save"] = 0.123, 3.21
    for r in speed["load_rows"]:
        if r["method"] == "tw default delta":
            r["load_peak_extra_bytes"] = speed["state"]["state_bytes"] * 1.5
    text = perf_doc.speed_headline(speed)
    keyframe = next(line for line in text.splitlines() if line.startswith("| keyframe, first save"))
    assert keyframe.startswith("| keyframe, first save (3.21x smaller) | **0.12x** |")
    delta = next(line for line in text.splitlines() if line.startswith("| delta, first after"))
    assert delta.endswith("| 1.50x |")


def test_the_goals_verdicts_follow_the_numbers():
    speed, codec = copy.deepcopy(_load("speed_compare")), copy.deepcopy(_load("codec_cpu"))

    def verdict(goal_prefix: str) -> str:
        table = perf_doc.goals_table(speed, codec)
        row = next(line for line in table.splitlines() if line.startswith("| " + goal_prefix))
        return row.rsplit("|", 2)[1].strip()

    for r in speed["save_rows"]:
        r["blocked_vs_torch_save"] = 0.1
        r["total_vs_torch_save"] = 0.9
    for r in speed["load_rows"]:
        r["load_vs_torch_load"] = 0.9
        r["load_peak_extra_bytes"] = 1.0
    for r in speed["resume_rows"]:
        r["resume_vs_torch"] = 0.9
    for r in codec["cpu"]:
        r["encode_over_copy"] = r["decode_over_copy"] = 0.7
    assert [verdict(g) for g in ("`save()`", "total", "load at", "codec", "load peak")] == ["yes"] * 5

    first = next(r for r in speed["save_rows"] if r["method"] == "tw default keyframe")
    first["blocked_vs_torch_save"] = 0.3
    assert verdict("`save()`") == "not for a first keyframe without `prepare`"
    next(r for r in codec["cpu"] if r["dtype"] == "bfloat16")["encode_over_copy"] = 0.2
    assert verdict("codec") == "not for bf16 input"
    for r in codec["cpu"]:
        r["decode_over_copy"] = 0.1
    assert verdict("codec") == "no"
    next(r for r in speed["resume_rows"] if "delta" in r["method"])["resume_vs_torch"] = 1.4
    assert verdict("load at") == "not for a delta's resume"


def test_replace_between_names_the_page_and_markers_when_they_are_missing(tmp_path):
    page = tmp_path / "p.md"
    start, end = perf_doc.marker("x")
    page.write_text(f"a\n{start}\nold\n{end}\nb\n")
    assert perf_doc.replace_between(page, "x", "new") is True
    assert page.read_text() == f"a\n{start}\nnew\n{end}\nb\n"
    assert perf_doc.replace_between(page, "x", "new") is False
    with pytest.raises(ValueError, match=r"p\.md: markers .*y:start"):
        perf_doc.replace_between(page, "y", "z")
