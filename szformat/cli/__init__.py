"""``szconvert``: the command line of szformat (convert, decompress, info, repack, verify).

:func:`main` is the console script's entry point: it sets up the handling of Ctrl-C, SIGTERM and SIGHUP before it
imports the commands, so a signal while the program starts prints one line like any other interruption.
"""

from __future__ import annotations

import sys
from typing import Sequence

from ._signals import exit_status, termination_as_interrupt


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``szconvert`` with ``argv`` (default: ``sys.argv[1:]``) and return the exit status."""
    try:
        with termination_as_interrupt():
            from .main import main as run
    except KeyboardInterrupt as e:
        status, what = exit_status(e)
        print(f"szconvert: {what} while starting", file=sys.stderr)
        return status
    return run(argv)
