"""shardpoint._pipeline.pipelined: the batches of a load to the device with several core loads in
flight (docs/GPU.md). No GPU needed: the steps here are plain functions."""

from __future__ import annotations

import threading
import time

import pytest

from shardpoint._pipeline import pipelined


class Recorder:
    """Steps whose run sleeps a little, recording what ran where and how many ran at once."""

    def __init__(self, fail_prepare: int = -1, fail_run: int = -1, fail_complete: int = -1) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple] = []
        self.running = 0
        self.most = 0
        self.lane_busy: dict[int, int] = {}
        self.main = threading.get_ident()
        self.fail = (fail_prepare, fail_run, fail_complete)

    def prepare(self, i: int, lane: int) -> tuple:
        assert threading.get_ident() == self.main
        with self.lock:
            self.events.append(("prepare", i, lane))
        if i == self.fail[0]:
            raise ValueError(f"prepare {i}")
        return (i, lane)

    def run(self, lane: int, prepared: tuple) -> str:
        i = prepared[0]
        assert lane == prepared[1]
        with self.lock:
            assert self.lane_busy.get(lane, 0) == 0, "two runs on one lane"
            self.lane_busy[lane] = 1
            self.running += 1
            self.most = max(self.most, self.running)
            self.events.append(("run", i, threading.get_ident() == self.main))
        time.sleep(0.02 + 0.01 * (i % 3))
        with self.lock:
            self.running -= 1
            self.lane_busy[lane] = 0
            self.events.append(("ran", i))
        if i == self.fail[1]:
            raise RuntimeError(f"run {i}")
        return f"result {i}"

    def complete(self, i: int, prepared: tuple, result: str) -> None:
        assert threading.get_ident() == self.main
        assert prepared[0] == i and result == f"result {i}"
        with self.lock:
            self.events.append(("complete", i))
        if i == self.fail[2]:
            raise KeyError(f"complete {i}")

    def of(self, kind: str) -> list[int]:
        return [e[1] for e in self.events if e[0] == kind]


@pytest.mark.parametrize("count", [1, 2, 3, 8])
def test_two_lanes_keep_two_runs_in_flight_and_complete_in_order(count):
    r = Recorder()
    pipelined(count, 2, r.prepare, r.run, r.complete)
    assert r.of("complete") == list(range(count))
    assert r.of("prepare") == list(range(count))
    assert [e[2] for e in r.events if e[0] == "prepare"] == [i % 2 for i in range(count)]
    assert r.most == min(2, count)
    runs_off_main = [e[2] for e in r.events if e[0] == "run"]
    assert runs_off_main == [count == 1] * count  # one step runs on the calling thread
    # A lane's next step is prepared only after its previous one completed.
    for i in range(2, count):
        assert r.events.index(("complete", i - 2)) < r.events.index(("prepare", i, i % 2))


def test_one_lane_runs_each_step_on_the_calling_thread_one_after_the_other():
    r = Recorder()
    pipelined(5, 1, r.prepare, r.run, r.complete)
    assert r.most == 1
    assert all(e[2] for e in r.events if e[0] == "run")
    kinds = [e[0] for e in r.events]
    assert kinds == ["prepare", "run", "ran", "complete"] * 5


@pytest.mark.parametrize("where, error, match", [
    ("prepare", ValueError, "prepare 3"),
    ("run", RuntimeError, "run 2"),
    ("complete", KeyError, "complete 2"),
])
def test_the_first_error_is_raised_once_the_runs_in_flight_returned(where, error, match):
    fails = {"prepare": dict(fail_prepare=3), "run": dict(fail_run=2), "complete": dict(fail_complete=2)}[where]
    r = Recorder(**fails)
    with pytest.raises(error, match=match):
        pipelined(8, 2, r.prepare, r.run, r.complete)
    assert r.running == 0  # nothing still running when the error reached the caller
    assert len(r.of("run")) == len(r.of("ran"))
    completed = r.of("complete")
    assert completed == list(range(len(completed)))  # in order, none after the failed step
    assert max(r.of("prepare")) <= 4  # steps after the error are not started
    assert not [t for t in threading.enumerate() if t.name.startswith("shardpoint-load-")]


def test_a_run_that_fails_while_the_next_one_runs_leaves_no_thread_behind():
    r = Recorder(fail_run=0)
    with pytest.raises(RuntimeError, match="run 0"):
        pipelined(2, 2, r.prepare, r.run, r.complete)
    assert r.of("ran") == [0, 1] or sorted(r.of("ran")) == [0, 1]
    assert r.of("complete") == []
    assert not [t for t in threading.enumerate() if t.name.startswith("shardpoint-load-")]
