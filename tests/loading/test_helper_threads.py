"""Helper threads kept between calls: every item runs once, on the caller's thread and helpers, one intra-op thread
each; helpers serve the next call and exit once idle; a call never waits for a helper busy elsewhere; the first
error stops every thread; a forked child gets helpers of its own."""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref

import pytest
import torch

from szformat.loading import helper_threads
from szformat.loading.helper_threads import run_items


@pytest.fixture
def short_idle(monkeypatch):
    """Helpers that exit after 50 ms idle; none left from earlier tests."""
    _wait_for_no_helpers()
    monkeypatch.setattr(helper_threads, "IDLE_SECONDS", 0.05)
    yield
    _wait_for_no_helpers()


def _helpers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == helper_threads.THREAD_NAME]


def _wait_for_no_helpers(limit: float = 5.0) -> None:
    deadline = time.monotonic() + limit
    while _helpers():
        assert time.monotonic() < deadline, "helper threads did not exit"
        time.sleep(0.01)


def _threads_of(count: int, threads: int) -> list[threading.Thread]:
    """Run ``count`` items, the first ``threads`` of which wait until that many threads are inside one at once (so
    every thread asked for must take part); the thread of each item (objects: a new thread can reuse an old ident)."""
    inside = threading.Barrier(threads, timeout=5)
    ran: list[threading.Thread | None] = [None] * count
    times = [0] * count

    def item(i: int) -> None:
        ran[i] = threading.current_thread()
        times[i] += 1  # one writer per item, if each runs once
        if i < threads:
            inside.wait()

    run_items(count, item, threads)
    assert times == [1] * count
    return ran


def test_every_item_runs_once_on_every_thread_asked_for(short_idle) -> None:
    ran = _threads_of(40, 4)
    assert None not in ran and len(set(ran)) == 4
    assert threading.current_thread() in ran  # the caller's thread works too


def test_one_intra_op_thread_each_and_the_callers_setting_back(short_idle) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        seen: list[int] = []
        inside = threading.Barrier(3, timeout=5)
        run_items(3, lambda i: (seen.append(torch.get_num_threads()), inside.wait()), 3)
        assert seen == [1, 1, 1] and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_helpers_serve_the_next_call_and_exit_when_idle(short_idle, monkeypatch) -> None:
    monkeypatch.setattr(helper_threads, "IDLE_SECONDS", 1.0)  # a stalled test machine still finds them between calls
    first = set(_threads_of(8, 3)) - {threading.current_thread()}
    assert len(first) == 2
    second = set(_threads_of(8, 3)) - {threading.current_thread()}
    assert second == first  # no thread started for the second call
    _wait_for_no_helpers(limit=4.0)


def test_what_a_helper_cached_goes_with_it(short_idle) -> None:
    cache = threading.local()
    freed = threading.Event()

    class Scratch:
        pass

    def item(i: int) -> None:
        if threading.get_ident() != caller:
            cache.scratch = Scratch()
            weakref.finalize(cache.scratch, freed.set)
        inside.wait()

    caller, inside = threading.get_ident(), threading.Barrier(2, timeout=5)
    run_items(2, item, 2)
    _wait_for_no_helpers(limit=2.0)
    gc.collect()
    assert freed.wait(2.0)


def test_a_call_does_not_wait_for_helpers_busy_elsewhere(short_idle) -> None:
    release, busy = threading.Event(), threading.Event()

    def hold(i: int) -> None:  # the other call: its caller waits for its helper, which holds its item
        if threading.get_ident() == other_caller:
            busy.wait(5)
        else:
            busy.set()
            release.wait(10)

    def other() -> None:
        nonlocal other_caller
        other_caller = threading.get_ident()
        run_items(2, hold, 2)

    other_caller = None
    thread = threading.Thread(target=other)
    thread.start()
    try:
        assert busy.wait(5)
        began = time.monotonic()
        ran = _threads_of_alone(20, 2)
        assert time.monotonic() - began < 1.0 and set(ran) == {threading.get_ident()}
    finally:
        release.set()
        thread.join(10)


def _threads_of_alone(count: int, threads: int) -> list[int]:
    ran: list[int] = []
    run_items(count, lambda i: ran.append(threading.get_ident()), threads)
    return ran


@pytest.mark.parametrize("count, threads", [(1, 4), (5, 1), (0, 3)])
def test_a_call_with_nothing_to_share_runs_on_the_callers_thread(short_idle, count, threads) -> None:
    """One item, or one thread: the items run in order on the caller's thread on one intra-op thread, no helper is
    started, the caller's setting comes back, and an item's error is raised after the items before it ran."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        seen: list[tuple[int, int, int]] = []
        run_items(count, lambda i: seen.append((i, threading.get_ident(), torch.get_num_threads())), threads)
        assert seen == [(i, threading.get_ident(), 1) for i in range(count)] and not _helpers()
        assert torch.get_num_threads() == 3
        if count > 1:
            ran: list[int] = []

            def failing(i: int) -> None:
                ran.append(i)
                if i == 1:
                    raise KeyError(i)

            with pytest.raises(KeyError):
                run_items(count, failing, threads)
            assert ran == [0, 1] and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_the_first_error_stops_every_thread_and_is_raised(short_idle) -> None:
    started: list[int] = []
    lock = threading.Lock()

    def item(i: int) -> None:
        with lock:
            started.append(i)
        if i == 5:
            raise MemoryError("item 5")
        time.sleep(0.002)

    with pytest.raises(MemoryError, match="item 5"):
        run_items(1000, item, 3)
    count = len(started)
    assert count < 20  # the others stopped after their item
    time.sleep(0.05)
    assert len(started) == count  # nothing ran after the call returned


def test_an_interrupted_wait_stops_the_helpers(short_idle, monkeypatch) -> None:
    started: list[int] = []
    inside = threading.Event()

    def item(i: int) -> None:
        started.append(i)
        if threading.current_thread() is threading.main_thread():
            inside.wait(5)  # the caller's one item: it then waits for the helper, which is inside one
        else:
            inside.set()
            time.sleep(0.01)

    class Interrupted(threading.Condition):
        def wait(self, timeout=None):
            raise KeyboardInterrupt

    class Call(helper_threads._Call):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            self.left = Interrupted(self.lock)

        def work(self) -> None:
            if threading.current_thread() is threading.main_thread():
                with self.lock:
                    self.next += 1
                self.run_item(0)
            else:
                super().work()

    monkeypatch.setattr(helper_threads, "_Call", Call)
    with pytest.raises(KeyboardInterrupt):
        run_items(1000, item, 2)
    time.sleep(0.05)
    count = len(started)
    time.sleep(0.1)
    assert len(started) == count < 10  # the helper stopped after its item


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_gets_helpers_of_its_own(short_idle) -> None:
    _threads_of(8, 2)  # helpers alive in the parent as it forks
    pid = os.fork()
    if pid == 0:  # the child: exits 0 only if two threads took part
        code = 1
        try:
            code = 0 if len(set(_threads_of(8, 2))) == 2 else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
