"""parallel_map and the CPU worker threads: order, errors, and bytes that do not depend on
the thread count."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import tw_triton
from tw_triton import format as fmt
from tw_triton.errors import TwTritonError
from tw_triton.parallel import ENV_THREADS, MIN_PARALLEL_SIZE, Background, cpu_threads, parallel_map


def test_results_come_back_in_item_order_whatever_finishes_first():
    # The first item sleeps longest: on workers it finishes last, yet its result is first.
    items = [0.05, 0.0, 0.02, 0.0]
    out = parallel_map(lambda s: (time.sleep(s), s)[1], items, sizes=[MIN_PARALLEL_SIZE] * 4, threads=4)
    assert out == items


def test_large_items_run_on_workers_small_ones_on_the_caller():
    names: dict[int, str] = {}

    def record(i: int) -> int:
        names[i] = threading.current_thread().name
        return i

    sizes = [MIN_PARALLEL_SIZE, 10, MIN_PARALLEL_SIZE * 4, 0]
    assert parallel_map(record, [0, 1, 2, 3], sizes=sizes, threads=2) == [0, 1, 2, 3]
    caller = threading.current_thread().name
    assert names[1] == names[3] == caller
    assert names[0].startswith("tw_triton-cpu") and names[2].startswith("tw_triton-cpu")


def test_one_thread_runs_everything_on_the_caller_in_order():
    seen: list[int] = []
    caller = threading.current_thread().name

    def record(i: int) -> str:
        seen.append(i)
        return threading.current_thread().name

    out = parallel_map(record, [3, 1, 2], sizes=[MIN_PARALLEL_SIZE] * 3, threads=1)
    assert seen == [3, 1, 2] and set(out) == {caller}


def test_the_first_failing_item_in_order_is_raised():
    def fn(i: int) -> int:
        if i == 1:
            time.sleep(0.05)  # fails late, but comes first in order
            raise ValueError("item 1")
        if i == 2:
            raise KeyError("item 2")
        return i

    with pytest.raises(ValueError, match="item 1"):
        parallel_map(fn, [0, 1, 2, 3], sizes=[MIN_PARALLEL_SIZE] * 4, threads=3)


def test_a_failing_small_item_stops_the_small_ones_after_it_and_is_raised_in_order():
    ran: list[int] = []
    done: list[int] = []

    def fn(i: int) -> int:
        ran.append(i)
        if i == 2:
            raise KeyError("small item 2")
        return i

    sizes = [MIN_PARALLEL_SIZE, 0, 0, 0, MIN_PARALLEL_SIZE]
    with pytest.raises(KeyError, match="small item 2"):
        parallel_map(fn, list(range(5)), sizes=sizes, threads=2, done=done.append)
    assert 3 not in ran  # the small item after the failure never started
    # Progress up to the failing item, in order; the large item 0 counts if it had started
    # before the failure cancelled it.
    assert done == [i for i in (0, 1) if i in ran]


def test_a_large_item_failing_before_a_failing_small_one_is_the_one_raised():
    started = threading.Event()

    def fn(i: int) -> int:
        if i == 0:
            started.set()
            time.sleep(0.05)  # fails after the small item has failed, but comes first
            raise ValueError("large item 0")
        if i == 1:
            assert started.wait(timeout=5)  # item 0 runs: the failure cannot cancel it
            raise KeyError("small item 1")
        return i

    with pytest.raises(ValueError, match="large item 0"):
        parallel_map(fn, [0, 1, 2], sizes=[MIN_PARALLEL_SIZE, 0, MIN_PARALLEL_SIZE], threads=2)


def test_no_item_is_still_running_when_a_call_raises():
    finished: list[int] = []

    def fn(i: int) -> int:
        if i == 0:
            raise ValueError("item 0")
        time.sleep(0.05)
        finished.append(i)
        return i

    with pytest.raises(ValueError, match="item 0"):
        parallel_map(fn, [0, 1, 2], sizes=[MIN_PARALLEL_SIZE] * 3, threads=3)
    seen = list(finished)
    time.sleep(0.1)
    assert finished == seen  # nothing finished after the call had raised


def test_done_is_called_on_the_caller_in_order():
    calls: list[tuple[int, str]] = []
    parallel_map(
        lambda s: time.sleep(s),
        [0.03, 0.0, 0.01],
        sizes=[MIN_PARALLEL_SIZE] * 3,
        threads=3,
        done=lambda i: calls.append((i, threading.current_thread().name)),
    )
    assert [i for i, _ in calls] == [0, 1, 2]
    assert {n for _, n in calls} == {threading.current_thread().name}


def test_thread_count_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(ENV_THREADS, "3")
    assert cpu_threads() == 3
    monkeypatch.delenv(ENV_THREADS)
    assert 1 <= cpu_threads() <= 8
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv(ENV_THREADS, bad)
        with pytest.raises(TwTritonError, match=ENV_THREADS):
            cpu_threads()


def _state() -> dict:
    g = torch.Generator().manual_seed(5)
    # Large enough that entries, stages and reads go to the workers.
    model = {f"layer{i}.weight": torch.randn(256, 512, generator=g) for i in range(4)}
    exp_avg = {
        f"{i}": {
            "exp_avg": torch.randn(256, 512, generator=g) * 1e-3,
            "exp_avg_sq": torch.rand(256, 512, generator=g) * 1e-6,
        }
        for i in range(4)
    }
    return {"model": model, "optimizer": {"state": exp_avg}}


@pytest.mark.parametrize("rules", ["exact", "smallest"])
def test_file_bytes_do_not_depend_on_the_thread_count(tmp_path, monkeypatch, rules):
    state = _state()
    files = []
    for threads in ("1", "4"):
        monkeypatch.setenv(ENV_THREADS, threads)
        q = tw_triton.quantize_state_dict(state, rules=rules, checkpoint_id="same-id")
        path = tmp_path / f"t{threads}.tw"
        fmt.write_file(q, path, fsync=False)
        files.append(path.read_bytes())
        back = tw_triton.load(path)
        monkeypatch.setenv(ENV_THREADS, "1")
        assert all(
            torch.equal(a, b)
            for a, b in zip(
                tw_triton.tree.flatten(back)[0].values(),
                tw_triton.tree.flatten(tw_triton.load(path))[0].values(),
            )
        )
    assert files[0] == files[1]


def test_a_corrupt_buffer_is_named_when_read_on_workers(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_THREADS, "4")
    path = tmp_path / "a.tw"
    fmt.write_file(tw_triton.quantize_state_dict(_state(), rules="exact"), path, fsync=False)
    manifest = fmt.read_manifest(path)
    buf = manifest["entries"]["model/layer2.weight"]["buffers"]["data"]
    raw = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(raw[:8], "little")
    at = header + buf["data_offsets"][0] + 1000
    raw[at] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(
        tw_triton.CheckpointError, match="entry 'model/layer2.weight' buffer 'data'.*checksum"
    ):
        tw_triton.load(path)
    with pytest.raises(
        tw_triton.CheckpointError, match="entry 'model/layer2.weight' buffer 'data'.*checksum"
    ):
        fmt.verify_file(path)


def test_workers_run_torch_ops_on_one_intraop_thread_and_the_default_comes_back():
    """Workers times torch's intra-op threads would oversubscribe the cores; the count a
    thread inherits when it first runs a torch op must be what it was before the call."""

    before = torch.get_num_threads()
    torch.set_num_threads(3)  # not the machine's default, so a leak of 1 shows either way
    try:
        inherited = _intraop_in_a_new_thread()
        assert inherited == 3
        seen = parallel_map(
            lambda _: torch.get_num_threads(), [0, 1, 2], sizes=[MIN_PARALLEL_SIZE] * 3, threads=2
        )
        assert seen == [1, 1, 1]
        assert torch.get_num_threads() == 3
        assert _intraop_in_a_new_thread() == 3
        # Also when an item raises.
        with pytest.raises(ValueError):
            parallel_map(
                lambda _: (_ for _ in ()).throw(ValueError("x")),
                [0, 1],
                sizes=[MIN_PARALLEL_SIZE] * 2,
                threads=2,
            )
        assert _intraop_in_a_new_thread() == 3
    finally:
        torch.set_num_threads(before)


def _intraop_in_a_new_thread() -> int:
    box: list[int] = []
    t = threading.Thread(target=lambda: box.append(torch.get_num_threads()))
    t.start()
    t.join()
    return box[0]


def test_background_runs_on_another_thread_and_returns_its_value():
    caller = threading.get_ident()
    job = Background(lambda: (threading.get_ident(), threading.current_thread().name), name="tw_triton-test")
    ident, name = job.result()
    assert ident != caller and name == "tw_triton-test"


def test_background_raises_its_error_from_result_and_wait_drops_it():
    def fail() -> None:
        raise tw_triton.CheckpointError("the reference is bad")

    job = Background(fail)
    with pytest.raises(tw_triton.CheckpointError, match="the reference is bad"):
        job.result()
    waiting = Background(fail)
    waiting.wait()  # the caller's own error is the one it reports
    assert not waiting._thread.is_alive()


def test_background_puts_back_the_callers_intraop_default():
    """A background side whose pool finished last leaves the workers' 1 as the default a
    new thread inherits; result() and wait() put the caller's back."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        for finish in ("result", "wait"):
            job = Background(lambda: torch.set_num_threads(1))
            getattr(job, finish)()
            assert _intraop_in_a_new_thread() == 3
    finally:
        torch.set_num_threads(before)
