"""Options and helpers every subcommand shares."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, TextIO

SZT_PATH_HELP = "a .szt file (recognised by its content, whatever its name), a *.szt.index.json or a converted folder"


def add_command(subparsers: argparse._SubParsersAction, name: str, run: Callable[[argparse.Namespace], int], *,
                help: str, description: str, examples: str) -> argparse.ArgumentParser:
    """Add subcommand ``name``, run by ``run(args)``, with its examples shown below the options as written."""
    parser = subparsers.add_parser(name, help=help, description=description, epilog=examples,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.set_defaults(run=run)
    return parser


def add_quiet(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="print nothing but errors (no progress bar, no report)")


def show_progress(args: argparse.Namespace) -> bool:
    """A progress bar only for a person watching: not with --quiet, not when stderr is a file or a pipe."""
    return not args.quiet and sys.stderr.isatty()


def print_lines(lines: list[str], *, file: TextIO | None = None) -> None:
    print("\n".join(lines), file=file or sys.stdout)


def add_at_rest(parser: argparse.ArgumentParser, *, default: str | None, help_default: str | None = None) -> None:
    parser.add_argument("--at-rest", metavar="zstd[:LEVEL]|none", default=default,
                        help="store the packed exponent codes as zstd frames: the at-rest form (format 1.1), about "
                             "12%% smaller, inflated on load; 'none' writes the in-memory form (fastest loads). "
                             f"Default: {help_default or default}")


def at_rest_level(option: str | None) -> int | None:
    """The zstd level of an ``--at-rest`` value (``None`` for 'none'), or CLIError saying what is accepted."""
    from ..errors import CLIError
    from ..format.at_rest import parse_at_rest_option

    try:
        return parse_at_rest_option(option)
    except ValueError as e:
        raise CLIError(f"--at-rest: {e}") from None
