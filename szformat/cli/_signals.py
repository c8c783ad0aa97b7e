"""SIGTERM and SIGHUP end a command the way Ctrl-C does: temporaries removed, one line, exit status 128 + signal.

By default either signal kills the process on the spot, so nothing removes the temporary output (a service
manager's stop, a closed terminal). Raised as :class:`Terminated`, a ``KeyboardInterrupt``, they unwind through
the same ``finally`` and ``except BaseException`` blocks as Ctrl-C does. A second signal while that runs is ignored,
so the clean-up finishes; SIGKILL cannot be caught, and the next writer to the same output removes what it left
(:mod:`szformat.format.atomic`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

HANDLED = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


class Terminated(KeyboardInterrupt):
    """A handled termination signal, raised in the main thread; ``signum`` says which."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _terminate(signum: int, frame) -> None:
    for handled in HANDLED:
        signal.signal(handled, signal.SIG_IGN)
    raise Terminated(signum)


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
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def exit_status(interrupt: KeyboardInterrupt) -> tuple[int, str]:
    """The exit status (128 + the signal's number, as a shell reports a death by signal) and what ended the run."""
    signum = interrupt.signum if isinstance(interrupt, Terminated) else signal.SIGINT
    name = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    return 128 + signum, name
