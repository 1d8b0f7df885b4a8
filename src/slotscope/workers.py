"""Work spread over the machine's cores, results handed back in input order.

The server-log parser reads each block of lines independently of the others (only session
numbering and task assembly need the blocks in order, and those stay in the calling
process), so blocks are parsed by worker processes while the caller assembles the results
of earlier blocks. At most two items per worker are in flight: memory stays bounded by a
few blocks whatever the input size.

:func:`beside` runs the later stages of work the same way, in order: the busy periods'
answers (each worker reads its own part), and what the what-if replay made (one loop that
cannot be cut, but measuring each stretch it replayed can run beside it).

Workers are forked (Linux, macOS with fork available), so they start in milliseconds with
every module already imported. Where forking is not available, or one core is all there is,
the work runs in the calling process instead; the results are the same either way.
"""

from __future__ import annotations

import os
import pickle
import signal
import traceback
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, TypeVar

from .errors import SlotscopeError

if TYPE_CHECKING:
    from concurrent.futures import Future, ProcessPoolExecutor

# (multiprocessing is imported when workers start: a log of one block never needs it)

T = TypeVar("T")
R = TypeVar("R")

ENV = "SLOTSCOPE_JOBS"


def default_jobs() -> int:
    """Worker processes to use: ``$SLOTSCOPE_JOBS`` if set, else the usable CPUs (at most 8)."""
    env = os.environ.get(ENV, "").strip()
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise SlotscopeError(None, None, f"{ENV}={env!r} is not a number of jobs") from None
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 8))


def _worker_start() -> None:
    """Keep freed block-sized arrays in the worker's heap (glibc): each block allocates and
    frees the same large arrays, and handing them back to the kernel every time costs the
    parse its page faults again. Elsewhere: nothing."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD: arrays up to 64 MB from the heap
        libc.mallopt(-1, 128 << 20)  # M_TRIM_THRESHOLD: keep up to 128 MB of free heap
    except (OSError, AttributeError):
        pass


class Pool:
    """Ordered map over worker processes (or in this process when ``jobs`` is 1).

    Use as a context manager; the workers are started on first use and stopped on exit.
    """

    def __init__(self, jobs: int | None = None) -> None:
        self.jobs = default_jobs() if jobs is None else max(1, jobs)
        self._executor: ProcessPoolExecutor | None = None

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def _start(self) -> ProcessPoolExecutor | None:
        if self.jobs < 2:
            return None
        if self._executor is None:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            try:
                ctx = multiprocessing.get_context("fork")
                self._executor = ProcessPoolExecutor(max_workers=self.jobs, mp_context=ctx, initializer=_worker_start)
            except (ValueError, OSError, NotImplementedError):  # no fork here: one process
                self.jobs = 1
                return None
        return self._executor

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
        """``fn(item)`` for each item, in order; at most 2 × jobs in flight.

        ``fn`` must be a module-level function (workers find it by name). An exception raised
        by ``fn`` is raised here, when its item's turn comes; one raised by ``items`` after the
        results of the items it gave before (as the one-process ``map`` would).
        """
        it = iter(items)
        pending: deque[Future[R]] = deque()
        failure: Exception | None = None
        try:
            while True:
                try:
                    item = next(it)
                except StopIteration:
                    break
                except Exception as e:  # the input failed (a damaged .gz): what it gave before comes first
                    failure = e
                    break
                executor = self._start()  # (at the first item: no work, no workers started)
                if executor is None:
                    yield fn(item)
                    continue
                pending.append(executor.submit(fn, item))
                if len(pending) >= 2 * self.jobs:
                    yield _result(pending.popleft())
            while pending:
                yield _result(pending.popleft())
        finally:
            for f in pending:
                f.cancel()
        if failure is not None:
            raise failure


def _result(f: "Future[R]") -> R:
    from concurrent.futures.process import BrokenProcessPool

    try:
        return f.result()
    except BrokenProcessPool:
        raise _died() from None


def _died() -> SlotscopeError:
    return SlotscopeError(None, None, f"a worker process died (out of memory?); try again with fewer workers: {ENV}=1")


def workers_for(items: int, most: int | None = None) -> int:
    """Worker processes for :func:`beside` over ``items`` items: one per CPU (:func:`default_jobs`),
    at most ``items`` and ``most``; none where there is one CPU or one item."""
    jobs = default_jobs()
    return 0 if jobs < 2 or items < 2 else min(jobs, items, jobs if most is None else most)


def beside(fn: Callable[[Any, T], R], shared: Any, items: Iterable[T], workers: int = 1) -> Iterator[R]:
    """``fn(shared, item)`` for each item, in order, in ``workers`` worker processes (taking the
    items in turn) while this one makes the next items; in this process where ``workers`` is 0
    or forking is not available. One worker makes a pipeline of two stages (``items`` the
    first, ``fn`` the second); more share out a map whose items cost nothing to make.

    The workers are forked with ``shared``, so it is never pickled: large read-only state
    costs nothing to hand over. Items and results cross pipes in the calling thread (an
    executor's threads would pickle them in malloc arenas of their own, which keep what they
    once held), and a worker is sent an item only once it has given back the one before: the
    two sides never wait on each other's sends.
    """
    ctx = None
    if workers >= 1:
        import multiprocessing

        try:
            ctx = multiprocessing.get_context("fork")
        except ValueError:
            pass
    if ctx is None:
        for item in items:
            yield fn(shared, item)
        return
    ends: list[Any] = []
    procs: list[Any] = []
    pending: deque[int] = deque()  # the workers holding an item, oldest item first
    done = False
    try:
        for k, item in enumerate(items):
            if not procs:
                for _ in range(workers):
                    here, there = ctx.Pipe()
                    ends.append(here)
                    # (not a daemon: a worker may start workers of its own; it ends when its
                    # pipe closes, with this process if need be)
                    proc = ctx.Process(target=_serve, args=(there, ends, fn, shared))
                    proc.start()
                    procs.append(proc)
                    there.close()
            j = k % workers
            # (all busy: each has one, the oldest worker j's, taken back before j is sent the next)
            result = [_received(ends[pending.popleft()])] if len(pending) == workers else []
            ends[j].send(item)
            pending.append(j)
            yield from result
        while pending:
            yield _received(ends[pending.popleft()])
        done = True
    finally:
        for conn in ends:
            conn.close()
        for proc in procs:
            if not done:  # (stopped early, by an error or Ctrl-C: what the workers do is not wanted)
                proc.terminate()
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
                proc.join()


def _serve(conn: Any, callers: list[Any], fn: Callable[[Any, T], R], shared: Any) -> None:
    """:func:`beside`'s worker: an item at a time, its result or the exception it raised sent
    back, until the caller closes its end (``callers``: the caller's ends, which this fork
    holds copies of: closed, so that the caller's closing is seen)."""
    for end in callers:
        end.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (Ctrl-C is the caller's to handle: it closes the pipe)
    while True:
        try:
            item = conn.recv()
        except (EOFError, ConnectionResetError):  # (the caller is done, or gone)
            return
        try:
            reply: tuple[bool, Any] = (True, fn(shared, item))
        except Exception as e:
            e.add_note("(raised in a worker process:)\n" + "".join(traceback.format_tb(e.__traceback__)))
            reply = (False, e)
        try:
            conn.send(reply)
        except (BrokenPipeError, ConnectionResetError):  # (the caller stopped, say on Ctrl-C)
            return
        except (pickle.PicklingError, TypeError, AttributeError) as e:  # (what cannot cross the pipe is said)
            conn.send((False, RuntimeError(f"a worker's result could not be handed back: {type(e).__name__}: {e}")))


def _received(conn: Any) -> Any:
    try:
        ok, value = conn.recv()
    except EOFError:
        raise _died() from None
    if not ok:
        raise value
    return value
