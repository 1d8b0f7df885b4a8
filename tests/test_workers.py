"""workers.beside: a second stage in a forked worker, results in order, errors as raised."""

from __future__ import annotations

import os

import pytest

from slotscope.errors import SlotscopeError
from slotscope.workers import beside


def _scaled(shared: dict[str, int], item: int) -> tuple[int, int]:
    if item < 0:
        raise ValueError(f"negative item {item}")
    return item * shared["factor"], os.getpid()


@pytest.mark.parametrize("workers", [0, 1, 2, 3])
def test_results_in_order_with_the_shared_state(workers: int) -> None:
    out = list(beside(_scaled, {"factor": 3}, iter(range(7)), workers))
    assert [v for v, _ in out] == [3 * i for i in range(7)]
    pids = {pid for _, pid in out}
    assert (pids == {os.getpid()}) if workers == 0 else (os.getpid() not in pids and len(pids) == workers)


def test_an_error_in_the_worker_is_raised_here_after_the_results_before_it() -> None:
    got = []
    with pytest.raises(ValueError, match="negative item -1"):
        for v, _ in beside(_scaled, {"factor": 2}, [1, 2, -1, 4], 2):
            got.append(v)
    assert got == [2, 4]


def _dies(shared: object, item: int) -> int:
    if item == 1:
        os._exit(3)
    return item


def test_a_worker_that_dies_is_one_message() -> None:
    with pytest.raises(SlotscopeError, match="worker process died"):
        list(beside(_dies, None, [0, 1, 2], 2))


def test_no_items_start_no_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    import multiprocessing.context

    started = []
    monkeypatch.setattr(multiprocessing.context.ForkProcess, "start", lambda self: started.append(self))
    assert list(beside(_scaled, {"factor": 1}, [], 2)) == []
    assert not started


def test_the_worker_ends_when_the_items_do() -> None:
    import time

    t = time.perf_counter()
    assert [v for v, _ in beside(_scaled, {"factor": 1}, [5], 2)] == [5]
    assert time.perf_counter() - t < 2  # (not the join's time-out: the worker saw its pipe close)
