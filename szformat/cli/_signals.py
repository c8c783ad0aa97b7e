"""SIGTERM and SIGHUP end a command the way Ctrl-C does: temporaries removed, one line, exit status 128 + signal.

By default either signal kills the process on the spot, so nothing removes the temporary output (a service
manager's stop, a closed terminal). Raised as :class:`Terminated`, a ``KeyboardInterrupt``, they unwind through
the same ``finally`` and ``except BaseException`` blocks as Ctrl-C does. A second signal while that runs is ignored,
so the clean-up finishes; SIGKILL cannot be caught, and the next writer to the same output removes what it left
(:mod:`szformat.format.atomic`).

A signal that arrives while a module is being imported is held until the import is over: an exception raised in
the middle of an import leaves the module half-initialised (NumPy's lazily imported ``np.matrix`` missing, say),
and the clean-up that follows would fail on it with a traceback instead of the one line. Ctrl-C is handled the same
way within the block.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

HANDLED = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
RETRY_SECONDS = 0.02
"""How often a signal held during an import looks again whether the import is over."""


class Terminated(KeyboardInterrupt):
    """A handled termination signal, raised in the main thread; ``signum`` says which."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_held: list[int] = []
"""The signal held while an import runs (at most one: the first)."""


def _importing(frame) -> bool:
    """Whether ``frame`` (where the main thread was interrupted) runs inside an import."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _terminate(signum: int, frame) -> None:
    if _importing(frame) and hasattr(signal, "setitimer"):
        if not _held:
            _held.append(signum)
        signal.setitimer(signal.ITIMER_REAL, RETRY_SECONDS)
        return
    for handled in HANDLED:
        signal.signal(handled, signal.SIG_IGN)
    raise Terminated(signum)


def _retry(signum: int, frame) -> None:
    """SIGALRM: raise the held signal now, unless the import is still running."""
    if _held:
        _terminate(_held[0], frame)


@contextlib.contextmanager
def termination_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise :class:`Terminated`; the previous handlers come back after.

    A signal ignored when the block starts stays ignored (``nohup`` ignores SIGHUP). Only the main thread may set
    handlers: elsewhere (a command run from a thread) the block changes nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _terminate) for signum in HANDLED
                if signal.getsignal(signum) is not signal.SIG_IGN}
    if hasattr(signal, "SIGALRM"):
        previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, _retry)
    try:
        yield
    finally:
        if hasattr(signal, "setitimer"):
            signal.setitimer(signal.ITIMER_REAL, 0)
        _held.clear()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def exit_status(interrupt: KeyboardInterrupt) -> tuple[int, str]:
    """The exit status (128 + the signal's number, as a shell reports a death by signal) and what ended the run."""
    signum = interrupt.signum if isinstance(interrupt, Terminated) else signal.SIGINT
    name = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    return 128 + signum, name
