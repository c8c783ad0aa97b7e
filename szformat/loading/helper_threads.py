"""Threads that help a caller through a list of work items, kept between calls for a moment.

A CPU decode runs its ranges on the caller's thread and ``threads - 1`` helpers. Helpers started and joined per
call cost 0.2 ms for 3 and 1.2 ms for 16 on the H200 host, 0.5 ms each on a 2-core VM, and the memory a new thread
works in was faulted in again every time (a MiniLM load on 16 threads: 4,500 page faults and 16-20 ms, against 216
and 11-13 ms with helpers kept; ``bench/RESULTS.md``, run 115), once per load and once per window of a tensor
``verify`` decodes in windows (two per 117 MB tensor on 16 threads, fourteen on 2). Here a helper waits
:data:`IDLE_SECONDS` for the next call once it is done, then exits, so what it cached for itself (a scratch buffer, a
zstd context) goes with it, as it did when every call started its own: a load followed by inference keeps nothing.

A call never waits for a helper that has not joined it: if every helper is busy with another call, the caller
works through its items alone, and a helper that gets to the call once it is over finds nothing left to take.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Callable

from ..codec.cpu import one_intra_op_thread

__all__ = ["IDLE_SECONDS", "run_items"]

IDLE_SECONDS = 1.0
"""How long a helper waits for another call before it exits: longer than the gap between a load's calls (windows,
groups, shards), shorter than a user notices a process holding threads it no longer uses."""

THREAD_NAME = "szformat-decode"


class _Call:
    """One call's items, taken in order by the caller and the helpers that join, until none is left or one fails."""

    def __init__(self, count: int, run_item: Callable[[int], None]):
        self.count = count
        self.run_item = run_item
        self.lock = threading.Lock()
        self.left = threading.Condition(self.lock)  # notified as helpers leave
        self.next = 0
        self.errors: list[BaseException] = []
        self.helping = 0

    def help(self) -> None:
        """A helper's part: join, work, leave (a helper that joins once the caller is done finds nothing to take)."""
        with self.lock:
            self.helping += 1
        try:
            self.work()
        finally:
            with self.lock:
                self.helping -= 1
                self.left.notify_all()

    def work(self) -> None:
        """Take the next item until none is left or any thread has failed; an error is kept for the caller."""
        try:
            with one_intra_op_thread():
                while True:
                    with self.lock:
                        if self.errors or self.next >= self.count:
                            return
                        item = self.next
                        self.next += 1
                    self.run_item(item)
        except BaseException as e:  # noqa: BLE001 - handed to the caller, which raises it
            with self.lock:
                self.errors.append(e)

    def end(self) -> None:
        """Wait for the helpers inside the call to finish their item (the caller has taken the last)."""
        with self.lock:
            try:
                while self.helping:
                    self.left.wait()
            except BaseException as e:  # interrupted: the helpers stop after their item, as after an error
                self.errors.append(e)
                raise


class _Helpers:
    """The helper threads of this process and the calls waiting for them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waiting: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.alive = 0

    def offer(self, call: _Call, helpers: int) -> None:
        """Ask ``helpers`` helpers to join ``call``, starting threads until that many are alive."""
        with self.lock:
            for _ in range(helpers):
                self.waiting.put(call.help)
            for _ in range(helpers - self.alive):
                threading.Thread(target=self._serve, name=THREAD_NAME, daemon=True).start()
                self.alive += 1

    def _serve(self) -> None:
        while True:
            try:
                task = self.waiting.get(timeout=IDLE_SECONDS)
            except queue.Empty:
                with self.lock:  # offer() holds it while it counts on this thread: exit only with nothing queued
                    if self.waiting.empty():
                        self.alive -= 1
                        return
                continue
            task()


_helpers = _Helpers()


def _forget_helpers() -> None:
    """In a forked child: the parent's helpers do not exist there."""
    global _helpers
    _helpers = _Helpers()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_helpers)


def run_items(count: int, run_item: Callable[[int], None], threads: int) -> None:
    """Call ``run_item(i)`` for every ``i`` in ``range(count)``, in order of start, on the caller's thread and up to
    ``threads - 1`` helpers, each on one intra-op thread; the first error stops every thread after its current item
    and is raised here once none is running an item.

    Every thread works under :func:`~szformat.codec.cpu.one_intra_op_thread`, the caller's from before any helper
    joins, so with a backend whose setting is process-wide no helper changes it under the caller.
    """
    if threads <= 1 or count <= 1:  # nothing to share: no call to coordinate (a small tensor costs less than one)
        with one_intra_op_thread():
            for item in range(count):
                run_item(item)
        return
    call = _Call(count, run_item)
    with one_intra_op_thread():
        _helpers.offer(call, min(threads, count) - 1)
        call.work()
        call.end()
    if call.errors:
        raise call.errors[0]
