"""Options and helpers every subcommand shares."""

from __future__ import annotations

import argparse
import sys
from typing import TextIO


def add_quiet(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="print nothing but errors (no progress bar, no report)")


def show_progress(args: argparse.Namespace) -> bool:
    """A progress bar only for a person watching: not with --quiet, not when stderr is a file or a pipe."""
    return not args.quiet and sys.stderr.isatty()


def print_lines(lines: list[str], *, file: TextIO | None = None) -> None:
    print("\n".join(lines), file=file or sys.stdout)
